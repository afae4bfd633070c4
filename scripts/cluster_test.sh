#!/usr/bin/env bash
# cluster_test.sh [--fails] [--within S] [--expect REGEX]... [--reject REGEX]... [--trace]
#                 [--signal SIG@T] -- CLUSTER_ARGS...: one CTest case of label `cluster`:
# runs scripts/cluster.sh CLUSTER_ARGS, in a session of its own, and checks
#   - its exit code: 0, or with --fails any other (a fault drill: the job must fail);
#   - with --within S: that it ended within S seconds of its cluster being up;
#   - that every --expect REGEX (grep -E) matches a line of its output, and no --reject
#     REGEX does;
#   - that it left nothing behind: no process of its session, of the programs or of Open
#     MPI's daemon still running (2 s after it ended at most), no namespace node0 or node1,
#     no /etc/netns/node0 or node1, and the cluster's lock free.
# --trace runs it under `bash -x`. --signal SIG@T (INT, TERM or HUP) sends SIG to its
# process group T seconds after the cluster is up (as Ctrl-C does to a terminal's), and
# checks the exit code, 128 + the signal's number, and that it ended, and left nothing
# behind, within 2 s of the signal.
# Exit 77 (CTest: skipped, with cluster.sh's one-line reason) where namespaces cannot be
# made. Another cluster.sh (another checkout's tests) may run at the same time: the lock
# makes one wait for the other, and the checks look at this run's processes only.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
fails="" within="" expect=() reject=() trace="" signal="" signal_at=""
while [[ $# -gt 0 && "$1" != -- ]]; do
  case "$1" in
    --fails) fails=1; shift ;;
    --within) within=$2; shift 2 ;;
    --expect) expect+=("$2"); shift 2 ;;
    --reject) reject+=("$2"); shift 2 ;;
    --trace) trace=1; shift ;;
    --signal)
      [[ $2 =~ ^(INT|TERM|HUP)@([0-9]+([.][0-9]+)?)$ ]] || { echo "cluster_test: --signal $2: INT, TERM or HUP @ seconds" >&2; exit 2; }
      signal=${BASH_REMATCH[1]} signal_at=${BASH_REMATCH[2]}
      shift 2 ;;
    *) echo "cluster_test: unknown option $1" >&2; exit 2 ;;
  esac
done
shift  # --
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
now() { date +%s.%N; }
seconds_since() { awk -v t0="$1" -v t1="$(now)" 'BEGIN { printf "%.2f", t1 - t0 }'; }

# Its own session and process group (setsid: a background job here is no group leader, so
# setsid makes the session in this very process, whose id is $!), with the signals a
# terminal's shell would leave to it (a background job starts with SIGINT ignored).
command=("$root/scripts/cluster.sh" "$@")
[[ -n $trace ]] && command=(bash -x "${command[@]}")
: > "$tmp/out"
start=$(now)
setsid env --default-signal=INT,TERM,HUP "${command[@]}" > "$tmp/out" 2>&1 < /dev/null &
pid=$!
# The clock starts when the cluster is up (it may first wait for another run's to end).
up="" signalled=""
while kill -0 "$pid" 2> /dev/null; do
  if [[ -z $up ]] && grep -q "^cluster: node0 (" "$tmp/out"; then
    up=$(now)
    if [[ -n $signal ]]; then
      sleep "$signal_at"
      if kill -0 "$pid" 2> /dev/null; then
        signalled=$(now)
        kill -s "$signal" -- "-$pid"
      fi
    fi
  fi
  sleep 0.1
done
wait "$pid"
code=$?
elapsed=$(seconds_since "${up:-$start}")
out=$(cat "$tmp/out")
echo "$out"
if [[ $code -eq 77 ]]; then
  exit 77
fi
status=0
fail() { echo "cluster_test: $*" >&2; status=1; }
if [[ -n $signal ]]; then
  want=$((128 + $(kill -l "$signal")))
  if [[ -z $signalled ]]; then
    fail "the run ended before the $signal was due (exit code $code)"
  else
    after=$(seconds_since "$signalled")
    [[ $code -eq $want ]] || fail "exit code $code after SIG$signal, not $want"
    awk -v t="$after" 'BEGIN { exit !(t > 2) }' && fail "ended ${after} s after SIG$signal, more than 2 s"
  fi
elif [[ -n "$fails" ]]; then
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
for pattern in "${reject[@]}"; do
  line=$(grep -E -m1 -- "$pattern" <<< "$out") && fail "a line of the output matches $pattern: $line"
done

# Its processes: those of its session, and the programs and daemons of this checkout
# (zombies, exited and not yet reaped, are not running). 2 s after the signal, or after
# the end, none may be left.
ours() {
  ps -eo stat=,sid=,pid=,args= | awk -v sid="$pid" '$1 !~ /^Z/ && $2 == sid' | cut -c1-200
  ps -eo stat=,pid=,args= | awk '$1 !~ /^Z/' |
    grep -E -e "$root/build/[^ ]*/bin/" -e "$root/scripts/cluster_agent.sh" | grep -v -e "grep -E" -e cluster_test | cut -c1-200
}
deadline=$(awk -v t="${signalled:-$(now)}" 'BEGIN { print t + 2 }')
while left=$(ours) && [[ -n $left ]] && awk -v d="$deadline" -v t="$(now)" 'BEGIN { exit !(t < d) }'; do
  sleep 0.1
done
[[ -z "$left" ]] || fail "still running: $left"
# The hosts and their files, looked at under the cluster's lock, so that another run's
# hosts are not taken for this one's: the lock must come free (waiting for another run is
# fine; a process of this run holding it is not).
exec 8> /run/shardlab-cluster/lock
if flock -w 240 8; then
  for ns in node0 node1; do
    ip netns list | grep -qE "^$ns( |$)" && fail "the namespace $ns is still there"
    [[ -e /etc/netns/$ns ]] && fail "/etc/netns/$ns is still there"
  done
  flock -u 8
else
  fail "the cluster's lock (/run/shardlab-cluster/lock) stayed held for 240 s"
fi
exec 8>&-
echo "cluster_test: exit code $code, ${elapsed} s after the cluster was up${signalled:+ (SIG$signal ${after} s before the end)}"
exit "$status"
