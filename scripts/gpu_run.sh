#!/usr/bin/env bash
# gpu_run.sh PROGRAM ARGS...: runs a chapter program with --device cuda --json for CTest's
# `gpu` label. Where there is no CUDA device it prints "skipped: no CUDA device" and exits
# 77 (CTest: skipped, never passed); otherwise the run must exit 0 with "ok": true.
set -uo pipefail
out=$("$@" --device cuda --json 2>&1)
code=$?
if [[ $code -eq 2 && "$out" == *"no CUDA device found"* ]]; then
  echo "skipped: no CUDA device"
  exit 77
fi
echo "$out"
if [[ $code -ne 0 ]]; then
  echo "gpu_run: exit code $code" >&2
  exit 1
fi
grep -q '"ok": true' <<< "$out" || { echo "gpu_run: no \"ok\": true in the output" >&2; exit 1; }
