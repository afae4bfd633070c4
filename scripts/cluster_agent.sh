#!/usr/bin/env bash
# cluster_agent.sh HOST COMMAND: what mpirun runs instead of ssh to start its daemon on a
# host of scripts/cluster.sh. Open MPI calls its launch agent as `agent HOST COMMAND...`
# (ssh's form: options first, then the host, then one shell command line); here HOST is a
# network namespace, entered with `ip netns exec`, in a UTS namespace of its own whose host
# name is HOST (so that MPI_Get_processor_name, and every message naming a host, says it).
set -euo pipefail
while [[ "${1:-}" == -* ]]; do shift; done  # ssh options (-x, ...): nothing to do here
host=${1:?cluster_agent.sh: no host given}
shift
exec ip netns exec "$host" unshare --uts /bin/sh -c \
  'printf "%s" "$0" > /proc/sys/kernel/hostname && exec /bin/sh -c "$1"' "$host" "$*"
