#!/usr/bin/env bash
# ShardLab set-up, for a fresh Debian 12 machine (run as root, or as a user with sudo).
#
#   scripts/setup.sh            install what is missing, build, run every chapter
#   scripts/setup.sh test       install what is missing, build, run the whole test suite
#   scripts/setup.sh test --ci  the same with warnings as errors, and the learner build of
#                               every untouched exercise, reported to do (.ci/run)
#
# Idempotent: packages already installed are not touched, the Python environment is
# only refreshed when notebooks/requirements.txt changes, and builds are incremental.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-run}
preset=default
[[ "${2:-}" == "--ci" ]] && preset=ci
case "$mode" in run|test) ;; *) echo "usage: scripts/setup.sh [run|test] [--ci]" >&2; exit 2 ;; esac

say() { printf '\n== %s\n' "$*"; }

# ---------------------------------------------------------------------------
# 1. Debian packages (only the missing ones).
packages=(cmake ninja-build g++ make pkg-config libopenmpi-dev openmpi-bin doctest-dev
          libcli11-dev nlohmann-json3-dev doxygen python3 python3-venv python3-pip clang-format
          iproute2 procps util-linux)  # the last three: scripts/cluster.sh's hosts
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
mkdir -p build
log=build/setup.log
: > "$log"
# A step's output goes to the log; the screen gets the log's end only if the step fails.
quietly() {
  if ! "$@" >> "$log" 2>&1; then
    tail -20 "$log" >&2
    echo "setup: '$*' failed (whole log: $log)" >&2
    exit 1
  fi
}
if ((${#missing[@]})); then
  say "installing ${missing[*]} (apt's output: $log)"
  sudo=""
  [[ $(id -u) -ne 0 ]] && sudo=sudo
  quietly $sudo apt-get update
  quietly env DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends \
    "${missing[@]}"
fi

# ---------------------------------------------------------------------------
# 2. The plotting environment for the notebooks (.venv), refreshed when the
#    requirements change.
stamp=.venv/.requirements.sha256
want=$(sha256sum notebooks/requirements.txt | cut -d' ' -f1)
if [[ ! -x .venv/bin/python || "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  say "Python environment .venv (notebooks/requirements.txt)"
  quietly python3 -m venv .venv
  quietly .venv/bin/python -m pip install --upgrade pip
  quietly .venv/bin/python -m pip install -r notebooks/requirements.txt
  echo "$want" > "$stamp"
fi

# ---------------------------------------------------------------------------
# 3. Build.
say "building (preset $preset)"
cmake --preset "$preset" > /dev/null
cmake --build --preset "$preset"

# ---------------------------------------------------------------------------
# 4. Run the chapters, or the tests.
if [[ "$mode" == run ]]; then
  scripts/run_chapters.sh "build/default/bin"
  say "done: every chapter ran. Next: read chapters/01_matmul_split/README.md, then 'make check CH=01'."
  exit 0
fi

say "test suite"
# CI's learner build (below) starts now, under the idle scheduling class (SCHED_IDLE: it
# runs only on a core nothing else wants) and two compilers at most: it takes the cores
# the tests leave idle while they wait (for processes to start, for timeouts), and what
# it has not built by the end is built then.
# It builds the exercises' tests, not the chapter programs a learner runs beside them (the
# suite's chNN.exercise_links_like_solution says that those link with the exercises), and
# without the sanitizers (learner-ci): the untouched stubs throw at once, so what CI checks
# here is the learner build's wiring and check.sh's verdicts; a learner's own `make check`
# has them.
learner_build=
if [[ "$preset" == ci ]]; then
  export CHECK_PROGRAMS=0 CHECK_PRESET=learner-ci
  setsid chrt --idle 0 env CMAKE_BUILD_PARALLEL_LEVEL=2 scripts/check.sh --build-only \
    > build/learner-early.log 2>&1 &
  learner_build=$!  # its own process group: the trap stops the compilers too
  trap 'kill -- "-$learner_build" 2>/dev/null || true' EXIT
fi
# The ten slowest tests, from the run's JUnit report, printed whether the run passed or not.
junit="$PWD/build/default/ctest-junit.xml"
status=0
ctest --preset "$preset" --output-junit "$junit" || status=$?
python3 - "$junit" <<'PY' || true
import sys, xml.etree.ElementTree as ET
cases = [(float(c.get("time", 0)), c.get("name")) for c in ET.parse(sys.argv[1]).iter("testcase")]
print("\nthe ten slowest tests (seconds; the suite runs two at a time):")
for seconds, name in sorted(cases, reverse=True)[:10]:
    print(f"  {seconds:7.1f}  {name}")
PY
((status == 0)) || exit "$status"
# Every exercise test already fails on its stub in the suite (ctest -L exercise). CI also
# builds the learner preset's wiring (learner-ci) and runs `make check` on the stubs.
if [[ "$preset" != ci ]]; then
  say "all tests passed"
  exit 0
fi
say "learner build: the untouched exercises must build and report every chapter as to do"
[[ -n "$learner_build" ]] && { wait "$learner_build" || true; }  # check.sh says why, if so
if scripts/check.sh > build/check.log 2>&1; then
  cat build/check.log
  echo "setup: 'make check' passed on the untouched stubs; a stub is not a stub" >&2
  exit 1
fi
cat build/check.log
# ...and it failed the right way: every chapter built, ran and was found to do.
chapters=$(ls -d chapters/[0-9][0-9]_*/ | wc -l)
if ! grep -qx "progress: 0 of $chapters chapters done" build/check.log; then
  echo "setup: 'make check' did not report the $chapters chapters as to do (log above)" >&2
  exit 1
fi
say "all tests passed"
