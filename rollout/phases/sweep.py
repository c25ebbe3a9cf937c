"""Speedup vs load: both arms at each level of experiment.sweep (same prompts, pinned
alternately), after the judged experiment; reported, never gated (rollout.load_sweep)."""

from __future__ import annotations

from cluster.arms import BASELINE, CANARY
from cluster.distributed_load import run_distributed_swarm
from loadtests.records import read_records
from loadtests.swarm import Swarm, SwarmProgress, SwarmResult, SwarmSpec
from rollout.load_sweep import summarize_sweep
from rollout.result import SweepRow
from rollout.run_context import RunContext

PROGRESS_EVERY_S = 15


def run_swarm(ctx: RunContext, spec: SwarmSpec, on_progress=None) -> SwarmResult:
    """One load test: workers under Ray actors on the cluster (worker_placement), or local processes."""
    placement = ctx.cfg.experiment.worker_placement
    if placement == "local" or spec.n_workers == 0:
        return Swarm(spec, on_progress=on_progress, progress_interval_s=1.0).run()
    return run_distributed_swarm(spec, placement, on_progress)


class Sweep:
    name = "sweep"

    def enabled(self, ctx: RunContext) -> bool:
        exp = ctx.cfg.experiment
        return not ctx.judged and ctx.result.decision is None and exp.enabled and bool(exp.sweep.levels)

    def run(self, ctx: RunContext) -> None:
        exp = ctx.cfg.experiment
        sweep, replicas = exp.sweep, ctx.cfg.canary.replicas
        levels = ",".join(str(level) for level in sweep.levels)
        ctx.say(f"sweep: speedup vs load at {levels} streams per replica, {sweep.step_s} s each (no gate)")
        ctx.event("sweep", "start", f"levels {levels}")
        out = ctx.run_dir / "sweep"
        traffic = ctx.traffic.pinned(
            out / "records.jsonl",
            tag="sweep",
            seed=exp.seed + 500,
            arm_pin=f"{BASELINE},{CANARY}",
            steps=levels,
            step_s=sweep.step_s,
            level_users=2 * replicas,  # each user alternates arms: level streams per replica
        )
        spec = ctx.traffic.swarm_spec(ctx.router.url, traffic, max(sweep.levels) * 2 * replicas, None, out,
                                      env=ctx.router.client_env())
        last = [0.0]

        def on_progress(p: SwarmProgress) -> None:
            if p.elapsed_s - last[0] >= PROGRESS_EVERY_S:
                last[0] = p.elapsed_s
                ctx.say(f"sweep: {p.phase} {p.elapsed_s:.0f}/{spec.duration_s:.0f} s, {p.requests_done} requests done")

        result = run_swarm(ctx, spec, on_progress)
        records = read_records(result.records_path)
        ctx.store.add_request_samples(ctx.run_id, "sweep", 1, records)
        rows = summarize_sweep(records, (BASELINE, CANARY), sweep.step_s)
        ctx.store.put_phase_result(ctx.run_id, "sweep", 1, rows)
        ctx.result.experiment.sweep = [SweepRow.model_validate(row) for row in rows]
        for row in rows:
            b, c = row["arms"][BASELINE], row["arms"][CANARY]
            ctx.say(
                f"sweep: {row['level']:g} streams/replica | TPOT p50 ms baseline {b['tpot_p50_ms']} canary {c['tpot_p50_ms']}"
                f" (ratio {row['tpot_ratio']}) | tokens/s {b['output_tokens_per_s']} vs {c['output_tokens_per_s']}"
            )
        ctx.event("sweep", "done", ", ".join(f"{r['level']:g}: {r['tpot_ratio']}" for r in rows))
