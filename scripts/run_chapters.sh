#!/usr/bin/env bash
# Runs every chapter program in BIN_DIR (default build/default/bin) on the threads
# backend, with its default flags; stops at the first one that fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/default/bin}
for program in "$bin"/ch[0-9][0-9]_*; do
  [[ -x "$program" ]] || continue
  printf '\n######## %s\n\n' "$(basename "$program")"
  "$program"
done
