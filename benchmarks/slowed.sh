#!/usr/bin/env bash
# Run a command on a slowed machine: every process it starts (Ray, vLLM, Locust, pytest)
# shares a CPU quota of CPUS cores (cgroup v1 `cpu.cfs_quota_us`, or v2 `cpu.max`).
#
#   benchmarks/slowed.sh 0.5 make demo      # a 2-core machine at a quarter of its speed
#   benchmarks/slowed.sh 0.5 make test
#
# Why a quota: the slow machines this project must hold on (2-core AVX2-only VMs) are
# ~4x slower for the tiny model than the AVX-512/AMX ones it was first measured on; a
# quota of half a core on 2 cores gives every parallel part a quarter of its speed
# (a single thread alone gets half a core, so this is harsher for the parallel parts
# than for a lone one). Needs root. The quota goes away with the cgroup at the end.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 CPUS COMMAND [ARGS...]   (CPUS: e.g. 0.5 = half a core for everything)" >&2
  exit 2
fi
cpus="$1"; shift
period=100000
quota=$(python3 -c "print(int(float('$cpus') * $period))")
name="mtp-canary-slowed-$$"
if [[ -d /sys/fs/cgroup/cpu && -w /sys/fs/cgroup/cpu ]]; then          # cgroup v1
  group="/sys/fs/cgroup/cpu/$name"
  mkdir "$group"
  echo "$period" > "$group/cpu.cfs_period_us"
  echo "$quota" > "$group/cpu.cfs_quota_us"
elif [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then                  # cgroup v2
  group="/sys/fs/cgroup/$name"
  mkdir "$group"
  echo "$quota $period" > "$group/cpu.max"
else
  echo "$0: no writable cpu cgroup here (needs root)" >&2
  exit 1
fi
cleanup() {
  # processes still in the group go back to the root group, then the group is removed
  if [[ -f "$group/cgroup.procs" ]]; then
    while read -r pid; do echo "$pid" > "$(dirname "$group")/cgroup.procs" 2>/dev/null || true; done < "$group/cgroup.procs"
  fi
  rmdir "$group" 2>/dev/null || true
}
trap cleanup EXIT
echo "slowed: $* at a CPU quota of $cpus core(s) ($(nproc) cores here; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))" >&2
started=$(date +%s)
set +e
bash -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' slowed "$group" "$@"
code=$?
set -e
echo "slowed: exit $code after $(( $(date +%s) - started )) s" >&2
exit $code
