#!/usr/bin/env bash
# make check [CH=NN]: builds your exercises (the `learner` preset: chapter programs and
# tests link exercises/ instead of solutions/) and runs the chapter's tests against them.
# Without CH: every chapter, and your progress over all of them.
# Exit 0 when every selected chapter's tests pass.
set -uo pipefail
cd "$(dirname "$0")/.."
want=${1:-}
want=${want#ch}
if [[ -n "$want" && ! "$want" =~ ^[0-9]{1,2}$ ]]; then
  echo "check: CH must be a chapter number like 01 (got '$1')" >&2
  exit 2
fi
[[ -n "$want" ]] && want=$(printf '%02d' "$((10#$want))")

chapters=()
for dir in chapters/[0-9][0-9]_*/; do
  name=$(basename "$dir")
  [[ -z "$want" || "${name:0:2}" == "$want" ]] && chapters+=("$name")
done
if ((${#chapters[@]} == 0)); then
  echo "check: there is no chapter $want (see chapters/)" >&2
  exit 2
fi

# Build only what the selected chapters need.
mkdir -p build
targets=()
for name in "${chapters[@]}"; do targets+=("test_ch${name:0:2}_exercise" "ch${name}"); done
if ! { cmake --preset learner > /dev/null && cmake --build --preset learner --target "${targets[@]}"; } > build/learner.log 2>&1; then
  grep -E "error|Error" build/learner.log | head -20
  echo "check: your exercise does not compile (full log: build/learner.log)" >&2
  exit 1
fi


passed_chapters=0
printf '\n%-24s %-12s %s\n' "chapter" "test cases" "status"
for name in "${chapters[@]}"; do
  number=${name:0:2}
  log=$(build/learner/bin/test_ch${number}_exercise 2>&1)
  code=$?
  summary=$(grep -E "test cases:" <<< "$log" | tail -1)
  total=$(sed -E 's/.*test cases: *([0-9]+).*/\1/' <<< "$summary")
  passed=$(sed -E 's/.*\| *([0-9]+) passed.*/\1/' <<< "$summary")
  if [[ $code -eq 0 ]]; then
    status="done"
    passed_chapters=$((passed_chapters + 1))
  else
    first=$(grep -m1 -oE "TODO\(ch[0-9]+: [a-z_]+\)" <<< "$log" || grep -m1 -E "ERROR|error" <<< "$log")
    status="to do — first failure: ${first:-see build/learner/bin/test_ch${number}_exercise}"
  fi
  printf '%-24s %-12s %s\n' "$name" "${passed:-0}/${total:-?}" "$status"
done
if [[ -z "$want" ]]; then
  printf '\nprogress: %d of %d chapters done\n' "$passed_chapters" "${#chapters[@]}"
else
  printf '\nfull output: build/learner/bin/test_ch%s_exercise; run your program: build/learner/bin/ch%s\n' \
    "$want" "${chapters[0]}"
fi
[[ $passed_chapters -eq ${#chapters[@]} ]]
