"""Power you read before you run: each gate's detectable effect at the configured plan.

`detectable_effects(plan)` says, per enabled gate, which true effect the plan passes
and which it fails with ``power`` (80%) at its last look, at the plan's ``alpha`` and
spending; between the two, neither verdict has that power (the run most likely ends
INCONCLUSIVE there). A margin the plan cannot decide (an unchanged canary would not
pass with that power) carries a warning with the numbers and what would decide it.

Every figure is a normal approximation of the gate's own statistic at the final
look's critical value (earlier looks add a little power: the figures are slightly
conservative), under assumptions stated in each line (`PowerAssumptions`):

* accuracy_noninferiority: paired items; with no true change the arms disagree on
  ``discordance`` of them (half each way), a drop d moves d of them to 'only the
  baseline right'. Tango's bounds (the gate's) exactly over the discordant counts;
  one analysis of all items (as the accuracy phase judges): pass at z(alpha), fail
  at z(alpha * (1 - early_stop_alpha_fraction)) (the always-valid early rule adds
  power to the fail side; not counted). What a margin would need (the warning) by
  the same sums.
* tpot_p50_improvement: the gate's own bounds (``judge_latency``, drift-robust over
  the looks) on simulated A/A runs of iid lognormal requests, shifted by log(ratio)
  (the ratio of quantiles is equivariant): exact for that world, and said as the
  design effect it amounts to over the formula for independent medians,
  var(log median) = (pi / 2) sigma^2 / n per arm; dependence across looks (which the
  run measures) lowers the power further.
* error_rate_guard: Newcombe's interval (the guard's) over both arms' binomial
  counts, exactly, at a baseline rate p0, each count and n divided by a design
  effect (errors come in bursts: the guard divides by the one it measures); the
  fail side at alpha / (number of enabled guardrails), Holm's first step.
* acceptance_length_floor: the request-clustered ratio of accepted tokens to verify
  steps (rollout.judge.acceptance), each request of ``output_tokens`` with its own
  per-position rate r drawn from a Beta of concentration ``acceptance_concentration``
  whose mean puts the canary's length at the floor; the per-request variance is exact
  under that model (a recursion on the tokens left), the se taken at the true length.

Pure (numbers in, numbers out); `rollout.run.plan_power.power_plan` builds the plan
from a run config. tests/test_power.py checks each formula against a simulation.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy import optimize, special
from scipy import stats as scipy_stats

from rollout.judge import stats
from rollout.judge.config import GatesConfig
from rollout.judge.looks import t_critical
from rollout.judge.names import ACCEPTANCE_NAME, ACCURACY_NAME, GUARDRAIL_NAMES, OBJECTIVE_NAME
from rollout.judge.verdicts import is_enabled

__all__ = [
    "PowerAssumptions",
    "PowerPlan",
    "DetectableEffect",
    "detectable_effects",
    "accuracy_pass_probability",
    "accuracy_fail_probability",
    "tpot_pass_probability",
    "error_pass_probability",
    "acceptance_moments",
    "render",
]

ERROR_NAME = "error_rate_guard"


class PowerAssumptions(BaseModel):
    """What the figures assume about the world (defaults: the calibration's worlds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    power: float = Field(0.8, gt=0.5, lt=1.0)
    discordance: float = Field(0.03, gt=0.0, lt=1.0, description="share of eval items the arms disagree on with no true change")
    tpot_log_sd: float = Field(0.25, gt=0.0, description="sd of a request's log TPOT within an arm")
    tpot_design_effect: float = Field(1.0, ge=1.0, description="variance inflation of the TPOT median by dependence")
    baseline_error_rate: float = Field(0.002, ge=0.0, lt=1.0)
    error_design_effect: float = Field(1.0, ge=1.0, description="variance inflation of an arm's error count by bursts")
    acceptance_concentration: float = Field(4.0, gt=0.0, description="a + b of the Beta of per-request acceptance rates")
    objective_trials: int = Field(200, ge=0, description="simulated A/A runs through the objective's own judge (0: the formula)")
    objective_seed: int = 7


class PowerPlan(BaseModel):
    """The plan the figures are for: the gates and how much data each phase is planned to have."""

    model_config = ConfigDict(extra="forbid")

    gates: GatesConfig
    eval_items: int | None = Field(None, description="paired eval items of the accuracy phase (None: no accuracy phase)")
    requests_per_arm: int | None = Field(None, description="the experiment's planned judged requests per arm (None: none)")
    planned_looks: int = 1
    output_tokens: int | None = Field(None, description="output tokens per experiment request (ignore_eos)")
    speculative_tokens: int = Field(0, description="the canary's num_speculative_tokens")
    discordance: float | None = Field(None, gt=0.0, lt=1.0, description="the eval's no-change discordance, where the "
                                      "eval kind knows better than PowerAssumptions (None: the assumption's)")


class DetectableEffect(BaseModel):
    """One gate's detectable effects at the plan (decision.json's ``detectable_effect``)."""

    gate: str
    metric: str
    threshold: float | None
    sample: int = Field(description="items (accuracy) or requests per arm at the last look")
    passed_at: float | None = Field(description="the true effect passed with `power` (drop <=, ratio <=, increase <=, length >=)")
    failed_at: float | None = Field(description="the true effect failed with `power` (drop >=, ratio >=, increase >=, length <=)")
    power: float
    decidable: bool = Field(description="an unchanged canary (or one at the expected value) passes with `power`")
    assumptions: str
    text: str
    warning: str | None = None


# -- critical values --------------------------------------------------------------------------
def _z(level: float) -> float:
    return float(special.ndtri(1.0 - level)) if level > 0 else math.inf


def _final_z(alpha: float, looks: int, cfg: GatesConfig) -> float:
    """The last look's critical value on the planned equal grid."""
    return stats.critical_value(alpha, looks, looks, cfg.spending)


def _points(x: float) -> str:
    return f"{100 * x:.2g}" if abs(100 * x) < 10 else f"{100 * x:.3g}"


# -- accuracy (paired non-inferiority) ---------------------------------------------------------
def _paired_bound_probability(drop: float, items: int, margin: float, discordance: float, z_value: float,
                              side: str) -> float:
    """P(Tango's upper bound of the drop < margin) (side "pass") or P(its lower bound > margin) (side "fail") at a
    true drop, exactly over the discordant counts (n12 only the baseline right, n21 only the canary)."""
    p12, p21 = discordance / 2 + drop, discordance / 2
    n12, pmf12 = _support(items, min(max(p12, 0.0), 1.0))
    conditional = p21 / (1.0 - p12) if p12 < 1 else 0.0
    lo = int(max(scipy_stats.binom.ppf(1e-9, items, p21) - 5, 0))
    hi = int(min(scipy_stats.binom.isf(1e-9, items, p21) + 5, items))
    n21 = np.arange(lo, hi + 1)
    grid12, grid21 = np.meshgrid(n12, n21, indexing="ij")
    pmf = pmf12[:, None] * scipy_stats.binom.pmf(grid21, items - grid12, conditional)
    if side == "pass":
        _, upper = stats.tango_interval(grid12, grid21, items, math.inf, z_value)
        hit = upper < margin
    else:
        lower, _ = stats.tango_interval(grid12, grid21, items, z_value, math.inf)
        hit = lower > margin
    return float(np.sum(pmf * hit))


def accuracy_pass_probability(drop: float, items: int, margin: float, discordance: float, z_pass: float) -> float:
    """P(upper bound of the drop < margin) at a true drop (Tango's bound, exact over the counts)."""
    return _paired_bound_probability(drop, items, margin, discordance, z_pass, "pass")


def accuracy_fail_probability(drop: float, items: int, margin: float, discordance: float, z_fail: float) -> float:
    """P(lower bound of the drop > margin) at a true drop (the always-valid early rule not counted: it adds power)."""
    return _paired_bound_probability(drop, items, margin, discordance, z_fail, "fail")


def _items_to_pass(margin: float, q: float, z_pass: float, power: float, start: int) -> int | None:
    """About how many items an unchanged canary needs to pass with ``power`` (doubling, then bisection: the
    exact probability is close to monotone in the items); None past a million."""
    lo, hi = start, start
    while accuracy_pass_probability(0.0, hi, margin, q, z_pass) < power:
        lo, hi = hi, hi * 2
        if hi > 1_000_000:
            return None
    while hi - lo > max(1, lo // 100):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if accuracy_pass_probability(0.0, mid, margin, q, z_pass) < power else (lo, mid)
    return hi


def _accuracy(plan: PowerPlan, a: PowerAssumptions) -> DetectableEffect:
    q = plan.discordance if plan.discordance is not None else a.discordance
    cfg, n, margin = plan.gates, int(plan.eval_items or 0), plan.gates.accuracy_margin
    z_pass = _z(cfg.alpha)
    z_fail = _z(cfg.alpha * (1.0 - cfg.early_stop_alpha_fraction))
    hi = 1.0 - q / 2  # a drop cannot exceed the items the baseline alone can get right
    reachable = accuracy_fail_probability(hi, n, margin, q, z_fail) >= a.power
    fail_at = optimize.brentq(lambda d: accuracy_fail_probability(d, n, margin, q, z_fail) - a.power, margin, hi) if reachable else None
    decidable = accuracy_pass_probability(0.0, n, margin, q, z_pass) >= a.power
    pass_at = (optimize.brentq(lambda d: accuracy_pass_probability(d, n, margin, q, z_pass) - a.power, -margin, margin)
               if decidable else None)
    assumptions = (f"{n:,} paired items, the arms disagreeing on {_points(q)}% of them with no true change; one analysis "
                   f"at alpha {cfg.alpha:g} (pass) / {cfg.alpha * (1 - cfg.early_stop_alpha_fraction):.3g} (fail)")
    text = (f"accuracy: a drop of >= {_points(fail_at)} points is failed with {a.power:.0%} power at {n:,} items"
            if fail_at is not None else f"accuracy: no drop is failed with {a.power:.0%} power at {n:,} items")
    warning = None
    if decidable:
        text += (f"; a drop of <= {_points(pass_at)} points is passed with {a.power:.0%} power; drops between are not "
                 f"decidable at margin {margin:g}")
    else:
        needed_margin = optimize.brentq(lambda m: accuracy_pass_probability(0.0, n, m, q, z_pass) - a.power, margin, 1.0,
                                        xtol=1e-4)
        needed_items = _items_to_pass(margin, q, z_pass, a.power, max(n, 1)) if margin > 0 else None
        unchanged = accuracy_pass_probability(0.0, n, margin, q, z_pass)
        text += (f"; no smaller drop is decidable at margin {margin:g}: even an unchanged canary passes only "
                 f"{unchanged:.0%} of runs")
        warning = (f"accuracy_margin {margin:g} is below what {n:,} items can decide: an unchanged canary passes "
                   f"{unchanged:.0%} of runs (not {a.power:.0%}); {a.power:.0%} needs a margin >= {needed_margin:.3g}"
                   + (f" or >= {needed_items:,} items" if needed_items else "")
                   + f" (assuming {_points(q)}% discordant items)")
    return DetectableEffect(gate=ACCURACY_NAME, metric="accuracy_diff", threshold=margin, sample=n, passed_at=pass_at,
                            failed_at=fail_at, power=a.power, decidable=decidable, assumptions=assumptions,
                            text=text + f" ({assumptions})", warning=warning)


# -- the TPOT p50 objective ----------------------------------------------------------------------
def _tpot_se(n: int, a: PowerAssumptions) -> float:
    """sd of the log ratio of the arms' medians: (pi/2) sigma^2 / n per arm, times the design effect."""
    return math.sqrt(a.tpot_design_effect * math.pi / 2 * a.tpot_log_sd**2 * 2 / n)


def tpot_pass_probability(ratio: float, n: int, bar: float, z_pass: float, a: PowerAssumptions) -> float:
    """P(upper bound of the TPOT p50 ratio < bar) at a true ratio (the formula: iid medians x design effect)."""
    return float(special.ndtr((math.log(bar) - math.log(ratio)) / _tpot_se(n, a) - z_pass))


def objective_null_bounds(n: int, looks: int, cfg: GatesConfig, a: PowerAssumptions) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) log bounds of the TPOT p50 ratio the gate itself (``judge_latency``) gives at its last look
    on ``a.objective_trials`` simulated A/A runs: iid lognormal TPOT of log-sd ``a.tpot_log_sd``, equal looks.

    The bounds shift by exactly log(ratio) when the canary's latencies are scaled by a ratio (the
    ratio of quantiles is equivariant), so these give P(PASS) and P(FAIL) at every true ratio."""
    from rollout.judge.latency import LatencySamples, judge_latency  # the gate's own statistics

    only = cfg.model_copy(update={"enabled": [OBJECTIVE_NAME], "disabled": []})
    per_look = max(n // looks, 1)
    window = np.repeat(np.arange(1, looks + 1), per_look)
    fractions = [(i + 1) / looks for i in range(looks)]
    rng = np.random.default_rng(a.objective_seed)
    lowers, uppers = [], []
    for _ in range(a.objective_trials):
        arms = []
        for _arm in range(2):
            tpot = np.exp(rng.normal(0.0, a.tpot_log_sd, window.size))
            arms.append(LatencySamples(ttft_s=np.ones(window.size), tpot_s=tpot, e2e_s=tpot + 1.0, n_errors=0,
                                       n_total=window.size, window=window))
        gate = judge_latency(arms[0], arms[1], only, look=looks, max_looks=looks, information=fractions)[0]
        lower, upper = gate.interval if gate.interval is not None else (0.0, math.inf)
        lowers.append(math.log(lower) if lower > 0 else -math.inf)
        uppers.append(math.log(upper) if math.isfinite(upper) else math.inf)
    return np.array(lowers), np.array(uppers)


def _objective(plan: PowerPlan, a: PowerAssumptions) -> DetectableEffect:
    cfg, n, looks = plan.gates, int(plan.requests_per_arm or 0), plan.planned_looks
    bar = 1.0 - cfg.tpot_p50_min_improvement
    z_final, zb = _final_z(cfg.alpha, looks, cfg), _z(1.0 - a.power)
    if a.objective_trials > 0:
        lowers, uppers = objective_null_bounds(n, looks, cfg, a)
        # PASS at a true ratio rho: upper + log(rho) < log(bar); FAIL: lower + log(rho) > log(bar)
        # a run with too few requests to judge has no bound: then no ratio is passed (or failed) with that power
        with np.errstate(over="ignore"):
            pass_at = bar * math.exp(-float(np.quantile(uppers, a.power)))
            fail_at = bar * math.exp(-float(np.quantile(lowers, 1.0 - a.power)))
        iid = (z_final + zb) * _tpot_se(n, a.model_copy(update={"tpot_design_effect": 1.0}))
        equivalent = (math.log(bar / pass_at) / iid) ** 2 if math.isfinite(pass_at) and pass_at > 0 else math.inf
        how = (f"the gate's own bounds on {a.objective_trials} simulated A/A runs of iid requests (per-request log-TPOT "
               f"sd {a.tpot_log_sd:g}): a design effect of {equivalent:.2g} over independent medians at z={z_final:.3f}; "
               "dependence across looks lowers it further")
    else:
        se = _tpot_se(n, a)
        pass_at, fail_at = bar * math.exp(-(z_final + zb) * se), bar * math.exp((z_final + zb) * se)
        how = (f"independent medians, per-request log-TPOT sd {a.tpot_log_sd:g}, design effect "
               f"{a.tpot_design_effect:g}, last look at z={z_final:.3f}")
    assumptions = f"{n:,} requests per arm over {looks} looks ({cfg.spending}, alpha {cfg.alpha:g}); {how}"
    if not (0.0 < pass_at and math.isfinite(fail_at)):
        return DetectableEffect(gate=OBJECTIVE_NAME, metric="tpot_p50_ratio", threshold=bar, sample=n, passed_at=None,
                                failed_at=None, power=a.power, decidable=False, assumptions=assumptions,
                                text=f"TPOT p50: the plan's requests decide no ratio with {a.power:.0%} power ({assumptions})",
                                warning=f"{n:,} requests per arm are too few for the TPOT p50 objective to pass or fail")
    text = (f"TPOT p50: a ratio canary/baseline <= {pass_at:.3f} ({(1 - pass_at):.1%} faster) is passed with "
            f"{a.power:.0%} power at bar {bar:.3g}; >= {fail_at:.3f} is failed with {a.power:.0%} power; between, "
            f"not decidable ({assumptions})")
    return DetectableEffect(gate=OBJECTIVE_NAME, metric="tpot_p50_ratio", threshold=bar, sample=n, passed_at=pass_at,
                            failed_at=fail_at, power=a.power, decidable=True, assumptions=assumptions, text=text)


# -- the error-rate guardrail --------------------------------------------------------------------
def _support(n: int, p: float) -> tuple[np.ndarray, np.ndarray]:
    """The counts of Binomial(n, p) outside 1e-9 tails and their probabilities."""
    lo, hi = scipy_stats.binom.ppf(1e-9, n, p), scipy_stats.binom.isf(1e-9, n, p)
    k = np.arange(int(max(lo, 0)), int(min(hi, n)) + 1)
    return k, scipy_stats.binom.pmf(k, n, p)


def _error_bound_probability(increase: float, n: int, threshold: float, p0: float, z_value: float, deff: float,
                             side: str) -> float:
    """P(Newcombe's upper bound < threshold) (side "pass") or P(its lower bound > threshold) (side "fail") at a
    true increase, exactly over both arms' binomial counts, each count and n divided by the design effect."""
    p1 = min(max(p0 + increase, 0.0), 1.0)
    kb, pb = _support(n, p0)
    kc, pc = _support(n, p1)
    grid_b, grid_c = np.meshgrid(kb / deff, kc / deff, indexing="ij")
    _, lower, upper = stats.newcombe_difference_interval(grid_b, n / deff, grid_c, n / deff, z_value, z_value)
    hit = (np.asarray(upper) < threshold) if side == "pass" else (np.asarray(lower) > threshold)
    return float(pb @ hit.astype(float) @ pc)


def error_pass_probability(increase: float, n: int, margin: float, p0: float, z_pass: float, deff: float = 1.0) -> float:
    """P(upper bound of canary - baseline error rate < margin) at a true increase (Newcombe, exact over the counts)."""
    return _error_bound_probability(increase, n, margin, p0, z_pass, deff, "pass")


def _error_rate(plan: PowerPlan, a: PowerAssumptions) -> DetectableEffect:
    cfg, n, looks, p0 = plan.gates, int(plan.requests_per_arm or 0), plan.planned_looks, a.baseline_error_rate
    margin, deff = cfg.error_rate_max_increase, a.error_design_effect
    guardrails = max(sum(is_enabled(g, cfg) for g in GUARDRAIL_NAMES), 1)
    z_pass = _final_z(cfg.alpha, looks, cfg)
    z_fail = _final_z(cfg.alpha / guardrails, looks, cfg)

    def fail_probability(increase: float) -> float:
        return _error_bound_probability(increase, n, margin, p0, z_fail, deff, "fail")

    fail_at = optimize.brentq(lambda d: fail_probability(d) - a.power, margin, 1.0 - p0) if fail_probability(1.0 - p0) > a.power else None
    unchanged = error_pass_probability(0.0, n, margin, p0, z_pass, deff)
    decidable = unchanged >= a.power
    pass_at = (optimize.brentq(lambda d: error_pass_probability(d, n, margin, p0, z_pass, deff) - a.power, 0.0, margin)
               if decidable else None)
    assumptions = (f"{n:,} requests per arm, baseline error rate {_points(p0)}%, design effect {deff:g}; last look at "
                   f"z={z_pass:.3f} (pass) / {z_fail:.3f} (fail, Holm over {guardrails} guardrails)")
    text = "error rate: "
    warning = None
    if decidable:
        text += f"an increase of <= {_points(pass_at)} points is passed with {a.power:.0%} power"
    else:
        needed = optimize.brentq(lambda m: error_pass_probability(0.0, n, m, p0, z_pass, deff) - a.power, margin, 1.0,
                                 xtol=1e-5)
        text += f"even an unchanged canary passes only {unchanged:.0%} of runs at max increase {margin:g}"
        warning = (f"error_rate_max_increase {margin:g} is below what {n:,} requests per arm can decide: an unchanged "
                   f"canary passes {unchanged:.0%} of runs (not {a.power:.0%}); {a.power:.0%} needs >= {needed:.3g} "
                   f"(baseline error rate {_points(p0)}%, design effect {deff:g})")
    if fail_at is not None:
        text += f"; >= {_points(fail_at)} points is failed with {a.power:.0%} power"
    return DetectableEffect(gate=ERROR_NAME, metric="error_rate_diff", threshold=margin, sample=n, passed_at=pass_at,
                            failed_at=fail_at, power=a.power, decidable=decidable, assumptions=assumptions,
                            text=f"{text} ({assumptions})", warning=warning)


# -- the acceptance-length floor -----------------------------------------------------------------
@lru_cache(maxsize=64)
def _beta_grid(mean: float, concentration: float, points: int = 401) -> tuple[np.ndarray, np.ndarray]:
    r = np.linspace(0.0, 1.0, points + 2)[1:-1]
    weight = scipy_stats.beta.pdf(r, concentration * mean, concentration * (1 - mean))
    return r, weight / weight.sum()


def _step_probabilities(r: np.ndarray, k: int) -> np.ndarray:
    """P(a verify step accepts j of k drafts), j = 0..k, per rate r (position i only after i - 1)."""
    return np.stack([r**j * (1 - r) for j in range(k)] + [r**k], axis=1)


def _first_moments(r: np.ndarray, k: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(E[verify steps], E[accepted tokens]) of a request emitting ``tokens`` decode tokens, per rate."""
    p = _step_probabilities(r, k)
    accepted_per_step = p @ np.arange(k + 1)
    steps = np.zeros((tokens + 1, r.size))
    accepted = np.zeros((tokens + 1, r.size))
    for n in range(1, tokens + 1):
        steps[n], accepted[n] = 1.0, accepted_per_step
        for j in range(k + 1):
            if n - 1 - j > 0:
                steps[n] += p[:, j] * steps[n - 1 - j]
                accepted[n] += p[:, j] * accepted[n - 1 - j]
    return steps[tokens], accepted[tokens]


def acceptance_moments(mean_rate: float, concentration: float, k: int, tokens: int) -> tuple[float, float, float]:
    """(true length 1 + R, E[steps per request], sd per request of accepted - R * steps) when each request's rate
    is Beta(mean_rate, concentration) and each emits ``tokens`` decode tokens (exact under the model)."""
    r, w = _beta_grid(round(mean_rate, 10), concentration)
    steps, accepted = _first_moments(r, k, tokens)
    ratio = float(w @ accepted) / float(w @ steps)
    p = _step_probabilities(r, k)
    first = np.zeros((tokens + 1, r.size))  # E[X(n)], X = accepted - ratio * steps over the request's steps
    second = np.zeros((tokens + 1, r.size))
    for n in range(1, tokens + 1):
        for j in range(k + 1):
            rest = n - 1 - j
            step = j - ratio
            f, s = (first[rest], second[rest]) if rest > 0 else (0.0, 0.0)
            first[n] += p[:, j] * (step + f)
            second[n] += p[:, j] * (step * step + 2 * step * f + s)
    return 1.0 + ratio, float(w @ steps), math.sqrt(max(float(w @ second[tokens]), 0.0))


@lru_cache(maxsize=512)
def _length_of(mean_rate: float, concentration: float, k: int, tokens: int) -> float:
    """The true mean length 1 + E[accepted] / E[steps] when the requests' rates are Beta(mean_rate, concentration)."""
    r, w = _beta_grid(round(mean_rate, 10), concentration)
    steps, accepted = _first_moments(r, k, tokens)
    return 1.0 + float(w @ accepted) / float(w @ steps)


def _rate_for_length(length: float, concentration: float, k: int, tokens: int) -> float | None:
    def gap(m: float) -> float:
        return _length_of(m, concentration, k, tokens) - length

    lo, hi = 1e-3, 1 - 1e-3
    if gap(lo) > 0 or gap(hi) < 0:
        return None
    return float(optimize.brentq(gap, lo, hi, xtol=1e-6))


def _acceptance(plan: PowerPlan, a: PowerAssumptions) -> DetectableEffect | None:
    cfg, n, looks, k = plan.gates, int(plan.requests_per_arm or 0), plan.planned_looks, plan.speculative_tokens
    floor = cfg.min_acceptance_length
    tokens = max(int(plan.output_tokens or 0) - 1, 1)
    if floor is None or k <= 0 or n < 2:
        return None
    rate = _rate_for_length(floor, a.acceptance_concentration, k, tokens)
    assumptions = (f"{n:,} canary requests of {tokens + 1} output tokens, k={k}, each request's acceptance rate "
                   f"Beta-distributed (concentration {a.acceptance_concentration:g}); request-clustered se at each length")
    if rate is None:
        return DetectableEffect(gate=ACCEPTANCE_NAME, metric="mean_acceptance_length", threshold=floor, sample=n,
                                passed_at=None, failed_at=None, power=a.power, decidable=False, assumptions=assumptions,
                                text=f"acceptance: floor {floor:g} is outside what k={k} drafts can reach",
                                warning=f"min_acceptance_length {floor:g} is outside [1, {1 + k}] for k={k}")
    crit = t_critical(_final_z(cfg.alpha, looks, cfg), n - 1)
    zb = _z(1.0 - a.power)

    def se_at(length: float) -> float:  # the request-clustered se of the ratio when the true length is `length`
        m = _rate_for_length(length, a.acceptance_concentration, k, tokens)
        if m is None:
            return math.inf
        _, steps, sd = acceptance_moments(m, a.acceptance_concentration, k, tokens)
        return sd / (math.sqrt(n) * steps)

    se = se_at(floor)

    def at(sign: float) -> float | None:
        """The true length whose distance from the floor is (crit + z_power) of its own se: the se moves
        slowly with the length, so two steps of the fixed point settle it (to well under 1% of the se)."""
        length = floor + sign * (crit + zb) * se
        for _ in range(2):
            step = se_at(length)
            if not math.isfinite(step):
                return None
            length = floor + sign * (crit + zb) * step
        return length if _rate_for_length(length, a.acceptance_concentration, k, tokens) is not None else None

    pass_at, fail_at = at(+1.0), at(-1.0)
    shown = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    text = (f"acceptance: a true mean length >= {shown(pass_at)} is passed with {a.power:.0%} power at floor {floor:g}, "
            f"<= {shown(fail_at)} failed ({assumptions}; se {se:.4f} at the floor)")
    return DetectableEffect(gate=ACCEPTANCE_NAME, metric="mean_acceptance_length", threshold=floor, sample=n,
                            passed_at=pass_at, failed_at=fail_at, power=a.power, decidable=True,
                            assumptions=assumptions, text=text)


# -- the plan ------------------------------------------------------------------------------------
def detectable_effects(plan: PowerPlan, assumptions: PowerAssumptions | None = None) -> list[DetectableEffect]:
    """Every enabled gate's detectable effects that the plan has data for (accuracy items, experiment requests)."""
    a = assumptions or PowerAssumptions()
    cfg = plan.gates
    out: list[DetectableEffect] = []
    if plan.eval_items and is_enabled(ACCURACY_NAME, cfg):
        out.append(_accuracy(plan, a))
    if plan.requests_per_arm:
        if is_enabled(OBJECTIVE_NAME, cfg):
            out.append(_objective(plan, a))
        if is_enabled(ERROR_NAME, cfg):
            out.append(_error_rate(plan, a))
        if is_enabled(ACCEPTANCE_NAME, cfg):
            effect = _acceptance(plan, a)
            if effect is not None:
                out.append(effect)
    return out


def render(effects: list[DetectableEffect], prefix: str = "power: ") -> list[str]:
    """One line per gate, then one WARNING line per margin the plan cannot decide."""
    lines = [prefix + e.text for e in effects]
    lines += [f"{prefix}WARNING: {e.warning}" for e in effects if e.warning]
    return lines
