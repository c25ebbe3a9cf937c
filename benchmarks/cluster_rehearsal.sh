#!/usr/bin/env bash
# A rehearsal of the GPU path on separate hosts, on one machine (root, iproute2, util-linux):
# four network namespaces on a bridge of their own (10.43.7.0/24, nothing outside the machine),
# each host with its own /tmp (a mount namespace with a tmpfs there):
#   head   10.43.7.1  `ray start --head` (token authentication, as Ray 2.60 offers it), no GPU
#   w1, w2 10.43.7.2-3 `ray start --address ... --num-gpus 8` with accelerator_type:H100 (fake GPUs)
#   laptop 10.43.7.4  runs `mtp-canary plan` and `mtp-canary submit` against the head
# Checks: plan of configs/mimo-v2.5-mtp.yaml from the laptop fails naming the layout that fits H100
# (TP 4 x PP 2) and plan of configs/mimo-v2.5-mtp-h100.yaml places one replica per worker host;
# a submitted run's runs dir is made on the head (its own /tmp home), not on the laptop.
# Processes are stopped by the ids each namespace holds (never `ray stop`, which finds every Ray
# process of the machine by name). Not part of CI (it needs root and network namespaces).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=$REPO/.venv/bin
NET=10.43.7
BR=mtpr0
HOSTS=(head w1 w2 laptop)
TOKEN=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
OUT=${OUT:-/tmp/mtp-rehearsal}
rm -rf "$OUT/hosts"
mkdir -p "$OUT"

cleanup() {
  for h in "${HOSTS[@]}"; do
    if ip netns list | grep -qw "mtp-$h"; then
      for pid in $(ip netns pids "mtp-$h"); do kill "$pid" 2>/dev/null || true; done
      sleep 1
      for pid in $(ip netns pids "mtp-$h"); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns del "mtp-$h"
    fi
  done
  ip link del "$BR" 2>/dev/null || true
}
trap cleanup EXIT
cleanup

ip link add "$BR" type bridge
ip link set "$BR" up
i=1
for h in "${HOSTS[@]}"; do
  ip netns add "mtp-$h"
  ip link add "v-$h" type veth peer name eth0 netns "mtp-$h"
  ip link set "v-$h" master "$BR" up
  ip netns exec "mtp-$h" ip addr add "$NET.$i/24" dev eth0
  ip netns exec "mtp-$h" ip link set eth0 up
  ip netns exec "mtp-$h" ip link set lo up
  i=$((i + 1))
done

# on host $1 (its network, its own /tmp: $OUT/hosts/<host>/tmp bound there, $HOME under it), run $2
on() {
  mkdir -p "$OUT/hosts/$1/tmp/home"
  ip netns exec "mtp-$1" unshare --mount --propagation private env HOST="$1" CMD="$2" REPO="$REPO" VENV="$VENV" \
    HOSTTMP="$OUT/hosts/$1/tmp" RAY_AUTH_MODE=token RAY_AUTH_TOKEN="$TOKEN" PYTHONPATH="$REPO" sh -c '
      mount --bind "$HOSTTMP" /tmp && export HOME=/tmp/home && cd "$REPO" && export PATH="$VENV:$PATH" &&
      eval "$CMD"'
}

on head "ray start --head --node-ip-address $NET.1 --port 6379 --dashboard-host 0.0.0.0 --num-cpus 8 --num-gpus 0 \
  --disable-usage-stats > /tmp/ray-start.log 2>&1; sleep infinity" &
sleep 20
for n in 2 3; do
  h=w$((n - 1))
  on "$h" "ray start --address $NET.1:6379 --node-ip-address $NET.$n --num-cpus 12 --num-gpus 8 \
    --resources '{\"accelerator_type:H100\": 1}' --disable-usage-stats > /tmp/ray-start.log 2>&1; sleep infinity" &
done
sleep 20

# plan from the laptop (no raylet of its own: Ray Client, port 10001): the H200 layout on H100
# hosts, then the H100 layout
# the head's Ray Client server answers some seconds after `ray start`: wait for one connection
for _ in $(seq 1 12); do
  on laptop "python -c \"import ray; ray.init('ray://$NET.1:10001'); print(ray.cluster_resources())\"" \
    > "$OUT/client.txt" 2>&1 && break
  sleep 10
done
for config in mimo-v2.5-mtp mimo-v2.5-mtp-h100; do
  on laptop "sed 's|^  address: auto|  address: ray://$NET.1:10001|' configs/$config.yaml > /tmp/$config.yaml &&
    mtp-canary plan /tmp/$config.yaml --placement-wait-s 20" > "$OUT/plan-$config.txt" 2>&1 && code=0 || code=$?
  echo "plan $config: exit $code (output in $OUT/plan-$config.txt)"
  grep -E "memory:|placement:|  (baseline|canary|twin)-0:" "$OUT/plan-$config.txt" || true
done

# submit from the laptop: the runs dir is made on the head (its $HOME/mtp-canary/runs), not here
on laptop "mtp-canary submit configs/local-cpu.yaml --address http://$NET.1:8265 --no-wait" > "$OUT/submit.txt" 2>&1 || true
cat "$OUT/submit.txt"
for _ in $(seq 1 60); do
  [ -e "$OUT/hosts/head/tmp/home/mtp-canary/runs" ] && break
  sleep 5
done
ls -la "$OUT/hosts/head/tmp/home/mtp-canary/runs/" || echo "no runs dir on the head"
[ -e "$OUT/hosts/laptop/tmp/home/mtp-canary" ] && echo "runs dir on the laptop: WRONG" || echo "no runs dir on the laptop"
on laptop "RAY_ADDRESS=http://$NET.1:8265 ray job stop --no-wait $(tail -1 "$OUT/submit.txt")" > /dev/null 2>&1 || true
