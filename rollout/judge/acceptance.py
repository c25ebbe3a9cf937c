"""The speculative-decoding gate: a floor on the canary's mean acceptance length, judged on confidence bounds.

`judge_acceptance(delta, cfg, ...)` judges the canary's spec-decode counter delta
(``cluster.metrics.SpecDecodeStats``: drafts D, draft tokens, accepted tokens,
accepted per position) against ``min_acceptance_length``. `acceptance_sd` (the
spread of accepted tokens per draft, from the per-position counters) is shared
with the progressive phase's guard (``rollout.judge.guards``).

Why bounds and not the point value: a canary whose true acceptance length sits
at the floor shows a mean above it half the time; judged as a number it would
promote at 50%, not at alpha.

The bounds: the mean acceptance length is 1 + mean of A, the accepted tokens of
one draft (0..k). The per-position counters give P(A >= i) = accepted_at_position[i-1] / D
exactly, so the variance of A too; the bounds are mean -+ z * sd / sqrt(D) with z
the look's critical value at ``alpha`` (one-sided, group-sequential like every
other gate when looks and information fractions are given). Assumption: drafts
are independent; drafts of one request are correlated (a hard prompt accepts
less), which makes the bounds optimistic by the design effect. With thousands
of drafts the interval is narrow and the floor (1.5 by default) far from a
healthy MTP canary's 2-4, so this matters only near the floor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cluster.metrics import SpecDecodeStats
from rollout.judge.config import GatesConfig
from rollout.judge.looks import finite_or_none, interval_or_none, resolve_information, z
from rollout.judge.names import ACCEPTANCE_NAME
from rollout.judge.verdicts import GateResult, Verdict

__all__ = ["MIN_DRAFTS", "acceptance_sd", "acceptance_bounds", "judge_acceptance"]

MIN_DRAFTS = 20  # fewer drafts: the normal approximation of the mean is not trusted, nothing is judged


def acceptance_sd(delta: SpecDecodeStats) -> float:
    """Standard deviation of accepted tokens per draft, from the per-position counters."""
    drafts = delta.drafts
    per_pos = list(delta.accepted_per_position)
    if per_pos and sum(per_pos) > 0 and abs(sum(per_pos) - delta.accepted_tokens) <= 0.5 + 1e-6 * delta.accepted_tokens:
        tail = [min(1.0, max(0.0, a / drafts)) for a in per_pos]  # P(A >= i), i = 1..k
        mean = sum(tail)
        second = sum((2 * i + 1) * t for i, t in enumerate(tail))  # E[A^2] = sum (2i - 1) P(A >= i)
        return math.sqrt(max(0.0, second - mean * mean))
    # No usable profile: the largest variance a value in [0, k] can have.
    k = delta.draft_tokens / drafts if drafts > 0 else 1.0
    return k / 2.0


def acceptance_bounds(delta: SpecDecodeStats, z_lower: float, z_upper: float) -> tuple[float, float]:
    """(lower, upper) bounds of the mean acceptance length at critical values z_lower / z_upper."""
    mean = delta.mean_acceptance_length
    if mean is None:
        return (math.nan, math.nan)
    se = acceptance_sd(delta) / math.sqrt(delta.drafts)
    return (mean - z_lower * se, mean + z_upper * se)


def judge_acceptance(
    delta: SpecDecodeStats | None,
    cfg: GatesConfig,
    look: int = 1,
    max_looks: int | None = 1,
    information: Sequence[float] | None = None,
) -> GateResult:
    """Floor on the canary's mean acceptance length (gate ``acceptance_length_floor``).

    * PASS: the lower bound (level ``alpha`` at this look) is at or above the floor;
    * FAIL: the upper bound (level ``alpha``) is below the floor;
    * INCONCLUSIVE otherwise, and when ``delta`` is None (not measured), has no
      drafts or fewer than ``MIN_DRAFTS``.

    Whether zero drafts on a speculative canary is itself a failure is the
    controller's call (it knows the engine config). ``look``/``max_looks``/
    ``information`` as for the latency judge; the default is one analysis.
    """
    floor = cfg.min_acceptance_length
    mean = delta.mean_acceptance_length if delta is not None else None
    drafts = int(delta.drafts) if delta is not None else 0
    common = dict(
        name=ACCEPTANCE_NAME,
        metric="mean_acceptance_length",
        baseline=None,
        canary=finite_or_none(mean),
        threshold=floor,
        n_baseline=0,
        n_canary=drafts,
        estimate=finite_or_none(mean),
        look=look,
    )
    if floor is None:
        return GateResult(**common, verdict=Verdict.PASS, detail="Acceptance-length floor disabled (min_acceptance_length is null).")
    if delta is None:
        return GateResult(**common, verdict=Verdict.INCONCLUSIVE, detail="Canary acceptance not measured (no spec-decode counters): cannot pass.")
    if mean is None or not math.isfinite(mean):
        return GateResult(**common, verdict=Verdict.INCONCLUSIVE, detail="The canary made no drafts: no acceptance length to judge.")
    boundary_look, planned, note, fractions = resolve_information(look, max_looks, cfg, information)
    crit = z(cfg.alpha, boundary_look, planned, cfg, fractions)
    lower, upper = acceptance_bounds(delta, crit, crit)
    text = (
        f"Mean acceptance length {mean:.3f} over {drafts} drafts, bounds [{lower:.3f}, {upper:.3f}] "
        f"(z={crit:.3f}, alpha {cfg.alpha:g} each side, look {boundary_look}/{planned}), floor {floor:g}"
    )
    result = dict(common, interval=interval_or_none(lower, upper))
    if drafts < MIN_DRAFTS:
        return GateResult(**result, verdict=Verdict.INCONCLUSIVE, detail=f"{text}: fewer than {MIN_DRAFTS} drafts.{note}")
    if lower >= floor:
        return GateResult(**result, verdict=Verdict.PASS, detail=f"{text}: lower bound clears the floor.{note}")
    if upper < floor:
        return GateResult(**result, verdict=Verdict.FAIL, detail=f"{text}: upper bound below the floor.{note}")
    return GateResult(**result, verdict=Verdict.INCONCLUSIVE, detail=f"{text}: the interval holds the floor.{note}")
