# Helpers shared by every chapter: warnings, the chapter wiring, the test registrations.

# Warnings for our own targets (errors only when SHARDLAB_WERROR is on, as in CI).
function(shardlab_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion
      $<$<BOOL:${SHARDLAB_WERROR}>:-Werror>>
    # GCC 12 warns about std::string concatenation at -O3 that cannot overlap (GCC PR105329).
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU>>:-Wno-restrict>)
endfunction()

# A program's main.cpp (flags, dispatch, the report), the tests' own code and the glue of
# the libraries (their flags, reports, tables and files: shardlab_glue_sources) are compiled
# at -O1 in Release: a third less compile time, in the build a learner waits for first.
# The work they call (kernels, layers, collectives, the chapters' algorithms) keeps -O3, and
# -ffp-contract=off keeps every result the same bits at any level. In the learner build the
# glue goes without AddressSanitizer, which is there for the learner's code: a bad write into
# a buffer the glue made is still caught where the learner's code makes it (ASan watches
# every allocation, instrumented or not). CLI11's and nlohmann-json's templates under ASan
# were half of that build's time.
set(SHARDLAB_GLUE_OPTIONS "$<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CONFIG:Release>>:-O1>")
if(SHARDLAB_LEARNER)
  list(APPEND SHARDLAB_GLUE_OPTIONS "$<$<COMPILE_LANGUAGE:CXX>:-fno-sanitize=address>")
endif()
function(shardlab_glue_code target)
  target_compile_options(${target} PRIVATE ${SHARDLAB_GLUE_OPTIONS})
endfunction()
function(shardlab_glue_sources)
  set_source_files_properties(${ARGN} PROPERTIES COMPILE_OPTIONS "${SHARDLAB_GLUE_OPTIONS}")
endfunction()

# The learner build (the `learner` preset's flags: AddressSanitizer and UBSan, -g) keeps
# AddressSanitizer everywhere, so that a bad write is caught wherever it lands, and gives
# UBSan and full debug information to the learner's own code, exercises/, where the
# arithmetic goes wrong and where a debugger steps; the rest has line tables (a sanitizer's
# stack trace still names file and line). UBSan and -g over CLI11's and nlohmann-json's
# templates were half the time of the build a learner waits for first (a main.cpp 22.7 s,
# 11.9 s without). shardlab_learner_code(target) marks a learner's target. (The project's
# own warnings are the default build's business; here GCC 12 sees uninitialised members in
# libstdc++'s std::regex that are not.)
# SHARDLAB_LEARNER_SANITIZE OFF (the learner-ci preset): neither, and no debug information.
option(SHARDLAB_LEARNER_SANITIZE "The learner build's sanitizers and debug information" ON)
if(SHARDLAB_LEARNER AND NOT SHARDLAB_LEARNER_SANITIZE)
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:-Wno-maybe-uninitialized>")
elseif(SHARDLAB_LEARNER)
  add_compile_options(
    "$<$<COMPILE_LANGUAGE:CXX>:-fno-sanitize=undefined;-g1;-Wno-maybe-uninitialized>")
  # What a program may hold of its own running only on the reference code (chapter 09's
  # activation peak against its model of the reference's allocations) it reports there
  # without failing: a learner's correct code may allocate otherwise.
  add_compile_definitions(SHARDLAB_LEARNER_BUILD=1)
endif()
# Uninitialised locals filled with a fixed pattern (-ftrivial-auto-var-init=pattern), so a
# value never written fails the same way every run: only where the compiler copies
# structures whole under it (cmake/probes/auto_var_init.cpp; GCC 12.2 does not).
if(SHARDLAB_LEARNER AND NOT DEFINED SHARDLAB_AUTO_VAR_INIT)
  try_run(auto_var_init_runs auto_var_init_compiles ${CMAKE_BINARY_DIR}/probes
          ${CMAKE_CURRENT_LIST_DIR}/probes/auto_var_init.cpp
          COMPILE_DEFINITIONS -ftrivial-auto-var-init=pattern CXX_STANDARD 20)
  if(auto_var_init_compiles AND auto_var_init_runs EQUAL 0)
    set(SHARDLAB_AUTO_VAR_INIT ON CACHE BOOL "Fill uninitialised locals with a pattern")
  else()
    set(SHARDLAB_AUTO_VAR_INIT OFF CACHE BOOL "Fill uninitialised locals with a pattern")
    message(STATUS "Uninitialised locals are left as they are: ${CMAKE_CXX_COMPILER_ID} "
                   "${CMAKE_CXX_COMPILER_VERSION} miscopies structures under "
                   "-ftrivial-auto-var-init (cmake/probes/auto_var_init.cpp)")
  endif()
endif()
if(SHARDLAB_LEARNER AND SHARDLAB_AUTO_VAR_INIT)
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:-ftrivial-auto-var-init=pattern>")
endif()
function(shardlab_learner_code target)
  if(SHARDLAB_LEARNER_SANITIZE)
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:-fsanitize=undefined;-g>")
  endif()
endfunction()

# The chapter list in CMakeLists.txt must name every folder in chapters/, in order.
function(shardlab_check_chapter_list chapters)
  file(GLOB found RELATIVE ${PROJECT_SOURCE_DIR}/chapters ${PROJECT_SOURCE_DIR}/chapters/[0-9][0-9]_*)
  list(SORT found)
  set(listed ${chapters})
  if(NOT "${found}" STREQUAL "${listed}")
    message(FATAL_ERROR "The chapter list in CMakeLists.txt (${listed}) does not match the "
                        "folders in chapters/ (${found}).")
  endif()
  foreach(chapter IN LISTS chapters)
    foreach(tree exercises solutions)
      if(NOT IS_DIRECTORY ${PROJECT_SOURCE_DIR}/${tree}/${chapter})
        message(FATAL_ERROR "Chapter ${chapter} has no ${tree}/${chapter} folder.")
      endif()
    endforeach()
  endforeach()
endfunction()

# A test that runs COMMAND and expects exit code EXIT (a number, or "nonzero") and output
# matching every regex in MATCH (and none in NO_MATCH).
function(shardlab_add_expect_test name)
  cmake_parse_arguments(ARG "" "EXIT;TIMEOUT" "COMMAND;MATCH;NO_MATCH;LABELS;ENVIRONMENT" ${ARGN})
  if(NOT DEFINED ARG_TIMEOUT)
    set(ARG_TIMEOUT 60)
  endif()
  # Lists travel to expect.cmake joined with "@@" (a ';' would split the argument).
  string(REPLACE ";" "@@" match "${ARG_MATCH}")
  string(REPLACE ";" "@@" no_match "${ARG_NO_MATCH}")
  string(REPLACE ";" "@@" command "${ARG_COMMAND}")
  add_test(NAME ${name}
    COMMAND ${CMAKE_COMMAND} "-DCOMMAND=${command}" "-DEXIT=${ARG_EXIT}"
            "-DMATCH=${match}" "-DNO_MATCH=${no_match}"
            -P ${PROJECT_SOURCE_DIR}/cmake/expect.cmake)
  set_tests_properties(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "${ARG_LABELS}")
  if(ARG_ENVIRONMENT)
    set_tests_properties(${name} PROPERTIES ENVIRONMENT "${ARG_ENVIRONMENT}")
  endif()
endfunction()

# Under the sanitizers every program runs several times slower (AddressSanitizer with UBSan
# about 2-4x, ThreadSanitizer 5-15x): each directory's tests, once the directory has added
# them all (a deferred call, shardlab_scale_timeouts_here), get their limits scaled by
# SHARDLAB_TIMEOUT_SCALE (a test without a limit counts as 300 s, the default preset's).
# SHARDLAB_SANITIZED: a sanitizer's build, where an address-space cap (ulimit -v) cannot
# hold (its shadow memory is terabytes of reserved address space). What AddressSanitizer
# changes in the code (the tensor cache is off, chapter 09 trains 20 steps by default) is a
# definition every file sees, SHARDLAB_ASAN_BUILD: in the learner build the glue is compiled
# without ASan, so __SANITIZE_ADDRESS__ would differ between the files of one program
# (options.cpp had read 200 steps where the library ran without its cache).
set(SHARDLAB_SANITIZED OFF)
set(SHARDLAB_TIMEOUT_SCALE 1)
if(CMAKE_CXX_FLAGS MATCHES "-fsanitize=thread")
  set(SHARDLAB_SANITIZED ON)
  set(SHARDLAB_TIMEOUT_SCALE 10)
elseif(CMAKE_CXX_FLAGS MATCHES "-fsanitize=address")
  set(SHARDLAB_SANITIZED ON)
  set(SHARDLAB_TIMEOUT_SCALE 4)
  add_compile_definitions(SHARDLAB_ASAN_BUILD=1)
elseif(CMAKE_CXX_FLAGS MATCHES "-fsanitize")
  set(SHARDLAB_TIMEOUT_SCALE 4)
endif()
function(shardlab_scale_timeouts)
  get_property(tests DIRECTORY PROPERTY TESTS)
  foreach(test IN LISTS tests)
    get_test_property(${test} TIMEOUT timeout)
    if(NOT timeout)
      set(timeout 300)
    endif()
    math(EXPR timeout "${timeout} * ${SHARDLAB_TIMEOUT_SCALE}")
    set_tests_properties(${test} PROPERTIES TIMEOUT ${timeout})
  endforeach()
endfunction()
# Scales the current directory's tests' limits when CMake is done with it.
macro(shardlab_scale_timeouts_here)
  if(NOT SHARDLAB_TIMEOUT_SCALE EQUAL 1)
    cmake_language(DEFER CALL shardlab_scale_timeouts)
  endif()
endmacro()

# shardlab_usage_faults(<prefix> <program> [LABELS ...] CASES <name> <args> <regex> ...)
# Bad input a careless user gave and what the program must say of it: for each triple, the
# test <prefix>.<name> runs `program args` and wants exit 2 and one line
# "<program's name>: error: ..." on which `regex` matches (the message that names the
# mistake, not any error).
function(shardlab_usage_faults prefix program)
  cmake_parse_arguments(ARG "" "" "LABELS;CASES" ${ARGN})
  get_filename_component(shown ${program} NAME)
  if(TARGET ${program})
    set(shown ${program})
    set(program $<TARGET_FILE:${program}>)
  endif()
  list(LENGTH ARG_CASES n)
  math(EXPR last "${n} - 1")
  foreach(i RANGE 0 ${last} 3)
    math(EXPR j "${i} + 1")
    math(EXPR k "${i} + 2")
    list(GET ARG_CASES ${i} name)
    list(GET ARG_CASES ${j} args)
    list(GET ARG_CASES ${k} regex)
    separate_arguments(args UNIX_COMMAND "${args}")
    shardlab_add_expect_test(${prefix}.${name} COMMAND ${program} ${args}
      EXIT 2 MATCH "^${shown}: error: [^\n]*${regex}[^\n]*\n$" LABELS ${ARG_LABELS})
  endforeach()
endfunction()

# mpirun with what a 2-core CI box running as root needs: more ranks than cores, and
# permission to run as root (through the environment, so nothing changes for other users).
# Under the debug preset's sanitizers, OpenMPI's own start-up allocations (some in plugins
# it loads at run time) would read as leaks, so leak checking is off for MPI runs only.
# What mpirun itself may add to a job's output, which the program cannot silence: Open MPI
# 4's libevent, as mpirun kills the other processes of a job one of them ended, now and then
# warns "[warn] Epoll MOD(1) on fd 25 failed ... Bad file descriptor" (a race in mpirun,
# open-mpi/ompi#2004; about 1 job in 15 of three processes on two cores). Appended to the
# regexes that match a whole failing job's output.
set(SHARDLAB_MPI_NOISE "(.warn. Epoll [^\n]*\n)*")
set(SHARDLAB_MPI_ENV "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1;ASAN_OPTIONS=detect_leaks=0")
# shardlab_add_notebook_test(<chNN> <NN_slug> RESULTS <dir> DEPENDS <test> EXPECT <png>...)
# Executes notebooks/<NN_slug>.ipynb headlessly on the CSVs in RESULTS (which the test
# DEPENDS on writes) and checks that it saved every EXPECT picture there. Only where the
# project's .venv (scripts/setup.sh) exists.
function(shardlab_add_notebook_test short slug)
  cmake_parse_arguments(ARG "" "RESULTS;DEPENDS" "EXPECT" ${ARGN})
  if(NOT EXISTS ${PROJECT_SOURCE_DIR}/.venv/bin/python)
    return()
  endif()
  string(JOIN "," expect ${ARG_EXPECT})
  add_test(NAME ${short}.notebook
    COMMAND ${PROJECT_SOURCE_DIR}/.venv/bin/python ${PROJECT_SOURCE_DIR}/notebooks/run_notebook.py
            ${PROJECT_SOURCE_DIR}/notebooks/${slug}.ipynb --results ${ARG_RESULTS}
            --expect ${expect})
  set_tests_properties(${short}.notebook PROPERTIES LABELS "${short};benchmark" TIMEOUT 300
    DEPENDS ${ARG_DEPENDS})
endfunction()

# GPU tests: CUDA starts under AddressSanitizer (the debug preset) only with the shadow
# gap unprotected; without ASan the variable is ignored.
set(SHARDLAB_GPU_ENV "ASAN_OPTIONS=protect_shadow_gap=0")

function(shardlab_mpirun_command out_var ranks)
  set(${out_var} ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} --oversubscribe
      ${MPIEXEC_PREFLAGS} ${ARGN} PARENT_SCOPE)
endfunction()

# A library built only for the precompiled header of ARGN, for other targets to reuse:
# `name`, from cmake/pch_anchor.cpp, with the flags of `kind` code (shardlab_glue_code or
# shardlab_learner_code). Made once.
function(shardlab_pch_library name kind)
  if(TARGET ${name})
    return()
  endif()
  add_library(${name} STATIC ${PROJECT_SOURCE_DIR}/cmake/pch_anchor.cpp)
  target_link_libraries(${name} PUBLIC shardlab::common)
  shardlab_warnings(${name})
  cmake_language(CALL shardlab_${kind}_code ${name})
  target_precompile_headers(${name} PRIVATE ${ARGN})
endfunction()

# The common headers every exercise includes, precompiled once (learner mode): a one-line
# edit then recompiles in under a second instead of three.
function(shardlab_exercise_pch)
  shardlab_pch_library(shardlab_exercise_pch learner
    <shardlab/check.hpp> <shardlab/comm.hpp> <shardlab/memory.hpp> <shardlab/nn.hpp>
    <shardlab/tensor.hpp>)
endfunction()

# The heavy headers of the programs' flag and report code (CLI11, nlohmann's JSON, the
# launcher), precompiled once with the glue's flags and reused by the targets made only of
# glue that include them (the chapters' main.cpp, chapter 08's two programs and its
# planner's test): each such file compiles in 5 s instead of 7. (Not for libraries: every
# file of a target gets the header, and CLI11's validators are objects each file builds.)
function(shardlab_program_pch target)
  shardlab_pch_library(shardlab_program_pch glue
    <CLI/CLI.hpp> <nlohmann/json.hpp> <shardlab/cli.hpp> <shardlab/launch.hpp>
    <shardlab/results.hpp> <shardlab/tensor.hpp>)
  target_precompile_headers(${target} REUSE_FROM shardlab_program_pch)
endfunction()

# Compile flags of a chapter's code without linking it anywhere: an object library whose
# objects go into both the solution's and the exercise's targets sees the chapter's
# headers, common's and those of LIBRARIES (usage requirements only: $<TARGET_OBJECTS>
# carries no link dependency, so neither library is pulled in twice).
function(shardlab_compile_as_chapter target chapter_dir)
  target_include_directories(${target} PRIVATE ${chapter_dir})
  target_link_libraries(${target} PRIVATE shardlab::common ${ARGN})
  shardlab_warnings(${target})
endfunction()

# shardlab_add_chapter(<NN_slug> SOURCES <file>... [CHAPTER_SOURCES <file>...]
#                      TESTS <test_file>... [CHAPTER_TESTS <test_file>...]
#                      [BAD_USAGE "<args>"...] [MPI_BAD_USAGE "<args>"...]
#                      [MPI_ARGS <arg>...] [MPI_RANKS <n>]
#                      [MPI_TIMED_KEYS <key|key...>]
#                      [GPU_ARGS <arg>...] [GPU_EXPECT <regex>...]
#                      [DEPENDS <NN>...] [LIBRARIES <target>...] [RUN_ARGS <arg>...])
#
# Wires one chapter, as DESIGN.md describes. DEPENDS names the earlier chapters it builds
# on (their numbers): a chapter's libraries link shardlab::chNN of each, which is the
# solution, or in learner mode the learner's exercise (unless SHARDLAB_USE_SOLUTIONS, a
# list of chapter numbers, asks for the reference of a chapter the learner skips).
# Configure fails on a dependency that is not an earlier chapter (so there is no cycle).
# LIBRARIES: other targets the chapter's code links (chapter 08's planner). RUN_ARGS: what
# the plain-run, JSON and mpirun tests add to the command (a chapter whose default run
# trains for minutes, chapter 09, runs a few steps there).
#   chNN_<slug>_solution  library from solutions/NN_slug/<SOURCES> (plus the chapter's own
#                         CHAPTER_SOURCES, which call the API: compiled once, in both)
#   chNN_<slug>_exercise  library from exercises/NN_slug/<SOURCES> (the learner's stubs)
#   chNN_<slug>           the chapter program (links the solution; the exercise when
#                         SHARDLAB_LEARNER is on), from chNN_<slug>_main, its main.cpp
#   test_chNN_solution / test_chNN_exercise   the TESTS files (compiled once) linked with each
# CTest: the program runs, prints JSON, rejects the common bad usages and the chapter's
# BAD_USAGE ones with exit 2 (and MPI_BAD_USAGE under mpirun -np 2, in one line), and under
# mpirun -np MPI_RANKS (default 3, with MPI_ARGS) gives the same JSON as --ranks MPI_RANKS (the values of MPI_TIMED_KEYS, timings, aside);
# the JSON test runs JSON_RANKS ranks (default 3). chNN.solution must pass. chNN.exercise must fail with every test case failing
# on the untouched stubs (a test that passes on a stub is a bug); in learner mode it must
# pass instead, because the learner has filled the stubs in.
function(shardlab_add_chapter chapter)
  shardlab_scale_timeouts_here()
  cmake_parse_arguments(ARG "" "MPI_RANKS;MPI_TIMED_KEYS;JSON_RANKS"
    "SOURCES;CHAPTER_SOURCES;TESTS;CHAPTER_TESTS;BAD_USAGE;MPI_BAD_USAGE;MPI_ARGS;GPU_ARGS;GPU_EXPECT;DEPENDS;LIBRARIES;RUN_ARGS"
    ${ARGN})
  if(NOT ARG_JSON_RANKS)
    set(ARG_JSON_RANKS 3)
  endif()
  if(NOT ARG_MPI_RANKS)
    set(ARG_MPI_RANKS 3)
  endif()
  string(SUBSTRING ${chapter} 0 2 number)
  set(target ch${chapter})
  set(short ch${number})
  set(chapter_dir ${PROJECT_SOURCE_DIR}/chapters/${chapter})

  # The chapters below this one: earlier ones only, already defined.
  set(depends)
  foreach(dep IN LISTS ARG_DEPENDS)
    if(NOT dep MATCHES "^[0-9][0-9]$")
      message(FATAL_ERROR "Chapter ${chapter}: DEPENDS ${dep} is not a chapter number like 02.")
    endif()
    if(NOT dep LESS number)
      message(FATAL_ERROR "Chapter ${chapter} depends on chapter ${dep}: a chapter builds only on "
                          "earlier chapters (no cycles, arrows only downward).")
    endif()
    if(NOT TARGET shardlab::ch${dep})
      message(FATAL_ERROR "Chapter ${chapter} depends on chapter ${dep}, which is not in the "
                          "chapter list before it.")
    endif()
    list(APPEND depends shardlab::ch${dep})
  endforeach()
  string(REPLACE ";" "," depends_text "${ARG_DEPENDS}")
  set_property(GLOBAL APPEND PROPERTY SHARDLAB_CHAPTER_DEPENDS "${number}:${depends_text}")

  # The chapter's own sources call the exercise's API through the chapter's headers, which
  # are the same for both libraries: compiled once, their objects put into each.
  set(chapter_objects)
  if(ARG_CHAPTER_SOURCES)
    set(sources)
    foreach(source IN LISTS ARG_CHAPTER_SOURCES)
      list(APPEND sources ${chapter_dir}/${source})
    endforeach()
    add_library(${target}_chapter_objects OBJECT ${sources})
    shardlab_compile_as_chapter(${target}_chapter_objects ${chapter_dir} ${depends} ${ARG_LIBRARIES})
    set(chapter_objects $<TARGET_OBJECTS:${target}_chapter_objects>)
  endif()
  foreach(kind solution exercise)
    set(sources)
    foreach(source IN LISTS ARG_SOURCES)
      list(APPEND sources ${PROJECT_SOURCE_DIR}/${kind}s/${chapter}/${source})
    endforeach()
    add_library(${target}_${kind} STATIC ${sources} ${chapter_objects})
    target_include_directories(${target}_${kind} PUBLIC ${chapter_dir})
    target_link_libraries(${target}_${kind} PUBLIC shardlab::common ${depends} ${ARG_LIBRARIES})
    shardlab_warnings(${target}_${kind})
  endforeach()
  # The learner's re-check recompiles one exercise file: most of that is parsing the
  # common headers, so in learner mode they come precompiled (one PCH for every chapter).
  if(SHARDLAB_LEARNER)
    shardlab_exercise_pch()
    target_precompile_headers(${target}_exercise REUSE_FROM shardlab_exercise_pch)
    shardlab_learner_code(${target}_exercise)
  endif()

  # shardlab::chNN: what the chapter program and later chapters run on.
  if(SHARDLAB_LEARNER AND NOT number IN_LIST SHARDLAB_USE_SOLUTIONS)
    set(program_impl ${target}_exercise)
  else()
    set(program_impl ${target}_solution)
  endif()
  add_library(shardlab::${short} ALIAS ${program_impl})
  # main.cpp compiled once, into the program and into the wrong versions' programs
  # (shardlab_add_wrong_version).
  add_library(${target}_main OBJECT ${chapter_dir}/main.cpp)
  target_link_libraries(${target}_main PRIVATE ${program_impl})
  shardlab_warnings(${target}_main)
  shardlab_glue_code(${target}_main)
  shardlab_program_pch(${target}_main)
  add_executable(${target} $<TARGET_OBJECTS:${target}_main>)
  target_link_libraries(${target} PRIVATE ${program_impl})
  shardlab_warnings(${target})
  set_property(GLOBAL APPEND PROPERTY SHARDLAB_PROGRAMS ${target})

  if(NOT SHARDLAB_TESTS)
    return()
  endif()

  # Every program: a plain run passes; bad usage is one line on stderr and exit 2.
  set(program $<TARGET_FILE:${target}>)
  shardlab_add_expect_test(${short}.runs COMMAND ${program} --quiet ${ARG_RUN_ARGS} EXIT 0
    LABELS "${short};program")
  shardlab_add_expect_test(${short}.json COMMAND ${program} --json --ranks ${ARG_JSON_RANKS} ${ARG_RUN_ARGS}
    EXIT 0 MATCH "\"ok\": true" "\"ranks\": ${ARG_JSON_RANKS}" LABELS "${short};program")
  shardlab_add_expect_test(${short}.help COMMAND ${program} --help EXIT 0 MATCH "--ranks"
    LABELS "${short};program")
  # What every program rejects: out-of-range, NaN and infinite numbers, seeds that are
  # not one, and benchmark folders it cannot write (found before any rank starts).
  set(bad_usages "--ranks 0" "--ranks abc" "--ranks -3" "--backend carrier-pigeon"
                 "--timeout 0" "--timeout nan" "--timeout inf" "--memory-limit nan"
                 "--seed -1" "--seed abc" "--seed 18446744073709551616"
                 "--no-such-flag" "stray-argument"
                 "--benchmark --csv-dir /dev/full" "--benchmark --csv-dir /proc"
                 "--benchmark --csv-dir /"
                 "--benchmark --csv-dir ${chapter_dir}/CMakeLists.txt" ${ARG_BAD_USAGE})
  set(index 0)
  foreach(bad IN LISTS bad_usages)
    math(EXPR index "${index} + 1")
    separate_arguments(bad_args UNIX_COMMAND "${bad}")
    shardlab_add_expect_test(${short}.usage_${index} COMMAND ${program} ${bad_args}
      EXIT 2 MATCH "^${target}: error: [^\n]+\n$" LABELS "${short};program")
  endforeach()
  # MPI_BAD_USAGE: the same under mpirun -np 2, where the mistake can only be seen once
  # the processes run (their number decides it): the job's whole output is the program's
  # one line, with none of mpirun's banners, and mpirun exits 2.
  if(SHARDLAB_HAVE_MPI)
    set(index 0)
    foreach(bad IN LISTS ARG_MPI_BAD_USAGE)
      math(EXPR index "${index} + 1")
      separate_arguments(bad_args UNIX_COMMAND "${bad}")
      shardlab_mpirun_command(mpi_cmd 2 ${program} ${bad_args})
      shardlab_add_expect_test(${short}.mpi_usage_${index} COMMAND ${mpi_cmd}
        EXIT 2 MATCH "^${target}: error: [^\n]+\n${SHARDLAB_MPI_NOISE}$" LABELS "${short};mpi" TIMEOUT 60
        ENVIRONMENT "${SHARDLAB_MPI_ENV}")
    endforeach()
  endif()
  # Chapters with a GPU path (GPU_ARGS given): --device cuda runs and verifies on a GPU,
  # and the same with --backend nccl (one GPU per rank), each output matching every
  # GPU_EXPECT regex (label gpu; skipped where there is no GPU, or too few for NCCL).
  if(ARG_GPU_ARGS)
    set(expect)
    foreach(pattern IN LISTS ARG_GPU_EXPECT)
      list(APPEND expect --expect ${pattern})
    endforeach()
    add_test(NAME ${short}.gpu COMMAND ${PROJECT_SOURCE_DIR}/scripts/gpu_run.sh ${expect}
             ${program} --quiet ${ARG_GPU_ARGS})
    set(gpu_tests ${short}.gpu)
    if(SHARDLAB_HAVE_NCCL)
      add_test(NAME ${short}.gpu_nccl COMMAND ${PROJECT_SOURCE_DIR}/scripts/gpu_run.sh ${expect}
               ${program} --quiet --backend nccl ${ARG_GPU_ARGS})
      list(APPEND gpu_tests ${short}.gpu_nccl)
    endif()
    set_tests_properties(${gpu_tests} PROPERTIES LABELS "${short};gpu" TIMEOUT 300
      SKIP_RETURN_CODE 77 ENVIRONMENT "${SHARDLAB_GPU_ENV}")
    # The expected numbers hold on the CPU too (so a pattern cannot be wrong unnoticed).
    add_test(NAME ${short}.gpu_expect COMMAND ${PROJECT_SOURCE_DIR}/scripts/gpu_run.sh --cpu
             ${expect} ${program} --quiet ${ARG_GPU_ARGS})
    set_tests_properties(${short}.gpu_expect PROPERTIES LABELS "${short};program" TIMEOUT 120)
  endif()

  # Under mpirun the program prints the same results as with threads (only the
  # backend's name, and whether its traffic is modeled, differ). MPI_RANKS 2 where the
  # blocking allreduce of 3 ranks, Open MPI's own, adds in another order than the threads
  # backend (the non-blocking collectives and the reduce-scatter add in rank order on
  # both), or where a program asks for 2 (chapter 07's experts).
  if(SHARDLAB_HAVE_MPI)
    shardlab_mpirun_command(mpi_cmd ${ARG_MPI_RANKS} ${program} --json --quiet ${ARG_MPI_ARGS}
                            ${ARG_RUN_ARGS})
    string(REPLACE ";" "@@" mpi_cmd "${mpi_cmd}")
    set(threads_cmd ${program} --json --quiet --ranks ${ARG_MPI_RANKS} ${ARG_MPI_ARGS}
        ${ARG_RUN_ARGS})
    string(REPLACE ";" "@@" threads_cmd "${threads_cmd}")
    add_test(NAME ${short}.mpi_matches_threads
      COMMAND ${CMAKE_COMMAND} "-DFIRST=${mpi_cmd}" "-DSECOND=${threads_cmd}"
              "-DTIMED=${ARG_MPI_TIMED_KEYS}"
              -P ${PROJECT_SOURCE_DIR}/cmake/same_json.cmake)
    set_tests_properties(${short}.mpi_matches_threads PROPERTIES
      LABELS "${short};mpi" TIMEOUT 120 ENVIRONMENT "${SHARDLAB_MPI_ENV}")
  endif()

  # The exercise's tests, compiled once and linked twice: against the solution, and
  # against the exercise.
  set(test_sources)
  foreach(test IN LISTS ARG_TESTS)
    list(APPEND test_sources ${chapter_dir}/${test})
  endforeach()
  add_library(test_${short}_objects OBJECT ${test_sources})
  shardlab_compile_as_chapter(test_${short}_objects ${chapter_dir} ${depends} ${ARG_LIBRARIES}
                              shardlab::testing)
  shardlab_glue_code(test_${short}_objects)
  foreach(kind solution exercise)
    add_executable(test_${short}_${kind} $<TARGET_OBJECTS:test_${short}_objects>)
    target_link_libraries(test_${short}_${kind} PRIVATE ${target}_${kind} shardlab::testing)
    shardlab_warnings(test_${short}_${kind})
  endforeach()
  # Tests of the chapter's own code (CHAPTER_SOURCES), which the exercise does not touch:
  # built once, against the solution.
  if(ARG_CHAPTER_TESTS)
    set(chapter_tests)
    foreach(test IN LISTS ARG_CHAPTER_TESTS)
      list(APPEND chapter_tests ${chapter_dir}/${test})
    endforeach()
    add_executable(test_${short}_chapter ${chapter_tests})
    target_link_libraries(test_${short}_chapter PRIVATE ${target}_solution shardlab::testing)
    shardlab_warnings(test_${short}_chapter)
    shardlab_glue_code(test_${short}_chapter)
    add_test(NAME ${short}.chapter COMMAND test_${short}_chapter)
    set_tests_properties(${short}.chapter PROPERTIES LABELS "${short};solution" TIMEOUT 120)
  endif()
  add_test(NAME ${short}.solution COMMAND test_${short}_solution)
  set_tests_properties(${short}.solution PROPERTIES LABELS "${short};solution" TIMEOUT 120)
  # Whatever links with the solution links with the exercise (cmake/same_symbols.cmake).
  add_test(NAME ${short}.exercise_links_like_solution
    COMMAND ${CMAKE_COMMAND} -DNM=${CMAKE_NM} -DSOLUTION=$<TARGET_FILE:${target}_solution>
            -DEXERCISE=$<TARGET_FILE:${target}_exercise> -P ${PROJECT_SOURCE_DIR}/cmake/same_symbols.cmake)
  set_tests_properties(${short}.exercise_links_like_solution PROPERTIES LABELS "${short};solution")
  if(SHARDLAB_LEARNER)
    add_test(NAME ${short}.exercise COMMAND test_${short}_exercise)
    set_tests_properties(${short}.exercise PROPERTIES LABELS "${short};exercise" TIMEOUT 120)
  else()
    shardlab_add_expect_test(${short}.exercise_fails_on_stubs
      COMMAND $<TARGET_FILE:test_${short}_exercise>
      EXIT nonzero
      MATCH "test cases: *[0-9]+ \\| *0 passed" "TODO\\(${short}"
      LABELS "${short};exercise")
  endif()
endfunction()

# shardlab_add_wrong_version(<NN_slug> <name> FILE <file> REPLACE <text> WITH <text>
#                            (TESTS | PROGRAM <arg>...) MATCH <regex>...
#                            [SUFFIX <suffix>] [LIBRARIES <target>...])
#
# A plausible wrong version of a chapter's exercise, kept as a test that it is caught:
# solutions/NN_slug/FILE with REPLACE's text replaced by WITH's (when the solution no
# longer holds that text, the test fails and says so: the wrong version is to update),
# compiled with the chapter's own code into a library of its own, chNN_<slug>_wrong_<name>.
# Then either the chapter's exercise tests (TESTS: what `make check` runs, stopped at the
# first failure) or its program (PROGRAM: run with these arguments, also linked with
# LIBRARIES) must fail and print every MATCH regex: the message that points at the
# mistake. CTest chNN.wrong_<name><SUFFIX>, label wrong_version. A second call with the
# same name and another SUFFIX runs the same wrong version again. Neither text may hold a
# ';' (CMake would split it). Only where the chapters below are the solutions (not in the
# learner's build).
function(shardlab_add_wrong_version chapter name)
  cmake_parse_arguments(ARG "TESTS" "FILE;REPLACE;WITH;SUFFIX" "PROGRAM;MATCH;LIBRARIES" ${ARGN})
  if(SHARDLAB_LEARNER OR NOT SHARDLAB_TESTS)
    return()
  endif()
  string(SUBSTRING ${chapter} 0 2 number)
  set(target ch${chapter})
  set(short ch${number})
  set(wrong ${target}_wrong_${name})
  set(solution ${PROJECT_SOURCE_DIR}/solutions/${chapter}/${ARG_FILE})
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${solution})
  file(READ ${solution} text)
  string(FIND "${text}" "${ARG_REPLACE}" at)
  if(at EQUAL -1)  # the solution changed under it: a test that fails, saying so
    set(stale "the wrong version ${short}.wrong_${name} replaces '${ARG_REPLACE}', which "
              "solutions/${chapter}/${ARG_FILE} no longer holds: update it")
    string(JOIN "" stale ${stale})
    message(WARNING "${stale}")
    shardlab_add_expect_test(${short}.wrong_${name}${ARG_SUFFIX}
      COMMAND ${CMAKE_COMMAND} -E echo "${stale}" EXIT 1 LABELS "${short};wrong_version")
    return()
  endif()
  if(NOT TARGET ${wrong})
    string(REPLACE "${ARG_REPLACE}" "${ARG_WITH}" text "${text}")
    set(source ${CMAKE_CURRENT_BINARY_DIR}/wrong_versions/${name}/${ARG_FILE})
    file(WRITE ${source}.new "${text}")
    configure_file(${source}.new ${source} COPYONLY)  # rewritten only when it changes
    # The solution's sources (its file and the chapter's own objects) with the one file
    # replaced, linked as the solution is.
    get_target_property(solution_sources ${target}_solution SOURCES)
    set(sources)
    foreach(file IN LISTS solution_sources)
      if(file STREQUAL solution)
        list(APPEND sources ${source})
      else()
        list(APPEND sources ${file})
      endif()
    endforeach()
    get_target_property(libraries ${target}_solution LINK_LIBRARIES)
    add_library(${wrong} STATIC ${sources})
    target_include_directories(${wrong} PUBLIC ${PROJECT_SOURCE_DIR}/chapters/${chapter})
    target_link_libraries(${wrong} PUBLIC ${libraries})
    shardlab_warnings(${wrong})
  endif()
  if(ARG_TESTS AND NOT TARGET test_${wrong})
    add_executable(test_${wrong} $<TARGET_OBJECTS:test_${short}_objects>)
    target_link_libraries(test_${wrong} PRIVATE ${wrong} shardlab::testing)
  elseif(NOT ARG_TESTS AND NOT TARGET ${wrong}_program)
    add_executable(${wrong}_program $<TARGET_OBJECTS:${target}_main>)
    target_link_libraries(${wrong}_program PRIVATE ${wrong} ${ARG_LIBRARIES})
  endif()
  if(ARG_TESTS)
    shardlab_add_expect_test(${short}.wrong_${name}${ARG_SUFFIX}
      COMMAND $<TARGET_FILE:test_${wrong}> --abort-after=1 EXIT nonzero MATCH ${ARG_MATCH}
      LABELS "${short};wrong_version" TIMEOUT 120)
  else()
    shardlab_add_expect_test(${short}.wrong_${name}${ARG_SUFFIX}
      COMMAND $<TARGET_FILE:${wrong}_program> ${ARG_PROGRAM} EXIT 1 MATCH ${ARG_MATCH}
      LABELS "${short};wrong_version" TIMEOUT 120)
  endif()
endfunction()
