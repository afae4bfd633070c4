# Every C++/CUDA source git tracks is formatted as .clang-format says (100 columns), and no
# line of it, comments included, is longer than 100 columns.
#   cmake -DCLANG_FORMAT=clang-format -DSOURCE_DIR=<repo> -P format_check.cmake
execute_process(COMMAND git ls-files "*.cpp" "*.hpp" "*.cu" "*.h"
                WORKING_DIRECTORY ${SOURCE_DIR} OUTPUT_VARIABLE files RESULT_VARIABLE git_result
                OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT git_result EQUAL 0)
  message(STATUS "not a git checkout: nothing to check")
  return()
endif()
string(REPLACE "\n" ";" files "${files}")
set(badly_formatted)
set(long_lines)
foreach(file IN LISTS files)
  execute_process(COMMAND ${CLANG_FORMAT} --dry-run --Werror ${file}
                  WORKING_DIRECTORY ${SOURCE_DIR} RESULT_VARIABLE result OUTPUT_QUIET ERROR_QUIET)
  if(NOT result EQUAL 0)
    list(APPEND badly_formatted ${file})
  endif()
  file(STRINGS ${SOURCE_DIR}/${file} lines)
  set(number 0)
  foreach(line IN LISTS lines)
    math(EXPR number "${number} + 1")
    string(LENGTH "${line}" length)
    if(length GREATER 100)
      list(APPEND long_lines "${file}:${number} (${length} columns)")
    endif()
  endforeach()
endforeach()
if(badly_formatted OR long_lines)
  string(REPLACE ";" "\n  " badly_formatted "${badly_formatted}")
  string(REPLACE ";" "\n  " long_lines "${long_lines}")
  message(FATAL_ERROR "Not formatted as .clang-format says (run `make format`):\n  "
                      "${badly_formatted}\nLonger than 100 columns:\n  ${long_lines}")
endif()
list(LENGTH files count)
message(STATUS "${count} files formatted, none longer than 100 columns")
