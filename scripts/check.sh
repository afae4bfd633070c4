#!/usr/bin/env bash
# make check [CH=NN]: builds your exercises (the `learner` preset: chapter programs and
# tests link exercises/ instead of solutions/, with AddressSanitizer and UBSan) and runs
# the chapter's tests against them. Without CH: every chapter, and your progress over all.
# Exit 0 when every selected chapter's tests pass.
#
# A test run stops at its first failure and prints that check's own message (which rank,
# which step, which values). A run that takes longer than CHECK_TIMEOUT seconds (default
# 60) is stopped and reported as a deadlock or a hang.
#
# Chapters build on earlier ones (chapter 04's pipeline trains on your chapter 02 sync,
# ...): a chapter runs on YOUR code of the chapters below it, and a stub down there is
# named as the reason it stops. USE_SOLUTIONS=04,05 (make check CH=09 USE_SOLUTIONS=04)
# takes the reference of chapters you skip instead.
#
# scripts/check.sh --build-only [CH]: the build alone, nothing run (exit 0 when it built).
# CHECK_PROGRAMS=0: the exercises' tests alone, not the chapter programs beside them (CI,
# where the default build's test chNN.exercise_links_like_solution stands for them: a
# program that links with the solution links with the exercise). CHECK_PRESET=learner-ci:
# the same build without the sanitizers, at -O0 (CI, on the untouched stubs, which throw
# at once: what it checks is the wiring and this script's verdicts, in 70 % of the time).
set -uo pipefail
cd "$(dirname "$0")/.."
build_only=false
if [[ "${1:-}" == --build-only ]]; then
  build_only=true
  shift
fi
want=${1:-}
want=${want#ch}
if [[ -n "$want" && ! "$want" =~ ^[0-9]{1,2}$ ]]; then
  echo "check: CH must be a chapter number like 01 (got '$1')" >&2
  exit 2
fi
[[ -n "$want" ]] && want=$(printf '%02d' "$((10#$want))")
limit=${CHECK_TIMEOUT:-60}

chapters=()
for dir in chapters/[0-9][0-9]_*/; do
  name=$(basename "$dir")
  [[ -z "$want" || "${name:0:2}" == "$want" ]] && chapters+=("$name")
done
if ((${#chapters[@]} == 0)); then
  echo "check: there is no chapter $want (see chapters/)" >&2
  exit 2
fi

# Build only what the selected chapters need. Configure only the first time, or when the
# presets changed: after that the build itself notices edited CMake files.
mkdir -p build
targets=()
for name in "${chapters[@]}"; do
  targets+=("test_ch${name:0:2}_exercise")
  [[ "${CHECK_PROGRAMS:-1}" == 0 ]] || targets+=("ch${name}")
done
use_solutions=${USE_SOLUTIONS:-}
use_solutions=${use_solutions//,/;}
use_solutions=${use_solutions// /;}
if [[ -n "$use_solutions" && ! "$use_solutions" =~ ^[0-9]{2}(\;[0-9]{2})*$ ]]; then
  echo "check: USE_SOLUTIONS takes chapter numbers like 04 or 04,05 (got '$USE_SOLUTIONS')" >&2
  exit 2
fi
preset=${CHECK_PRESET:-learner}
if [[ "$preset" != learner && "$preset" != learner-ci ]]; then
  echo "check: CHECK_PRESET is learner or learner-ci (got '$preset')" >&2
  exit 2
fi
dir=build/$preset
configure=true
if [[ -f $dir/build.ninja && $dir/CMakeCache.txt -nt CMakePresets.json ]] &&
   grep -qxF "SHARDLAB_USE_SOLUTIONS:STRING=$use_solutions" "$dir/CMakeCache.txt"; then
  configure=false
fi
if ! { { ! $configure ||
         cmake --preset "$preset" "-DSHARDLAB_USE_SOLUTIONS=$use_solutions" > /dev/null; } &&
       cmake --build --preset "$preset" --target "${targets[@]}"; } > build/learner.log 2>&1; then
  # The first error with what the compiler says after it (the candidates it considered,
  # the notes), not only the error lines.
  grep -m1 -A14 -E ": error:|Error" build/learner.log | grep -vE "^\[[0-9]+/[0-9]+\]|^ninja:"
  echo "check: your exercise does not compile (full log: build/learner.log)" >&2
  exit 1
fi
$build_only && exit 0

# The first failure in a doctest log, in the words of the check that failed: the test
# case (and world size), then its own message — the "logged:" text of a CHECK_MESSAGE,
# the text of a FAIL_CHECK, or what an exception said.
first_failure() {
  awk '
    /^TEST CASE:/ { sub(/^TEST CASE: */, ""); test = $0; where = ""; getline; if ($0 ~ /^  [^ ]/) where = " (" substr($0, 3) ")"; next }
    !found && /ERROR: / && !/exception thrown in subcase/ && !/too many failed/ {
      found = 1; check = ($0 ~ /(CHECK|REQUIRE)(_[A-Z]+)?\(.*\) is NOT correct/)
      msg = $0; sub(/.*ERROR: (test case THREW exception: )?/, "", msg); next
    }
    found && /^  logged: / { text = $0; sub(/^  logged: /, "", text); logged = text; next }
    found && logged != "" && /^    / { logged = logged "\n          " substr($0, 5); next }
    found && (/^$/ || /^===/) { exit }
    END {
      if (!found) exit
      # A failed CHECK_MESSAGE says what went wrong in its logged text; an exception or
      # FAIL_CHECK in its own, with the logged values (CAPTURE) as context.
      if (check && logged != "") msg = logged
      else if (logged != "") msg = msg "\n          (" logged ")"
      printf "  test:   %s%s\n  failed: %s\n", test, where, msg
    }
  '
}

# A sanitizer's report, shortened to what a learner needs: what went wrong, and the first
# line of their own code (exercises/, chapters/) on the way there.
sanitizer_summary() {
  awk '
    function from_repo(text,   i) {  # "/path/to/repo/exercises/x.cpp:3" -> "exercises/x.cpp:3"
      i = index(text, "/exercises/"); if (!i) i = index(text, "/chapters/")
      if (!i) i = index(text, "/common/"); return i ? substr(text, i + 1) : text
    }
    /ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:|Assertion .* failed/ && !head {
      head = $0; sub(/^==[0-9]+==ERROR: /, "", head); sub(/ on address .*/, "", head)
      if (head ~ /runtime error:/) head = from_repo(head)
      next
    }
    head && /^(READ|WRITE) of size/ && !access { access = $0; sub(/ at 0x[0-9a-f]+/, "", access) }
    head && /is located/ && !where { where = $0; sub(/^0x[0-9a-f]+ /, "", where); sub(/ \[.*/, "", where) }
    head && / in .*\/(exercises|chapters)\/[^ ]+:[0-9]+/ && !frame {
      line = $0; sub(/^ *#[0-9]+ 0x[0-9a-f]+ in /, "", line)
      n = split(line, part, " "); frame = from_repo(part[n])
      fn = line; sub(/\(.*/, "", fn); frame = frame "  (in " fn ")"
    }
    END {
      if (!head) exit
      printf "  failed: %s\n", head
      if (access) printf "          %s, %s\n", access, where
      if (frame) printf "  at:     %s\n", frame
    }
  '
}

# The compiler's warnings about your own files, when they were compiled just now: an
# uninitialised variable or a narrowing is often the bug. (Where the compiler does it
# correctly, the learner build fills uninitialised locals with a pattern,
# -ftrivial-auto-var-init=pattern, so that such a bug fails the same way every run.)
warnings=$(grep -E "^[^ ]*exercises/[^ ]+: warning:" build/learner.log | sed -E 's|^.*/(exercises/)|\1|' |
           sort -u | head -10)
if [[ -n "$warnings" ]]; then
  printf '\nthe compiler warns about your code:\n'
  sed 's/^/  /' <<< "$warnings"
fi

# Which chapters each one builds on ("04:02" per line, written by CMake).
declare -A depends_on=()
while IFS=: read -r number deps; do
  [[ -n "$number" ]] && depends_on[$number]=${deps//,/ }
done < "$dir/chapter_depends.txt"
solution_of() { [[ ";$use_solutions;" == *";$1;"* ]]; }

passed_chapters=0
report=""
printf '\n%-24s %-18s %-12s %s\n' "chapter" "builds on" "test cases" "status"
# A test that grows past CHECK_MEMORY_MB (default 4096) is stopped by AddressSanitizer
# with a report, before it takes the machine's memory.
memory_mb=${CHECK_MEMORY_MB:-4096}
run_tests() {  # run_tests PROGRAM [doctest options]: its log on stdout, its exit code
  ASAN_OPTIONS=handle_abort=1:detect_leaks=0:hard_rss_limit_mb=$memory_mb \
    UBSAN_OPTIONS=print_stacktrace=1 timeout -k 5 "$limit" "$@" 2>&1
}
count_of() {  # count_of LOG KEY: "test cases: 6 | 2 passed" -> total or passed
  local summary
  summary=$(grep -E "test cases:" <<< "$1" | tail -1)
  [[ -z "$summary" ]] && return
  if [[ $2 == total ]]; then sed -E 's/.*test cases: *([0-9]+).*/\1/' <<< "$summary"
  else sed -E 's/.*\| *([0-9]+) passed.*/\1/' <<< "$summary"; fi
}

for name in "${chapters[@]}"; do
  number=${name:0:2}
  program=$dir/bin/test_ch${number}_exercise
  # First up to the first failure (seconds, even for a deadlock); then, if that failure was
  # quick, the whole suite, for the count of test cases that pass.
  log=$(run_tests "$program" --abort-after=1)
  code=$?
  total=$("$program" --count 2>/dev/null | sed -nE 's/.*test cases passing the current filters: ([0-9]+).*/\1/p')
  passed=$(count_of "$log" passed)
  if [[ $code -eq 0 ]]; then
    status="done"
    passed_chapters=$((passed_chapters + 1))
  elif [[ $code -eq 124 || $code -eq 137 ]]; then
    status="timed out after $limit s — a deadlock or a hang; run $program to see where"
    passed="?"
  elif [[ -z "$(count_of "$log" total)" ]]; then
    passed="crashed"
    status="crashed — see below"
    failure=$(sanitizer_summary <<< "$log")
    grep -q "hard rss limit exhausted" <<< "$log" &&
      failure="  failed: the test grew past $memory_mb MiB of memory (CHECK_MEMORY_MB): a loop that"$'\n'"          does not end, or a count that was never set?"
    [[ -z "$failure" ]] && failure=$(tail -15 <<< "$log")
    report+=$'\n'"$name: where it crashed"$'\n'"$failure"$'\n'
  else
    if grep -q "(--timeout)" <<< "$log"; then
      passed="?"  # a deadlock: the other test cases would wait as long
    else
      passed=$(count_of "$(run_tests "$program")" passed)
    fi
    todo=$(grep -m1 -oE "TODO\(ch[0-9]+: [a-z_0-9]+\)" <<< "$log")
    from=${todo:7:2}
    if [[ -n "$todo" && "$from" != "$number" ]]; then
      status="stopped at $todo: chapter $from first (or USE_SOLUTIONS=$from)"
    elif [[ -n "$todo" ]]; then
      status="to do — first: $todo"
    else
      status="failing — see below"
      failure=$(first_failure <<< "$log")
      [[ -z "$failure" ]] && failure=$(tail -15 <<< "$log")
      report+=$'\n'"$name: the first failing check"$'\n'"$failure"$'\n'
    fi
  fi
  [[ "$passed" == crashed ]] && total=""
  below=""
  for dep in ${depends_on[$number]:-}; do
    below+="${below:+ }$dep"
    solution_of "$dep" && below+="*"
  done
  printf '%-24s %-18s %-12s %s\n' "$name" "${below:--}" "${passed:-0}${total:+/$total}" "$status"
done
[[ -n "$report" ]] && printf '%s' "$report"
[[ -n "$use_solutions" ]] && printf '\n* the reference solution (USE_SOLUTIONS), not your code\n'
if [[ -z "$want" ]]; then
  printf '\nprogress: %d of %d chapters done\n' "$passed_chapters" "${#chapters[@]}"
else
  printf '\nfull output: %s/bin/test_ch%s_exercise; run your program: %s/bin/ch%s\n' "$dir" \
    "$want" "$dir" "${chapters[0]}"
fi
[[ $passed_chapters -eq ${#chapters[@]} ]]
