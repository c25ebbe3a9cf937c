"""The accuracy and divergence gates: paired proportions against a margin.

`judge_accuracy` (paired non-inferiority of canary accuracy) and
`judge_divergence` (greedy output divergence against the twin baseline's A/A
noise floor): Tango score intervals over the planned looks, plus an always-valid
betting rule that fails a clear regression at any look.

Reference errors: an item whose baseline (or, for divergence, twin) request failed
says nothing about the canary, and counting it as "only the canary was right"
would hide a regression (3% baseline timeouts mask a ~2.8-point drop), so such
items are left out of the pairs. Above ``max_baseline_eval_error_rate`` of them the
comparison is not trusted: a PASS becomes INCONCLUSIVE (a FAIL stands: the canary
was clearly worse on the items both answered). A canary error stays a wrong answer
of the canary (the fail-closed direction).
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
    FAIL_CODE,
    interval_or_none,
    resolve_look,
    upper_is_good_verdict,
    z,
)
from rollout.judge.names import ACCURACY_NAME, DIVERGENCE_NAME
from rollout.judge.verdicts import GateResult, Verdict

__all__ = ["judge_accuracy", "judge_divergence", "early_stop_log_threshold"]


@dataclass(frozen=True)
class _ReferenceErrors:
    """Items whose reference request (baseline, or twin) failed: left out of the pairs."""

    items: int
    dropped: int
    max_rate: float

    @property
    def too_many(self) -> bool:
        return self.items > 0 and self.dropped / self.items > self.max_rate

    def note(self, arm: str) -> str:
        if not self.dropped:
            return ""
        return f" {self.dropped} of {self.items} items left out: the {arm} request failed."


def _reference_errors(errored: Sequence[bool] | None, n: int, cfg: GatesConfig, what: str) -> tuple[np.ndarray, _ReferenceErrors]:
    """(keep mask, counts): the items whose reference request did not fail."""
    if errored is None:
        return np.ones(n, dtype=bool), _ReferenceErrors(n, 0, cfg.max_baseline_eval_error_rate)
    failed = _as_bool_array(errored, what)
    if failed.size != n:
        raise ValueError(f"{what} must cover the same items: {failed.size} vs {n}")
    return ~failed, _ReferenceErrors(n, int(failed.sum()), cfg.max_baseline_eval_error_rate)


def _with_reference_errors(gate: GateResult, errors: _ReferenceErrors, arm: str) -> GateResult:
    """The gate with the left-out items said, and a PASS withheld when too many were left out."""
    detail = gate.detail + errors.note(arm)
    if errors.too_many and gate.verdict is Verdict.PASS:
        return gate.model_copy(
            update={
                "verdict": Verdict.INCONCLUSIVE,
                "detail": f"{errors.dropped} of {errors.items} items had a failed {arm} request "
                f"(> max_baseline_eval_error_rate {errors.max_rate:g}): the comparison is not trusted, cannot pass. {detail}",
            }
        )
    return gate.model_copy(update={"detail": detail})


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


def _paired_margin_reason(
    *,
    verdict: Verdict,
    early_at: int | None,
    enough: bool,
    lower: float,
    upper: float,
    margin: float,
    n: int,
    what: str,
    cfg: GatesConfig,
) -> str:
    """The first sentence of a paired margin gate's detail: why it reached ``verdict``."""
    if early_at is not None:
        return (
            f"Clear regression: the always-valid betting test rejected 'difference <= {margin:g}' after "
            f"{early_at} {what} (alpha {cfg.alpha * cfg.early_stop_alpha_fraction:.4g})."
        )
    if verdict is Verdict.PASS:
        return f"Upper bound {upper:.4f} < margin {margin:g}."
    if verdict is Verdict.FAIL:
        return f"Lower bound {lower:.4f} > margin {margin:g}."
    if not enough:
        return f"Only {n} {what} (< {cfg.min_eval_items}): cannot pass yet."
    return f"Interval [{lower:.4f}, {upper:.4f}] straddles margin {margin:g}."


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
    z_upper = z(cfg.alpha, boundary_look, planned, cfg)
    z_lower = z(alpha_fail, boundary_look, planned, cfg)
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
    verdict = CODE_TO_VERDICT[code]

    counts = f"n={n}, discordant {n12} vs {n21}, exact McNemar p={common['p_value']:.3g}"
    levels = (
        f"Tango score bounds: lower at look {boundary_look}/{planned} z={z_lower:.3f} (alpha {alpha_fail:.4g}), "
        f"upper at z={z_upper:.3f} (alpha {cfg.alpha:.4g})"
        if not interim
        else "interim look: only the always-valid clear-regression rule may decide"
    )
    reason = _paired_margin_reason(
        verdict=verdict, early_at=early_at, enough=enough, lower=lower, upper=upper, margin=margin, n=n, what=what, cfg=cfg
    )
    return GateResult(
        **common,
        verdict=verdict,
        estimate=estimate,
        interval=None if interim else interval_or_none(lower, upper),
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
    baseline_errored: Sequence[bool] | None = None,
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

    ``baseline_errored`` (per item, whether the baseline request failed): those
    items are left out; above ``max_baseline_eval_error_rate`` of them no PASS.
    """
    baseline = _as_bool_array(baseline_correct, "baseline_correct")
    canary = _as_bool_array(canary_correct, "canary_correct")
    if baseline.size != canary.size:
        raise ValueError(f"paired accuracy needs equal lengths, got {baseline.size} and {canary.size}")
    keep, errors = _reference_errors(baseline_errored, baseline.size, cfg, "baseline_errored")
    baseline, canary = baseline[keep], canary[keep]
    boundary_look, planned, note = resolve_look(look, max_looks, cfg)
    n = baseline.size
    gate = _paired_margin_gate(
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
    return _with_reference_errors(gate, errors, "baseline")


def _absolute_cap_gate(
    canary: np.ndarray,
    margin: float,
    cfg: GatesConfig,
    *,
    look: int,
    boundary_look: int,
    planned: int,
    look_note: str,
    interim: bool,
) -> GateResult:
    """Divergence without a twin baseline: the canary's divergence rate against ``margin`` as an absolute cap.

    Wilson bounds at the look's critical values (none at an interim look) plus
    the always-valid betting rule on the rate itself (only with a positive cap).
    """
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
        return GateResult(**common, verdict=Verdict.INCONCLUSIVE, detail=f"No items compared.{look_note}")
    alpha_fail = cfg.alpha * (1.0 - cfg.early_stop_alpha_fraction)
    z_upper = math.inf if interim else z(cfg.alpha, boundary_look, planned, cfg)
    z_lower = math.inf if interim else z(alpha_fail, boundary_look, planned, cfg)
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
    verdict = CODE_TO_VERDICT[code]
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
        interval=interval_or_none(lower, upper),
        detail=f"{reason} No twin baseline: absolute cap. {k}/{n} diverged; Wilson bounds at "
        f"z={z_lower:.3f}/{z_upper:.3f} (look {boundary_look}/{planned}).{look_note}",
    )


def judge_divergence(
    canary_vs_baseline_diverged: Sequence[bool],
    twin_vs_baseline_diverged: Sequence[bool] | None,
    cfg: GatesConfig,
    look: int = 1,
    max_looks: int | None = None,
    *,
    interim: bool = False,
    reference_errored: Sequence[bool] | None = None,
) -> GateResult:
    """Greedy output divergence against the A/A noise floor (gate ``output_divergence``).

    With a twin baseline (same items, same order) the estimate is the paired
    difference canary divergence rate - twin divergence rate, judged like
    accuracy (Tango interval, always-valid early stop) against
    ``divergence_margin``. Without a twin the canary's divergence rate itself
    is judged against the margin as an absolute cap (Wilson interval).
    ``baseline`` reports the twin's divergence rate (None without a twin),
    ``canary`` the canary's. ``reference_errored`` (per item, whether the baseline or
    the twin request failed): those items are left out, as for accuracy.
    """
    canary = _as_bool_array(canary_vs_baseline_diverged, "canary_vs_baseline_diverged")
    keep, errors = _reference_errors(reference_errored, canary.size, cfg, "reference_errored")
    boundary_look, planned, note = resolve_look(look, max_looks, cfg)
    margin = cfg.divergence_margin
    if twin_vs_baseline_diverged is not None:
        twin = _as_bool_array(twin_vs_baseline_diverged, "twin_vs_baseline_diverged")
        if twin.size != canary.size:
            raise ValueError(f"twin divergence must cover the same items: {twin.size} vs {canary.size}")
        canary, twin = canary[keep], twin[keep]
        gate = _paired_margin_gate(
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
    else:
        gate = _absolute_cap_gate(
            canary[keep], margin, cfg, look=look, boundary_look=boundary_look, planned=planned, look_note=note,
            interim=interim,
        )
    return _with_reference_errors(gate, errors, "baseline" if twin_vs_baseline_diverged is None else "baseline or twin")
