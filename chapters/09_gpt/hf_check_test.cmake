# Chapter 09's checkpoint, read by another implementation of GPT-2: trains a few steps on
# a 2 x 1 x 2 mesh, saves, and has hf_check.py (numpy, and Hugging Face's transformers
# where it is installed) compute the validation loss the program printed.
#   cmake -DPROGRAM=ch09_gpt -DPYTHON=python -DSCRIPT=hf_check.py -DTEXT=corpus -DDIR=scratch
#         -P this
file(REMOVE_RECURSE ${DIR})
file(MAKE_DIRECTORY ${DIR})
execute_process(
  COMMAND ${PROGRAM} --ranks 4 --tp 2 --pp 2 --steps 3 --no-reference --save ${DIR}/ckpt
          --json --quiet
  OUTPUT_FILE ${DIR}/run.json RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ch09_gpt --save exited ${rc}")
endif()
execute_process(
  COMMAND ${PYTHON} ${SCRIPT} ${DIR}/ckpt --text ${TEXT} --validation --expect-json ${DIR}/run.json
          --tolerance 1e-5
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "hf_check.py exited ${rc}")
endif()
