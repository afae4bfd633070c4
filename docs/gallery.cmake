# cmake -DPLOTS=<make plots' folder> -DOUT=<the site's gallery input> -P gallery.cmake
# The site's plot gallery: the page and figures `make plots` drew (notebooks/gallery.py),
# or, before it has run, a page that says how to draw them.
file(REMOVE_RECURSE ${OUT})
file(MAKE_DIRECTORY ${OUT})
if(EXISTS ${PLOTS}/gallery.md)
  file(GLOB figures ${PLOTS}/*.png)
  file(COPY ${PLOTS}/gallery.md ${figures} DESTINATION ${OUT})
else()
  file(WRITE ${OUT}/gallery.md "# Every figure {#gallery}

No figures yet: `make plots` runs every chapter's benchmark or series at a small size and
draws its figures (in `${PLOTS}`); `make docs` after it shows them here.
")
endif()
