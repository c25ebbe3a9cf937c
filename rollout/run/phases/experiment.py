"""The experiment: one continuous Locust load through the router, both arms pinned alternately
with the same prompts, judged at looks by evidence (the loop: rollout.run.phases.experiment_loop);
this module builds its load and turns its outcome into the run's summary and gates."""

from __future__ import annotations

import numpy as np

from cluster.arms import CANARY
from cluster.metrics import MetricsSampler, SpecDecodeStats, kv_stats, requests_not_routed
from loadtests.health import percentile_ms
from loadtests.records import RequestRecord
from rollout.analysis.acceptance_slices import by_prompt_length, by_turn
from rollout.config import TWIN
from rollout.analysis.depth_advice import DepthAdvice, DepthArm, advise_depth
from rollout.judge.goodput import goodput_by_arm
from rollout.judge.verdicts import GateResult, Verdict
from rollout.run.phases.candidate_choice import lost_candidates
from rollout.run.phases.experiment_loop import LOAD_MARGIN_S, LOAD_STOP_TIMEOUT_S, ExperimentContext, ExperimentPhase
from rollout.run.phases.web_ui import with_console
from rollout.record.result import ExperimentSummary, SpecDecodeSummary
from rollout.run.context import RunContext


KV_SAMPLE_EVERY_S = 5.0
# a check, not a configurable gate (not in GATE_NAMES): the decision counts it whatever gates are enabled
OTHER_TRAFFIC_CHECK = "experiment_other_traffic"


class Experiment:
    name = "experiment"

    def enabled(self, ctx: RunContext) -> bool:
        return not ctx.judged and not ctx.decided and ctx.cfg.experiment.enabled

    def run(self, ctx: RunContext) -> None:
        exp = ctx.cfg.experiment
        replicas = ctx.canary_arm.replicas
        ctx.say(
            f"experiment: looks every {exp.requests_per_look} completed requests per arm (at least {exp.window_s} s apart), "
            f"{exp.requests_per_arm} per arm planned ({exp.planned_looks} looks), at most {exp.max_duration_s:g} s; "
            + (
                f"open loop {exp.rate_per_replica:g} req/s per replica"
                if exp.rate_per_replica
                else f"closed loop {exp.users_per_replica} streams per replica"
            )
        )
        ctx.event("experiment", "start", f"looks every {exp.requests_per_look} requests per arm")
        out = ctx.run_dir / "experiment"
        # a twin baseline is a third pinned arm with its own share of the streams (the A/A noise floor);
        # several candidates are one pinned arm each
        arms = ctx.cfg.experiment_arms
        traffic = ctx.traffic.pinned(
            out / "records.jsonl",
            tag="experiment",
            seed=exp.seed + 1,
            arm_pin=",".join(arms),
            arm_users=exp.arm_users and not exp.rate_per_replica,
            rate=exp.rate_per_replica * len(arms) * replicas if exp.rate_per_replica else None,
        )
        spec = ctx.traffic.swarm_spec(
            ctx.router.url, traffic, exp.users_per_replica * len(arms) * replicas, int(exp.max_duration_s + LOAD_MARGIN_S),
            out / "locust", stop_timeout_s=LOAD_STOP_TIMEOUT_S, env=ctx.router.client_env(),
        )
        spec = with_console(ctx, spec, "experiment")
        # KV usage is a gauge: its peak and mean need samples between the looks (cluster.metrics)
        sampler = MetricsSampler(ctx.fleet.metrics, every_s=KV_SAMPLE_EVERY_S).start()
        counted = _request_counts(ctx)
        try:
            outcome = self._run_phase(ctx, exp, spec, sampler)
        finally:
            samples = sampler.stop()
        _check_other_traffic(ctx, counted, _request_counts(ctx))
        for arm in ctx.result.arms:
            replicas = [name for name, a in ctx.replica_arms().items() if a == arm]
            ctx.result.arms[arm]["kv"] = kv_stats(samples, replicas).to_dict()
        self._summarize(ctx, outcome)

    @staticmethod
    def _run_phase(ctx: RunContext, exp, spec, sampler: MetricsSampler):
        return ExperimentPhase(
            ExperimentContext(
                run_id=ctx.run_id,
                config=exp,
                gates=ctx.cfg.gates,
                store=ctx.store,
                swarm_spec=spec,
                placement=exp.worker_placement,
                scrape=sampler.recording,
                replica_arms=ctx.replica_arms(),
                router=ctx.router,
                speculative_canary=CANARY in ctx.engines and ctx.speculative_canary,
                say=ctx.say,
                event=lambda event, reason: ctx.event("experiment", event, reason),
                # an abort stops the loop; the controller records its ROLLBACK when this phase returns
                aborted=lambda: ctx.aborted("experiment"),
                replicas_alive=ctx.replicas_alive, replica_node=ctx.replica_node,
                twin=ctx.cfg.twin_baseline,
                candidates=tuple(c.name for c in ctx.cfg.candidates),
                speculative={c.name: ctx.engines[c.name].num_speculative_tokens > 0 for c in ctx.cfg.candidates},
                lost=lost_candidates(ctx),
                tick=ctx.tick,
            )
        ).run()

    @staticmethod
    def _summarize(ctx: RunContext, outcome) -> None:
        ctx.experiment_capped = outcome.capped_reason
        records = outcome.records
        arms = ctx.cfg.experiment_arms
        slo = ctx.cfg.gates.goodput_slo
        # goodput over the judged records (those after the last look have no verdict), as the goodput gate counts
        # (outcome.records has no warm-up records: its requests are stored, never judged nor summarized)
        judged = records[: len(records) - outcome.summary["records_after_last_look"]]
        for arm, stats in outcome.spec_decode.items():
            k = ctx.engines[arm].num_speculative_tokens
            expected = None
            if k > 1 and stats.per_position_rate:
                expected = {str(kk): stats.expected_length_for_k(kk) for kk in range(1, k + 1)}
            who = outcome.attribution.get(arm)
            server = who.server if who is not None else None
            ctx.result.spec_decode[arm] = SpecDecodeSummary(
                **stats.to_dict(), expected_length_by_k=expected,
                counted_from=who.counted_from if who is not None else None,
                server_drafts=server.drafts if server is not None else None,
                server_mean_acceptance_length=server.mean_acceptance_length if server is not None else None,
                other_traffic_steps=who.other_steps if who is not None else None,
                other_traffic=who.note() if who is not None else None,
                by_prompt_length=by_prompt_length(judged, arm), by_turn=by_turn(judged, arm),
            )
        ctx.result.experiment = ExperimentSummary(
            **outcome.summary,
            latency_ms={arm: latency_summary(records, arm) for arm in arms},
            client_tokens_per_chunk={
                arm: _mean([r.decode_tokens_per_chunk for r in records if r.arm == arm]) for arm in arms if arm != TWIN
            },
            stopped_by="abort" if outcome.aborted else "max_duration_s" if outcome.capped_reason else "evidence",
            goodput=goodput_by_arm(judged, slo) if slo is not None else None,
            noise_floor=outcome.noise_floor,
            depth_advice=depth_advice_of(ctx, judged, outcome.looks_of[: len(judged)], outcome.spec_decode),
        )
        ctx.result.gates += outcome.gates
        for name, gates in outcome.candidate_gates.items():
            ctx.candidate_gates.setdefault(name, []).extend(gates)


def _request_counts(ctx: RunContext) -> tuple[dict, dict] | None:
    """(replica URL -> finished requests on its server, replica URL -> the router's counts); None
    when either side cannot answer. Launched replicas only: an `endpoints:` server is shared."""
    try:
        scraped, state = ctx.fleet.metrics(), ctx.router.state()
    except Exception:  # a dead router or fleet shows in the phase itself
        return None
    shared = {arm for arm in ctx.cfg.experiment_arms if ctx.cfg.arm(arm).endpoints}
    urls = {r.name: r.url.rstrip("/") for r in ctx.fleet.replicas if r.url and r.arm not in shared}
    finished = {urls[name]: snap.requests_finished for name, snap in scraped.items() if name in urls}
    routed = {url.rstrip("/"): counts for url, counts in state["replica_counts"].items()}
    return finished, routed


def _check_other_traffic(ctx: RunContext, before: tuple[dict, dict] | None, after: tuple[dict, dict] | None) -> None:
    """Requests a replica's server finished during the experiment that the router did not send it:
    someone else loaded that arm, so its latency is not the experiment's. It blocks PROMOTE (an
    inconclusive check); a rollback still stands."""
    if before is None or after is None:
        return
    common = set(before[0]) & set(after[0]) & set(before[1]) & set(after[1])
    excess = requests_not_routed(
        {url: after[0][url] - before[0][url] for url in common},
        {url: after[1][url]["routed"] - before[1][url]["routed"] for url in common},
        {url: before[1][url]["in_flight"] for url in common},
    )
    if not excess:
        return
    detail = "; ".join(f"{url} ({after[1][url]['arm']}) finished {n} requests the router did not send"
                       for url, n in sorted(excess.items()))
    ctx.say(f"experiment: WARNING: other traffic reached the arms: {detail}")
    ctx.result.gates.append(GateResult(
        name=OTHER_TRAFFIC_CHECK, metric="requests_not_routed", baseline=None, canary=None, threshold=0.0,
        verdict=Verdict.INCONCLUSIVE, estimate=float(sum(excess.values())),
        detail=f"other traffic on the arms, the experiment cannot judge them: {detail}"))


def depth_advice_of(ctx: RunContext, records: list[RequestRecord], looks_of: list[int],
                    spec_decode: dict[str, SpecDecodeStats]) -> DepthAdvice | None:
    """The TPOT of every MTP depth up to the deepest arm's, predicted from its acceptance profile and
    the arms' step costs (rollout.analysis.depth_advice); None when the arms do not give it (one depth, an arm
    whose counters were not scraped, no TPOT)."""
    by_look: dict[int, list[RequestRecord]] = {}
    for record, look in zip(records, looks_of):
        by_look.setdefault(look, []).append(record)
    arms = []
    for arm in (a for a in ctx.cfg.experiment_arms if a != TWIN):
        k = ctx.engines[arm].num_speculative_tokens
        stats = spec_decode.get(arm)
        length = 1.0 if k == 0 else (stats.mean_acceptance_length if stats is not None else None)
        tpot = latency_summary(records, arm)["tpot_p50"]
        if length is None or tpot is None:
            return None
        per_look = [latency_summary(look_records, arm)["tpot_p50"] for _, look_records in sorted(by_look.items())]
        # a look without this arm's TPOT leaves the interval out (the point prediction stands)
        arms.append(DepthArm(arm, k, length, tpot, per_look if None not in per_look else []))
    deepest = max(arms, key=lambda a: a.k)
    stats = spec_decode.get(deepest.name)
    if stats is None or not stats.per_position_rate:
        return None
    replicas = [name for name, arm in ctx.replica_arms().items() if arm == deepest.name]
    logged = any("same MTP layer" in warning for name in replicas for warning in ctx.result.engine_warnings.get(name, []))
    exp = ctx.cfg.experiment
    return advise_depth(arms, stats.per_position_rate, profile_arm=deepest.name,
                        streams_per_replica=None if exp.rate_per_replica else float(exp.users_per_replica),
                        reuse_logged=logged)


def latency_summary(records: list[RequestRecord], arm: str) -> dict[str, float | None]:
    """TTFT, TPOT and E2E p50/p95/p99 in ms of an arm's successful requests."""
    ok = [r for r in records if r.arm == arm and r.ok and not r.cancelled]
    out: dict[str, float | None] = {}
    for metric, values in (
        ("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]),
        ("tpot", [r.tpot_s for r in ok if r.tpot_s is not None]),
        ("e2e", [r.e2e_s for r in ok]),
    ):
        for q in (50, 95, 99):
            out[f"{metric}_p{q}"] = percentile_ms(values, q)
    return out


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None
