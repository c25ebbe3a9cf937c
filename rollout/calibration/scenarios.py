"""The calibration's simulated world: one trial's request records, spec-decode counters and eval outcomes.

Pure functions of a numpy Generator and a `TrialSpec` (what is true in this trial:
the canary's effects and the scenario's latency structure). ``rollout.calibration.calibrate``
pushes what they produce through the controller's own judging path
(``rollout.calibration.trial``).

Latency, per arm and request (seconds)
--------------------------------------
    TPOT and TTFT are lognormal; E2E = TTFT + TPOT x (output tokens - 1), the output
    being ``max_tokens`` long (the demo's prompts always run to the length limit).
    The canary's TPOT is ``tpot_ratio`` x the baseline's, its TTFT ``ttft_ratio`` x:
    every effect below is multiplicative and identically distributed in both arms, so
    the true p50 / p95 ratios are exactly those factors. A request fails with the
    arm's error rate (no TTFT, no tokens). Scenarios add, independently per arm:

    iid            nothing;
    arm_level_SD   a random log-level N(0, SD) per block of ``requests_per_look``
                   consecutive requests of the arm (a per-look level: a replica's
                   state, a noisy neighbour), added to log TPOT and log TTFT;
    shared_level_SD    one such level per block for both arms (their blocks are the same
                   stretch of time: a disturbance of the whole machine);
    opposed_level_SD   the canary's level is minus the baseline's (two replicas fighting
                   for the same cores: one slow while the other is fast);
    within_look_drift  inside each such block the log level moves linearly from
                   -d/2 to +d/2, d ~ N(0, 0.10);
    stall_runs     a stall starts at a request with probability 0.02 and covers it
                   and the next 9 (runs of ~10 slow requests): TTFT x 4, TPOT x 1.5;
    ties_1ms       a stable decode (TPOT log-sd 0.05) with TTFT and TPOT rounded to
                   1 ms, so the samples are full of ties (30 ms vs 27 ms: ratio 0.9);
    unequal_n      each arm runs its own closed loop, so the faster arm completes
                   more requests in the same time (the others share one ticket
                   sequence that alternates the arms, as the load generator does);
    heavy_tails    log-sd 1.0 for TPOT and TTFT, and 3% of requests multiplied by
                   1 + Pareto(1.5) (infinite variance).

Worlds built to break the looks' independence (each arm's level persists across looks):

    ar1_SD_RHO     each arm's per-look log-level is a stationary AR(1) with sd SD and
                   look-to-look correlation RHO (a replica's state, a neighbour that stays);
    random_walk_STEP   each arm's per-look log-level is a random walk with step sd STEP
                   (no stationary level at all: the drift of a degrading node);
    linear_drift   each arm's log-level moves linearly over the run, from 0 to a
                   slope ~ N(0, 0.10) at the plan's last look;
    warmup_ARM_AMP_LOOKS   ARM's (baseline or canary) latency starts AMP higher and
                   decays by e every LOOKS looks (a cold cache, a JIT, a first compile);
    error_bursts_B     errors come in bursts of B consecutive requests of an arm (a
                   stalled replica times out everything in flight) at the arm's rate;
    feedback       closed-loop feedback: an arm's latency rises with its requests in
                   flight (x (1 + 0.15 (in flight - 1))), so the slower arm holds more in
                   flight and slows further (Little's law), as a shared closed loop does.

A twin baseline (``TrialSpec.twin_tpot_ratio`` set): a third arm with the baseline's
latency, its TPOT ``twin_tpot_ratio`` x the baseline's (1: a true A/A; below 1: the
baseline's replica sits on slower cores than the twin's), in the same alternating ticket
sequence; its draws come after the other two arms', so they are unchanged by it.

Several candidates (``TrialSpec.candidates`` K > 1): K candidate arms (``candidate_arms``:
the canary, then canary-2 ...), each with the canary's effects and its own draws, all in
the same alternating ticket sequence as the baseline (a linked level links each of them
to the baseline as it links the canary).

Order and clock: ``users`` closed-loop streams; each sends its next request when the
previous one ends; records come out in completion order with ``sent_at`` and
``e2e_s``, so the look rule runs on their clock as on a live run's.

Goodput at the margin: `goodput_share` is an arm's true share of requests meeting an SLO
(TTFT, TPOT, E2E bounds) in the ``iid`` and ``arm_level_SD`` worlds, exactly (quadrature
over the per-look level and the TTFT noise: E2E couples TTFT and TPOT), and
`goodput_boundary_spec` moves the canary's TTFT factor (its TPOT factor when the SLO
bounds neither TTFT nor E2E) until baseline - canary is exactly the margin. Under
``arm_level_SD`` the level is drawn per look-sized block, so the shares a trial sees
swing from look to look around that truth: the correlated world the gate must survive.

Speculative decoding (canary): every decode step drafts ``k`` tokens; position i is
accepted with probability ``r`` if every earlier one was (``r`` solved from the
trial's true mean acceptance length). Counters accumulate per completed request.

    per-position profile (`spec_decode_by_profile`): each request draws its own conditional
    rate at every position (accepted given the one before was) from a Beta of the given
    concentration around that position's mean (a hard prompt accepts less at each position);
    `profile_truth` is the per-position rate the server's counters converge to (accepted at
    position i over verify steps, exact per request by recursion on the tokens left, averaged
    over the Beta by common random numbers), and `conditional_means_for_profile` solves the
    means that put it exactly on a target profile (the boundary a gate's error is measured at).

Eval items (paired): each item falls in one of four cells (both right, both wrong,
only baseline right, only canary right); with no true change the arms still disagree
on ``discordance`` of the items, a drop of d moves d of them from 'both right' to
'only baseline right'. Divergence: the canary (and the twin, when the run has one)
diverge from the baseline independently per item at their rates.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
from scipy import optimize, special
from scipy.stats import qmc as stats_qmc

from cluster.arms import BASELINE, CANARY
from loadtests.records import RequestRecord
from rollout.judge.names import TWIN_ARM

__all__ = [
    "LATENCY_SCENARIOS",
    "DEPENDENCE_SCENARIOS",
    "ALL_SCENARIOS",
    "LatencyWorld",
    "AccuracyWorld",
    "TrialSpec",
    "StreamShape",
    "simulate_records",
    "candidate_arms",
    "goodput_share",
    "goodput_boundary_spec",
    "spec_decode_by_request",
    "acceptance_rate_for_length",
    "spec_decode_by_profile",
    "profile_truth",
    "conditional_means_for_profile",
    "paired_items",
]

LATENCY_SCENARIOS = (
    "iid",
    "arm_level_0.05",
    "arm_level_0.10",
    "shared_level_0.10",
    "opposed_level_0.10",
    "within_look_drift",
    "stall_runs",
    "ties_1ms",
    "unequal_n",
    "heavy_tails",
)
# The worlds that break the looks' independence (``calibrate`` runs them beside the ones above).
DEPENDENCE_SCENARIOS = (
    "ar1_0.05_0.5",
    "ar1_0.10_0.8",
    "random_walk_0.05",
    "linear_drift",
    "warmup_baseline_0.30_1",
    "warmup_baseline_0.15_3",
    "warmup_canary_0.30_1",
    "error_bursts_10",
    "feedback",
)
ALL_SCENARIOS = LATENCY_SCENARIOS + DEPENDENCE_SCENARIOS
FEEDBACK_PER_REQUEST = 0.15  # the feedback world: latency x (1 + this x the arm's other requests in flight)


@dataclass(frozen=True)
class LatencyWorld:
    """The baseline's latency (medians in seconds, log-sds) and the scenarios' effect sizes."""

    tpot_median_s: float = 0.030
    tpot_sigma: float = 0.25
    ttft_median_s: float = 0.15
    ttft_sigma: float = 0.6
    error_rate: float = 0.002
    error_latency_s: float = 0.05  # a failed request ends quickly (an HTTP 500)
    drift_sd: float = 0.10
    stall_start_probability: float = 0.02
    stall_run: int = 10
    stall_ttft_factor: float = 4.0
    stall_tpot_factor: float = 1.5
    ties_tpot_sigma: float = 0.05
    ties_resolution_s: float = 0.001
    heavy_sigma: float = 1.0
    heavy_stall_probability: float = 0.03
    heavy_pareto_shape: float = 1.5


@dataclass(frozen=True)
class AccuracyWorld:
    """Paired eval outcomes; defaults echo gsm8k on MiMo (0.95 accuracy, 3% no-change discordance)."""

    baseline_accuracy: float = 0.95
    discordance: float = 0.03
    divergence_rate: float = 0.02  # canary (and twin) vs baseline greedy divergence with no true change


@dataclass(frozen=True)
class TrialSpec:
    """What is true in one set of simulated trials (the canary against the baseline)."""

    scenario: str = "iid"
    tpot_ratio: float = 1.0
    ttft_ratio: float = 1.0
    canary_error_rate: float | None = None  # None: the baseline's
    acceptance_length: float = 2.95  # the canary's true mean acceptance length (k=3, r=0.8)
    accuracy_drop: float = 0.0
    canary_divergence_excess: float = 0.0  # over the twin's rate (or over the no-change rate without a twin)
    canary_divergence_rate: float | None = None  # absolute rate (no twin: the cap scenario), None: world's + excess
    run_accuracy: bool = False
    run_experiment: bool = True
    twin_tpot_ratio: float | None = None  # a twin baseline arm in the experiment, TPOT x this; None: no twin arm
    candidates: int = 1  # candidate arms, each with the canary's effects (the first is CANARY; see candidate_arms)

    def __post_init__(self) -> None:
        if self.scenario not in ALL_SCENARIOS:
            raise ValueError(f"unknown scenario {self.scenario!r}; known: {', '.join(ALL_SCENARIOS)}")
        if self.candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {self.candidates}")


@dataclass(frozen=True)
class StreamShape:
    """The load the experiment offers: how many streams, how long the outputs, how many requests."""

    requests_per_arm: int
    requests_per_look: int
    users_per_arm: int
    output_tokens: int
    speculative_tokens: int = 3
    warmup_per_arm: int = 0  # completed requests per arm before the looks begin (stored, never judged)


def candidate_arms(candidates: int) -> tuple[str, ...]:
    """The simulated candidate arms' names: CANARY, then canary-2, canary-3, ..."""
    return (CANARY, *(f"{CANARY}-{i}" for i in range(2, candidates + 1)))


# -- latency -------------------------------------------------------------------------
def _arm_level(scenario: str) -> float:
    return float(scenario.removeprefix("arm_level_")) if scenario.startswith("arm_level_") else 0.0


def _linked_level(scenario: str) -> tuple[float, int]:
    """(sd, the canary's sign) of a per-block level linked between the arms; sd 0 when they are not linked."""
    for prefix, sign in (("shared_level_", 1), ("opposed_level_", -1)):
        if scenario.startswith(prefix):
            return float(scenario.removeprefix(prefix)), sign
    return 0.0, 1


def _persistent_level(rng: np.random.Generator, scenario: str, blocks: int, plan_blocks: int, arm: str) -> np.ndarray | None:
    """One arm's log-level per look-sized block in the worlds whose levels persist across looks (None elsewhere).

    ``plan_blocks``: the looks the plan holds (a linear drift reaches its slope there); ``arm``: BASELINE,
    CANARY or the twin's name (a warm-up hits only the arm it names; the twin is a baseline).
    """
    index = np.arange(blocks)
    if scenario.startswith("ar1_"):
        sd, rho = (float(x) for x in scenario.removeprefix("ar1_").split("_"))
        shocks = rng.normal(0.0, sd * math.sqrt(1.0 - rho * rho), blocks)
        level = np.empty(blocks)
        level[0] = rng.normal(0.0, sd)
        for t in range(1, blocks):
            level[t] = rho * level[t - 1] + shocks[t]
        return level
    if scenario.startswith("random_walk_"):
        return np.cumsum(rng.normal(0.0, float(scenario.removeprefix("random_walk_")), blocks))
    if scenario == "linear_drift":
        return rng.normal(0.0, 0.10) * index / max(plan_blocks - 1, 1)
    if scenario.startswith("warmup_"):
        who, amplitude, looks = scenario.removeprefix("warmup_").split("_")
        hit = who == arm
        return math.log1p(float(amplitude)) * np.exp(-index / float(looks)) * hit
    return None


def _arm_latencies(
    rng: np.random.Generator, n: int, world: LatencyWorld, spec: TrialSpec, shape: StreamShape, canary: bool,
    twin: bool = False, linked_level: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ttft_s, tpot_s, ok) of one arm's n requests in send order (``twin``: the twin baseline's;
    ``linked_level``: this arm's level per block when the arms' levels are linked)."""
    scenario = spec.scenario
    tpot_sigma = world.ties_tpot_sigma if scenario == "ties_1ms" else world.tpot_sigma
    ttft_sigma = world.ttft_sigma
    if scenario == "heavy_tails":
        tpot_sigma = ttft_sigma = world.heavy_sigma
    log_tpot = math.log(world.tpot_median_s) + rng.normal(0.0, tpot_sigma, n)
    log_ttft = math.log(world.ttft_median_s) + rng.normal(0.0, ttft_sigma, n)
    block = np.arange(n) // shape.requests_per_look
    if (level_sd := _arm_level(scenario)) > 0:
        level = rng.normal(0.0, level_sd, block[-1] + 1)[block]
        log_tpot, log_ttft = log_tpot + level, log_ttft + level
    if linked_level is not None:
        log_tpot, log_ttft = log_tpot + linked_level[block], log_ttft + linked_level[block]
    arm = CANARY if canary else TWIN_ARM if twin else BASELINE
    plan_blocks = max((shape.requests_per_arm + shape.warmup_per_arm) // shape.requests_per_look, 1)
    if (persistent := _persistent_level(rng, scenario, block[-1] + 1, plan_blocks, arm)) is not None:
        log_tpot, log_ttft = log_tpot + persistent[block], log_ttft + persistent[block]
    if scenario == "within_look_drift":
        span = rng.normal(0.0, world.drift_sd, block[-1] + 1)[block]
        position = (np.arange(n) % shape.requests_per_look) / max(shape.requests_per_look - 1, 1) - 0.5
        log_tpot, log_ttft = log_tpot + span * position, log_ttft + span * position
    if scenario == "stall_runs":
        starts = np.flatnonzero(rng.random(n) < world.stall_start_probability)
        stalled = np.zeros(n, bool)
        for start in starts:
            stalled[start : start + world.stall_run] = True
        log_tpot = log_tpot + stalled * math.log(world.stall_tpot_factor)
        log_ttft = log_ttft + stalled * math.log(world.stall_ttft_factor)
    if scenario == "heavy_tails":
        hit = rng.random(n) < world.heavy_stall_probability
        factor = np.log1p(rng.pareto(world.heavy_pareto_shape, n)) * hit
        log_tpot, log_ttft = log_tpot + factor, log_ttft + factor
    tpot_factor = spec.tpot_ratio if canary else (spec.twin_tpot_ratio or 1.0) if twin else 1.0
    tpot = np.exp(log_tpot) * tpot_factor
    ttft = np.exp(log_ttft) * (spec.ttft_ratio if canary else 1.0)
    if scenario == "ties_1ms":
        tick = world.ties_resolution_s
        tpot = np.maximum(np.round(tpot / tick), 1.0) * tick
        ttft = np.maximum(np.round(ttft / tick), 1.0) * tick
    error_rate = world.error_rate if not canary or spec.canary_error_rate is None else spec.canary_error_rate
    if scenario.startswith("error_bursts_"):  # the same rate, in runs of `burst` consecutive requests
        burst = int(scenario.removeprefix("error_bursts_"))
        starts = rng.random(n) < error_rate / burst
        ok = np.convolve(starts, np.ones(burst, dtype=int))[:n] == 0
    else:
        ok = rng.random(n) >= error_rate
    return ttft, tpot, ok


def _closed_loop(
    durations: dict[str, np.ndarray], users: int, alternate: bool, feedback: float = 0.0
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(sent_at, completed_at) per arm for closed-loop streams.

    ``alternate``: ``users`` streams share one ticket sequence that alternates the
    arms; else every arm has ``users // 2`` streams of its own. ``feedback`` (alternate
    only): a request's duration is multiplied by 1 + feedback x (its arm's requests
    in flight when it is sent); ``durations`` is scaled in place by that factor.
    """
    if alternate:
        free = [(0.0, u) for u in range(users)]
        heapq.heapify(free)
        counts = {arm: 0 for arm in durations}
        sent = {arm: np.empty(len(d)) for arm, d in durations.items()}
        in_flight: dict[str, list[float]] = {arm: [] for arm in durations}  # completion times, a heap per arm
        arms = list(durations)
        limit = min(len(d) for d in durations.values())
        ticket = 0
        while min(counts.values()) < limit:
            arm = arms[ticket % len(arms)]
            ticket += 1
            t, user = heapq.heappop(free)
            i = counts[arm]
            counts[arm] += 1
            sent[arm][i] = t
            if feedback:
                flying = in_flight[arm]
                while flying and flying[0] <= t:
                    heapq.heappop(flying)
                durations[arm][i] *= 1.0 + feedback * len(flying)
                heapq.heappush(flying, t + durations[arm][i])
            heapq.heappush(free, (t + durations[arm][i], user))
        return {arm: (sent[arm][: counts[arm]], sent[arm][: counts[arm]] + durations[arm][: counts[arm]]) for arm in arms}
    out = {}
    per_arm = max(users // len(durations), 1)
    for arm, d in durations.items():
        free = [0.0] * per_arm
        sent_arm = np.empty(len(d))
        for i, duration in enumerate(d):
            t = heapq.heappop(free)
            sent_arm[i] = t
            heapq.heappush(free, t + duration)
        out[arm] = (sent_arm, sent_arm + d)
    return out


def simulate_records(
    rng: np.random.Generator, world: LatencyWorld, spec: TrialSpec, shape: StreamShape, template: RequestRecord
) -> list[RequestRecord]:
    """Both arms' request records in completion order, enough for the whole plan.

    ``template`` is a valid record every simulated one is a copy of (the fields a
    simulation does not model keep its values).
    """
    alternate = spec.scenario != "unequal_n"
    # Sharing one alternating ticket sequence, an arm with requests_per_arm + every stream's
    # request sent has completed the plan; on its own loop the faster arm sends more.
    candidates = candidate_arms(spec.candidates)
    arms = (BASELINE, CANARY, *((TWIN_ARM,) if spec.twin_tpot_ratio is not None else ()), *candidates[1:])
    users = len(arms) * shape.users_per_arm
    planned = shape.requests_per_arm + shape.warmup_per_arm
    budget = planned + users + 2 if alternate else int(2.5 * planned) + 2 * users
    linked_sd, canary_sign = _linked_level(spec.scenario)
    # drawn only where linked, so every other scenario's draws stay as they were
    linked = rng.normal(0.0, linked_sd, (budget - 1) // shape.requests_per_look + 1) if linked_sd > 0 else None
    latencies = {
        arm: _arm_latencies(
            rng, budget, world, spec, shape, canary=(arm in candidates), twin=(arm == TWIN_ARM),
            linked_level=None if linked is None else (canary_sign if arm in candidates else 1) * linked,
        )
        for arm in arms
    }
    tokens = shape.output_tokens
    e2e = {arm: np.where(ok, ttft + tpot * (tokens - 1), world.error_latency_s) for arm, (ttft, tpot, ok) in latencies.items()}
    if spec.scenario == "feedback":  # a request's whole latency scales with its arm's load when it is sent
        unscaled = {arm: d.copy() for arm, d in e2e.items()}
        times = _closed_loop(e2e, users, alternate=alternate, feedback=FEEDBACK_PER_REQUEST)
        for arm, (ttft, tpot, ok) in latencies.items():
            factor = e2e[arm] / unscaled[arm]
            latencies[arm] = (ttft * factor, tpot * factor, ok)
    else:
        times = _closed_loop(e2e, users, alternate=alternate)
    # Up to the moment both arms have completed the plan (plus the requests in flight then).
    enough = max(np.sort(done)[min(planned, done.size) - 1] for _, done in times.values())
    rows = []
    for arm, (sent, done) in times.items():
        ttft, tpot, ok = latencies[arm]
        for i in np.flatnonzero(done <= enough):
            rows.append((done[i], arm, i, sent[i], ttft[i], e2e[arm][i], bool(ok[i])))
    rows.sort()
    records = []
    for done, arm, i, sent, ttft, e2e_s, ok in rows:
        fields = dict(
            request_id=f"{arm}-{i}", arm=arm, pinned_arm=arm, dataset_index=int(i), sent_at=float(sent),
            e2e_s=float(e2e_s), ok=ok,
        )
        if ok:
            fields.update(ttft_s=float(ttft), output_tokens=tokens, chunks=tokens, status=200, error=None)
        else:
            fields.update(ttft_s=None, output_tokens=None, chunks=0, status=500, error="simulated server error")
        records.append(template.model_copy(update=fields))
    return records


# -- goodput ------------------------------------------------------------------------------
GOODPUT_LEVEL_NODES = 64  # Gauss-Hermite nodes over the per-look level (exact for any smooth integrand here)
GOODPUT_TTFT_GRID = 4001  # trapezoid points over the TTFT noise below the TTFT bound (E2E couples TTFT and TPOT)


def goodput_share(
    world: LatencyWorld, spec: TrialSpec, shape: StreamShape, bounds: Mapping[str, float], canary: bool
) -> float:
    """An arm's true share of requests that succeed and meet ``bounds`` (``ttft_s``, ``tpot_s``, ``e2e_s``).

    Worlds ``iid`` and ``arm_level_SD`` only (the level, shared by the arm's log TTFT and
    log TPOT in a block, is integrated out: the share over the whole run).
    """
    if spec.scenario != "iid" and not spec.scenario.startswith("arm_level_"):
        raise ValueError(f"goodput_share models the iid and arm_level_* worlds, not {spec.scenario!r}")
    tokens = shape.output_tokens
    log_ttft = math.log(world.ttft_median_s) + (math.log(spec.ttft_ratio) if canary else 0.0)
    log_tpot = math.log(world.tpot_median_s) + (math.log(spec.tpot_ratio) if canary else 0.0)
    ttft_max, tpot_max, e2e_max = (bounds.get(name, math.inf) for name in ("ttft_s", "tpot_s", "e2e_s"))
    level_sd = _arm_level(spec.scenario)
    nodes, weights = np.polynomial.hermite_e.hermegauss(GOODPUT_LEVEL_NODES) if level_sd > 0 else (np.zeros(1), np.ones(1))
    weights = weights / weights.sum()
    total = 0.0
    for level, weight in zip(nodes * level_sd, weights):
        # the TTFT noise up to the TTFT bound; at each, the TPOT bound the E2E bound leaves
        e_max = (math.log(ttft_max) - log_ttft - level) / world.ttft_sigma if math.isfinite(ttft_max) else 9.0
        if not math.isfinite(e2e_max):
            tpot_share = special.ndtr((math.log(tpot_max) - log_tpot - level) / world.tpot_sigma) if math.isfinite(tpot_max) else 1.0
            total += weight * float(special.ndtr(e_max)) * float(tpot_share)
            continue
        eps = np.linspace(-9.0, min(e_max, 9.0), GOODPUT_TTFT_GRID)
        ttft = np.exp(log_ttft + level + world.ttft_sigma * eps)
        room = (e2e_max - ttft) / max(tokens - 1, 1)
        tpot_bound = np.minimum(room, tpot_max)
        with np.errstate(divide="ignore"):
            tpot_share = np.where(tpot_bound > 0, special.ndtr((np.log(np.maximum(tpot_bound, 1e-300)) - log_tpot - level) / world.tpot_sigma), 0.0)
        density = np.exp(-(eps**2) / 2.0) / math.sqrt(2.0 * math.pi)
        total += weight * float(np.trapezoid(density * tpot_share, eps)) if eps[-1] > eps[0] else 0.0
    error_rate = world.error_rate if not canary or spec.canary_error_rate is None else spec.canary_error_rate
    return (1.0 - error_rate) * total


def goodput_boundary_spec(
    world: LatencyWorld, spec: TrialSpec, shape: StreamShape, bounds: Mapping[str, float], drop: float
) -> TrialSpec:
    """``spec`` with the canary's TTFT factor (its TPOT factor when ``bounds`` has no TTFT or E2E bound) moved
    until baseline goodput - canary goodput is exactly ``drop``."""
    field = "ttft_ratio" if ("ttft_s" in bounds or "e2e_s" in bounds) else "tpot_ratio"
    baseline = goodput_share(world, spec, shape, bounds, canary=False)

    def gap(log_factor: float) -> float:
        trial = replace(spec, **{field: math.exp(log_factor)})
        return baseline - goodput_share(world, trial, shape, bounds, canary=True) - drop

    if gap(math.log(1e3)) <= 0:
        raise ValueError(f"no canary {field} puts the goodput drop at {drop:g} (the baseline's goodput is {baseline:.3f})")
    return replace(spec, **{field: math.exp(optimize.brentq(gap, math.log(1e-3), math.log(1e3), xtol=1e-12))})


# -- speculative decoding --------------------------------------------------------------
def acceptance_rate_for_length(mean_length: float, k: int) -> float:
    """Per-position acceptance probability r with 1 + r + r^2 + ... + r^k = mean_length."""
    if not 1.0 <= mean_length <= 1.0 + k:
        raise ValueError(f"a mean acceptance length of k={k} drafts lies in [1, {1 + k}], got {mean_length}")
    if mean_length in (1.0, 1.0 + k):
        return 0.0 if mean_length == 1.0 else 1.0
    return float(optimize.brentq(lambda r: sum(r**i for i in range(1, k + 1)) - (mean_length - 1.0), 0.0, 1.0, xtol=1e-14))


def spec_decode_by_request(
    rng: np.random.Generator, n_requests: int, output_tokens: int, k: int, mean_length: float
) -> tuple[np.ndarray, np.ndarray]:
    """Every request's decode steps until its output_tokens - 1 decode tokens are out:
    (drafts per request, accepted tokens per request and draft position (n, k))."""
    r = acceptance_rate_for_length(mean_length, k)
    steps = max(output_tokens - 1, 1)
    accepted = np.cumprod(rng.random((n_requests, steps, k)) < r, axis=-1)  # position i only if all before it
    emitted = np.cumsum(1 + accepted.sum(axis=-1), axis=-1)
    drafts = np.minimum(np.argmax(emitted >= steps, axis=-1) + 1, steps)
    used = np.arange(steps)[None, :] < drafts[:, None]
    return drafts.astype(float), (accepted * used[:, :, None]).sum(axis=1).astype(float)


def _position_rates(u: np.ndarray, means: np.ndarray, concentration: float) -> np.ndarray:
    """Conditional rates per request and position: the Beta(c m, c (1 - m)) quantiles of ``u`` (0 and 1 stay put)."""
    means = np.clip(np.asarray(means, dtype=float), 0.0, 1.0)
    inner = (means > 0.0) & (means < 1.0)
    a = np.where(inner, concentration * means, 1.0)
    b = np.where(inner, concentration * (1.0 - means), 1.0)
    return np.where(inner, special.betaincinv(a, b, u), means)


def spec_decode_by_profile(
    rng: np.random.Generator, n_requests: int, output_tokens: int, conditional_means: np.ndarray, concentration: float
) -> tuple[np.ndarray, np.ndarray]:
    """Every request's verify steps until its output_tokens - 1 decode tokens are out, each request drawing its
    conditional acceptance rate at each position from a Beta around ``conditional_means``:
    (drafts per request, accepted tokens per request and draft position (n, k))."""
    k = len(conditional_means)
    rates = _position_rates(rng.random((n_requests, k)), np.asarray(conditional_means), concentration)
    steps = max(output_tokens - 1, 1)
    accepted = np.cumprod(rng.random((n_requests, steps, k)) < rates[:, None, :], axis=-1)
    emitted = np.cumsum(1 + accepted.sum(axis=-1), axis=-1)
    drafts = np.minimum(np.argmax(emitted >= steps, axis=-1) + 1, steps)
    used = np.arange(steps)[None, :] < drafts[:, None]
    return drafts.astype(float), (accepted * used[:, :, None]).sum(axis=1).astype(float)


def _expected_counts(rates: np.ndarray, decode_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(expected verify steps (m,), expected accepted per position (m, k)) of requests with conditional ``rates``
    (m, k) until ``decode_tokens`` are out: S[n] = 1 + sum_j P(A=j) S[n-1-j], the same for each position's count."""
    m, k = rates.shape
    tail = np.cumprod(rates, axis=1)  # P(A >= i), i = 1..k
    tail0 = np.column_stack([np.ones(m), tail, np.zeros(m)])
    exactly = tail0[:, :-1] - tail0[:, 1:]  # P(A = j), j = 0..k
    steps = np.zeros((decode_tokens + 1, m))
    accepted = np.zeros((decode_tokens + 1, m, k))
    for n in range(1, decode_tokens + 1):
        steps[n], accepted[n] = 1.0, tail
        for j in range(k + 1):
            if n - 1 - j > 0:
                steps[n] += exactly[:, j] * steps[n - 1 - j]
                accepted[n] += exactly[:, j, None] * accepted[n - 1 - j]
    return steps[decode_tokens], accepted[decode_tokens]


def _quantiles(k: int, draws: int, seed: int) -> np.ndarray:
    """Scrambled Sobol points in [0, 1)^k: the Beta quantiles' common random numbers (error ~1/draws, not 1/sqrt)."""
    return stats_qmc.Sobol(k, scramble=True, seed=seed).random(draws)


def _truth_of_rates(rates: np.ndarray, decode_tokens: int) -> np.ndarray:
    steps, accepted = _expected_counts(rates, decode_tokens)
    return accepted.mean(axis=0) / steps.mean()


def profile_truth(conditional_means: np.ndarray, concentration: float, output_tokens: int, draws: int = 1 << 14,
                  seed: int = 0) -> np.ndarray:
    """Per-position acceptance sum E[accepted_i] / E[verify steps] the counters of many requests converge to."""
    u = _quantiles(len(conditional_means), draws, seed)
    return _truth_of_rates(_position_rates(u, np.asarray(conditional_means), concentration), max(output_tokens - 1, 1))


def conditional_means_for_profile(target: np.ndarray, concentration: float, output_tokens: int,
                                  draws: int = 1 << 14, seed: int = 0, tolerance: float = 1e-7) -> np.ndarray:
    """The conditional means whose `profile_truth` (same draws) is ``target`` (non-increasing, in [0, 1])."""
    target = np.asarray(target, dtype=float)
    decode_tokens = max(output_tokens - 1, 1)
    u = _quantiles(target.size, draws, seed)
    means = np.append(target[:1], target[1:] / np.maximum(target[:-1], 1e-12)).clip(0.0, 1.0)
    rates = _position_rates(u, means, concentration)
    for _ in range(12):  # Gauss-Seidel: each position's mean moves its own rate most, the others' a little
        if np.max(np.abs(_truth_of_rates(rates, decode_tokens) - target)) < tolerance:
            break
        for i in range(target.size):
            if target[i] in (0.0, 1.0):
                continue

            def gap(x: float, i: int = i) -> float:
                trial = rates.copy()
                trial[:, i] = _position_rates(u[:, i], np.array(x), concentration)
                return float(_truth_of_rates(trial, decode_tokens)[i] - target[i])

            if gap(1e-9) < 0 < gap(1.0 - 1e-9):
                means[i] = optimize.brentq(gap, 1e-9, 1.0 - 1e-9, xtol=1e-12)
                rates[:, i] = _position_rates(u[:, i], means[i:i + 1], concentration)
    return means


# -- eval items ------------------------------------------------------------------------
def paired_items(
    rng: np.random.Generator, items: int, world: AccuracyWorld, spec: TrialSpec, twin: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(baseline correct, canary correct, canary diverged, twin diverged or None), one entry per item."""
    only_canary = world.discordance / 2.0
    only_baseline = world.discordance / 2.0 + spec.accuracy_drop
    both_right = world.baseline_accuracy - only_baseline
    if both_right < 0 or 1.0 - world.baseline_accuracy - only_canary < 0:
        raise ValueError("the accuracy world's cells must be non-negative")
    u = rng.random(items)
    baseline = u < world.baseline_accuracy  # both right or only baseline right
    canary = (u < both_right) | ((u >= world.baseline_accuracy) & (u < world.baseline_accuracy + only_canary))
    rate = spec.canary_divergence_rate
    if rate is None:
        rate = world.divergence_rate + spec.canary_divergence_excess
    canary_diverged = rng.random(items) < rate
    twin_diverged = rng.random(items) < world.divergence_rate if twin else None
    return baseline, canary, canary_diverged, twin_diverged
