# The text chapter 09's GPT learns: every chapter's README and the project's, one after
# another, gathered at build time into one file (cmake -DOUT=file -DIN="a|b|c" -P this).
string(REPLACE "|" ";" texts "${IN}")
file(WRITE ${OUT}.partial "")
foreach(text IN LISTS texts)
  file(READ ${text} content)
  file(APPEND ${OUT}.partial "${content}\n")
endforeach()
file(RENAME ${OUT}.partial ${OUT})
