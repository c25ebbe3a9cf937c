"""The experiment's looks as pure functions: when a look is due, what it carries, how it is judged, when to stop.

One copy of the look logic for everyone who needs it:

* the controller (``rollout.run.phases.experiment_loop``) calls `LookPlan.look_due`,
  `next_information`, `judge_look` and `stop_after` on the records it tails live;
* ``mtp-canary judge`` (``rollout.commands.judge``) replays a finished run's records through
  `replay_looks`, which applies the same rules in the order the records arrived;
* the calibration may simulate looks with the same functions.

The rules (the controller's, unchanged):

* a look happens when every arm has ``requests_per_look`` more completed
  (not cancelled) requests, or the least-served arm has reached the plan, and at
  least ``min_interval_s`` has passed since the previous look;
* its information fraction is min over arms of completed requests / ``requests_per_arm``
  (capped at 1), forced strictly increasing so the spending function sees new
  information at every look;
* each look judges everything so far: the latency gates (``judge_latency`` with
  every sample's look), the acceptance-length floor on the canary's spec-decode
  counters since the phase began (``acceptance``), and the sample-ratio check
  (``sample_ratio``: the arms' completed requests against the equal shares the
  alternating pinning promises), and, when ``gates.slo`` sets a bound, the goodput
  gate on the arms' requests paired by prompt, a look per block (``goodput``), and, when
  ``gates.acceptance_profile`` is set, the canary's acceptance at each draft position on the
  same counters as the floor (``position_acceptance``);
* with a twin baseline (``LookPlan.twin``: a third arm, the baseline's config, pinned in
  turn like the others) the A/A TPOT p50 ratio twin / baseline at every look
  (``noise_floor``): the objective cannot pass while its interval excludes 1;
* the phase stops at information 1, or from ``min_looks`` on once every enabled
  gate is decided (``verdicts.is_final``);
* with ``warmup_requests_per_arm`` N, the records up to the one at which every arm has N
  completed requests (``warmup_end``) are a warm-up: stored, never judged; the looks
  and their clock begin after them.

A caller that judges many prefixes of one stream (the calibration's trials) may pass the
stream's `RecordColumns`, read once: each look then slices arrays instead of reading every
record again, with the very samples and counts the record-by-record path gives.

No clock here: the controller passes the seconds since its last look; a replay uses
the records' own completion times (sent_at + e2e_s) as its clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from cluster.arms import BASELINE, CANARY
from cluster.metrics import SpecDecodeStats
from loadtests.records import RequestRecord
from rollout.judge.acceptance import judge_acceptance
from rollout.judge.config import GatesConfig
from rollout.judge.goodput import goodput_samples, judge_goodput
from rollout.judge.latency import LatencySamples, judge_latency, latency_samples_by_arm, latency_samples_from_records
from rollout.judge.sample_ratio import judge_sample_ratio
from rollout.judge.names import GOODPUT_NAME, OBJECTIVE_NAME, PREFIX_CACHE_NAME, PROFILE_NAME, TWIN_ARM
from rollout.judge.position_acceptance import judge_profile_of_counters
from rollout.judge.prefix_cache import PrefixCacheLooks, judge_prefix_cache
from rollout.judge.request_acceptance import spec_decode_of_requests
from rollout.judge.noise_floor import NoiseFloor, apply_noise_floor, judge_noise_floor
from rollout.judge.verdicts import GateResult, Verdict, is_enabled, is_final

__all__ = [
    "ARMS",
    "LookPlan",
    "RecordColumns",
    "Look",
    "Replay",
    "record_arm",
    "completed",
    "requests_by_arm",
    "latency_samples",
    "next_information",
    "judge_look",
    "judge_look_with_floor",
    "stop_after",
    "replay_looks",
    "look_ends_by_rule",
    "warmup_end",
]

ARMS = (BASELINE, CANARY)
INFORMATION_STEP = 1e-3  # a look with no new information still advances the fraction this much


class PlannedExperiment(Protocol):
    """What a `LookPlan` reads from the run's ``experiment:`` config (rollout.config.ExperimentConfig)."""

    requests_per_look: int
    requests_per_arm: int
    window_s: float
    min_looks: int
    max_duration_s: float
    arm_users: bool
    warmup_requests_per_arm: int


# -- the plan ------------------------------------------------------------------------
@dataclass(frozen=True)
class LookPlan:
    """When to look and how much information a look carries."""

    requests_per_look: int
    requests_per_arm: int
    min_interval_s: float
    min_looks: int
    max_duration_s: float
    # each Locust user keeps one arm (rollout.config.ExperimentConfig.arm_users): the arms' request
    # counts differ by their speed, and the sample-ratio check compares busy time instead
    arm_users: bool = False
    # a twin baseline gets the experiment's traffic too (twin_baseline): a third arm, the A/A noise floor
    twin: bool = False
    # every arm's first N completed requests are a warm-up, not judged (experiment.warmup_requests_per_arm)
    warmup_requests_per_arm: int = 0
    # several candidates (config candidates): their arm names, each judged on its own against the
    # baseline (rollout.judge.candidates.candidate_view, with `pair()`); () for the one-canary form
    candidates: tuple[str, ...] = ()

    @classmethod
    def of(cls, exp: PlannedExperiment, twin: bool = False, candidates: tuple[str, ...] = ()) -> "LookPlan":
        return cls(exp.requests_per_look, exp.requests_per_arm, float(exp.window_s), exp.min_looks, exp.max_duration_s,
                   exp.arm_users, twin, exp.warmup_requests_per_arm, tuple(candidates))

    @property
    def arms(self) -> tuple[str, ...]:
        """The arms the experiment's traffic goes to, each look waiting for all of them."""
        if self.candidates:
            return (BASELINE, *self.candidates)
        return (*ARMS, TWIN_ARM) if self.twin else ARMS

    def pair(self) -> "LookPlan":
        """The plan one candidate is judged under: the baseline and that candidate (as the canary),
        at the looks and information fractions of the whole experiment."""
        return replace(self, candidates=())

    @property
    def planned_looks(self) -> int:
        return math.ceil(self.requests_per_arm / self.requests_per_look)

    def information(self, totals: dict[str, int]) -> float:
        """Information fraction: the least-served arm's completed requests over the plan (capped at 1)."""
        return min(1.0, min(totals.values()) / self.requests_per_arm) if totals else 0.0

    def look_due(self, new: dict[str, int], totals: dict[str, int], since_last_s: float) -> bool:
        """Every arm has requests_per_look more (or has reached the plan), and window_s has passed."""
        if not new or since_last_s < self.min_interval_s or min(new.values()) < 1:
            return False
        return all(n >= self.requests_per_look for n in new.values()) or self.information(totals) >= 1.0


# -- the records ----------------------------------------------------------------------
def record_arm(record: RequestRecord) -> str | None:
    """The arm that served the request (the one it was pinned to when the response did not say)."""
    return record.served_arm


def completed(records: Sequence[RequestRecord], arm: str) -> int:
    """Requests of `arm` that ended (ok or failed); cut-off (cancelled) requests are not evidence."""
    return sum(1 for r in records if record_arm(r) == arm and not r.cancelled)


def requests_by_arm(records: Sequence[RequestRecord], arms: Sequence[str] = ARMS) -> dict[str, int]:
    """`completed` of every arm, in one pass over the records (every look counts all records so far)."""
    counts = dict.fromkeys(arms, 0)
    for r in records:
        if not r.cancelled:
            arm = r.arm if r.arm is not None else r.pinned_arm
            if arm in counts:
                counts[arm] += 1
    return counts


def promised_shares(records: Sequence[RequestRecord], arm_users: bool, arms: Sequence[str] = ARMS) -> dict[str, float]:
    """The share of requests each arm should have served, for the sample-ratio check.

    Every prompt to each arm in turn: equal shares. Each user keeping one arm (equal users per
    arm, closed loop, no think time): every user is busy all the time, so an arm serves its
    users' time over its mean request time; the shares are each arm's requests per second of
    busy time (its completed requests over the sum of their E2E). An arm whose records were
    lost, or that got fewer users, or whose pinned requests went elsewhere, then falls off
    its share; an arm that is merely faster does not.
    """
    if not arm_users:
        return {arm: 1.0 for arm in arms}
    shares: dict[str, float] = {}
    for arm in arms:
        mine = [r for r in records if record_arm(r) == arm and not r.cancelled]
        busy = sum(r.e2e_s for r in mine)
        shares[arm] = len(mine) / busy if busy > 0 else 1.0
    return shares


@dataclass(frozen=True)
class RecordColumns:
    """A stream of records read once into arrays, for judging many of its prefixes.

    ``arm``: index of each record's served arm in ``arms`` (-1: none of them);
    ``timed``: the record has both a TTFT and a TPOT (else they read NaN here). `samples_by_arm` and
    `counts` of a prefix equal `latency.latency_samples_by_arm` and `requests_by_arm`
    of those records (the same rule, the same values and order).
    """

    arms: tuple[str, ...]
    arm: np.ndarray
    cancelled: np.ndarray
    ok: np.ndarray
    timed: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    e2e_s: np.ndarray

    @classmethod
    def of(cls, records: Sequence[RequestRecord], arms: Sequence[str]) -> "RecordColumns":
        index = {name: i for i, name in enumerate(arms)}
        tpot = [r.tpot_s for r in records]  # the record's own property: the same float the judge reads
        return cls(
            arms=tuple(arms),
            arm=np.array([index.get(record_arm(r), -1) for r in records], dtype=int),
            cancelled=np.array([r.cancelled for r in records], dtype=bool),
            ok=np.array([r.ok for r in records], dtype=bool),
            timed=np.array([r.ttft_s is not None and t is not None for r, t in zip(records, tpot)], dtype=bool),
            ttft_s=np.array([math.nan if r.ttft_s is None else r.ttft_s for r in records], dtype=float),
            tpot_s=np.array([math.nan if t is None else t for t in tpot], dtype=float),
            e2e_s=np.array([r.e2e_s for r in records], dtype=float),
        )

    @property
    def size(self) -> int:
        return int(self.arm.size)

    def counts(self, end: int, arms: Sequence[str]) -> dict[str, int]:
        """`requests_by_arm` of the first ``end`` records."""
        live = self.arm[:end][~self.cancelled[:end]]
        return {name: int(np.count_nonzero(live == self.arms.index(name))) if name in self.arms else 0 for name in arms}

    def samples_by_arm(self, end: int, looks_of: Sequence[int], arms: Sequence[str]) -> dict[str, LatencySamples]:
        """`latency.latency_samples_by_arm` of the first ``end`` records, ``looks_of`` their looks."""
        if len(looks_of) != end or end > self.size:
            raise ValueError(f"one look per record needed: {len(looks_of)} for {end} records of {self.size}")
        looks = np.asarray(looks_of, dtype=int)
        live = ~self.cancelled[:end]
        ok = self.ok[:end]
        ttft, tpot = self.ttft_s[:end], self.tpot_s[:end]
        has = ok & self.timed[:end]
        out = {}
        for name in arms:
            mine = live & (self.arm[:end] == (self.arms.index(name) if name in self.arms else -2))
            sample, failed = mine & has, mine & ~ok
            out[name] = LatencySamples(
                ttft_s=ttft[sample], tpot_s=tpot[sample], e2e_s=self.e2e_s[:end][sample],
                n_errors=int(np.count_nonzero(failed)), n_total=int(np.count_nonzero(mine)),
                window=looks[sample], error_window=looks[failed],
            )
        return out


def latency_samples(records: Sequence[RequestRecord], looks_of: Sequence[int], arm: str) -> LatencySamples:
    """Per-request samples of one arm with the look each arrived in: the latency judge's own rule
    (``latency_samples_from_records``: cancelled requests are not samples, failed ones carry their look)."""
    return latency_samples_from_records(records, looks_of, arm)


# -- one look -------------------------------------------------------------------------
def next_information(fractions: Sequence[float], information: float) -> float:
    """The next look's information fraction: the observed one, strictly above the previous look's, at most 1."""
    fraction = information if not fractions else max(information, fractions[-1] + INFORMATION_STEP)
    return min(1.0, fraction)


def judge_look(
    records: Sequence[RequestRecord],
    looks_of: Sequence[int],
    fractions: Sequence[float],
    cfg: GatesConfig,
    plan: LookPlan,
    canary_spec: SpecDecodeStats | None,
    speculative_canary: bool,
    prefix_cache: PrefixCacheLooks | None = None,
    columns: RecordColumns | None = None,
) -> list[GateResult]:
    """Every experiment gate at look ``len(fractions)`` on all records so far: latency, acceptance, sample ratio,
    goodput when the config enables it (``gates.slo`` sets a bound), the per-position acceptance profile when
    ``gates.acceptance_profile`` is set, and the prefix-cache gate when enabled
    (``prefix_cache``: each arm's counters at every look so far; None: unknown, so it is INCONCLUSIVE).

    ``looks_of[i]`` is the look record ``i`` arrived in; ``fractions`` the information
    fraction of every look so far, this one last. ``canary_spec`` is the canary's
    spec-decode counters since the phase began (None: not scraped, so unknown).
    With ``plan.twin`` the objective is held to the A/A noise floor (`judge_look_with_floor`).
    ``columns``: the stream's `RecordColumns` when the caller has them (``records`` its first records).
    """
    return judge_look_with_floor(records, looks_of, fractions, cfg, plan, canary_spec, speculative_canary,
                                 prefix_cache, columns)[0]


def judge_look_with_floor(
    records: Sequence[RequestRecord],
    looks_of: Sequence[int],
    fractions: Sequence[float],
    cfg: GatesConfig,
    plan: LookPlan,
    canary_spec: SpecDecodeStats | None,
    speculative_canary: bool,
    prefix_cache: PrefixCacheLooks | None = None,
    columns: RecordColumns | None = None,
) -> tuple[list[GateResult], NoiseFloor | None]:
    """`judge_look`'s gates and, with a twin baseline, the look's A/A noise floor (None without a twin).
    ``prefix_cache``: each arm's prefix-cache counters at every look (the live loop reads them from
    /metrics; a replay has them only from the run's decision.json, at the run's own looks)."""
    look = len(fractions)
    if columns is not None:
        samples = columns.samples_by_arm(len(records), looks_of, plan.arms)
    else:
        samples = latency_samples_by_arm(records, looks_of, plan.arms)
    baseline, canary = samples[BASELINE], samples[CANARY]
    latency = judge_latency(baseline, canary, cfg, look=look, max_looks=plan.planned_looks, information=list(fractions))
    floor = None
    if plan.twin:
        twin = samples[TWIN_ARM]
        floor = judge_noise_floor(baseline, twin, cfg, look=look, max_looks=plan.planned_looks, information=list(fractions))
        # the objective must also hold against the twin: an asymmetry too small for the A/A
        # interval to exclude 1 can still carry canary / baseline below the bar
        against_twin = judge_latency(twin, canary, cfg, look=look, max_looks=plan.planned_looks, information=list(fractions))
        latency = apply_noise_floor(latency, floor, next((g for g in against_twin if g.name == OBJECTIVE_NAME), None))
    acceptance = judge_acceptance(canary_spec, cfg, look=look, max_looks=plan.planned_looks, information=list(fractions))
    if canary_spec is not None and speculative_canary and canary_spec.drafts <= 0:
        acceptance = acceptance.model_copy(
            update={"verdict": Verdict.FAIL, "detail": "the speculative canary made no drafts under load"}
        )
    counts = columns.counts(len(records), plan.arms) if columns is not None else requests_by_arm(records, plan.arms)
    sample_ratio = judge_sample_ratio(counts, cfg, promised_shares(records, plan.arm_users, plan.arms), look=look)
    gates = [*latency, acceptance, sample_ratio]
    if is_enabled(GOODPUT_NAME, cfg) and cfg.goodput_slo is not None:
        samples = goodput_samples(records, cfg.goodput_slo, looks_of)
        gates.append(judge_goodput(samples, cfg, look=look, max_looks=plan.planned_looks, information=list(fractions)))
    if is_enabled(PREFIX_CACHE_NAME, cfg):
        gates.append(judge_prefix_cache(prefix_cache, cfg, look=look, max_looks=plan.planned_looks,
                                        information=list(fractions)))
    if is_enabled(PROFILE_NAME, cfg):
        gates.append(judge_profile_of_counters(canary_spec, speculative_canary, cfg, look=look,
                                               max_looks=plan.planned_looks, information=list(fractions)))
    return gates, floor


def stop_after(look: int, fractions: Sequence[float], plan: LookPlan, gates: Sequence[GateResult], cfg: GatesConfig) -> str | None:
    """Why the phase stops after this look ('information' or 'evidence'), or None to go on."""
    if fractions and fractions[-1] >= 1.0:
        return "information"
    if look >= plan.min_looks and is_final(gates, cfg):
        return "evidence"
    return None


# -- a replay of a finished stream ------------------------------------------------------
@dataclass(frozen=True)
class Look:
    """One look of a replay: its number, fraction, new requests per arm and the gates judged at it."""

    look: int
    information: float
    requests: dict[str, int]
    gates: list[GateResult]


@dataclass
class Replay:
    """The looks a stream of records gives under a plan, and what stopped it."""

    looks: list[Look] = field(default_factory=list)
    stopped_by: str = "end of records"
    judged_records: int = 0
    unjudged_records: int = 0
    warmup_records: int = 0  # the first records, a warm-up: before the judged ones

    @property
    def gates(self) -> list[GateResult]:
        return self.looks[-1].gates if self.looks else []


def warmup_end(records: Sequence[RequestRecord], plan: LookPlan) -> int | None:
    """End index (exclusive) of the warm-up in ``records`` (arrival order): the record at which every
    arm has ``plan.warmup_requests_per_arm`` completed requests; 0 without a warm-up, None before its end.

    Whatever arrived before that record is warm-up too (another arm's extra requests, cancelled
    ones): the judged records are one unbroken stretch after it, as the looks need."""
    try:  # the warm-up is a stored look of N completed requests per arm
        return _boundaries_by_counts(records, [dict.fromkeys(plan.arms, plan.warmup_requests_per_arm)], plan.arms)[0]
    except ValueError:  # the records do not hold it yet
        return None


def look_ends_by_rule(records: Sequence[RequestRecord], plan: LookPlan) -> list[int]:
    """End index (exclusive) of every look the controller's boundary rule would make, records in arrival order.

    The clock is the records' completion times; the phase starts at the first send.
    The live controller looks at its 0.25 s ticks, so its looks hold a few more records.
    """
    if not records:
        return []
    start = min(r.sent_at for r in records)
    last_look_at, clock, ends = start, start, []
    new = {arm: 0 for arm in plan.arms}
    totals = dict(new)
    for i, r in enumerate(records):
        clock = max(clock, r.sent_at + r.e2e_s)
        arm = record_arm(r)
        if arm in new and not r.cancelled:
            new[arm] += 1
            totals[arm] += 1
        capped = clock - start >= plan.max_duration_s
        if plan.look_due(new, totals, clock - last_look_at) or (capped and any(new.values())):
            ends.append(i + 1)
            last_look_at, new = clock, {arm: 0 for arm in plan.arms}
        if capped:
            break
    return ends


def _boundaries_by_counts(
    records: Sequence[RequestRecord], counts: Sequence[dict[str, int]], arms: Sequence[str] = ARMS
) -> list[int]:
    """End index of every stored look: the first record at which each arm has that look's completed count."""
    ends, i = [], 0
    for wanted in counts:
        got = {arm: 0 for arm in arms}
        while i < len(records) and any(got[arm] < wanted.get(arm, 0) for arm in arms):
            arm = record_arm(records[i])
            if arm in got and not records[i].cancelled:
                got[arm] += 1
            i += 1
        if any(got[arm] < wanted.get(arm, 0) for arm in arms):
            raise ValueError(f"look {len(ends) + 1} needs {wanted} completed requests; the records hold only {got} more")
        ends.append(i)
    return ends


def replay_looks(
    records: Sequence[RequestRecord],
    plan: LookPlan,
    cfg: GatesConfig,
    canary_spec: SpecDecodeStats | None,
    speculative_canary: bool,
    stored_counts: Sequence[dict[str, int]] | None = None,
    stored_prefix_cache: PrefixCacheLooks | None = None,
) -> Replay:
    """Judge ``records`` (in the order the controller read them) look by look, as the controller did.

    With ``stored_counts`` (the run's per-look completed requests, from decision.json)
    the looks fall exactly where the run's did; without, where the boundary rule puts
    them on the records' own clock. The spec-decode counters: the canary's requests'
    own up to each look where they carry them (as the run counted), else ``canary_spec``
    (the phase's final ones) at every look. ``stored_prefix_cache``: the run's prefix-cache
    counters at each of its looks (used only with ``stored_counts``: they belong to the run's
    look boundaries, not to any others). Records after the last
    look are not judged, as in the run; nor are a warm-up's (``warmup_end``): the looks
    begin after it, and ``judged_records`` counts from the warm-up's end.
    """
    warmup = warmup_end(records, plan)
    replay = Replay()
    if warmup is None:  # the records end inside the warm-up: nothing to judge
        replay.stopped_by, replay.unjudged_records = "end of records in the warm-up", len(records)
        return replay
    records = records[warmup:]
    ends = _boundaries_by_counts(records, stored_counts, plan.arms) if stored_counts is not None else look_ends_by_rule(records, plan)
    looks_of: list[int] = []
    fractions: list[float] = []
    start = 0
    for look, end in enumerate(ends, start=1):
        look_records = records[start:end]
        looks_of += [look] * len(look_records)
        fractions.append(next_information(fractions, plan.information(requests_by_arm(records[:end], plan.arms))))
        # the canary's own requests' counters up to this look where they carry them, as the run counted
        look_spec = spec_decode_of_requests(records[:end], CANARY) or canary_spec
        prefix = None
        if stored_prefix_cache is not None and stored_counts is not None:
            prefix = PrefixCacheLooks(baseline=stored_prefix_cache.baseline[:look], canary=stored_prefix_cache.canary[:look])
        gates = judge_look(records[:end], looks_of, fractions, cfg, plan, look_spec, speculative_canary, prefix)
        replay.looks.append(Look(look, round(fractions[-1], 4), requests_by_arm(look_records, plan.arms), gates))
        start = end
        reason = stop_after(look, fractions, plan, gates, cfg)
        if reason is not None:
            replay.stopped_by = reason
            break
    replay.warmup_records = warmup
    replay.judged_records, replay.unjudged_records = start, len(records) - start
    return replay
