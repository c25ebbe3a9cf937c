"""Speedup vs load: both arms at each level of experiment.sweep (same prompts, pinned
alternately), after the judged experiment; never gated (rollout.analysis.load_sweep), with
the crossover load where the TPOT ratio reaches the objective's bar and 1.0 (rollout.analysis.crossover),
and `promote_up_to`, the load up to which the candidate is shown to pay (rollout.judge.load_curve),
which qualifies a PROMOTE and decides nothing.

Fixed levels (`sweep.levels`) run as one stepped load. The adaptive sweep (`sweep.adaptive`)
runs one load per level and asks `rollout.analysis.crossover.next_level` for the next one (doubling,
then bisection around the crossover) until it says done."""

from __future__ import annotations

from pathlib import Path

from cluster.arms import BASELINE, CANARY
from cluster.distributed_load import run_distributed_swarm
from loadtests.records import RequestRecord, read_records, write_records
from loadtests.swarm import Swarm, SwarmProgress, SwarmResult, SwarmSpec
from rollout.analysis.crossover import AdaptivePolicy, LevelResult, crossing, next_level
from rollout.analysis.load_sweep import level_results, summarize_sweep
from rollout.judge.load_curve import objective_bar, promote_up_to_of
from rollout.record.result import SweepCrossover, SweepRow
from rollout.run.phases.web_ui import with_console
from rollout.run.context import RunContext

PROGRESS_EVERY_S = 15
ARMS = (BASELINE, CANARY)


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
        return not ctx.judged and not ctx.decided and exp.enabled and exp.sweep.enabled

    def run(self, ctx: RunContext) -> None:
        if ctx.cfg.experiment.sweep.adaptive.enabled:
            records, levels = self._adaptive(ctx)
        else:
            records = self._fixed(ctx)
            levels = level_results(records, ARMS, ctx.cfg.experiment.sweep.step_s, ctx.canary_arm.replicas)
        rows = summarize_sweep(records, ARMS, ctx.cfg.experiment.sweep.step_s, ctx.cfg.gates.goodput_slo)
        ctx.store.put_phase_result(ctx.run_id, "sweep", 1, rows)
        ctx.result.experiment.sweep = [SweepRow.model_validate(row) for row in rows]
        found = SweepCrossover(
            ratio_1=crossing(levels, 1.0),
            objective_bar=crossing(levels, self._bar(ctx)),
            levels=levels,
            adaptive=ctx.cfg.experiment.sweep.adaptive.enabled,
        )
        ctx.result.experiment.sweep_crossover = found
        # up to which load the candidate pays, judged (the crossover above is an estimate): it qualifies a PROMOTE
        claim = ctx.result.promote_up_to = promote_up_to_of(levels, ctx.cfg.gates)
        for row in rows:
            b, c = row["arms"][BASELINE], row["arms"][CANARY]
            ctx.say(
                f"sweep: {row['level']:g} streams/replica | TPOT p50 ms baseline {b['tpot_p50_ms']} canary {c['tpot_p50_ms']}"
                f" (ratio {row['tpot_ratio']}) | tokens/s {b['output_tokens_per_s']} vs {c['output_tokens_per_s']}"
            )
        for what in (found.objective_bar, found.ratio_1):
            where = "none in range" if what.level is None else f"{what.level:g} streams/replica"
            ctx.say(f"sweep: TPOT ratio reaches {what.bar:g}: {where} "
                    f"[{_end(what.level_low, 'below')}, {_end(what.level_high, 'above')}] ({what.reason})")
        ctx.say(f"sweep: pays up to {'no level' if claim.streams_per_replica is None else f'{claim.streams_per_replica:g}'} "
                f"streams/replica ({claim.reason})")
        ctx.event("sweep", "done", ", ".join(f"{r['level']:g}: {r['tpot_ratio']}" for r in rows))

    @staticmethod
    def _bar(ctx: RunContext) -> float:
        return objective_bar(ctx.cfg.gates)

    def _fixed(self, ctx: RunContext) -> list[RequestRecord]:
        """Every level of sweep.levels in one stepped load (the records carry their level)."""
        sweep = ctx.cfg.experiment.sweep
        levels = ",".join(str(level) for level in sweep.levels)
        ctx.say(f"sweep: speedup vs load at {levels} streams per replica, {sweep.step_s} s each (no gate)")
        ctx.event("sweep", "start", f"levels {levels}")
        out = ctx.run_dir / "sweep"
        records = self._load(ctx, levels, max(sweep.levels), out / "records.jsonl", out)
        ctx.store.add_request_samples(ctx.run_id, "sweep", 1, records)
        return records

    def _adaptive(self, ctx: RunContext) -> tuple[list[RequestRecord], list[LevelResult]]:
        """One load per level, the next level from the planner; all records in sweep/records.jsonl."""
        sweep, replicas = ctx.cfg.experiment.sweep, ctx.canary_arm.replicas
        adaptive = sweep.adaptive
        bar = self._bar(ctx)
        policy = AdaptivePolicy(
            start=adaptive.start_level, max_level=adaptive.max_level, min_step=adaptive.min_step,
            max_levels=adaptive.max_levels, bars=tuple(dict.fromkeys((bar, 1.0))),
            resolution=1.0 / (2 * replicas),  # one closed-loop user: each user alternates the two arms
        )
        ctx.say(f"sweep: adaptive, from {adaptive.start_level} streams per replica doubling up to {adaptive.max_level}, "
                f"then bisection to {adaptive.min_step:g} around TPOT ratio {' and '.join(f'{b:g}' for b in policy.bars)}; "
                f"at most {adaptive.max_levels} levels of {sweep.step_s} s (no gate)")
        ctx.event("sweep", "start", f"adaptive from {adaptive.start_level} to {adaptive.max_level}")
        out = ctx.run_dir / "sweep"
        out.mkdir(parents=True, exist_ok=True)
        records: list[RequestRecord] = []
        done: list[LevelResult] = []
        while (level := next_level(done, policy)) is not None:
            name = f"level-{len(done) + 1:02d}"
            got = self._load(ctx, f"{level:.12g}", level, out / f"{name}.jsonl", out / name)
            ctx.store.add_request_samples(ctx.run_id, "sweep", 1, got)
            records += got
            write_records(out / "records.jsonl", records)  # the HTML report reads one file, as for fixed levels
            result = level_results(got, ARMS, sweep.step_s, replicas)
            if not result:  # no record carries the level: nothing to steer by
                result = [LevelResult(level=level, ratio=None, ratio_low=None, ratio_high=None, pairs=0, block=None)]
            done += result
            r = result[0]
            upcoming = next_level(done, policy)
            interval = "no interval" if r.ratio_low is None else f"95% [{r.ratio_low:.3f}, {r.ratio_high:.3f}]"
            ctx.say(f"sweep: level {len(done)} of at most {adaptive.max_levels}: {level:g} streams/replica, TPOT ratio "
                    f"{r.ratio} ({interval}, {r.pairs} pairs); next: {'done' if upcoming is None else f'{upcoming:g}'}")
            if r.ratio is None:
                ctx.say(f"sweep: {level:g} streams/replica has no TPOT ratio (no successful request on an arm): "
                        "the adaptive sweep stops")
        return records, done

    def _load(self, ctx: RunContext, steps: str, top_level: float, path: Path, log_dir: Path) -> list[RequestRecord]:
        """Both arms, every prompt pinned to each in turn, at the stepped levels `steps`."""
        exp = ctx.cfg.experiment
        sweep, replicas = exp.sweep, ctx.canary_arm.replicas
        traffic = ctx.traffic.pinned(
            path,
            tag="sweep",
            seed=exp.seed + 500,
            arm_pin=f"{BASELINE},{CANARY}",
            steps=steps,
            step_s=sweep.step_s,
            level_users=2 * replicas,  # each user alternates arms: level streams per replica
        )
        spec = ctx.traffic.swarm_spec(ctx.router.url, traffic, round(top_level * 2 * replicas), None, log_dir,
                                      env=ctx.router.client_env())
        spec = with_console(ctx, spec, "sweep")  # the web UI and its Rollout tab at the same address
        last = [0.0]

        def on_progress(p: SwarmProgress) -> None:
            ctx.tick(f"sweep at {steps} streams (s)", round(p.elapsed_s), round(spec.duration_s))
            if p.elapsed_s - last[0] >= PROGRESS_EVERY_S:
                last[0] = p.elapsed_s
                ctx.say(f"sweep: {p.phase} {p.elapsed_s:.0f}/{spec.duration_s:.0f} s, {p.requests_done} requests done")

        result = run_swarm(ctx, spec, on_progress)
        return read_records(result.records_path)


def _end(value: float | None, beyond: str) -> str:
    return f"{beyond} range" if value is None else f"{value:g}"
