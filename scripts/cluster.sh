#!/usr/bin/env bash
# A cluster on one machine: two hosts, node0 and node1, joined by a slow link, and mpirun
# across them.
#
# Each host is a network namespace with a UTS namespace of its own (its own interfaces and
# host name); a veth pair joins them, and a tbf qdisc on each end limits what it sends to
# --link-gbit. Inside a host, ranks talk through shared memory (Open MPI's vader); between
# hosts, through TCP over the link — as a cluster's GPUs talk over NVLink inside a node
# and over the network between nodes. mpirun runs on node0 and starts its daemon on node1
# through scripts/cluster_agent.sh (`ip netns exec`) where a cluster would use ssh.
#
# Usage: scripts/cluster.sh [options] WHAT [program options]
#   ch03   chapter 03's allreduces across the hosts: ring, pipelined, MPI_Allreduce, the
#          hierarchical one; bytes between hosts per algorithm, busbw against the link
#   ch08   chapter 08's mesh twice, tp inside a host, then tp across the hosts
#   ch09   chapter 09's GPT the same two ways, with its profile
#   overlap  chapter 09's GPT on dp 2, one rank on each host, its gradients across the
#          link: for each per-rank batch, the step with --overlap all and none beside
#          compute, communication, their max and their sum, and the overlap condition's
#          knee (program options, when given, are added to every run; 16 gradient
#          buckets unless they give --buckets)
#   run    PROGRAM [options]: any program under mpirun across the hosts
#   mpirun -np N PROGRAM [options]: the same, N ranks, half on each host: a stand-in for
#          mpirun (chapter 11's supervisor starts each attempt so: --mpirun
#          "scripts/cluster.sh mpirun", a cluster made afresh each time, a lost host back).
#          The ranks see SHARDLAB_CLUSTER=1: a rank told to fail takes its host's link down.
# Program options, when given, replace the defaults of ch03, ch08 and ch09 (--link-gbit
# and --timeout are added unless given).
#
# Options:
#   --link-gbit G       the link's bandwidth, 0.001 to 100 Gbit/s each way (default 1)
#   --ranks-per-node K  ranks on each host (default 2)
#   --map-by slot|node  slot: ranks 0..K-1 on node0, the next K on node1 (the default);
#                       node: round robin, rank 0 on node0, rank 1 on node1, ...
#   --timeout S         seconds a blocking call may wait before the job fails, 0.001 to
#                       86400 (default 20)
#   --fault link-down@T node1's link goes down T seconds into the run
#   --fault kill@R@T    rank R is killed (SIGKILL) T seconds into the run
#                       (R a whole number, T a decimal one such as 2 or 0.5: no sign,
#                       exponent or leading zero)
#   --build DIR         where the programs were built (default build/default)
#   --csv-dir DIR       overlap: also write its table to DIR/09_gpt_overlap.csv
#   --rounds R          overlap: every run R times, the sizes and modes in turn, and the
#                       medians tabulated (1 to 20, default 3)
#
# Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN), iproute2 (ip, tc with tbf), util-linux's
# unshare and Open MPI. Without the rights to make namespaces it says so in one line and
# exits 77 (CTest: skipped); bad options, one line and exit 2, before anything is made.
# Everything it makes — namespaces, the link, the processes in them, /etc/netns/node0 and
# node1 — is removed on exit and on failure, and within a second or so on Ctrl-C (exit
# 130), SIGTERM (143) or SIGHUP (129), each said in one line.
# The kernel's tbf limits bandwidth only: where delay would matter (small messages), say
# so — netem, which adds delay, is not in every kernel (not in this project's CI's).
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
say() { echo "cluster: $*" >&2; }
usage() { say "error: $* (usage: scripts/cluster.sh [options] ch03|ch08|ch09|overlap|run|mpirun [program options]; the options are in its first lines)"; exit 2; }

link_gbit=1 per_node=2 map_by=slot timeout=20 fault="" build="$root/build/default" csv_dir="" rounds=3
# Numbers as the user writes them: digits, a point and digits; no sign, no exponent, and no
# leading zero (bash's arithmetic reads 08 as octal, and `08` is no way to write a rank).
whole='(0|[1-9][0-9]*)'
decimal="$whole([.][0-9]+)?"
in_range() {  # in_range VALUE LO HI: LO <= VALUE <= HI
  awk -v v="$1" -v lo="$2" -v hi="$3" 'BEGIN { exit !(v + 0 >= lo && v + 0 <= hi) }'
}
fault_kind="" fault_at="" victim=""
parse_fault() {  # parse_fault SPEC: fault_kind, fault_at and victim, or a usage error
  local spec=$1
  if [[ $spec =~ ^link-down@($decimal)$ ]]; then
    fault_kind=link-down fault_at=${BASH_REMATCH[1]}
  elif [[ $spec =~ ^kill@($whole)@($decimal)$ ]]; then
    fault_kind=kill victim=${BASH_REMATCH[1]} fault_at=${BASH_REMATCH[3]}
  else
    usage "--fault $spec: link-down@SECONDS or kill@RANK@SECONDS (RANK a whole number such as 3, SECONDS a decimal number such as 2 or 0.5; no sign, exponent or leading zero)"
  fi
  in_range "$fault_at" 0 86400 || usage "--fault $spec: $fault_at s is more than a day"
}
while [[ $# -gt 0 && "$1" == --* ]]; do
  [[ $# -ge 2 ]] || usage "$1 needs a value"
  case "$1" in
    # The ranges are the programs' own (chapter 03's --link-gbit takes 0.001 and more,
    # every program's --timeout 0.001 to 86400): refused here, before a cluster is made.
    --link-gbit) link_gbit=$2; [[ $2 =~ ^$decimal$ ]] && in_range "$2" 0.001 100 || usage "--link-gbit $2: a number of Gbit/s from 0.001 to 100" ;;
    --ranks-per-node) per_node=$2; [[ $2 =~ ^[1-9][0-9]?$ ]] || usage "--ranks-per-node $2: 1 to 99" ;;
    --map-by) map_by=$2; [[ $2 == slot || $2 == node ]] || usage "--map-by $2: slot or node" ;;
    --timeout) timeout=$2; [[ $2 =~ ^$decimal$ ]] && in_range "$2" 0.001 86400 || usage "--timeout $2: a number of seconds from 0.001 to 86400" ;;
    --fault) fault=$2; parse_fault "$2" ;;
    --build) build=$(cd "$2" 2>/dev/null && pwd) || usage "--build $2: no such folder" ;;
    --csv-dir) csv_dir=$(mkdir -p "$2" 2>/dev/null && cd "$2" && pwd) || usage "--csv-dir $2: cannot make that folder" ;;
    --rounds) rounds=$2; [[ $2 =~ ^[1-9][0-9]?$ ]] && ((rounds <= 20)) || usage "--rounds $2: 1 to 20" ;;
    *) usage "unknown option $1" ;;
  esac
  shift 2
done
[[ $# -ge 1 ]] || usage "what to run: ch03, ch08, ch09, overlap or run PROGRAM"
what=$1
shift
case "$what" in ch03|ch08|ch09|overlap|run|mpirun) ;; *) usage "unknown $what: ch03, ch08, ch09, overlap, run PROGRAM or mpirun -np N PROGRAM" ;; esac
if [[ $what == mpirun ]]; then
  [[ $# -ge 3 && $1 == -np ]] || usage "mpirun: -np N PROGRAM [options]"
  [[ $2 =~ ^[1-9][0-9]?$ ]] && (($2 % 2 == 0)) || usage "mpirun -np $2: an even number of ranks up to 98, half on each host"
  per_node=$(($2 / 2))
  shift 2
fi
ranks=$((2 * per_node))
# chapter 09's comparison runs one tp group of two ranks; the overlap experiment one
# data-parallel pair, a rank on each host
[[ $what == ch09 || $what == overlap ]] && ranks=2
if [[ $fault_kind == kill ]] && ! ((${#victim} <= 3 && victim < ranks)); then
  usage "--fault $fault: there are only $ranks ranks (0 to $((ranks - 1)))"
fi

# --- the end, however it comes ---------------------------------------------------------------
# The main shell owns the cleanup: on exit, on failure, on Ctrl-C (exit 130), SIGTERM (143)
# or a closed terminal (129), it ends the fault's and the watch's timers, every process on
# either host, the hosts themselves and their /etc/netns files, and so releases the lock.
# The job runs in the background and the shell waits for it with `wait`, which a signal
# interrupts at once (a foreground mpirun would delay the trap until it had finished).
probe="" made="" fault_pid="" watch_pid="" job_pid="" signalled=""
stop_timers() {  # the fault's and the watch's subshells first (so that neither goes on to
  local p kids  # print or act once its sleep is ended), then the sleep each waits in
  for p in $fault_pid $watch_pid; do
    kids=$(pgrep -P "$p" 2> /dev/null)
    kill -KILL "$p" $kids 2> /dev/null
    wait "$p" 2> /dev/null
  done
  fault_pid="" watch_pid=""
}
host_pids() { (ip netns pids node0; ip netns pids node1) 2> /dev/null; }
teardown() {
  local code=$?
  # Nothing stops the cleanup halfway: not a second Ctrl-C, not an output whose reader is
  # gone (a write to it fails instead of ending the shell with SIGPIPE).
  trap '' INT TERM HUP PIPE
  trap - EXIT
  stop_timers
  # The job ends below, killed: no "Killed" line from this shell about it.
  [[ -n $job_pid ]] && disown "$job_pid" 2> /dev/null
  [[ -n $probe ]] && ip netns del "$probe" 2> /dev/null
  if [[ -n $made ]]; then
    # The job, if it still runs, first: mpirun, or the shell about to become it (which,
    # killed, never starts it).
    [[ -n $job_pid ]] && kill -KILL "$job_pid" 2> /dev/null
    # Every process on either host: TERM, half a second, then KILL; after a signal, KILL
    # at once (the job's own handlers would spend the user's time).
    local attempt attempts=(TERM KILL) pids
    [[ -n $signalled ]] && attempts=(KILL)
    for attempt in "${attempts[@]}"; do
      pids=$(host_pids)
      [[ -z "$pids" ]] && break
      kill -"$attempt" $pids 2> /dev/null
      for _ in 1 2 3 4 5 6 7 8 9 10; do
        sleep 0.05
        [[ -z "$(host_pids)" ]] && break
      done
    done
    for ns in node0 node1; do ip netns del "$ns" 2> /dev/null; done
    rm -rf /etc/netns/node0 /etc/netns/node1 "$state/made" "$state/hostfile" "$state/rankfile" "$state/slot.json" "$state/node.json"
  fi
  exit "$code"
}
on_signal() {  # on_signal WHAT CODE
  trap '' INT TERM HUP PIPE
  signalled=1
  say "$1${made:+: taking the cluster down}"
  exit "$2"
}
trap teardown EXIT
trap 'on_signal interrupted 130' INT
trap 'on_signal terminated 143' TERM
trap 'on_signal "hung up" 129' HUP

# --- the rights, and the tools ------------------------------------------------------------
for tool in ip tc unshare mpirun awk; do
  command -v "$tool" > /dev/null || { say "skipped: $tool is not installed (scripts/setup.sh installs it)"; exit 77; }
done
probe="shardlab-probe-$$"
if ! why=$(ip netns add "$probe" 2>&1); then
  probe=""
  say "skipped: cannot make network namespaces here (ip netns add: ${why:-refused}); run as root, or with CAP_SYS_ADMIN and CAP_NET_ADMIN"
  exit 77
fi
ip netns del "$probe"
probe=""

# One cluster at a time: the names node0 and node1 are the machine's.
state=/run/shardlab-cluster
mkdir -p "$state" || { say "cannot make $state"; exit 1; }
exec 9> "$state/lock"
if ! flock -n 9; then
  say "another scripts/cluster.sh is running; waiting for it"
  flock 9
fi
for ns in node0 node1; do
  if ip netns list | grep -qE "^$ns( |$)"; then
    if [[ -e "$state/made" ]]; then
      say "removing $ns, left behind by an earlier run that did not finish"
      ip netns pids "$ns" 2> /dev/null | xargs -r kill -KILL 2> /dev/null
      ip netns del "$ns"
    else
      say "a network namespace named $ns exists that this script did not make: remove it first (ip netns del $ns)"
      exit 2
    fi
  fi
done

# --- making the cluster --------------------------------------------------------------------
made=1
touch "$state/made"

make_cluster() {
  ip netns add node0 && ip netns add node1 &&
    ip link add veth0 netns node0 type veth peer name veth1 netns node1 &&
    ip -n node0 addr add 10.77.0.1/24 dev veth0 &&
    ip -n node1 addr add 10.77.0.2/24 dev veth1 || return 1
  local n
  for n in 0 1; do
    ip -n node$n link set lo up && ip -n node$n link set veth$n up || return 1
    # Each end sends at most the link's rate; the queue holds 50 ms of it (past that, tbf
    # drops, and TCP slows down, as a switch's full buffer makes it).
    ip netns exec node$n tc qdisc add dev veth$n root tbf rate "${link_gbit}gbit" \
      burst "$(awk "BEGIN{printf \"%d\", $link_gbit * 1e9 / 8 / 1000 + 65536}")" latency 50ms || return 1
    mkdir -p /etc/netns/node$n &&
      printf '127.0.0.1 localhost\n10.77.0.1 node0\n10.77.0.2 node1\n' > /etc/netns/node$n/hosts || return 1
  done
}
if ! why=$(make_cluster 2>&1); then
  if [[ $why == *"qdisc kind is unknown"* ]]; then
    say "skipped: this kernel has no tbf qdisc to limit the link with (tc: ${why//$'\n'/ })"
    exit 77
  fi
  say "could not make the cluster: ${why//$'\n'/ }"
  exit 1
fi
printf 'node0 slots=%d\nnode1 slots=%d\n' "$per_node" "$per_node" > "$state/hostfile"
say "node0 (10.77.0.1) and node1 (10.77.0.2), $per_node ranks each, joined by ${link_gbit} Gbit/s each way (veth + tbf); ranks by $map_by"

if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
# mpirun on node0, its daemon on node1 through the agent; TCP between the hosts on the
# link's subnet only, shared memory inside each. mpirun and the daemon probe their
# connection every second when it is idle (TCP keepalive; the default waits 5 minutes), so
# that a host that drops off ends the job in seconds. Two TCP connections between each
# pair of ranks (Open MPI's default is one): over one, two ranks that exchange buffers
# (both directions at once: the ring of two, recursive doubling, the hierarchical
# algorithm's pairs) reached 0.48 of the link each way in this project's runs, over two
# 0.92 — a property of Open MPI's TCP transport, not of the algorithms. And ranks that
# wait yield their core (each host has as many slots as ranks, so Open MPI would spin, but
# the two hosts share this machine's cores: with more ranks than cores, a spinning rank
# takes the core of the rank it waits for).
#
# Messages up to 1 MiB go eagerly, in sockets of 4 MiB: Open MPI's TCP transport sends
# anything over 64 KiB as a rendezvous (a request, the receiver's answer, then the data),
# and each of those steps moves on only when the library runs on that rank. A rank that
# computes while its gradients travel (chapter 09's --overlap) answers late: dp 2 across
# the link, ZeRO-1's buckets of 100 KiB a rank crossed at a third of the link's speed
# under the backward, and the step was 1.16 times max(compute, comm) at 768 tokens a rank;
# sent eagerly, the kernel moves the bytes while the rank computes: 1.13 times.
#
# Each rank is bound to a core of its own, counted across both hosts (a rankfile): left to
# itself, each host's Open MPI binds its first rank to core 0, as it would on a machine of
# its own, and with a rank on each host both ranks ran on core 0 while core 1 idled (dp 2
# across the link: each rank used 0.45 of a core, and the step's compute took twice its
# time on one device).
write_rankfile() {  # write_rankfile: node0's ranks, then node1's, on cores 0, 1, ... in turn
  local h r core=0 cores
  cores=$(nproc)
  : > "$state/rankfile"
  for h in 0 1; do
    for r in $(ranks_on "$h"); do
      printf 'rank %d=node%d slot=%d\n' "$r" "$h" $((core++ % cores)) >> "$state/rankfile"
    done
  done
}
mpirun_on_cluster() {  # mpirun_on_cluster PROGRAM ARGS... &: becomes mpirun (exec)
  write_rankfile  # by $current_map
  exec ip netns exec node0 unshare --uts /bin/sh -c 'printf node0 > /proc/sys/kernel/hostname && exec "$@"' sh \
    mpirun --hostfile "$state/hostfile" -np "$ranks" --rankfile "$state/rankfile" \
    --mca plm_rsh_agent "$root/scripts/cluster_agent.sh" \
    --mca btl self,vader,tcp --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 \
    --mca oob_tcp_keepalive_time 1 --mca oob_tcp_keepalive_intvl 1 --mca oob_tcp_keepalive_probes 3 \
    --mca btl_tcp_links 2 --mca mpi_yield_when_idle 1 \
    --mca btl_tcp_eager_limit 1048576 --mca btl_tcp_rndv_eager_limit 1048576 \
    --mca btl_tcp_max_send_size 1048576 --mca btl_tcp_sndbuf 4194304 --mca btl_tcp_rcvbuf 4194304 \
    ${SHARDLAB_CLUSTER:+-x SHARDLAB_CLUSTER} "$@"
}

# --- faults ---------------------------------------------------------------------------------
# Two timers beside the job, each a subshell in a `sleep`: the fault, at its time, and the
# watch, which ends a job that outlives the fault by its --timeout and a margin. Both end
# with the job (stop_timers).
start_fault() {
  [[ -z "$fault" ]] && return
  (
    sleep "$fault_at"
    if [[ $fault_kind == link-down ]]; then
      ip -n node1 link set veth1 down && say "at ${fault_at} s: node1's link is down (ip link set veth1 down)"
    else
      for ns in node0 node1; do
        for pid in $(ip netns pids "$ns" 2> /dev/null); do
          if tr '\0' '\n' < "/proc/$pid/environ" 2> /dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$victim"; then
            kill -KILL "$pid" && say "at ${fault_at} s: killed rank $victim on $ns (pid $pid)"
            exit 0
          fi
        done
      done
      say "at ${fault_at} s: rank $victim is not running (finished already?)"
    fi
  ) &
  fault_pid=$!
  # However the job takes the fault, it ends: its --timeout after the fault, and a margin
  # for mpirun to notice; past that, this script ends it.
  local limit
  limit=$(awk -v at="$fault_at" -v t="$timeout" 'BEGIN { print at + t + 15 }')
  (
    sleep "$limit"
    say "the job still runs ${limit} s in (the fault, then --timeout $timeout, then 15 s): ending it"
    host_pids | xargs -r kill -KILL
  ) &
  watch_pid=$!
}

# The ranks on host h (0 or 1) of the job running now (mapped by $current_map).
current_map=$map_by
ranks_on() {
  local h=$1 r host out=""
  for ((r = 0; r < ranks; r++)); do
    if [[ $current_map == slot ]]; then host=$((r / per_node)); else host=$((r % 2)); fi
    ((host == h)) && out+="${out:+ }$r"
  done
  echo "$out"
}
# mpirun's messages, passed on; when it loses a host, which ranks went with it.
name_lost_ranks() {
  local line
  while IFS= read -r line; do
    printf '%s\n' "$line"
    if [[ $line =~ Remote\ daemon:.*on\ node\ (node[01]) ]]; then
      local host=${BASH_REMATCH[1]}
      say "$host dropped off the job (its daemon stopped answering): ranks $(ranks_on "${host#node}") ran there"
    fi
  done
}

# What the link carried since the last report, each way, from the tbf qdiscs' counters:
# bytes, packets, and packets dropped because the queue was full (TCP then sends them
# again, slower); and what the sending interface counted (/proc/net/dev's figures). The
# two differ: TCP hands the interface segments of up to 64 KiB with one set of headers
# (GSO), which the interface counts as one packet, while tbf charges each of the frames it
# stands for, headers and all (1514 bytes for 1448 of data).
declare -A link_seen=()
link_report() {
  local n line bytes packets dropped sent frames text=""
  for n in 0 1; do
    line=$(ip netns exec node$n tc -s qdisc show dev veth$n 2> /dev/null | grep -m1 "Sent")
    [[ $line =~ Sent\ ([0-9]+)\ bytes\ ([0-9]+)\ pkt\ \(dropped\ ([0-9]+) ]] || continue
    bytes=${BASH_REMATCH[1]} packets=${BASH_REMATCH[2]} dropped=${BASH_REMATCH[3]}
    read -r sent frames < <(ip netns exec node$n cat /sys/class/net/veth$n/statistics/tx_bytes \
      /sys/class/net/veth$n/statistics/tx_packets 2> /dev/null | paste -sd ' ')
    [[ ${sent:-} =~ ^[0-9]+$ && ${frames:-} =~ ^[0-9]+$ ]] || sent=0 frames=0
    read -r b0 p0 d0 s0 f0 <<< "${link_seen[$n]:-0 0 0 0 0}"
    link_seen[$n]="$bytes $packets $dropped $sent $frames"
    text+="${text:+; }node$n -> node$((1 - n)): $((bytes - b0)) bytes in $((packets - p0)) packets, $((dropped - d0)) dropped"
    text+=" (its interface: $((sent - s0)) bytes in $((frames - f0)) packets)"
  done
  [[ -n "$text" ]] && say "the link carried $text"
}

# Runs one program across the hosts: its exit code. The job runs in the background, the
# shell waits for it (so that a signal's trap runs at once), and mpirun's messages pass
# through name_lost_ranks, which outlives a signal to the process group to pass on the
# last of them. Neither holds the cluster's lock (fd 9): only this shell does.
run_program() {  # run_program MAP_BY PROGRAM ARGS...
  local map=$1 program=$2
  shift 2
  current_map=$map
  local path=$program
  [[ $program == */* ]] || path="$build/bin/$program"
  [[ -x "$path" ]] || { say "no program $path: build first (scripts/setup.sh), or give --build"; return 2; }
  local args=("$@")
  [[ " ${args[*]} " == *" --timeout "* ]] || args+=(--timeout "$timeout")
  start_fault
  local started code took
  started=$(date +%s.%N)
  mpirun_on_cluster "$path" "${args[@]}" 9>&- 2> >(trap '' INT TERM HUP; name_lost_ranks >&2) &
  job_pid=$!
  wait "$job_pid"
  code=$?
  job_pid=""
  stop_timers
  link_report
  if [[ -n "$fault" ]]; then
    # Whole seconds, rounded down, from the clock (bash's SECONDS, itself whole seconds,
    # would make a 7.3 s job 8 s when it spans 8 of its ticks).
    took=$(awk -v t0="$started" -v t1="$(date +%s.%N)" 'BEGIN { print t1 - t0 }')
    awk -v t="$took" -v at="$fault_at" 'BEGIN { exit !(t < at) }' &&
      say "the job ended before the fault's time (${fault_at} s): there was no fault"
    say "the job ended with exit code $code, $(awk -v t="$took" 'BEGIN { printf "%d", t }') s after it started"
  fi
  return "$code"
}

# The same model twice: tp inside a host (ranks by slot: a tp group's two ranks are
# neighbours, on one host), then tp across the hosts (ranks by node: neighbours on different
# hosts). Each run's own report, then the two side by side.
compare() {  # compare ch08|ch09 [program options]
  local chapter=$1 program
  shift
  if [[ $chapter == ch08 ]]; then
    program=ch08_hybrid_mesh
    [[ $# -gt 0 ]] || set -- --tp 2 --pp 1 --hidden 256 --ffn 64 --batch 2048 --blocks 4 --steps 5 --lr 0.003
  else
    # Two ranks, one tp group: both on node0, or one on each host. Each rank has a core
    # of its own then, so the profile's shares are the step's, not the queue for a core.
    program=ch09_gpt
    ranks=2
    [[ $# -gt 0 ]] || set -- --tp 2 --pp 1 --channels 128 --context 128 --batch 32 --steps 6 --log-every 3 --no-reference
  fi
  local map code=0
  for map in slot node; do
    say "$program $* — ranks by $map: $([[ $map == slot ]] && echo "tp inside a host" || echo "tp across the hosts")"
    run_program "$map" "$program" "$@" --json > "$state/$map.json" || code=$?
    [[ $code -eq 0 ]] || return "$code"
  done
  python3 - "$state/slot.json" "$state/node.json" "$link_gbit" "$program $*" >&2 <<'PY'
import json, sys
runs = [json.load(open(path)) for path in sys.argv[1:3]]
# The link's data rate, bytes per second each way: TCP carries 1448 bytes of data in each
# 1514-byte frame, and tbf charges the frame (chapter 03's payload_per_frame).
link = float(sys.argv[3]) * 1e9 / 8 * 1448 / 1514
print(f"\ncluster: {sys.argv[4]}, the same model on the same 2 hosts, two placements")
print(f"  {'placement':<34}{'tp groups across':>17}{'bytes between hosts':>21}{'on the wire':>13}"
      f"{'link time':>11}{'step':>10}" + (f"{'tp_exposed':>11}  30 % rule" if "profile" in runs[0] else ""))
rows = []
for name, run in zip(["tp inside a host (--map-by slot)", "tp across (--map-by node)"], runs):
    # All the ranks on one host: no table, nothing between hosts.
    axes = {row["axis"]: row for row in run.get("between_hosts", [])}
    between = axes["all"]["bytes_between_hosts"] if axes else 0
    tp_across = f"{axes['tp']['groups_across_hosts']} of {axes['tp']['groups']}" if axes else "0 (one host)"
    link_ms = 1e3 * between / 2 / link  # half each way, both ways at once
    line = (f"  {name:<34}{tp_across:>17}"
            f"{between:>21}{run['wire_bytes']:>13}{link_ms:>9.0f}ms{run['step_ms']:>8.0f}ms")
    if "profile" in run:  # chapter 09's profile: the share of the step in tp's allreduces
        share = max(row["tp_exposed"] for row in run["profile"])
        line += f"{share:>11.2f}  " + ("fires (over 0.3)" if share > 0.3 else "quiet")
    print(line)
    rows.append((between, run["step_ms"], link_ms))
(b0, s0, l0), (b1, s1, l1) = rows
bytes = f"{b1 / b0:.3g} x the bytes between hosts" if b0 else f"{b1} bytes between hosts instead of none"
print(f"  tp across / tp inside: {bytes}, {s1 / s0:.3g} x the step time; the link alone adds "
      f"{l1 - l0:.0f} ms a step (half the bytes each way at {float(sys.argv[3]):g} Gbit/s, "
      f"{link / 1e9:.4g} GB/s of data), the "
      f"step took {s1 - s0:.0f} ms longer")
PY
}

overlap() {  # overlap [program options]: dp 2 across the link, each per-rank batch both ways, --rounds times
  local per code=0 mode round buckets=(--buckets 16) sequences=(1 2 3 4 5 6 8 10 12 16)  # a rank's
  [[ " $* " == *" --buckets "* || " $* " == *" --buckets="* ]] && buckets=()  # the options' own
  # Round by round, every size and mode in turn: a slow minute of the shared machine
  # falls on every column alike, and the medians leave it out.
  for ((round = 1; round <= rounds; round++)); do
    for per in "${sequences[@]}"; do
      for mode in none all; do
        say "round $round of $rounds: ch09_gpt dp 2 across the hosts, $per sequences a rank, --overlap $mode"
        run_program node ch09_gpt --pp 1 --dp 2 --tp 1 --batch $((2 * per)) --microbatches 1 \
          "${buckets[@]}" --steps 30 --no-reference --overlap "$mode" "$@" --json \
          > "$state/overlap_${per}_${mode}_$round.json" || code=$?
        [[ $code -eq 0 ]] || return "$code"
      done
    done
  done
  python3 - "$state" "$link_gbit" "$csv_dir" "$*" "${sequences[*]}" "$rounds" >&2 <<'PY'
import csv, json, re, sys
from pathlib import Path
from statistics import median
state, gbit, csv_dir, rounds = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], int(sys.argv[6])
given = re.search(r"--context (\d+)", sys.argv[4])
context = int(given.group(1)) if given else 64
zero = re.search(r"--zero 1\b", sys.argv[4]) is not None
def runs(per, mode):
    return [json.loads((state / f"overlap_{per}_{mode}_{k}.json").read_text())
            for k in range(1, rounds + 1)]
# A run's step: its median step (the first steps, connecting and warming up, left out). Its
# parts: the last step's profile, the median rank's, in ms. Each the median of the rounds.
def ms(run, column):
    return median(r[column] * r["step_ms"] for r in run["profile"])
rows = []
for per in map(int, sys.argv[5].split()):  # the sequences a rank the runs above had
    none, both = runs(per, "none"), runs(per, "all")
    tokens = per * context  # a rank's, a step
    compute = median(ms(run, "compute") for run in none)
    comm = median(ms(run, "dp_exposed") for run in none)
    # What overlap cannot hide, by the overlap condition: the allreduce under the backward
    # (about 2/3 of the compute: 4 of the 6 N FLOPs a token); under ZeRO-1 the
    # reduce-scatter (half the bytes) under the backward, the all-gather under the forward.
    backward, forward = 2 / 3 * compute, compute / 3
    if zero:
        predicted = max(0.0, comm / 2 - backward) + max(0.0, comm / 2 - forward)
    else:
        predicted = max(0.0, comm - backward)
    rows.append({
        "sequences_per_rank": per, "tokens_per_rank": tokens,
        "step_none_ms": round(median(run["step_ms"] for run in none), 1),
        "step_all_ms": round(median(run["step_ms"] for run in both), 1),
        "compute_ms": round(compute, 1), "comm_ms": round(comm, 1),
        "max_ms": round(max(compute, comm), 1), "sum_ms": round(compute + comm, 1),
        "exposed_all_ms": round(median(ms(run, "dp_exposed") for run in both), 1),
        "backward_ms": round(backward, 1),
        "predicted_exposed_ms": round(predicted, 1), "zero": int(zero),
        "dp_bytes": median(r["dp_bytes"] for r in none[0]["bytes_per_axis"]),
        "flops_per_token": none[0]["model_flops_per_token"],
    })
print(f"\ncluster: ch09_gpt, dp 2{' with ZeRO-1' if zero else ''} with a rank on each host, its gradients over the {gbit:g} Gbit/s link "
      f"(the medians of {rounds} rounds: each run's median step, and the parts of its last step, "
      "the median rank's)")
print(f"  {'seq/rank':>8}{'tokens':>8}{'compute':>9}{'comm':>8}{'max':>8}{'sum':>8}"
      f"{'none':>8}{'all':>8}{'all/max':>9}{'none/all':>10}{'exposed':>9}{'predicted':>11}")
for r in rows:
    print(f"  {r['sequences_per_rank']:>8}{r['tokens_per_rank']:>8}{r['compute_ms']:>7.0f}ms"
          f"{r['comm_ms']:>6.0f}ms{r['max_ms']:>6.0f}ms{r['sum_ms']:>6.0f}ms{r['step_none_ms']:>6.0f}ms"
          f"{r['step_all_ms']:>6.0f}ms{r['step_all_ms'] / r['max_ms']:>9.2f}"
          f"{r['step_none_ms'] / r['step_all_ms']:>10.2f}{r['exposed_all_ms']:>7.0f}ms"
          f"{r['predicted_exposed_ms']:>9.0f}ms")
# The overlap condition (the Ultra-Scale Playbook's A3, the Scaling Book's B/X > C/W): the
# backward's 4 N T FLOPs take longer than the ring allreduce's 2 (d-1)/d 4N bytes when a
# rank's tokens T > 2 (d-1)/d C / busbw, C the rank's FLOP rate, busbw the allreduce's.
big = rows[-1]
rate = big["flops_per_token"] * big["tokens_per_rank"] / (big["compute_ms"] / 1e3)
busbw = big["dp_bytes"] / (big["comm_ms"] / 1e3)
knee = rate / busbw  # d = 2: 2 (d-1)/d = 1
print(f"  the knee by the formula: T > 2(d-1)/d C/busbw = {rate / 1e9:.3g} GFLOP/s / "
      f"{busbw / 1e6:.3g} MB/s = {knee:.0f} tokens a rank (C and busbw measured at "
      f"{big['sequences_per_rank']} sequences a rank)")
print("  compute, comm: --overlap none's compute and dp wait; exposed: --overlap all's dp wait; "
      "predicted: " + ("max(0, comm/2 - backward) + max(0, comm/2 - forward)" if zero else
                       "max(0, comm - backward)") + ", the backward 2/3 of the compute (4 of "
      "the 6 N FLOPs a token), the forward 1/3")
if csv_dir:
    path = Path(csv_dir) / "09_gpt_overlap.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["knee_tokens", "link_gbit"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, "knee_tokens": round(knee), "link_gbit": gbit})
    print(f"  wrote {path}")
PY
}

with_link() {  # the program's options, with --link-gbit unless given
  local args=("$@")
  [[ " ${args[*]} " == *" --link-gbit "* ]] || args+=(--link-gbit "$link_gbit")
  printf '%s\n' "${args[@]}"
}

case "$what" in
  run)
    [[ $# -ge 1 ]] || usage "run: which program?"
    run_program "$map_by" "$@"
    ;;
  mpirun)
    export SHARDLAB_CLUSTER=1
    run_program "$map_by" "$@"
    ;;
  ch03)
    [[ $# -gt 0 ]] || set -- -b 1M -e 16M -f 4 -n 5 -w 1
    mapfile -t args < <(with_link "$@")
    run_program "$map_by" ch03_ring_allreduce "${args[@]}"
    ;;
  ch08 | ch09)
    compare "$what" "$@"
    ;;
  overlap)
    overlap "$@"
    ;;
esac
