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
	@echo "make plots          plot every benchmark CSV in RESULTS (default results/)"
	@echo "make docs           Doxygen over common/ and the chapter texts"
	@echo "make format | tidy  clang-format / clang-tidy over the sources"
	@echo "make setup          install what is missing, build, run every chapter"
	@echo "PRESET=debug make test   the same under AddressSanitizer and UBSan"

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

RESULTS ?= results
plots:
	@for script in notebooks/plot_*.py; do \
	  csv=$(RESULTS)/$$(basename $$script .py | sed 's/^plot_//').csv; \
	  if [ -f $$csv ]; then .venv/bin/python $$script $(RESULTS); else echo "skip $$script: no $$csv"; fi; \
	done

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
