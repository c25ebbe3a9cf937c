"""The latency gates: the TPOT p50 objective and the TTFT / E2E p95 and error-rate guardrails.

`judge_latency(baseline, canary, cfg, ...)` judges quantile ratios canary /
baseline on repeated confidence bounds intersected over the looks, and the
error-rate difference with Newcombe bounds; the guardrails' rollback side is
Holm-adjusted. `LatencySamples` is one arm's input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rollout.judge import stats
from rollout.judge.config import GatesConfig
from rollout.judge.looks import (
    CODE_TO_VERDICT,
    finite_or_none,
    holm_levels,
    interval_or_none,
    resolve_information,
    upper_is_good_verdict,
    z,
)
from rollout.judge.names import GUARDRAIL_NAMES, OBJECTIVE_NAME
from rollout.judge.verdicts import GateResult, Verdict, is_enabled

__all__ = ["LatencySamples", "judge_latency", "cumulative_bounds"]


@dataclass(frozen=True)
class LatencySamples:
    """One arm's per-request latencies so far (successful requests only).

    ``n_total`` counts every request sent, errors included. ``window``, when
    given, holds for every sample the look (1-based window number) in which it
    arrived; the judge then intersects the repeated confidence intervals of
    all looks so far, so a verdict once reached is never taken back and an
    interval never widens as data accrue.
    """

    ttft_s: np.ndarray
    tpot_s: np.ndarray
    e2e_s: np.ndarray
    n_errors: int
    n_total: int
    window: np.ndarray | None = None


# ---------------------------------------------------------------------------
# Latency (quantile ratios, error rate) -- array kernels shared with calibrate
# ---------------------------------------------------------------------------


def cumulative_bounds(
    lower_by_look: np.ndarray, upper_by_look: np.ndarray, usable_by_look: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Running intersection of repeated confidence intervals over looks (axis 0).

    Looks without enough data restrict nothing. With probability >= 1 - 2
    alpha all repeated intervals cover the truth simultaneously, so their
    intersection does too (Jennison & Turnbull 2000, sec. 9.1): verdicts
    become monotone and intervals never widen.
    """
    usable = np.asarray(usable_by_look, dtype=bool)
    lower = np.where(usable, lower_by_look, -np.inf)
    upper = np.where(usable, upper_by_look, np.inf)
    return np.maximum.accumulate(lower, axis=0), np.minimum.accumulate(upper, axis=0)


@dataclass(frozen=True)
class _QuantileLook:
    log_quantile: float
    se: float
    n: int


def _finite_positive(values: np.ndarray, window: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    values = np.asarray(values, dtype=float).ravel()
    keep = np.isfinite(values) & (values > 0)
    if window is None:
        return values[keep], None
    window = np.asarray(window).ravel()
    if window.size != values.size:
        raise ValueError(f"window ids ({window.size}) must match the samples ({values.size})")
    return values[keep], window[keep]


def _quantile_by_look(values: np.ndarray, window: np.ndarray | None, q: float, looks: Sequence[int], current: int):
    out: list[_QuantileLook | None] = []
    for lk in looks:
        subset = values if (window is None or lk >= current) else values[window <= lk]
        if subset.size < 2:
            out.append(None)
            continue
        log_q, se = stats.log_quantile_with_se(np.sort(subset), q)
        out.append(_QuantileLook(float(log_q), float(se), int(subset.size)))
    return out

@dataclass(frozen=True)
class _LookPlan:
    """Where a call sits in the sequential design, as `resolve_information` resolved it.

    ``look`` is the caller's look number (reported in every GateResult),
    ``boundary_look`` the look whose boundary applies, ``planned`` the planned
    looks, ``note`` the text appended to every detail, ``information`` the
    observed information fractions (None: equal steps over ``planned``).
    """

    look: int
    boundary_look: int
    planned: int
    note: str
    information: tuple[float, ...] | None


@dataclass(frozen=True)
class _QuantileRatioBounds:
    """One quantile ratio canary/baseline with its repeated-CI bounds (log scale) at the current look.

    ``upper`` is the pass-side bound (alpha); ``lowers`` holds the fail-side
    bound at each requested fail level (one per Holm step for guardrails).
    ``usable``: both arms have at least ``min_requests_per_arm`` samples now.
    ``dropped``: non-finite/non-positive samples removed (baseline, canary).
    """

    name: str
    metric: str
    baseline_ms: float | None
    canary_ms: float | None
    log_threshold: float
    threshold: float
    log_estimate: float
    upper: float
    lowers: tuple[float, ...]
    usable: bool
    n_baseline: int
    n_canary: int
    looks_used: int
    dropped: tuple[int, int]


@dataclass(frozen=True)
class _ErrorRateBounds:
    """Error counts of both arms and the Newcombe bounds of the rate difference canary - baseline.

    ``diff``/``upper`` are None (and ``lowers`` empty) when an arm recorded no
    requests at all; ``lowers`` holds the fail-side bound per Holm step.
    """

    usable: bool
    can_fail: bool
    nb: int
    nc: int
    eb: int
    ec: int
    diff: float | None = None
    upper: float | None = None
    lowers: tuple[float, ...] = ()


@dataclass(frozen=True)
class _HolmStep:
    """How Holm's step-down treated one guardrail: rejected or not, and the level it was last tested at."""

    rejected: bool
    level_index: int
    level: float


def _quantile_ratio_bounds(
    *,
    name: str,
    metric: str,
    q: float,
    field: str,
    baseline: LatencySamples,
    canary: LatencySamples,
    threshold: float,
    cfg: GatesConfig,
    plan: _LookPlan,
    fail_levels: Sequence[float],
) -> _QuantileRatioBounds:
    """Repeated-CI bounds for one quantile ratio, at the pass level and each fail level.

    Returns the numbers a guardrail or the objective needs: point values,
    the pass-side upper bound (alpha), the fail-side lower bound at each of
    ``fail_levels`` (Holm steps), usability flags.
    """
    boundary_look, planned, information = plan.boundary_look, plan.planned, plan.information
    b_values, b_window = _finite_positive(getattr(baseline, field), baseline.window)
    c_values, c_window = _finite_positive(getattr(canary, field), canary.window)
    use_windows = b_window is not None and c_window is not None
    looks = list(range(1, boundary_look + 1)) if use_windows else [boundary_look]
    b_looks = _quantile_by_look(b_values, b_window if use_windows else None, q, looks, boundary_look)
    c_looks = _quantile_by_look(c_values, c_window if use_windows else None, q, looks, boundary_look)

    usable = np.array(
        [
            bl is not None and cl is not None and min(bl.n, cl.n) >= cfg.min_requests_per_arm
            for bl, cl in zip(b_looks, c_looks)
        ]
    )
    nan = float("nan")
    log_b = np.array([bl.log_quantile if bl else nan for bl in b_looks])
    se_b = np.array([bl.se if bl else nan for bl in b_looks])
    log_c = np.array([cl.log_quantile if cl else nan for cl in c_looks])
    se_c = np.array([cl.se if cl else nan for cl in c_looks])

    z_pass = np.array([z(cfg.alpha, lk, planned, cfg, information) for lk in looks])
    log_ratio, _, _, upper_own = stats.log_ratio_interval(log_b, se_b, log_c, se_c, np.inf, z_pass)
    _, upper = cumulative_bounds(np.full_like(upper_own, -np.inf), upper_own, usable)

    lowers = []
    for level in fail_levels:
        z_fail = np.array([z(level, lk, planned, cfg, information) for lk in looks])
        _, _, lower_own, _ = stats.log_ratio_interval(log_b, se_b, log_c, se_c, z_fail, np.inf)
        lower, _ = cumulative_bounds(lower_own, np.full_like(lower_own, np.inf), usable)
        lowers.append(float(lower[-1]))

    current_b, current_c = b_looks[-1], c_looks[-1]
    return _QuantileRatioBounds(
        name=name,
        metric=metric,
        baseline_ms=math.exp(current_b.log_quantile) * 1e3 if current_b else None,
        canary_ms=math.exp(current_c.log_quantile) * 1e3 if current_c else None,
        log_threshold=math.log(threshold),
        threshold=threshold,
        log_estimate=float(log_ratio[-1]),
        upper=float(upper[-1]),
        lowers=tuple(lowers),
        usable=bool(usable[-1]),
        n_baseline=current_b.n if current_b else int(b_values.size),
        n_canary=current_c.n if current_c else int(c_values.size),
        looks_used=int(usable.sum()),
        dropped=(int(np.size(getattr(baseline, field)) - b_values.size), int(np.size(getattr(canary, field)) - c_values.size)),
    )


def _error_rate_bounds(
    baseline: LatencySamples, canary: LatencySamples, cfg: GatesConfig, plan: _LookPlan, fail_levels: Sequence[float]
) -> _ErrorRateBounds:
    """Newcombe bounds of the error-rate difference: upper at alpha, lower at each fail level."""
    boundary_look, planned, information = plan.boundary_look, plan.planned, plan.information
    nb, nc = int(baseline.n_total), int(canary.n_total)
    eb, ec = int(baseline.n_errors), int(canary.n_errors)
    if nb < 1 or nc < 1:
        return _ErrorRateBounds(usable=False, can_fail=False, nb=nb, nc=nc, eb=eb, ec=ec)
    z_pass = z(cfg.alpha, boundary_look, planned, cfg, information)
    diff, _, upper = stats.newcombe_difference_interval(eb, nb, ec, nc, np.inf, z_pass)
    lowers = []
    for level in fail_levels:
        _, lower, _ = stats.newcombe_difference_interval(eb, nb, ec, nc, z(level, boundary_look, planned, cfg, information), np.inf)
        lowers.append(float(lower))
    return _ErrorRateBounds(
        usable=min(nb, nc) >= cfg.min_requests_per_arm,
        # An error-rate jump can be judged with few requests (Newcombe's
        # interval keeps its coverage), so a canary that errors on everything
        # fails even before the latency gates have enough samples.
        can_fail=True,
        nb=nb,
        nc=nc,
        eb=eb,
        ec=ec,
        diff=float(diff),
        upper=float(upper),
        lowers=tuple(lowers),
    )


def _level_text(level: float) -> str:
    return f"{level:.4g}"


def _ratio_gate_result(
    bounds: _QuantileRatioBounds,
    verdict: Verdict,
    lower_log: float,
    fail_level: float,
    reason: str,
    cfg: GatesConfig,
    plan: _LookPlan,
) -> GateResult:
    """The GateResult of a quantile-ratio gate (objective or guardrail), bounds back on the ratio scale."""
    estimate = math.exp(bounds.log_estimate) if math.isfinite(bounds.log_estimate) else None
    lower = math.exp(lower_log) if not math.isnan(lower_log) else float("nan")
    upper = math.exp(bounds.upper) if not math.isnan(bounds.upper) else float("nan")
    interval = interval_or_none(lower, upper) if (math.isfinite(lower) and math.isfinite(upper) and lower <= upper) else None
    windows = f"intersected over {bounds.looks_used} look(s)" if bounds.looks_used > 1 else "this look"
    dropped = ""
    if any(bounds.dropped):
        dropped = f" Dropped non-finite/non-positive samples: baseline {bounds.dropped[0]}, canary {bounds.dropped[1]}."
    return GateResult(
        name=bounds.name,
        metric=bounds.metric,
        baseline=finite_or_none(bounds.baseline_ms),
        canary=finite_or_none(bounds.canary_ms),
        threshold=bounds.threshold,
        verdict=verdict,
        estimate=finite_or_none(estimate),
        interval=interval,
        n_baseline=bounds.n_baseline,
        n_canary=bounds.n_canary,
        look=plan.look,
        detail=(
            f"{reason} Bounds: lower at alpha {_level_text(fail_level)}, upper at alpha {_level_text(cfg.alpha)}, "
            f"look {plan.boundary_look}/{plan.planned} ({cfg.spending} spending), {windows}; latencies in ms.{dropped}{plan.note}"
        ),
    )


def _objective_result(baseline: LatencySamples, canary: LatencySamples, cfg: GatesConfig, plan: _LookPlan) -> GateResult:
    """The TPOT p50 objective: both sides at alpha, no multiplicity.

    Pass is the promote side; fail means 'does not deliver the improvement',
    not a false-alarm risk, so it needs no Holm adjustment.
    """
    alpha = cfg.alpha
    threshold = 1.0 - cfg.tpot_p50_min_improvement
    bounds = _quantile_ratio_bounds(
        name=OBJECTIVE_NAME, metric="tpot_p50_ratio", q=0.5, field="tpot_s", baseline=baseline, canary=canary,
        threshold=threshold, cfg=cfg, plan=plan, fail_levels=[alpha],
    )
    lower_log = bounds.lowers[0]
    code = int(upper_is_good_verdict(lower_log, bounds.upper, bounds.log_threshold, bounds.usable, bounds.usable))
    verdict = CODE_TO_VERDICT[code]
    if not bounds.usable:
        reason = f"Too few TPOT samples ({bounds.n_baseline}/{bounds.n_canary} < {cfg.min_requests_per_arm} per arm)."
    elif verdict is Verdict.PASS:
        reason = f"TPOT p50 ratio upper bound {math.exp(bounds.upper):.4f} < {threshold:.4g}: improvement shown."
    elif verdict is Verdict.FAIL:
        reason = f"TPOT p50 ratio lower bound {math.exp(lower_log):.4f} > {threshold:.4g}: the required improvement is absent."
    else:
        reason = f"TPOT p50 ratio interval straddles {threshold:.4g}."
    return _ratio_gate_result(bounds, verdict, lower_log, alpha, reason, cfg, plan)


def _guardrail_bounds(
    name: str, baseline: LatencySamples, canary: LatencySamples, cfg: GatesConfig, plan: _LookPlan, levels: Sequence[float]
) -> _QuantileRatioBounds | _ErrorRateBounds:
    """The bounds one guardrail is judged on, with its fail side at every Holm level."""
    if name == "ttft_p95_guard":
        return _quantile_ratio_bounds(
            name=name, metric="ttft_p95_ratio", q=0.95, field="ttft_s", baseline=baseline, canary=canary,
            threshold=cfg.ttft_p95_max_ratio, cfg=cfg, plan=plan, fail_levels=levels,
        )
    if name == "e2e_p95_guard":
        assert cfg.e2e_p95_max_ratio is not None
        return _quantile_ratio_bounds(
            name=name, metric="e2e_p95_ratio", q=0.95, field="e2e_s", baseline=baseline, canary=canary,
            threshold=cfg.e2e_p95_max_ratio, cfg=cfg, plan=plan, fail_levels=levels,
        )
    return _error_rate_bounds(baseline, canary, cfg, plan, levels)


def _holm_steps(
    bounds_by_gate: Sequence[_QuantileRatioBounds | _ErrorRateBounds], cfg: GatesConfig, levels: Sequence[float]
) -> list[_HolmStep]:
    """Holm's step-down over the guardrails' fail sides: which are rejected, and at which level each was tested."""
    m = len(bounds_by_gate)
    crossings = np.zeros((m, m), dtype=bool)
    for j, bounds in enumerate(bounds_by_gate):
        if isinstance(bounds, _ErrorRateBounds):
            if bounds.can_fail:
                crossings[j] = np.array(bounds.lowers) > cfg.error_rate_max_increase
        elif bounds.usable:
            crossings[j] = np.array(bounds.lowers) > bounds.log_threshold
    rejected = stats.holm_step_down(crossings)
    n_rejected = int(rejected.sum())
    # The level each guardrail was last tested at: the rejecting step for the
    # rejected ones, the step where Holm stopped for the others.
    level_index = {
        True: max(n_rejected - 1, 0),
        False: min(n_rejected, m - 1),
    }
    steps = []
    for j in range(m):
        index = level_index[bool(rejected[j])]
        steps.append(_HolmStep(rejected=bool(rejected[j]), level_index=index, level=levels[index]))
    return steps


def _error_rate_result(bounds: _ErrorRateBounds, step: _HolmStep, holm: str, cfg: GatesConfig, plan: _LookPlan) -> GateResult:
    """The error-rate guardrail's GateResult (``holm`` is the Holm sentence for its detail)."""
    name = "error_rate_guard"
    threshold = cfg.error_rate_max_increase
    if bounds.diff is None or bounds.upper is None:
        return GateResult(
            name=name, metric="error_rate_diff", baseline=None, canary=None, threshold=threshold,
            verdict=Verdict.INCONCLUSIVE, n_baseline=bounds.nb, n_canary=bounds.nc, look=plan.look,
            detail=f"No requests recorded in an arm.{plan.note}",
        )
    upper = bounds.upper
    passed = bounds.usable and upper < threshold
    failed = step.rejected
    verdict = Verdict.FAIL if failed else (Verdict.PASS if passed else Verdict.INCONCLUSIVE)
    lower = bounds.lowers[step.level_index]
    if failed:
        reason = f"Error-rate increase lower bound {lower:.4f} > {threshold:g}."
    elif passed:
        reason = f"Error-rate increase upper bound {upper:.4f} < {threshold:g}."
    elif not bounds.usable:
        reason = f"Too few requests ({bounds.nb}/{bounds.nc} < {cfg.min_requests_per_arm} per arm) to pass."
    else:
        reason = f"Error-rate increase interval [{lower:.4f}, {upper:.4f}] straddles {threshold:g}."
    return GateResult(
        name=name,
        metric="error_rate_diff",
        baseline=bounds.eb / bounds.nb,
        canary=bounds.ec / bounds.nc,
        threshold=threshold,
        verdict=verdict,
        estimate=bounds.diff,
        interval=interval_or_none(lower, upper) if lower <= upper else None,
        n_baseline=bounds.nb,
        n_canary=bounds.nc,
        look=plan.look,
        detail=(
            f"{reason} Errors {bounds.eb}/{bounds.nb} baseline vs {bounds.ec}/{bounds.nc} "
            f"canary; Newcombe hybrid score bounds, upper at alpha {_level_text(cfg.alpha)}, look "
            f"{plan.boundary_look}/{plan.planned}.{holm}{plan.note}"
        ),
    )


def _quantile_guardrail_result(
    bounds: _QuantileRatioBounds, step: _HolmStep, holm: str, cfg: GatesConfig, plan: _LookPlan
) -> GateResult:
    """A p95-ratio guardrail's GateResult: fail as Holm decided, pass on the upper bound at alpha."""
    upper_ok = bounds.usable and bounds.upper < bounds.log_threshold
    failed = step.rejected
    verdict = Verdict.FAIL if failed else (Verdict.PASS if upper_ok else Verdict.INCONCLUSIVE)
    lower_log = bounds.lowers[step.level_index]
    label = bounds.metric.replace("_ratio", "").replace("_", " ").upper()
    if not bounds.usable:
        reason = f"Too few samples ({bounds.n_baseline}/{bounds.n_canary} < {cfg.min_requests_per_arm} per arm)."
    elif failed:
        reason = f"{label} ratio lower bound {math.exp(lower_log):.4f} > {bounds.threshold:g}."
    elif upper_ok:
        reason = f"{label} ratio upper bound {math.exp(bounds.upper):.4f} < {bounds.threshold:g}."
    else:
        reason = f"{label} ratio interval straddles {bounds.threshold:g}."
    return _ratio_gate_result(bounds, verdict, lower_log, step.level, reason + holm, cfg, plan)


def _guardrail_results(
    guardrails: Sequence[str], baseline: LatencySamples, canary: LatencySamples, cfg: GatesConfig, plan: _LookPlan
) -> list[GateResult]:
    """The enabled guardrails' results, their rollback side Holm-adjusted across them."""
    m = len(guardrails)
    levels = holm_levels(cfg.alpha, m)
    bounds_by_gate = [_guardrail_bounds(name, baseline, canary, cfg, plan, levels) for name in guardrails]
    results = []
    for bounds, step in zip(bounds_by_gate, _holm_steps(bounds_by_gate, cfg, levels)):
        holm = f" Holm over {m} guardrail(s): rollback side tested at alpha {_level_text(step.level)}."
        if isinstance(bounds, _ErrorRateBounds):
            results.append(_error_rate_result(bounds, step, holm, cfg, plan))
        else:
            results.append(_quantile_guardrail_result(bounds, step, holm, cfg, plan))
    return results


def judge_latency(
    baseline: LatencySamples,
    canary: LatencySamples,
    cfg: GatesConfig,
    look: int = 1,
    max_looks: int | None = None,
    information: Sequence[float] | None = None,
) -> list[GateResult]:
    """Latency objective and guardrails from per-request samples.

    Gates (those enabled): ``tpot_p50_improvement`` (objective: ratio of TPOT
    p50 canary/baseline must be <= 1 - tpot_p50_min_improvement),
    ``ttft_p95_guard``, ``e2e_p95_guard`` (when configured) and
    ``error_rate_guard``. Ratios are judged on repeated confidence bounds
    (order-statistic SEs, alpha spending over ``max_looks``); the guardrails'
    rollback side is Holm-adjusted across the enabled guardrails; the promote
    side of each gate is at alpha (intersection-union). Fewer than
    ``min_requests_per_arm`` samples in an arm: inconclusive.

    ``information``, when given, holds the information fraction (requests so
    far / requests planned) of every look 1..look: alpha is then spent at
    those fractions (looks by evidence) instead of on ``max_looks`` equal steps.
    """
    boundary_look, planned, note, fractions = resolve_information(look, max_looks, cfg, information)
    plan = _LookPlan(look=look, boundary_look=boundary_look, planned=planned, note=note, information=fractions)
    results: list[GateResult] = []
    if is_enabled(OBJECTIVE_NAME, cfg):
        results.append(_objective_result(baseline, canary, cfg, plan))
    guardrails = [name for name in GUARDRAIL_NAMES if is_enabled(name, cfg)]
    if guardrails:
        results.extend(_guardrail_results(guardrails, baseline, canary, cfg, plan))
    return results
