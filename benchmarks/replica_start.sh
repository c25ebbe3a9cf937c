#!/usr/bin/env bash
# One CPU replica's start and decode speed with the model in a worker process of its own
# (vLLM's CPU default: three processes, each importing vLLM) and inside the engine-core
# process (VLLM_ENABLE_V1_MULTIPROCESSING=0, what CPU replicas run: two processes).
#
#   benchmarks/replica_start.sh [CHECKPOINT_DIR]     # default: the newest tiny checkpoint in ~/.cache/mtp-canary
#
# Prints, per mode: seconds until /v1/models answers, and seconds for 128 greedy tokens of
# one k=1 stream (5 requests), bound to core 0 and with libiomp5 preloaded as a replica
# runs it. Needs `make venv`; run it on a quiet machine (it is a timing).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
MODEL=${1:-$(ls -td "$HOME"/.cache/mtp-canary/tiny-mimo-v2-* 2>/dev/null | head -1)}
[[ -n "$MODEL" && -d "$MODEL" ]] || { echo "$0: no tiny checkpoint; run make demo once, or give its directory" >&2; exit 2; }
IOMP=$($PY -c "from cluster.replica import iomp_library; print(iomp_library() or '')")
PORT=$($PY -c "from cluster.replica import free_port; print(free_port())")
for mode in worker-process engine-core; do
  # bound to core 0 as a replica is: by vLLM (the worker's OMP thread) or by CPU affinity (the whole tree)
  if [[ $mode == engine-core ]]; then
    extra=(VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=nobind); bind=(taskset -c 0)
  else
    extra=(VLLM_CPU_OMP_THREADS_BIND=0); bind=()
  fi
  log=$(mktemp)
  t0=$(date +%s.%N)
  env "${extra[@]}" VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 LD_PRELOAD="$IOMP" \
    CUDA_VISIBLE_DEVICES= "${bind[@]}" $PY -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --served-model-name tiny --port "$PORT" --dtype auto --max-model-len 1024 --enforce-eager \
    --speculative-config '{"method":"mtp","num_speculative_tokens":1}' > "$log" 2>&1 &
  pid=$!
  until curl -sf "localhost:$PORT/v1/models" > /dev/null; do
    sleep 0.5
    kill -0 $pid 2>/dev/null || { echo "$mode: the server exited"; tail -5 "$log"; exit 1; }
  done
  ready=$(echo "$(date +%s.%N) - $t0" | bc)
  times=()
  for _ in 1 2 3 4 5; do
    s=$(date +%s.%N)
    curl -s "localhost:$PORT/v1/completions" -H 'content-type: application/json' -o /dev/null \
      -d '{"model":"tiny","prompt":"1 2 3 4","max_tokens":128,"temperature":0,"ignore_eos":true}'
    times+=("$(echo "$(date +%s.%N) - $s" | bc | xargs printf '%.2f')")
  done
  printf '%-15s ready after %.1f s | 128 tokens: %s s\n' "$mode" "$ready" "${times[*]}"
  kill -INT $pid; wait $pid 2>/dev/null || true
  rm -f "$log"
done
