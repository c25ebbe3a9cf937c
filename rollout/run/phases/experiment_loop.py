"""The experiment phase's loop: one continuous load, looks by evidence, the sequential latency judgement.

    one Locust swarm (master + workers, web UI when asked) through the router,
    both arms pinned alternately with the same prompts, from the first look to the last
    with `warmup_requests_per_arm` N, the records until every arm has N completed requests
        are a warm-up: stored as look 0, never judged; the looks, their clock and the
        acceptance counters begin after it
    a look happens when every arm has `requests_per_look` more completed requests
        (and at least `window_s` passed since the previous look); alpha is spent
        at the observed information fraction min_arm(n) / `requests_per_arm`
    each look: commit the look's records, scrape /metrics (acceptance since the
        phase began), judge latency + acceptance, commit the verdicts, THEN act
    with a twin baseline (twin_baseline): the twin is a third pinned arm with the same
        traffic; each look also bounds the A/A TPOT p50 ratio twin / baseline (the noise
        floor, rollout.judge.noise_floor) and the objective cannot pass while it excludes 1
    with several candidates (config candidates): every candidate is a pinned arm; each look
        judges each candidate against the baseline at alpha / K (rollout.judge.candidates),
        a candidate's gates stand from the look they are final, and the phase stops when
        every candidate's are (or at information 1)
    stop early when every gate is decided (after `min_looks`), at information 1,
    on an abort command, or at `max_duration_s` (INCONCLUSIVE, with the counts)
    the load then stops gracefully: records that arrive after the last look are
    stored under one more look index that has no verdict (none is lost)

A look is a slice of the records stream, never a new swarm: no start-up or drain
between looks, requests in flight at a look belong to the next one, and the web UI
stays at one URL. Why looks by requests rather than by the clock: the same plan (and
the same error control) holds on a machine 4x slower, which only takes longer.

The phase gathers data and calls the pure judges in `rollout.judge`; it owns no
statistics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.arms import BASELINE, CANARY
from cluster.continuous_load import ContinuousLoad
from cluster.metrics import MetricsSnapshot, SpecDecodeStats, kv_stats, spec_decode_delta
from cluster.router import RouterClient
from loadtests.health import format_or_na, percentile_ms
from loadtests.records import RequestRecord
from loadtests.swarm import SwarmError, SwarmResult, SwarmSpec
from rollout.config import TWIN, ExperimentConfig
from rollout.judge.candidates import CandidateLooks, candidate_gates
from rollout.judge.config import GatesConfig
from rollout.judge.experiment_looks import (
    LookPlan,
    completed,
    judge_look_with_floor,
    latency_samples,
    next_information,
    requests_by_arm,
    stop_after,
    warmup_end,
)
from rollout.judge.goodput import goodput_by_arm
from rollout.judge.latency import look_dependence
from rollout.judge.noise_floor import NoiseFloor
from rollout.judge.prefix_cache import PrefixCacheLooks
from rollout.judge.request_acceptance import (
    AcceptanceAttribution,
    attribute,
    spec_decode_of_requests,
    unseen_steps_bound,
)
from rollout.judge.verdicts import GateResult
from rollout.run.phases.replica_watch import ReplicaWatch
from rollout.run.store import RunStore

PHASE = "experiment"
TICK_S = 0.25  # the loop's heartbeat: records, commands
PROGRESS_EVERY_S = 15.0
LOAD_STOP_TIMEOUT_S = 10.0  # requests in flight when the load stops get this long, then are cancelled records
LOAD_MARGIN_S = 300.0  # the swarm's own run time beyond max_duration_s: the phase, not Locust, ends the load
FIRST_RECORD_TIMEOUT_S = 300.0  # a load that delivers no record at all in this long is broken
WARMUP_LOOK = 0  # the store's look number of the warm-up's records (experiment.warmup_requests_per_arm)


# -- the look logic lives in rollout.judge.experiment_looks (pure, shared with `mtp-canary judge`) --
def duty_cycle(records: Sequence[RequestRecord], start: float, end: float) -> float | None:
    """Share of [start, end] (wall clock) during which at least one request was in flight.

    The windowed design it replaces left gaps (a swarm's start-up and drain per window);
    one continuous load keeps this near 1.
    """
    if end <= start:
        return None
    spans = sorted((max(start, r.sent_at), min(end, r.sent_at + r.e2e_s)) for r in records)
    covered, cursor = 0.0, start
    for lo, hi in spans:
        lo = max(lo, cursor)
        if hi > lo:
            covered += hi - lo
            cursor = hi
    return covered / (end - start)


# -- the phase ----------------------------------------------------------------------
def judged_load(exp: ExperimentConfig) -> dict[str, Any]:
    """The load the latency verdict is about (decision.json's ``experiment.judged_load``): what each replica of
    every arm was offered in the judged looks. The verdict holds at this load; speculation's gain shrinks as
    the load grows (the sweep, when configured, measures how)."""
    if exp.dataset == "trace":
        kind, streams, rate = "trace", exp.users_per_replica, None
        text = f"a trace replayed open loop at x{exp.trace_speedup:g}, at most {streams} requests in flight per replica"
    elif exp.rate_per_replica:
        kind, streams, rate = "open_loop", None, float(exp.rate_per_replica)
        text = f"open loop, {rate:g} requests/s offered to each replica of every arm"
    else:
        kind, streams, rate = "closed_loop", exp.users_per_replica, None
        text = f"closed loop, {streams} streams in flight per replica of every arm"
        text += (" (each stream keeps one arm)" if exp.arm_users
                 else " (each request takes the next arm: the slower arm holds more of the streams in flight)")
    return {"kind": kind, "streams_per_replica": streams, "rate_per_replica": rate,
            "arm_users": bool(exp.arm_users and kind == "closed_loop"), "text": text}


@dataclass
class ExperimentContext:
    """What the phase needs from the controller (callables keep it testable)."""

    run_id: str
    config: ExperimentConfig
    gates: GatesConfig
    store: RunStore
    swarm_spec: SwarmSpec  # the continuous load (run time > max_duration_s; the phase stops it)
    placement: str
    scrape: Callable[[], dict[str, MetricsSnapshot]]
    replica_arms: dict[str, str]  # replica name -> arm
    router: RouterClient
    speculative_canary: bool
    say: Callable[[str], None]
    event: Callable[[str, str], None]
    aborted: Callable[[], bool]
    # replica name -> alive (a name left out: no evidence); a confirmed death ends the phase
    replicas_alive: Callable[[], dict[str, bool]] = lambda: {}
    # where a replica ran ("on node IP"), for the cause line of a confirmed death or stall
    replica_node: Callable[[str], str | None] = lambda name: None
    twin: bool = False  # a twin baseline arm gets the experiment's traffic (its A/A ratio is the noise floor)
    # several candidates: their arm names, and whether each speculates (its acceptance gate then needs drafts)
    candidates: tuple[str, ...] = ()
    speculative: dict[str, bool] = field(default_factory=dict)
    lost: frozenset[str] = frozenset()  # candidates that already failed a gate (preflight, accuracy): not waited for
    tick: Callable[[str, int, int], None] = lambda task, done, total: None  # a progress bar's feed


@dataclass
class ExperimentOutcome:
    gates: list[GateResult]
    summary: dict[str, Any]
    spec_decode: dict[str, SpecDecodeStats]
    capped_reason: str | None = None  # max_duration_s reached before the plan
    aborted: bool = False
    records: list[RequestRecord] = field(default_factory=list)  # judged, then the ones after the last look
    noise_floor: NoiseFloor | None = None  # the last look's A/A ratio twin / baseline (twin_baseline only)
    warmup_records: list[RequestRecord] = field(default_factory=list)  # before `records`: stored, never judged
    looks_of: list[int] = field(default_factory=list)  # the look each of `records` arrived in (the last: after the last look)
    # per arm: whose counters the acceptance is (the requests' own or the server's), and what the server counted beside
    attribution: dict[str, AcceptanceAttribution] = field(default_factory=dict)
    # several candidates: each one's gates against the baseline at alpha / K ({} for the one-canary form)
    candidate_gates: dict[str, list[GateResult]] = field(default_factory=dict)


class ExperimentPhase:
    def __init__(self, ctx: ExperimentContext) -> None:
        self.ctx = ctx
        self.plan = LookPlan.of(ctx.config, twin=ctx.twin, candidates=ctx.candidates)
        self.records: list[RequestRecord] = []
        # the warm-up's records once it is over (experiment.warmup_requests_per_arm); None until then
        self.warmup: list[RequestRecord] | None = [] if self.plan.warmup_requests_per_arm == 0 else None
        self.looks_of: list[int] = []
        self.pending: list[RequestRecord] = []
        self.fractions: list[float] = []
        self.look_summaries: list[dict[str, Any]] = []
        self.gates: list[GateResult] = []
        self.noise_floor: NoiseFloor | None = None
        self.spec_delta: dict[str, SpecDecodeStats] = {}  # per arm, as the acceptance gate counts it
        # each arm's prefix-cache (hits, queries) since the phase began, read at every look (None: unknown)
        self.prefix_counters: dict[str, list[tuple[float, float] | None]] = {
            arm: [] for arm in self.plan.arms if arm != TWIN}
        # several candidates: each one's gates at its share of alpha, standing from the look they are final
        self.candidate_looks = CandidateLooks(ctx.candidates, candidate_gates(ctx.gates, max(1, len(ctx.candidates))),
                                              self.plan.pair(), settled_at=dict.fromkeys(ctx.lost, 0))
        self.candidate_gates: dict[str, list[GateResult]] = {}
        self.unscraped: set[str] = set()
        self.metrics_start: dict[str, MetricsSnapshot] = {}
        self._last_look_wall: float | None = None
        self.watch = ReplicaWatch(PHASE, ctx.replicas_alive, where=ctx.replica_node)

    @property
    def arms(self) -> tuple[str, ...]:
        return self.plan.arms

    def say(self, message: str) -> None:
        self.ctx.say(f"experiment: {message}")

    def run(self) -> ExperimentOutcome:
        ctx, plan = self.ctx, self.plan
        started = time.monotonic()
        self.metrics_start = ctx.scrape()
        router_before = ctx.router.request_counts()
        load = ContinuousLoad(ctx.swarm_spec, ctx.placement)
        load.start()
        capped_reason: str | None = None
        aborted = False
        last_look_at = started
        next_progress = started + PROGRESS_EVERY_S
        try:
            while True:
                time.sleep(TICK_S)
                load.check()
                self.pending += load.tail.read()
                now = time.monotonic()
                if self.warmup is None and self._end_of_warmup():
                    last_look_at = now  # the looks' clock begins after the warm-up
                new = {arm: completed(self.pending, arm) for arm in self.arms}
                totals = {arm: completed(self.records, arm) + new[arm] for arm in self.arms}
                if not (self.records or self.pending or self.warmup) and now - started > FIRST_RECORD_TIMEOUT_S:
                    raise SwarmError(f"the experiment's load delivered no record in {FIRST_RECORD_TIMEOUT_S:g} s")
                if ctx.aborted():
                    aborted = True
                    break
                self.watch.tick(now)
                self.watch.check()
                capped = now - started >= plan.max_duration_s
                looking = self.warmup is not None  # never a look over warm-up records
                if looking and (plan.look_due(new, totals, now - last_look_at) or (capped and any(new.values()))):
                    self.watch.confirm()  # never a look over the survivors of a replica seen down
                    last_look_at = now
                    final = self._look(plan.information(totals))
                    if final:
                        break
                if capped:
                    capped_reason = self._capped_reason(totals)
                    self.say(capped_reason)
                    break
                # the bar follows the arm with the fewest requests: the plan ends when it reaches requests_per_arm;
                # the warm-up has a bar of its own (its requests are not the plan's: that bar never runs backwards)
                if looking:
                    ctx.tick("experiment requests (fewest arm)", min(totals.values()), plan.requests_per_arm)
                else:
                    ctx.tick("experiment warm-up (fewest arm)", min(totals.values()), plan.warmup_requests_per_arm)
                if now >= next_progress and not looking:
                    next_progress = now + PROGRESS_EVERY_S
                    self.say(f"{now - started:.0f} s, warm-up: completed requests {self._counts(totals)} of "
                             f"{plan.warmup_requests_per_arm} each, not judged")
                elif now >= next_progress:
                    next_progress = now + PROGRESS_EVERY_S
                    self.say(
                        f"{now - started:.0f} s, completed requests {self._counts(totals)}"
                        f" (look {len(self.fractions) + 1} at +{plan.requests_per_look} each)"
                    )
        except BaseException:
            load.kill()
            self._store_rest(load)
            raise
        stopped_at = time.time()
        result = load.finish()
        tail = self._store_rest(load)
        attribution = self._attribution()
        judged_end = self._last_look_wall or stopped_at
        summary = self._summary(result, router_before, started, load.started_at, judged_end, tail)
        ctx.event("done", ", ".join(f"{g.name}={g.verdict.value}" for g in self.gates))
        return ExperimentOutcome(
            gates=self.gates,
            summary=summary,
            spec_decode=self.spec_delta,
            capped_reason=capped_reason,
            aborted=aborted,
            records=self.records,
            noise_floor=self.noise_floor,
            warmup_records=self.warmup or [],
            looks_of=self.looks_of,
            attribution=attribution,
            candidate_gates=self.candidate_gates,
        )

    # -- the warm-up -----------------------------------------------------------
    def _end_of_warmup(self) -> bool:
        """Whether the warm-up ended with the records read so far; if so they are stored as look 0,
        the looks go on from the rest, and the acceptance counters start again from here."""
        ctx = self.ctx
        end = warmup_end(self.pending, self.plan)
        if end is None:
            return False
        warm, self.pending = self.pending[:end], self.pending[end:]
        if ctx.store.add_request_samples(ctx.run_id, PHASE, WARMUP_LOOK, warm) != len(warm):
            raise SwarmError("experiment: the warm-up had duplicate request ids")
        self.warmup = warm
        # a canary's warm-up is its slowest stretch, and spec-decode counters from it would
        # weigh the acceptance floor as the judged latencies no longer are
        self.metrics_start = ctx.scrape()
        counts = requests_by_arm(warm, self.arms)
        self.say("warm-up over: " + ", ".join(f"{arm} {n}" for arm, n in counts.items())
                 + " completed requests stored, not judged; the looks begin now")
        ctx.event("warmup", f"{len(warm)} records")
        return True

    # -- one look --------------------------------------------------------------
    def _look(self, information: float) -> bool:
        """Judge everything so far; True when the phase may stop."""
        ctx, plan = self.ctx, self.plan
        look = len(self.fractions) + 1
        self.fractions.append(next_information(self.fractions, information))
        look_records, self.pending = self.pending, []
        stored = ctx.store.add_request_samples(ctx.run_id, PHASE, look, look_records)
        if stored != len(look_records):
            raise SwarmError(f"experiment: look {look} had duplicate request ids")
        self.records += look_records
        self.looks_of += [look] * len(look_records)
        self._last_look_wall = time.time()
        self._scrape_acceptance()
        if ctx.candidates:
            return self._look_at_candidates(look, look_records)
        canary_spec = self.spec_delta.get(CANARY) or (None if CANARY in self.unscraped else SpecDecodeStats())
        self.gates, self.noise_floor = judge_look_with_floor(
            self.records, self.looks_of, self.fractions, ctx.gates, plan, canary_spec, ctx.speculative_canary,
            prefix_cache=PrefixCacheLooks(baseline=self.prefix_counters[BASELINE], canary=self.prefix_counters[CANARY]),
        )
        ctx.store.put_phase_result(ctx.run_id, PHASE, look, [g.model_dump(mode="json") for g in self.gates])
        summary = self._look_summary(look, look_records, {g.name: g.verdict.value for g in self.gates})
        baseline = latency_samples(self.records, self.looks_of, BASELINE)
        canary = latency_samples(self.records, self.looks_of, CANARY)
        acceptance_length = self.spec_delta.get(CANARY, SpecDecodeStats()).mean_acceptance_length
        self.say(
            f"look {look}/{plan.planned_looks} (information {self.fractions[-1]:.2f}) | requests baseline "
            f"{baseline.n_total} canary {canary.n_total} | TPOT p50 ms baseline {percentile_ms(baseline.tpot_s, 50)} canary "
            f"{percentile_ms(canary.tpot_s, 50)} | acceptance length {format_or_na(acceptance_length)} | "
            + ", ".join(f"{g.name}: {g.verdict.value}" for g in self.gates)
        )
        if self.noise_floor is not None:
            self.say(f"look {look} noise floor: {self.noise_floor.detail}")
        ctx.event("look", f"look {look}: " + ", ".join(f"{k}={v}" for k, v in summary["verdicts"].items()))
        stop = stop_after(look, self.fractions, plan, self.gates, ctx.gates)
        if stop == "evidence":
            self.say(f"verdict reached at look {look} of {plan.planned_looks}, stopping early")
        return stop is not None

    def _look_at_candidates(self, look: int, look_records: list[RequestRecord]) -> bool:
        """Each candidate judged against the baseline at alpha / K on all records so far
        (rollout.judge.candidates.CandidateLooks). True when the phase may stop."""
        ctx, plan, judged = self.ctx, self.plan, self.candidate_looks
        stop = judged.look(
            look, self.records, self.looks_of, self.fractions,
            spec_of=lambda name: self.spec_delta.get(name) or (None if name in self.unscraped else SpecDecodeStats()),
            speculative=ctx.speculative,
            prefix_cache_of=lambda name: PrefixCacheLooks(baseline=self.prefix_counters[BASELINE],
                                                          canary=self.prefix_counters[name]),
        )
        self.candidate_gates = judged.gates
        verdicts = {f"{name}/{g.name}": g.verdict.value for name, gates in judged.gates.items() for g in gates}
        ctx.store.put_phase_result(ctx.run_id, f"{PHASE}_candidates", look, {
            name: [g.model_dump(mode="json") for g in gates] for name, gates in judged.gates.items()})
        self._look_summary(look, look_records, verdicts)
        tpot = " ".join(f"{arm} {percentile_ms(latency_samples(self.records, self.looks_of, arm).tpot_s, 50)}"
                        for arm in self.arms)
        self.say(f"look {look}/{plan.planned_looks} (information {self.fractions[-1]:.2f}) | requests "
                 f"{self._counts(requests_by_arm(self.records, self.arms))} | TPOT p50 ms {tpot}")
        for name in ctx.candidates:
            if judged.settled_at.get(name) == 0:
                self.say(f"look {look} {name}: lost before the experiment (a failed gate), not judged")
                continue
            held = f" (final at look {judged.settled_at[name]})" if name in judged.settled_at else ""
            self.say(f"look {look} {name} at alpha {judged.cfg.alpha:g}{held}: "
                     + ", ".join(f"{g.name}: {g.verdict.value}" for g in judged.gates[name]))
        ctx.event("look", f"look {look}: " + ", ".join(f"{k}={v}" for k, v in verdicts.items()))
        if stop == "evidence":
            self.say(f"every candidate's verdict reached by look {look} of {plan.planned_looks}, stopping early")
        return stop is not None

    def _look_summary(self, look: int, look_records: list[RequestRecord], verdicts: dict[str, str]) -> dict[str, Any]:
        """decision.json experiment.looks[] of this look (kept in self.look_summaries)."""
        slo = self.ctx.gates.goodput_slo
        summary = {
            "look": look,
            "at": self._last_look_wall,
            "information": round(self.fractions[-1], 4),
            "requests": requests_by_arm(look_records, self.arms),
            "verdicts": verdicts,
            # the counters read at this look (none where an arm was not read: unknown, as the gate has it)
            "prefix_cache": {arm: counters[-1] if len(counters) == look else None
                             for arm, counters in self.prefix_counters.items()},
            # each arm's share of this look's requests meeting gates.slo (the gate judges all looks so far)
            "goodput": None if slo is None else {arm: g.share for arm, g in goodput_by_arm(look_records, slo).items()},
        }
        self.look_summaries.append(summary)
        return summary

    def _counts(self, totals: dict[str, int]) -> str:
        return " ".join(f"{arm} {totals.get(arm, 0)}" for arm in self.arms)

    def _counted_arms(self) -> list[str]:
        return [arm for arm in dict.fromkeys(self.ctx.replica_arms.values()) if arm != TWIN]

    def _replicas_of(self, arm: str) -> list[str]:
        return [name for name, a in self.ctx.replica_arms.items() if a == arm]

    def _scrape_acceptance(self) -> None:
        """Spec-decode counters since the phase began, per arm: the judged requests' own where every one
        carries them (rollout.judge.request_acceptance), else the servers' /metrics deltas; a replica not
        scraped (or restarted) then makes its arm's acceptance unknown, not zero, for the rest of the phase."""
        after = self.ctx.scrape()
        totals: dict[str, SpecDecodeStats] = {}
        for arm in self._counted_arms():
            replicas = self._replicas_of(arm)
            delta = spec_decode_delta(self.metrics_start, after, replicas)
            own = spec_decode_of_requests(self.records, arm)
            if delta is None:
                self.unscraped.add(arm)
            if own is not None:
                totals[arm] = own
            elif arm not in self.unscraped and delta is not None:
                totals[arm] = delta
            if arm in self.prefix_counters:
                kv = kv_stats([self.metrics_start, after], replicas)
                known = kv.prefix_cache_hits is not None and kv.prefix_cache_queries is not None
                self.prefix_counters[arm].append((kv.prefix_cache_hits, kv.prefix_cache_queries) if known else None)
        self.spec_delta = totals

    def _attribution(self) -> dict[str, AcceptanceAttribution]:
        """After the load: each arm's servers' counters over the phase against its requests' own, every
        record in (a server with more verify steps than the experiment's requests is serving someone else)."""
        after = self.ctx.scrape()
        streams = self.ctx.swarm_spec.users
        out: dict[str, AcceptanceAttribution] = {}
        for arm in self._counted_arms():
            replicas = self._replicas_of(arm)
            server = None if arm in self.unscraped else spec_decode_delta(self.metrics_start, after, replicas)
            own = spec_decode_of_requests(self.records, arm)
            out[arm] = attribute(arm, server, own, unseen_steps_bound(self.records, arm, streams))
            note = out[arm].note()
            if note is not None:
                self.say(f"WARNING: {note}")
        return out

    def _capped_reason(self, totals: dict[str, int]) -> str:
        plan = self.plan
        if self.warmup is None:
            return (
                f"experiment.max_duration_s ({plan.max_duration_s:g} s) reached in the warm-up: "
                f"{self._counts_with_commas(totals)} completed requests of the "
                f"{plan.warmup_requests_per_arm} per arm it needs before the first look"
            )
        return (
            f"experiment.max_duration_s ({plan.max_duration_s:g} s) reached after {len(self.fractions)} look(s): "
            f"{self._counts_with_commas(totals)} completed requests; the plan needs "
            f"{plan.requests_per_arm} per arm"
        )

    def _counts_with_commas(self, totals: dict[str, int]) -> str:
        return ", ".join(f"{arm} {totals.get(arm, 0)}" for arm in self.arms if arm != TWIN)

    # -- the end ---------------------------------------------------------------
    def _store_rest(self, load: ContinuousLoad) -> int:
        """Records after the last look (in flight at the stop, or still shipping): stored, not judged."""
        rest = self.pending + load.tail.read()
        self.pending = []
        if not rest:
            return 0
        look = len(self.fractions) + 1
        self.ctx.store.add_request_samples(self.ctx.run_id, PHASE, look, rest)
        self.records += rest
        self.looks_of += [look] * len(rest)
        return len(rest)

    def _summary(
        self, result: SwarmResult, router_before: dict[str, int], started: float, load_started: float,
        judged_end: float, tail: int,
    ) -> dict[str, Any]:
        router_after = self.ctx.router.request_counts()
        received = (
            sum(router_after.values()) - sum(router_before.values()) if router_after and router_before else None
        )
        first_send = min((r.sent_at for r in self.records), default=None)
        duty = duty_cycle(self.records, first_send, judged_end) if first_send is not None else None
        stored = self.ctx.store.count_request_samples(self.ctx.run_id, PHASE)
        if received is not None and received != stored:
            self.say(f"WARNING: the router received {received} requests in this phase, the store holds {stored} records")
        generator_warnings = list(result.generator.warnings) if result.generator.generator_limited else []
        for warning in generator_warnings:
            self.say(f"load generator limited: {warning}")
        return {
            "looks": self.look_summaries,
            "planned_looks": self.plan.planned_looks,
            "requests_per_look": self.plan.requests_per_look,
            "requests_per_arm_planned": self.plan.requests_per_arm,
            "warmup_requests_per_arm": self.plan.warmup_requests_per_arm,
            # per arm with a warm-up; {} without one, so a run without one keeps the key paths it had
            # (tests/test_cli_run.py compares them with recorded runs')
            "warmup_requests": requests_by_arm(self.warmup, self.arms) if self.warmup else {},
            "arm_users": self.plan.arm_users,
            "information": self.fractions[-1] if self.fractions else 0.0,
            "requests": {arm: latency_samples(self.records, self.looks_of, arm).n_total for arm in self.arms},
            "records_after_last_look": tail,
            "requests_received": received,
            "records_stored": stored,
            "duty_cycle": None if duty is None else round(duty, 4),
            "load_start_s": round(first_send - load_started, 3) if first_send is not None else None,
            "duration_s": time.monotonic() - started,
            "generator_warnings": generator_warnings,
            "generator_send_lag_p99_ms": percentile_ms([r.send_lag_s for r in self.records if r.send_lag_s is not None], 99),
            "judged_load": judged_load(self.ctx.config),
            "dependence": self._dependence(),
        }

    def _dependence(self) -> dict[str, Any] | None:
        """How much the TPOT p50 persisted across the judged looks (None before two looks of both arms)."""
        if not self.records or self.ctx.candidates:  # candidates: each has its own view of the baseline's looks
            return None
        found = look_dependence(latency_samples(self.records, self.looks_of, BASELINE),
                                latency_samples(self.records, self.looks_of, CANARY), self.ctx.gates)
        return found.model_dump(mode="json") if found is not None else None
