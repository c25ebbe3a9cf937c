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
from rollout.judge.verdicts import GUARDRAIL_NAMES, OBJECTIVE_NAME, GateResult, Verdict, is_enabled

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


def _quantile_ratio_gate(
    *,
    name: str,
    metric: str,
    q: float,
    field: str,
    baseline: LatencySamples,
    canary: LatencySamples,
    threshold: float,
    cfg: GatesConfig,
    look: int,
    boundary_look: int,
    planned: int,
    fail_levels: Sequence[float],
    information: Sequence[float] | None = None,
) -> dict:
    """Repeated-CI bounds for one quantile ratio, at the pass level and each fail level.

    Returns the numbers a guardrail or the objective needs: point values,
    the pass-side upper bound (alpha), the fail-side lower bound at each of
    ``fail_levels`` (Holm steps), usability flags.
    """
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
    return dict(
        name=name,
        metric=metric,
        baseline_ms=math.exp(current_b.log_quantile) * 1e3 if current_b else None,
        canary_ms=math.exp(current_c.log_quantile) * 1e3 if current_c else None,
        log_threshold=math.log(threshold),
        threshold=threshold,
        log_estimate=float(log_ratio[-1]),
        upper=float(upper[-1]),
        lowers=lowers,
        usable=bool(usable[-1]),
        n_baseline=current_b.n if current_b else int(b_values.size),
        n_canary=current_c.n if current_c else int(c_values.size),
        looks_used=int(usable.sum()),
        dropped=(int(np.size(getattr(baseline, field)) - b_values.size), int(np.size(getattr(canary, field)) - c_values.size)),
    )


def _error_rate_numbers(
    baseline: LatencySamples, canary: LatencySamples, cfg: GatesConfig, boundary_look: int, planned: int,
    fail_levels: Sequence[float], information: Sequence[float] | None = None,
) -> dict:
    nb, nc = int(baseline.n_total), int(canary.n_total)
    eb, ec = int(baseline.n_errors), int(canary.n_errors)
    if nb < 1 or nc < 1:
        return dict(usable=False, can_fail=False, nb=nb, nc=nc, eb=eb, ec=ec)
    z_pass = z(cfg.alpha, boundary_look, planned, cfg, information)
    diff, _, upper = stats.newcombe_difference_interval(eb, nb, ec, nc, np.inf, z_pass)
    lowers = []
    for level in fail_levels:
        _, lower, _ = stats.newcombe_difference_interval(eb, nb, ec, nc, z(level, boundary_look, planned, cfg, information), np.inf)
        lowers.append(float(lower))
    return dict(
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
        lowers=lowers,
    )


def _level_text(level: float) -> str:
    return f"{level:.4g}"


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
    boundary_look, planned, note, information = resolve_information(look, max_looks, cfg, information)
    results: list[GateResult] = []
    alpha = cfg.alpha

    def ratio_result(numbers: dict, verdict: Verdict, lower_log: float, fail_level: float, reason: str) -> GateResult:
        estimate = math.exp(numbers["log_estimate"]) if math.isfinite(numbers["log_estimate"]) else None
        lower = math.exp(lower_log) if not math.isnan(lower_log) else float("nan")
        upper = math.exp(numbers["upper"]) if not math.isnan(numbers["upper"]) else float("nan")
        interval = interval_or_none(lower, upper) if (math.isfinite(lower) and math.isfinite(upper) and lower <= upper) else None
        windows = f"intersected over {numbers['looks_used']} look(s)" if numbers["looks_used"] > 1 else "this look"
        dropped = ""
        if any(numbers["dropped"]):
            dropped = f" Dropped non-finite/non-positive samples: baseline {numbers['dropped'][0]}, canary {numbers['dropped'][1]}."
        return GateResult(
            name=numbers["name"],
            metric=numbers["metric"],
            baseline=finite_or_none(numbers["baseline_ms"]),
            canary=finite_or_none(numbers["canary_ms"]),
            threshold=numbers["threshold"],
            verdict=verdict,
            estimate=finite_or_none(estimate),
            interval=interval,
            n_baseline=numbers["n_baseline"],
            n_canary=numbers["n_canary"],
            look=look,
            detail=(
                f"{reason} Bounds: lower at alpha {_level_text(fail_level)}, upper at alpha {_level_text(alpha)}, "
                f"look {boundary_look}/{planned} ({cfg.spending} spending), {windows}; latencies in ms.{dropped}{note}"
            ),
        )

    # Objective: both sides at alpha, no multiplicity (pass is the promote side,
    # fail means 'does not deliver the improvement', not a false alarm risk).
    if is_enabled(OBJECTIVE_NAME, cfg):
        threshold = 1.0 - cfg.tpot_p50_min_improvement
        numbers = _quantile_ratio_gate(
            name=OBJECTIVE_NAME, metric="tpot_p50_ratio", q=0.5, field="tpot_s", baseline=baseline, canary=canary,
            threshold=threshold, cfg=cfg, look=look, boundary_look=boundary_look, planned=planned, information=information, fail_levels=[alpha],
        )
        code = int(upper_is_good_verdict(numbers["lowers"][0], numbers["upper"], numbers["log_threshold"], numbers["usable"], numbers["usable"]))
        verdict = CODE_TO_VERDICT[code]
        if not numbers["usable"]:
            reason = f"Too few TPOT samples ({numbers['n_baseline']}/{numbers['n_canary']} < {cfg.min_requests_per_arm} per arm)."
        elif verdict is Verdict.PASS:
            reason = f"TPOT p50 ratio upper bound {math.exp(numbers['upper']):.4f} < {threshold:.4g}: improvement shown."
        elif verdict is Verdict.FAIL:
            reason = f"TPOT p50 ratio lower bound {math.exp(numbers['lowers'][0]):.4f} > {threshold:.4g}: the required improvement is absent."
        else:
            reason = f"TPOT p50 ratio interval straddles {threshold:.4g}."
        results.append(ratio_result(numbers, verdict, numbers["lowers"][0], alpha, reason))

    guardrails = [name for name in GUARDRAIL_NAMES if is_enabled(name, cfg)]
    m = len(guardrails)
    if m == 0:
        return results
    levels = holm_levels(alpha, m)
    numbers_by_gate: dict[str, dict] = {}
    for name in guardrails:
        if name == "ttft_p95_guard":
            numbers_by_gate[name] = _quantile_ratio_gate(
                name=name, metric="ttft_p95_ratio", q=0.95, field="ttft_s", baseline=baseline, canary=canary,
                threshold=cfg.ttft_p95_max_ratio, cfg=cfg, look=look, boundary_look=boundary_look, planned=planned, information=information,
                fail_levels=levels,
            )
        elif name == "e2e_p95_guard":
            assert cfg.e2e_p95_max_ratio is not None
            numbers_by_gate[name] = _quantile_ratio_gate(
                name=name, metric="e2e_p95_ratio", q=0.95, field="e2e_s", baseline=baseline, canary=canary,
                threshold=cfg.e2e_p95_max_ratio, cfg=cfg, look=look, boundary_look=boundary_look, planned=planned, information=information,
                fail_levels=levels,
            )
        else:
            numbers_by_gate[name] = _error_rate_numbers(baseline, canary, cfg, boundary_look, planned, levels, information)

    crossings = np.zeros((m, m), dtype=bool)
    for j, name in enumerate(guardrails):
        numbers = numbers_by_gate[name]
        if name == "error_rate_guard":
            if numbers["can_fail"]:
                crossings[j] = np.array(numbers["lowers"]) > cfg.error_rate_max_increase
        elif numbers["usable"]:
            crossings[j] = np.array(numbers["lowers"]) > numbers["log_threshold"]
    rejected = stats.holm_step_down(crossings)
    n_rejected = int(rejected.sum())
    # The level each guardrail was last tested at: the rejecting step for the
    # rejected ones, the step where Holm stopped for the others.
    level_index = {
        True: max(n_rejected - 1, 0),
        False: min(n_rejected, m - 1),
    }

    for j, name in enumerate(guardrails):
        numbers = numbers_by_gate[name]
        step = level_index[bool(rejected[j])]
        fail_level = levels[step]
        holm = f" Holm over {m} guardrail(s): rollback side tested at alpha {_level_text(fail_level)}."
        if name == "error_rate_guard":
            threshold = cfg.error_rate_max_increase
            if "diff" not in numbers:
                results.append(
                    GateResult(
                        name=name, metric="error_rate_diff", baseline=None, canary=None, threshold=threshold,
                        verdict=Verdict.INCONCLUSIVE, n_baseline=numbers["nb"], n_canary=numbers["nc"], look=look,
                        detail=f"No requests recorded in an arm.{note}",
                    )
                )
                continue
            passed = numbers["usable"] and numbers["upper"] < threshold
            failed = bool(rejected[j])
            verdict = Verdict.FAIL if failed else (Verdict.PASS if passed else Verdict.INCONCLUSIVE)
            lower = numbers["lowers"][step]
            if failed:
                reason = f"Error-rate increase lower bound {lower:.4f} > {threshold:g}."
            elif passed:
                reason = f"Error-rate increase upper bound {numbers['upper']:.4f} < {threshold:g}."
            elif not numbers["usable"]:
                reason = f"Too few requests ({numbers['nb']}/{numbers['nc']} < {cfg.min_requests_per_arm} per arm) to pass."
            else:
                reason = f"Error-rate increase interval [{lower:.4f}, {numbers['upper']:.4f}] straddles {threshold:g}."
            results.append(
                GateResult(
                    name=name,
                    metric="error_rate_diff",
                    baseline=numbers["eb"] / numbers["nb"],
                    canary=numbers["ec"] / numbers["nc"],
                    threshold=threshold,
                    verdict=verdict,
                    estimate=numbers["diff"],
                    interval=interval_or_none(lower, numbers["upper"]) if lower <= numbers["upper"] else None,
                    n_baseline=numbers["nb"],
                    n_canary=numbers["nc"],
                    look=look,
                    detail=(
                        f"{reason} Errors {numbers['eb']}/{numbers['nb']} baseline vs {numbers['ec']}/{numbers['nc']} "
                        f"canary; Newcombe hybrid score bounds, upper at alpha {_level_text(alpha)}, look "
                        f"{boundary_look}/{planned}.{holm}{note}"
                    ),
                )
            )
            continue

        upper_ok = numbers["usable"] and numbers["upper"] < numbers["log_threshold"]
        failed = bool(rejected[j])
        verdict = Verdict.FAIL if failed else (Verdict.PASS if upper_ok else Verdict.INCONCLUSIVE)
        lower_log = numbers["lowers"][step]
        label = numbers["metric"].replace("_ratio", "").replace("_", " ").upper()
        if not numbers["usable"]:
            reason = f"Too few samples ({numbers['n_baseline']}/{numbers['n_canary']} < {cfg.min_requests_per_arm} per arm)."
        elif failed:
            reason = f"{label} ratio lower bound {math.exp(lower_log):.4f} > {numbers['threshold']:g}."
        elif upper_ok:
            reason = f"{label} ratio upper bound {math.exp(numbers['upper']):.4f} < {numbers['threshold']:g}."
        else:
            reason = f"{label} ratio interval straddles {numbers['threshold']:g}."
        results.append(ratio_result(numbers, verdict, lower_log, fail_level, reason + holm))
    return results
