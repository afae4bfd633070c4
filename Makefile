# A thin entry point over CMake presets. `make help` lists the targets.
PRESET ?= default
CH ?=

.PHONY: all build test check docs run plots setup format tidy clean help

all: build

help:
	@echo "make                build (preset $(PRESET): Release, tests)"
	@echo "make test           build and run the whole test suite"
	@echo "make check CH=01    build YOUR exercise for chapter 01 and run its tests"
	@echo "make check          your progress over all chapters"
	@echo "make check CH=09 USE_SOLUTIONS=04   the reference for chapters you skip"
	@echo "make run            run every chapter program (threads backend)"
	@echo "make plots          every chapter's benchmark, small, drawn into build/PRESET/plots"
	@echo "make plots RESULTS=results   draw the CSVs already in RESULTS instead"
	@echo "make docs           the site: chapters, guides, API, gallery (build/PRESET/docs/html)"
	@echo "make format | tidy  clang-format / clang-tidy over the sources"
	@echo "make setup          install what is missing, build, run every chapter"
	@echo "PRESET=debug make test   the same under AddressSanitizer and UBSan"
	@echo "PRESET=tsan make test    the tests whose ranks are threads, under ThreadSanitizer"

build:
	cmake --preset $(PRESET) > /dev/null
	cmake --build --preset $(PRESET)

test: build
	ctest --preset $(PRESET)

USE_SOLUTIONS ?=
check:
	@USE_SOLUTIONS=$(USE_SOLUTIONS) scripts/check.sh $(CH)

run: build
	scripts/run_chapters.sh build/$(PRESET)/bin

# Every chapter's figures in one folder with a page showing them all (index.html), and the
# site's gallery page. RESULTS=dir draws the CSVs already there (a larger run of your own);
# FIGURES=docs/images also refreshes the README's small copies.
RESULTS ?=
FIGURES ?=
PLOTS = build/$(PRESET)/plots
plots: build
	@test -x .venv/bin/python || { echo "make plots: no .venv: run scripts/setup.sh first"; exit 2; }
	.venv/bin/python notebooks/gallery.py --bin build/$(PRESET)/bin --out $(PLOTS) \
	  $(if $(RESULTS),--from $(RESULTS)) $(if $(FIGURES),--readme-figures $(FIGURES))

docs: build
	cmake --build --preset $(PRESET) --target docs

setup:
	scripts/setup.sh

SOURCES = $(shell git ls-files '*.cpp' '*.hpp' '*.cu')

format:
	clang-format -i $(SOURCES)

tidy: build
	clang-tidy -p build/$(PRESET) --quiet --extra-arg=-Wno-unknown-warning-option $(filter %.cpp,$(SOURCES))

clean:
	rm -rf build
