# The text chapter 09's GPT learns, chapters/09_gpt/text/chapters.txt: the texts of
# chapters 01-08 and the project's README, one after another. It is a copy, made once and
# committed, so that a run's numbers (and the chapter's README, which shows them) do not
# move each time a README is edited. To make it again from today's texts:
#   cmake -P chapters/09_gpt/gather_corpus.cmake
get_filename_component(root ${CMAKE_CURRENT_LIST_DIR}/../.. ABSOLUTE)
file(GLOB texts ${root}/chapters/0[1-8]_*/README.md)
list(SORT texts)
list(APPEND texts ${root}/README.md)
set(out ${CMAKE_CURRENT_LIST_DIR}/text/chapters.txt)
file(WRITE ${out}.partial "")
foreach(text IN LISTS texts)
  file(READ ${text} content)
  file(APPEND ${out}.partial "${content}\n")
endforeach()
file(RENAME ${out}.partial ${out})
message(STATUS "wrote ${out}")
