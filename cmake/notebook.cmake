# cmake -DPYTHON=<venv python> -DNOTEBOOK=<.ipynb> -DRESULTS=<dir with the CSV> -DEXPECT=<png,...> -P notebook.cmake
# Executes a notebook headlessly on the CSV in RESULTS and checks that it wrote the PNGs,
# each a whole picture of plausible size with something drawn on it (notebooks/plotting.py).
string(REPLACE "," ";" EXPECT "${EXPECT}")
foreach(png IN LISTS EXPECT)
  file(REMOVE ${RESULTS}/${png})
endforeach()
get_filename_component(dir ${NOTEBOOK} DIRECTORY)
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env SHARDLAB_RESULTS=${RESULTS} MPLBACKEND=Agg
          ${PYTHON} -m nbconvert --to notebook --execute --output-dir ${RESULTS} ${NOTEBOOK}
  WORKING_DIRECTORY ${dir}
  RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT code EQUAL 0)
  message(FATAL_ERROR "notebook: ${NOTEBOOK} failed (${code})\n${out}${err}")
endif()
set(pngs)
foreach(png IN LISTS EXPECT)
  if(NOT EXISTS ${RESULTS}/${png})
    message(FATAL_ERROR "notebook: ${NOTEBOOK} ran but did not write ${RESULTS}/${png}")
  endif()
  list(APPEND pngs ${RESULTS}/${png})
endforeach()
execute_process(COMMAND ${PYTHON} ${dir}/plotting.py --check ${pngs}
  RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT code EQUAL 0)
  message(FATAL_ERROR "notebook: ${NOTEBOOK} wrote a bad image\n${err}")
endif()
message("notebook: ${out}")
