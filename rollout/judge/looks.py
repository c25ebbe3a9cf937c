"""Sequential looks and intervals shared by the judges: verdict codes, critical values per look, Holm levels.

Array-capable kernels (the calibration calls them with a trials axis) and the
small conversions every judge applies to its numbers before a `GateResult`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import special

from rollout.judge import stats
from rollout.judge.config import GatesConfig
from rollout.judge.verdicts import Verdict

__all__ = [
    "PASS_CODE",
    "FAIL_CODE",
    "INCONCLUSIVE_CODE",
    "CODE_TO_VERDICT",
    "upper_is_good_verdict",
    "holm_levels",
    "resolve_look",
    "z",
    "t_critical",
    "resolve_information",
    "finite_or_none",
    "interval_or_none",
]


# ---------------------------------------------------------------------------
# Shared verdict kernels (array-capable: the calibration calls them too)
# ---------------------------------------------------------------------------

PASS_CODE, FAIL_CODE, INCONCLUSIVE_CODE = 1, -1, 0
CODE_TO_VERDICT = {PASS_CODE: Verdict.PASS, FAIL_CODE: Verdict.FAIL, INCONCLUSIVE_CODE: Verdict.INCONCLUSIVE}


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


def resolve_look(look: int, max_looks: int | None, cfg: GatesConfig) -> tuple[int, int, str]:
    planned = int(max_looks if max_looks is not None else cfg.max_looks)
    if planned < 1 or planned > stats.MAX_PLANNED_LOOKS:
        raise ValueError(f"max_looks must be in [1, {stats.MAX_PLANNED_LOOKS}], got {planned}")
    if look < 1:
        raise ValueError(f"look must be >= 1, got {look}")
    note = ""
    if look > planned:
        note = f" Look {look} is past the {planned} planned looks: judged at the last planned boundary."
    return min(look, planned), planned, note


def z(alpha: float, look: int, planned: int, cfg: GatesConfig, information: Sequence[float] | None = None) -> float:
    """Critical z of `look`: on the planned equal grid, or at the observed information fractions."""
    if information is None:
        return stats.critical_value(alpha, look, planned, cfg.spending)
    if alpha <= 0.0:
        return math.inf
    return float(stats.boundaries_at_information(alpha, information[:look], cfg.spending)[-1])


def t_critical(z_value: float, df: float) -> float:
    """The t quantile on ``df`` at the one-sided level of the look's critical z (inf stays inf): the
    block-robust gates' (goodput, prefix cache) critical value on blocks - 1 degrees of freedom."""
    if not math.isfinite(z_value):
        return math.inf
    level = float(special.ndtr(-z_value))
    # the latency bands' t (stats.block_rank_band), cached there: one t for every block-robust bound
    return stats._t_upper_quantile(level, round(float(df), 2)) if level > 0.0 else math.inf


def resolve_information(
    look: int, max_looks: int | None, cfg: GatesConfig, information: Sequence[float] | None
) -> tuple[int, int, str, tuple[float, ...] | None]:
    """(boundary look, planned looks, note, fractions): `information` (one fraction per look so far) wins."""
    if information is None:
        return (*resolve_look(look, max_looks, cfg), None)
    fractions = tuple(float(t) for t in information)
    if len(fractions) != look:
        raise ValueError(f"information needs one fraction per look: {len(fractions)} given at look {look}")
    planned = int(max_looks if max_looks is not None else look)
    return look, max(planned, look), f" Information fraction {fractions[-1]:.3f}.", fractions


def finite_or_none(value: float | np.floating | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def interval_or_none(lower: float, upper: float) -> tuple[float, float] | None:
    lower, upper = float(lower), float(upper)
    if math.isnan(lower) or math.isnan(upper):
        return None
    return (lower, upper)
