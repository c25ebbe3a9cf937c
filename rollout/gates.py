"""Gate configuration and the judge: (baseline data, canary data, config) -> verdicts.

Kayenta's rule, kept strictly: the judge is a pure function of numbers, with
no I/O, no clocks and no state. The controller calls it after every window
(look k of ``max_looks`` planned looks) with everything measured so far, and
stops when ``is_final`` says so. The statistics live in ``rollout.stats``;
this module turns their intervals into verdicts:

* PASS      the confidence bound on the good side clears the threshold;
* FAIL      the bound on the bad side is past the threshold (or an
            always-valid early-stop rule fired);
* INCONCLUSIVE otherwise, and always when data is missing or too scarce.
  Missing data is never a pass.

Error control, in one place
---------------------------
Every interval is a repeated confidence interval over the planned looks
(alpha spending, see ``rollout.stats``). The promote side of every gate is
tested at ``alpha``: PROMOTE needs *all* gates to pass, an intersection-union
test, so the false-promote rate is <= alpha without any multiplicity
correction (Berger 1982, "Multiparameter hypothesis testing and acceptance
sampling", Technometrics 24:295-300). The rollback side of the latency
guardrails is Holm-adjusted across the enabled guardrails, so adding a
guardrail does not multiply false rollbacks. The accuracy gate splits its
rollback-side alpha between the planned-look test and the always-valid
clear-regression rule (Bonferroni).

Directions: every latency ratio is canary / baseline (below 1 = canary
faster); the accuracy difference is baseline - canary (above 0 = canary
worse); error and divergence differences are canary - reference. Swapping the
arms mirrors every estimate and interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Literal

import numpy as np
import pydantic
from pydantic import Field

from rollout import stats

__all__ = [
    "GATE_NAMES",
    "GUARDRAIL_NAMES",
    "Verdict",
    "Decision",
    "GatesConfig",
    "GateResult",
    "LatencySamples",
    "judge_accuracy",
    "judge_divergence",
    "judge_latency",
    "judge_acceptance",
    "decide",
    "is_final",
    "is_enabled",
]

OBJECTIVE_NAME = "tpot_p50_improvement"
GUARDRAIL_NAMES = ("ttft_p95_guard", "e2e_p95_guard", "error_rate_guard")
ACCURACY_NAME = "accuracy_noninferiority"
DIVERGENCE_NAME = "output_divergence"
ACCEPTANCE_NAME = "acceptance_length_floor"
GATE_NAMES = (OBJECTIVE_NAME, *GUARDRAIL_NAMES, ACCURACY_NAME, DIVERGENCE_NAME, ACCEPTANCE_NAME)


class Verdict(str, Enum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


class Decision(str, Enum):
    PROMOTE = "promote"
    ROLLBACK = "rollback"
    INCONCLUSIVE = "inconclusive"


class GatesConfig(pydantic.BaseModel, extra="forbid"):
    """How to judge a canary; embedded in the run YAML under ``gates:``."""

    alpha: float = Field(
        0.05,
        gt=0.0,
        le=0.2,
        description="Error rate per decision side: the chance of promoting a canary that sits exactly at a gate's "
        "threshold, and (family-wise, over all looks) of rolling back on a guardrail that is not violated.",
    )
    accuracy_margin: float = Field(
        0.02,
        ge=0.0,
        lt=1.0,
        description="Non-inferiority margin on baseline accuracy minus canary accuracy (absolute, 0.02 = 2 points). "
        "Pass needs the upper confidence bound of the drop below it; fail needs the lower bound above it.",
    )
    divergence_margin: float = Field(
        0.05,
        ge=0.0,
        lt=1.0,
        description="Allowed excess of the canary-vs-baseline greedy output divergence rate over the twin (A/A) "
        "baseline's divergence rate; with no twin, the absolute cap on the canary-vs-baseline divergence rate.",
    )
    tpot_p50_min_improvement: float = Field(
        0.10,
        ge=0.0,
        lt=1.0,
        description="Objective: the canary's median time per output token must be at least this much lower "
        "(0.10: ratio canary/baseline <= 0.90), judged by the ratio's upper confidence bound. 0 asks only 'faster'.",
    )
    ttft_p95_max_ratio: float = Field(
        1.25,
        ge=1.0,
        description="Guardrail: largest acceptable ratio canary/baseline of the 95th-percentile time to first token.",
    )
    e2e_p95_max_ratio: float | None = Field(
        None,
        ge=1.0,
        description="Optional guardrail: largest acceptable ratio of the 95th-percentile end-to-end latency; "
        "null disables it.",
    )
    error_rate_max_increase: float = Field(
        0.01,
        ge=0.0,
        lt=1.0,
        description="Guardrail: largest acceptable canary error rate minus baseline error rate (absolute).",
    )
    min_acceptance_length: float | None = Field(
        1.5,
        ge=1.0,
        description="Floor on the canary's mean acceptance length (1 + accepted draft tokens per draft); "
        "null disables the gate.",
    )
    min_requests_per_arm: int = Field(
        30,
        ge=5,
        description="Fewer successful requests than this in either arm: latency gates are inconclusive.",
    )
    min_eval_items: int = Field(
        20,
        ge=1,
        description="Fewer paired eval items than this: accuracy and divergence can only fail (via the "
        "always-valid clear-regression rule), never pass.",
    )
    max_looks: int = Field(
        5,
        ge=1,
        le=stats.MAX_PLANNED_LOOKS,
        description="Planned equal looks over which alpha is spent when a judge is called without information "
        "fractions (calibrate's simulated design). The experiment plans its own looks "
        "(experiment.requests_per_arm / requests_per_look) and spends alpha at the observed information fractions. "
        "Looks past this number reuse the last boundary and are outside the error guarantee.",
    )
    enabled: list[str] | None = Field(
        None,
        description=f"Optional subset of gate names to judge; null means all configured gates. "
        f"Known names: {', '.join(GATE_NAMES)}.",
    )
    spending: Literal["obrien_fleming", "pocock"] = Field(
        "obrien_fleming",
        description="Alpha-spending function over the looks (Lan-DeMets): obrien_fleming keeps early looks strict, "
        "pocock stops earlier on large effects but needs more data at the last look.",
    )
    early_stop_alpha_fraction: float = Field(
        0.2,
        ge=0.0,
        lt=1.0,
        description="Share of the accuracy and divergence gates' rollback-side alpha given to the always-valid "
        "clear-regression rule that may fail a broken canary after a few dozen items at any look.",
    )

    @pydantic.field_validator("enabled")
    @classmethod
    def _known_gate_names(cls, names: list[str] | None) -> list[str] | None:
        if names is None:
            return None
        unknown = sorted(set(names) - set(GATE_NAMES))
        if unknown:
            raise ValueError(f"unknown gate name(s) {unknown}; known: {list(GATE_NAMES)}")
        if not names:
            raise ValueError("enabled must name at least one gate (or be null for all)")
        return names


class GateResult(pydantic.BaseModel):
    """One gate's verdict with the numbers behind it (goes into decision.json)."""

    name: str = Field(description="Gate name, one of GATE_NAMES.")
    metric: str = Field(description="What the estimate measures, e.g. 'tpot_p50_ratio' or 'accuracy_diff'.")
    baseline: float | None = Field(description="Baseline point value (latency in ms, rates as fractions).")
    canary: float | None = Field(description="Canary point value, same unit as baseline.")
    threshold: float | None = Field(description="The configured limit the estimate is judged against.")
    verdict: Verdict
    estimate: float | None = Field(None, description="Comparison estimate (ratio or difference).")
    interval: tuple[float, float] | None = Field(
        None, description="Repeated confidence bounds of the estimate used for the verdict (see detail for levels)."
    )
    n_baseline: int = Field(0, description="Baseline samples (requests or items) behind the numbers.")
    n_canary: int = Field(0, description="Canary samples behind the numbers.")
    look: int = Field(1, description="Look number k of the planned max_looks.")
    p_value: float | None = Field(None, description="Exact McNemar p-value (accuracy) where applicable.")
    detail: str = Field("", description="Human-readable account of the decision.")


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
# Shared verdict kernels (array-capable: the calibration calls them too)
# ---------------------------------------------------------------------------

PASS_CODE, FAIL_CODE, INCONCLUSIVE_CODE = 1, -1, 0
_CODE_TO_VERDICT = {PASS_CODE: Verdict.PASS, FAIL_CODE: Verdict.FAIL, INCONCLUSIVE_CODE: Verdict.INCONCLUSIVE}


def upper_is_good_verdict(lower: np.ndarray, upper: np.ndarray, threshold: float, can_pass, can_fail) -> np.ndarray:
    """Verdict codes for 'estimate must stay below threshold' gates.

    PASS when the whole interval is below the threshold, FAIL when it is
    wholly above; ties are inconclusive (an interval touching the threshold
    proves nothing). ``can_pass``/``can_fail`` mask out scarce data.
    """
    passed = (np.asarray(upper) < threshold) & np.asarray(can_pass, dtype=bool)
    failed = (np.asarray(lower) > threshold) & np.asarray(can_fail, dtype=bool)
    return np.where(failed, FAIL_CODE, np.where(passed, PASS_CODE, INCONCLUSIVE_CODE))


def holm_levels(alpha: float, m: int) -> list[float]:
    """Holm's step levels alpha/m, alpha/(m-1), ..., alpha."""
    return [alpha / (m - i) for i in range(m)]


def _resolve_look(look: int, max_looks: int | None, cfg: GatesConfig) -> tuple[int, int, str]:
    planned = int(max_looks if max_looks is not None else cfg.max_looks)
    if planned < 1 or planned > stats.MAX_PLANNED_LOOKS:
        raise ValueError(f"max_looks must be in [1, {stats.MAX_PLANNED_LOOKS}], got {planned}")
    if look < 1:
        raise ValueError(f"look must be >= 1, got {look}")
    note = ""
    if look > planned:
        note = f" Look {look} is past the {planned} planned looks: judged at the last planned boundary."
    return min(look, planned), planned, note


def _z(alpha: float, look: int, planned: int, cfg: GatesConfig, information: Sequence[float] | None = None) -> float:
    """Critical z of `look`: on the planned equal grid, or at the observed information fractions."""
    if information is None:
        return stats.critical_value(alpha, look, planned, cfg.spending)
    if alpha <= 0.0:
        return math.inf
    return float(stats.boundaries_at_information(alpha, information[:look], cfg.spending)[-1])


def _resolve_information(
    look: int, max_looks: int | None, cfg: GatesConfig, information: Sequence[float] | None
) -> tuple[int, int, str, tuple[float, ...] | None]:
    """(boundary look, planned looks, note, fractions): `information` (one fraction per look so far) wins."""
    if information is None:
        return (*_resolve_look(look, max_looks, cfg), None)
    fractions = tuple(float(t) for t in information)
    if len(fractions) != look:
        raise ValueError(f"information needs one fraction per look: {len(fractions)} given at look {look}")
    planned = int(max_looks if max_looks is not None else look)
    return look, max(planned, look), f" Information fraction {fractions[-1]:.3f}.", fractions


def _finite_or_none(value: float | np.floating | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _interval_or_none(lower: float, upper: float) -> tuple[float, float] | None:
    lower, upper = float(lower), float(upper)
    if math.isnan(lower) or math.isnan(upper):
        return None
    return (lower, upper)


def is_enabled(name: str, cfg: GatesConfig) -> bool:
    """Whether ``cfg`` asks for gate ``name`` (configured and, if listed, enabled)."""
    if cfg.enabled is not None and name not in cfg.enabled:
        return False
    if name == "e2e_p95_guard" and cfg.e2e_p95_max_ratio is None:
        return False
    if name == ACCEPTANCE_NAME and cfg.min_acceptance_length is None:
        return False
    return True


# ---------------------------------------------------------------------------
# Accuracy and divergence (paired proportions)
# ---------------------------------------------------------------------------


def _as_bool_array(values: Sequence[bool], what: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence of booleans")
    return array.astype(bool)


def early_stop_log_threshold(cfg: GatesConfig) -> float:
    alpha_early = cfg.alpha * cfg.early_stop_alpha_fraction
    return math.log(1.0 / alpha_early) if alpha_early > 0 else math.inf


def _early_regression(paired_loss: np.ndarray, margin: float, lower_bound: float, cfg: GatesConfig) -> int | None:
    """Item count at which the always-valid rule first rejected H0: mean loss <= margin."""
    threshold = early_stop_log_threshold(cfg)
    if paired_loss.size == 0 or not math.isfinite(threshold):
        return None
    log_wealth = stats.betting_log_wealth(paired_loss, margin, lower_bound)
    crossed = np.flatnonzero(log_wealth >= threshold)
    return int(crossed[0]) + 1 if crossed.size else None


def _paired_margin_gate(
    *,
    name: str,
    metric: str,
    first: np.ndarray,
    second: np.ndarray,
    margin: float,
    cfg: GatesConfig,
    look: int,
    boundary_look: int,
    planned: int,
    look_note: str,
    interim: bool,
    baseline_value: float | None,
    canary_value: float | None,
    what: str,
) -> GateResult:
    """Judge mean(first) - mean(second) < margin on paired booleans.

    n12 counts pairs where only ``first`` is true. With accuracy, first =
    baseline correct, second = canary correct; with divergence, first =
    canary diverged, second = twin diverged.
    """
    n = int(first.size)
    n12 = int(np.sum(first & ~second))
    n21 = int(np.sum(~first & second))
    alpha_fail = cfg.alpha * (1.0 - cfg.early_stop_alpha_fraction)
    z_upper = _z(cfg.alpha, boundary_look, planned, cfg)
    z_lower = _z(alpha_fail, boundary_look, planned, cfg)
    if interim:
        # Unplanned look: the planned-look boundaries do not apply.
        z_upper = z_lower = math.inf
    early_at = _early_regression(first.astype(float) - second.astype(float), margin, -1.0, cfg)

    common = dict(
        name=name,
        metric=metric,
        baseline=baseline_value,
        canary=canary_value,
        threshold=margin,
        n_baseline=n,
        n_canary=n,
        look=look,
        p_value=float(stats.mcnemar_exact_pvalue(n12, n21)),
    )
    if n == 0:
        return GateResult(**common, verdict=Verdict.INCONCLUSIVE, detail=f"No paired {what}: nothing to judge.{look_note}")

    estimate = (n12 - n21) / n
    lower, upper = stats.tango_interval(n12, n21, n, z_lower, z_upper)
    lower, upper = float(lower), float(upper)
    enough = n >= cfg.min_eval_items
    code = int(upper_is_good_verdict(lower, upper, margin, enough and not interim, enough and not interim))
    if early_at is not None:
        code = FAIL_CODE
    verdict = _CODE_TO_VERDICT[code]

    counts = f"n={n}, discordant {n12} vs {n21}, exact McNemar p={common['p_value']:.3g}"
    levels = (
        f"Tango score bounds: lower at look {boundary_look}/{planned} z={z_lower:.3f} (alpha {alpha_fail:.4g}), "
        f"upper at z={z_upper:.3f} (alpha {cfg.alpha:.4g})"
        if not interim
        else "interim look: only the always-valid clear-regression rule may decide"
    )
    if early_at is not None:
        reason = (
            f"Clear regression: the always-valid betting test rejected 'difference <= {margin:g}' after "
            f"{early_at} {what} (alpha {cfg.alpha * cfg.early_stop_alpha_fraction:.4g})."
        )
    elif verdict is Verdict.PASS:
        reason = f"Upper bound {upper:.4f} < margin {margin:g}."
    elif verdict is Verdict.FAIL:
        reason = f"Lower bound {lower:.4f} > margin {margin:g}."
    elif not enough:
        reason = f"Only {n} {what} (< {cfg.min_eval_items}): cannot pass yet."
    else:
        reason = f"Interval [{lower:.4f}, {upper:.4f}] straddles margin {margin:g}."
    return GateResult(
        **common,
        verdict=verdict,
        estimate=estimate,
        interval=None if interim else _interval_or_none(lower, upper),
        detail=f"{reason} {counts}; {levels}.{look_note}",
    )


def judge_accuracy(
    baseline_correct: Sequence[bool],
    canary_correct: Sequence[bool],
    cfg: GatesConfig,
    look: int = 1,
    max_looks: int | None = None,
    *,
    interim: bool = False,
) -> GateResult:
    """Paired non-inferiority of canary accuracy (gate ``accuracy_noninferiority``).

    The sequences hold, per eval item in the same order for both arms, whether
    the answer was correct. Items should be in random order (the betting rule
    assumes exchangeable items). Estimate = baseline - canary accuracy.

    * PASS: the upper Tango bound (level alpha at look k) < ``accuracy_margin``
      with at least ``min_eval_items`` items;
    * FAIL: the lower bound (level alpha * (1 - early_stop_alpha_fraction)) >
      margin, or the always-valid betting rule rejected 'drop <= margin' at
      some item so far (a 95% -> 1% canary fails after about a dozen items,
      at any look, even below ``min_eval_items``);
    * INCONCLUSIVE otherwise.

    ``look``/``max_looks`` set the information fraction look/max_looks (equal
    batches of items). For one analysis of all items pass ``look=1,
    max_looks=1``. ``interim=True`` marks an unplanned look between planned
    ones (e.g. every 10 items to catch a broken config early): only the
    always-valid rule may decide, so such looks spend no alpha.
    """
    baseline = _as_bool_array(baseline_correct, "baseline_correct")
    canary = _as_bool_array(canary_correct, "canary_correct")
    if baseline.size != canary.size:
        raise ValueError(f"paired accuracy needs equal lengths, got {baseline.size} and {canary.size}")
    boundary_look, planned, note = _resolve_look(look, max_looks, cfg)
    n = baseline.size
    return _paired_margin_gate(
        name=ACCURACY_NAME,
        metric="accuracy_diff",
        first=baseline,
        second=canary,
        margin=cfg.accuracy_margin,
        cfg=cfg,
        look=look,
        boundary_look=boundary_look,
        planned=planned,
        look_note=note,
        interim=interim,
        baseline_value=float(baseline.mean()) if n else None,
        canary_value=float(canary.mean()) if n else None,
        what="items",
    )


def judge_divergence(
    canary_vs_baseline_diverged: Sequence[bool],
    twin_vs_baseline_diverged: Sequence[bool] | None,
    cfg: GatesConfig,
    look: int = 1,
    max_looks: int | None = None,
    *,
    interim: bool = False,
) -> GateResult:
    """Greedy output divergence against the A/A noise floor (gate ``output_divergence``).

    With a twin baseline (same items, same order) the estimate is the paired
    difference canary divergence rate - twin divergence rate, judged like
    accuracy (Tango interval, always-valid early stop) against
    ``divergence_margin``. Without a twin the canary's divergence rate itself
    is judged against the margin as an absolute cap (Wilson interval).
    ``baseline`` reports the twin's divergence rate (None without a twin),
    ``canary`` the canary's.
    """
    canary = _as_bool_array(canary_vs_baseline_diverged, "canary_vs_baseline_diverged")
    boundary_look, planned, note = _resolve_look(look, max_looks, cfg)
    margin = cfg.divergence_margin
    if twin_vs_baseline_diverged is not None:
        twin = _as_bool_array(twin_vs_baseline_diverged, "twin_vs_baseline_diverged")
        if twin.size != canary.size:
            raise ValueError(f"twin divergence must cover the same items: {twin.size} vs {canary.size}")
        return _paired_margin_gate(
            name=DIVERGENCE_NAME,
            metric="divergence_excess_over_twin",
            first=canary,
            second=twin,
            margin=margin,
            cfg=cfg,
            look=look,
            boundary_look=boundary_look,
            planned=planned,
            look_note=note,
            interim=interim,
            baseline_value=float(twin.mean()) if twin.size else None,
            canary_value=float(canary.mean()) if canary.size else None,
            what="items",
        )

    n = int(canary.size)
    k = int(canary.sum())
    common = dict(
        name=DIVERGENCE_NAME,
        metric="divergence_rate",
        baseline=None,
        canary=(k / n) if n else None,
        threshold=margin,
        n_baseline=0,
        n_canary=n,
        look=look,
    )
    if n == 0:
        return GateResult(**common, verdict=Verdict.INCONCLUSIVE, detail=f"No items compared.{note}")
    alpha_fail = cfg.alpha * (1.0 - cfg.early_stop_alpha_fraction)
    z_upper = math.inf if interim else _z(cfg.alpha, boundary_look, planned, cfg)
    z_lower = math.inf if interim else _z(alpha_fail, boundary_look, planned, cfg)
    lower, _ = stats.wilson_interval(k, n, z_lower)
    _, upper = stats.wilson_interval(k, n, z_upper)
    lower, upper = float(lower), float(upper)
    enough = n >= cfg.min_eval_items and not interim
    code = int(upper_is_good_verdict(lower, upper, margin, enough, enough))
    early_at = None
    if margin > 0:
        early_at = _early_regression(canary.astype(float), margin, 0.0, cfg)
    if early_at is not None:
        code = FAIL_CODE
    verdict = _CODE_TO_VERDICT[code]
    if early_at is not None:
        reason = f"Clear divergence: the always-valid betting test rejected 'rate <= {margin:g}' after {early_at} items."
    elif verdict is Verdict.PASS:
        reason = f"Upper bound {upper:.4f} < cap {margin:g}."
    elif verdict is Verdict.FAIL:
        reason = f"Lower bound {lower:.4f} > cap {margin:g}."
    else:
        reason = f"Interval [{lower:.4f}, {upper:.4f}] vs cap {margin:g}: not decided."
    return GateResult(
        **common,
        verdict=verdict,
        estimate=k / n,
        interval=_interval_or_none(lower, upper),
        detail=f"{reason} No twin baseline: absolute cap. {k}/{n} diverged; Wilson bounds at "
        f"z={z_lower:.3f}/{z_upper:.3f} (look {boundary_look}/{planned}).{note}",
    )


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

    z_pass = np.array([_z(cfg.alpha, lk, planned, cfg, information) for lk in looks])
    log_ratio, _, _, upper_own = stats.log_ratio_interval(log_b, se_b, log_c, se_c, np.inf, z_pass)
    _, upper = cumulative_bounds(np.full_like(upper_own, -np.inf), upper_own, usable)

    lowers = []
    for level in fail_levels:
        z_fail = np.array([_z(level, lk, planned, cfg, information) for lk in looks])
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
    z_pass = _z(cfg.alpha, boundary_look, planned, cfg, information)
    diff, _, upper = stats.newcombe_difference_interval(eb, nb, ec, nc, np.inf, z_pass)
    lowers = []
    for level in fail_levels:
        _, lower, _ = stats.newcombe_difference_interval(eb, nb, ec, nc, _z(level, boundary_look, planned, cfg, information), np.inf)
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
    boundary_look, planned, note, information = _resolve_information(look, max_looks, cfg, information)
    results: list[GateResult] = []
    alpha = cfg.alpha

    def ratio_result(numbers: dict, verdict: Verdict, lower_log: float, fail_level: float, reason: str) -> GateResult:
        estimate = math.exp(numbers["log_estimate"]) if math.isfinite(numbers["log_estimate"]) else None
        lower = math.exp(lower_log) if not math.isnan(lower_log) else float("nan")
        upper = math.exp(numbers["upper"]) if not math.isnan(numbers["upper"]) else float("nan")
        interval = _interval_or_none(lower, upper) if (math.isfinite(lower) and math.isfinite(upper) and lower <= upper) else None
        windows = f"intersected over {numbers['looks_used']} look(s)" if numbers["looks_used"] > 1 else "this look"
        dropped = ""
        if any(numbers["dropped"]):
            dropped = f" Dropped non-finite/non-positive samples: baseline {numbers['dropped'][0]}, canary {numbers['dropped'][1]}."
        return GateResult(
            name=numbers["name"],
            metric=numbers["metric"],
            baseline=_finite_or_none(numbers["baseline_ms"]),
            canary=_finite_or_none(numbers["canary_ms"]),
            threshold=numbers["threshold"],
            verdict=verdict,
            estimate=_finite_or_none(estimate),
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
        verdict = _CODE_TO_VERDICT[code]
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
                    interval=_interval_or_none(lower, numbers["upper"]) if lower <= numbers["upper"] else None,
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


# ---------------------------------------------------------------------------
# Speculative decoding health
# ---------------------------------------------------------------------------


def judge_acceptance(mean_acceptance_length: float | None, n_drafts: int, cfg: GatesConfig) -> GateResult:
    """Floor on the canary's mean acceptance length (gate ``acceptance_length_floor``).

    The value comes from /metrics counter deltas over many drafts (1 +
    accepted tokens / drafts), so it is judged as a number, not a test.
    ``None`` (not measured) is inconclusive. Whether zero drafts on a
    speculative canary is itself a failure is the controller's call (it knows
    the engine config); with a value given, the value is judged.
    """
    floor = cfg.min_acceptance_length
    common = dict(
        name=ACCEPTANCE_NAME,
        metric="mean_acceptance_length",
        baseline=None,
        canary=_finite_or_none(mean_acceptance_length),
        threshold=floor,
        n_baseline=0,
        n_canary=int(n_drafts),
        estimate=_finite_or_none(mean_acceptance_length),
    )
    if floor is None:
        return GateResult(**common, verdict=Verdict.PASS, detail="Acceptance-length floor disabled (min_acceptance_length is null).")
    if mean_acceptance_length is None or not math.isfinite(float(mean_acceptance_length)):
        return GateResult(**common, verdict=Verdict.INCONCLUSIVE, detail="Mean acceptance length not measured: cannot pass.")
    value = float(mean_acceptance_length)
    verdict = Verdict.PASS if value >= floor else Verdict.FAIL
    relation = ">=" if verdict is Verdict.PASS else "<"
    return GateResult(
        **common,
        verdict=verdict,
        detail=f"Mean acceptance length {value:.3f} {relation} floor {floor:g} over {int(n_drafts)} drafts.",
    )


# ---------------------------------------------------------------------------
# Decision
# ---------------------------------------------------------------------------


def _considered(results: Sequence[GateResult], cfg: GatesConfig | None) -> list[GateResult]:
    if cfg is None:
        return list(results)
    return [r for r in results if is_enabled(r.name, cfg)]


def decide(results: Sequence[GateResult], cfg: GatesConfig | None = None) -> Decision:
    """Any FAIL -> ROLLBACK; all PASS (at least one gate) -> PROMOTE; else INCONCLUSIVE.

    With ``cfg``, gates it does not enable are ignored.
    """
    considered = _considered(results, cfg)
    if any(r.verdict is Verdict.FAIL for r in considered):
        return Decision.ROLLBACK
    if considered and all(r.verdict is Verdict.PASS for r in considered):
        return Decision.PROMOTE
    return Decision.INCONCLUSIVE


def is_final(results: Sequence[GateResult], cfg: GatesConfig | None = None) -> bool:
    """True when the sequential procedure may stop: any FAIL, or every gate decided."""
    considered = _considered(results, cfg)
    if any(r.verdict is Verdict.FAIL for r in considered):
        return True
    return bool(considered) and all(r.verdict is not Verdict.INCONCLUSIVE for r in considered)
