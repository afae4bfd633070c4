# cmake -DFIRST=<cmd@@args> -DSECOND=<cmd@@args> -DDIR=<dir> -P same_training.cmake
# Runs two trainings, each saving its checkpoint under DIR (first/, second/), and fails
# unless they are the same bit for bit: every file of the two checkpoints (the weights,
# Adam's moments, the trainer's state with each tensor's hash), and the loss curve each
# printed (the rows of its first table). For runs that differ only in when things happen
# (chapter 09's --overlap), not in what is computed.
file(REMOVE_RECURSE ${DIR}/first ${DIR}/second)
foreach(which FIRST SECOND)
  string(TOLOWER ${which} name)
  string(REPLACE "@@" ";" cmd "${${which}}")
  execute_process(COMMAND ${cmd} --save ${DIR}/${name} RESULT_VARIABLE code OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT code EQUAL 0)
    message(FATAL_ERROR "same_training: '${cmd}' exited with ${code}\n${out}${err}")
  endif()
  # The loss curve: the rows under the first table's header, up to the blank line.
  string(REGEX MATCH "\n *step [^\n]*\n([^\n]+\n)+" curve "${out}")
  if(curve STREQUAL "")
    message(FATAL_ERROR "same_training: no loss curve in the output of '${cmd}'\n${out}")
  endif()
  set(curve_${which} "${curve}")
endforeach()
if(NOT curve_FIRST STREQUAL curve_SECOND)
  message(FATAL_ERROR "same_training: the loss curves differ\n--- ${FIRST}${curve_FIRST}"
                      "--- ${SECOND}${curve_SECOND}")
endif()
file(GLOB files RELATIVE ${DIR}/first ${DIR}/first/*)
file(GLOB others RELATIVE ${DIR}/second ${DIR}/second/*)
if(NOT files STREQUAL others OR files STREQUAL "")
  message(FATAL_ERROR "same_training: the checkpoints hold other files: [${files}] and [${others}]")
endif()
foreach(f IN LISTS files)
  execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${DIR}/first/${f} ${DIR}/second/${f}
                  RESULT_VARIABLE differ)
  if(NOT differ EQUAL 0)
    message(FATAL_ERROR "same_training: ${f} differs between\n  ${FIRST}\n  ${SECOND}")
  endif()
endforeach()
list(LENGTH files n)
message("same_training: the same loss curve and the same ${n} checkpoint files from\n"
        "  ${FIRST}\n  ${SECOND}")
