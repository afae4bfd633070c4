# cmake -DFIRST=<cmd@@args> -DSECOND=<cmd@@args> [-DTIMED=<key|key...>] -P same_json.cmake
# Runs both commands (each prints one JSON object) and fails unless the objects agree once
# the keys that name the run rather than its results are removed.
set(ignored backend)
foreach(which FIRST SECOND)
  string(REPLACE "@@" ";" cmd "${${which}}")
  execute_process(COMMAND ${cmd} RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT code EQUAL 0)
    message(FATAL_ERROR "same_json: '${cmd}' exited with ${code}\n${out}${err}")
  endif()
  foreach(key IN LISTS ignored)
    string(JSON out ERROR_VARIABLE missing REMOVE "${out}" ${key})
  endforeach()
  # Whether a strategy's traffic was measured or modeled depends on the backend too.
  string(REGEX REPLACE "\"traffic_modeled\" *: *(true|false)" "" out "${out}")
  # Timings (-DTIMED=<regex of keys>) differ from run to run: only their presence counts,
  # a number's or a text's (one that says what a measurement found).
  if(TIMED)
    string(REGEX REPLACE "\"(${TIMED})\" *: *[-+0-9.eE]+" "\"\\1\": timed" out "${out}")
    string(REGEX REPLACE "\"(${TIMED})\" *: *\"[^\"]*\"" "\"\\1\": timed" out "${out}")
    # ...and a list of numbers decided by a timing (the ranks a run found slow).
    string(REGEX REPLACE "\"(${TIMED})\" *: *\\[[-+0-9.eE, \n]*\\]" "\"\\1\": timed" out "${out}")
  endif()
  set(result_${which} "${out}")  # not a list: the JSON may hold ';'
endforeach()
set(first "${result_FIRST}")
set(second "${result_SECOND}")
if(NOT first STREQUAL second)
  message(FATAL_ERROR "same_json: the results differ\n--- ${FIRST}\n${first}\n--- ${SECOND}\n${second}")
endif()
message("same_json: identical results from\n  ${FIRST}\n  ${SECOND}")
