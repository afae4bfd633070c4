# cmake -DNM=<nm> -DSOLUTION=<lib> -DEXERCISE=<lib> -P same_symbols.cmake
# Every function and object the solution's library defines for others to call (nm's T, D,
# B and R: not the templates' weak copies) is defined by the exercise's library too, so
# that whatever links with one links with the other: the chapter program and the later
# chapters on the learner's code. The learner build in CI builds the exercise's tests
# alone and counts on this for the programs. (Mangled names: no list separators in them.)
cmake_minimum_required(VERSION 3.20)
foreach(kind SOLUTION EXERCISE)
  execute_process(COMMAND ${NM} --defined-only --extern-only ${${kind}}
    RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_QUIET)
  if(NOT code EQUAL 0)
    message(FATAL_ERROR "same_symbols: ${NM} could not read ${${kind}}")
  endif()
  string(REGEX MATCHALL "\n[0-9a-f]+ [TDBR] [^\n]+" lines "\n${out}")
  set(${kind}_names)
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^\n[0-9a-f]+ [TDBR] " "" name "${line}")
    list(APPEND ${kind}_names "${name}")
  endforeach()
endforeach()
set(missing)
foreach(name IN LISTS SOLUTION_names)
  if(NOT name IN_LIST EXERCISE_names)
    list(APPEND missing "${name}")
  endif()
endforeach()
if(missing)
  list(REMOVE_DUPLICATES missing)
  execute_process(COMMAND c++filt ${missing} OUTPUT_VARIABLE text ERROR_QUIET)
  if(text STREQUAL "")
    list(JOIN missing "\n" text)
  endif()
  string(REPLACE "\n" "\n  " text "${text}")
  message(FATAL_ERROR "same_symbols: the solution defines what the exercise does not (a "
                      "program built on the exercise would not link):\n  ${text}")
endif()
list(LENGTH SOLUTION_names n)
message("same_symbols: the exercise defines all ${n} of the solution's symbols")
