#!/usr/bin/env bash
# Run a command while one CPU-bound hog per core runs at a higher priority than Ray's actors:
# the replicas (and every other Ray actor: the router, the Locust workers) get about a quarter
# of a core each, the driver's processes (pytest, the controller, the Locust master, at nice 0)
# most of theirs.
#
#   benchmarks/hogged.sh 10 make demo      # hogs at nice 10: Ray's nice-15 actors get ~25%
#   benchmarks/hogged.sh 10 make test
#
# Why a second way to slow the machine (besides benchmarks/slowed.sh's CPU quota): the slow
# machines this project must hold on (2-core AVX2-only VMs) are ~4x slower for the model's
# math, not for everything; slowed.sh slows every process 4x (harsher for the Python parts:
# imports, the controller, pytest itself), this slows what Ray runs (the vLLM servers, their
# engine cores, the router, the Locust workers) by about 4x and the rest by ~10%. The CFS
# weights: nice 10 = 110, nice 15 = 36, nice 0 = 1024, so a nice-15 process beside a nice-10
# hog gets 36 / (36 + 110) = 25% of the core, a nice-0 one 1024 / (1024 + 110) = 90%.
# The hogs end with the command.
#
# Those shares hold only where nice values compare across the whole machine. With the kernel's
# autogroup on (/proc/sys/kernel/sched_autogroup_enabled = 1, the default on many distributions),
# each session is a group that shares a core fairly with the others, and nice orders tasks only
# inside their group. Each vLLM server starts in a session of its own (cluster/replica.py, so that
# it stops as a whole; the Locust processes too), so beside the hogs (the caller's session, with
# the driver and Ray's own workers) the servers' engine processes get about half of their core,
# not a quarter, and the two replicas' shares swing against each other (the caller's group's
# weight is split across the cores by its load there); docs/performance.md has the measured
# shares. A plain Ray worker beside a hog, in the caller's group, gets the quarter or less.
# HOGGED_AUTOGROUP=0 turns autogroup off for the command (root) and back on after it: then the
# servers get the quarter above too.
#
# The tiny model's sizing probe times CPU, which the hogs cannot slow: by itself it would size the
# model for the unhogged machine, and the replicas would then run it at 4x the TPOT, where a machine
# that is really 4x slower gets a smaller model from the same probe (tinymodel/sizing.py). So where
# nice compares across the machine (autogroup off or absent) this exports MTP_CANARY_CPU_SHARE, the
# share of a core a nice-15 replica gets beside a hog (0.247 at hog nice 10): the probe divides its
# times by it and sizes the model as that slower machine would (its own cache entry; the unhogged
# size stays cached apart). HOGGED_PROBE=blind keeps the unhogged size (the harsher test: the
# full-size model at a quarter of the speed).
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 NICE COMMAND [ARGS...]   (NICE: the hogs' niceness, e.g. 10; Ray's actors run at 15)" >&2
  exit 2
fi
hog_nice="$1"; shift
hogs=()
autogroup=/proc/sys/kernel/sched_autogroup_enabled
restore_autogroup=""
nice_compares=1  # 0 while autogroup stays on: nice then orders tasks only inside their session
cleanup() {
  for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null || true; done
  if [[ -n "$restore_autogroup" ]]; then echo "$restore_autogroup" > "$autogroup"; fi
}
trap cleanup EXIT
if [[ -r "$autogroup" && "$(cat "$autogroup")" == 1 ]]; then
  if [[ "${HOGGED_AUTOGROUP:-1}" == 0 ]]; then
    echo 0 > "$autogroup"  # fails (and the script stops) without root
    restore_autogroup=1
    echo "hogged: autogroup off for the command (nice compares across sessions: the vLLM servers get ~25%)" >&2
  else
    nice_compares=0
    echo "hogged: autogroup is on: the vLLM servers (sessions of their own) get about half of a core, not a" \
         "quarter (HOGGED_AUTOGROUP=0 turns it off for the command)" >&2
  fi
fi
# CFS weights of nice 0..19 (kernel/sched/core.c sched_prio_to_weight)
weights=(1024 820 655 526 423 335 272 215 172 137 110 87 70 56 45 36 29 23 18 15)
replica_nice=15
if [[ "${HOGGED_PROBE:-}" != blind && "$nice_compares" == 1 && "$hog_nice" -ge 0 && "$hog_nice" -le 19 ]]; then
  share=$(awk -v r="${weights[$replica_nice]}" -v h="${weights[$hog_nice]}" 'BEGIN { printf "%.3f", r / (r + h) }')
  export MTP_CANARY_CPU_SHARE="$share"
  echo "hogged: MTP_CANARY_CPU_SHARE=$share (the tiny model is sized for a replica at that share of a core;" \
       "HOGGED_PROBE=blind keeps the unhogged size)" >&2
else
  echo "hogged: the tiny model keeps the unhogged machine's size (the probe times CPU, which the hogs do not slow)" >&2
fi
for ((core = 0; core < $(nproc); core++)); do
  # one per core, pinned, so each core has one (a floating pair can meet on one core)
  taskset -c "$core" nice -n "$hog_nice" bash -c 'while :; do :; done' &
  hogs+=($!)
done
echo "hogged: $* beside $(nproc) CPU hog(s) at nice $hog_nice ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))" >&2
started=$(date +%s)
set +e
"$@"
code=$?
set -e
echo "hogged: exit $code after $(( $(date +%s) - started )) s" >&2
exit $code
