#!/usr/bin/env bash
# gpu_run.sh [--cpu] [--expect REGEX]... PROGRAM ARGS...: runs a chapter program with --device cuda
# --json for CTest's `gpu` label. Skipped (exit 77: CTest says skipped, never passed) only
# where there is no GPU at all ("no CUDA device found") or, with --backend nccl, fewer GPUs
# than ranks. Otherwise the run must exit 0, print "ok": true, and match every REGEX (the
# chapter's numbers: bytes equal to their formulas, not only the verdict). A GPU that is
# there but that CUDA cannot start fails with the program's message. --cpu: the same run
# and expectations on the CPU (CTest's chNN.gpu_expect, everywhere: the GPU's numbers are
# the CPU's).
set -uo pipefail
device=(--device cuda)
if [[ "${1:-}" == --cpu ]]; then
  device=()
  shift
fi
expect=()
while [[ "${1:-}" == --expect ]]; do
  expect+=("$2")
  shift 2
done
out=$("$@" "${device[@]}" --json 2>&1)
code=$?
if [[ $code -eq 2 && "$out" == *"no CUDA device found"* ]]; then
  echo "skipped: no CUDA device"
  exit 77
fi
if [[ $code -eq 2 && "$out" == *"needs one GPU per rank"* ]]; then
  echo "skipped: ${out##*error: }"
  exit 77
fi
echo "$out"
if [[ $code -ne 0 ]]; then
  echo "gpu_run: exit code $code" >&2
  exit 1
fi
grep -q '"ok": true' <<< "$out" || { echo "gpu_run: no \"ok\": true in the output" >&2; exit 1; }
for pattern in "${expect[@]}"; do
  grep -Eq -- "$pattern" <<< "$out" || { echo "gpu_run: the output has no match for: $pattern" >&2; exit 1; }
done
