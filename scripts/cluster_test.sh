#!/usr/bin/env bash
# cluster_test.sh [--fails] [--within S] [--expect REGEX]... -- CLUSTER_ARGS...: one CTest
# case of label `cluster`: runs scripts/cluster.sh CLUSTER_ARGS and checks
#   - its exit code: 0, or with --fails any other (a fault drill: the job must fail);
#   - with --within S: that it ended within S seconds;
#   - that every REGEX (grep -E) matches a line of its output;
#   - that it left nothing behind: no namespace node0 or node1, no /etc/netns/node0 or
#     node1, no process of the programs or of Open MPI's daemon still running.
# Exit 77 (CTest: skipped, with cluster.sh's one-line reason) where namespaces cannot be
# made. The cases run alone (RUN_SERIAL), so any such process is this run's.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
fails="" within="" expect=()
while [[ $# -gt 0 && "$1" != -- ]]; do
  case "$1" in
    --fails) fails=1; shift ;;
    --within) within=$2; shift 2 ;;
    --expect) expect+=("$2"); shift 2 ;;
    *) echo "cluster_test: unknown option $1" >&2; exit 2 ;;
  esac
done
shift  # --
start=$(date +%s.%N)
out=$("$root/scripts/cluster.sh" "$@" 2>&1)
code=$?
elapsed=$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $start}")
echo "$out"
if [[ $code -eq 77 ]]; then
  exit 77
fi
status=0
fail() { echo "cluster_test: $*" >&2; status=1; }
if [[ -n "$fails" ]]; then
  [[ $code -ne 0 ]] || fail "the job should have failed, and exited 0"
else
  [[ $code -eq 0 ]] || fail "exit code $code"
fi
if [[ -n "$within" ]] && awk "BEGIN{exit !($elapsed > $within)}"; then
  fail "took ${elapsed} s, more than ${within} s"
fi
for pattern in "${expect[@]}"; do
  grep -Eq -- "$pattern" <<< "$out" || fail "no line of the output matches: $pattern"
done
for ns in node0 node1; do
  ip netns list | grep -qE "^$ns( |$)" && fail "the namespace $ns is still there"
  [[ -e /etc/netns/$ns ]] && fail "/etc/netns/$ns is still there"
done
left=$(ps -eo stat=,pid=,args= | awk '$1 !~ /^Z/' | grep -E "$root/build/[^ ]*/bin/|orted" |
  grep -v -e "grep -E" -e cluster_test)  # zombies (exited, not yet reaped) are not running
[[ -z "$left" ]] || fail "still running: $left"
echo "cluster_test: exit code $code after ${elapsed} s"
exit "$status"
