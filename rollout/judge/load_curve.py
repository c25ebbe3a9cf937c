"""Up to which load the candidate pays: the sweep's per-level TPOT ratios judged as one curve (pure).

The claim
    `promote_up_to` answers "up to how many streams per replica does the candidate beat the
    objective's bar?" from the load sweep (rollout.analysis.load_sweep, rollout.analysis.crossover):
    C is the largest swept level such that the canary/baseline TPOT p50 ratio is shown below the bar
    (1 - gates.tpot_p50_min_improvement) at EVERY swept level <= C, all of them together with
    confidence 1 - alpha. None when even the lowest level is not shown below the bar.
    What C is not: loads between two swept levels are interpolated by nobody (the claim holds at
    the levels, and between them only if the true curve is monotone there, which nothing checks),
    and loads above the top level swept are not claimed at all.

The test: a fixed sequence, in ascending load
    Level i's null hypothesis is H_i: true ratio >= bar (no gain worth shipping there). It is
    rejected when the upper end of the level's two-sided 1 - alpha interval (a one-sided
    1 - alpha/2 bound) is below the bar: the level's bootstrap log-ratio spread (`log_sd`, a
    circular moving-block bootstrap over the prompts, rollout.analysis.crossover.ratio_interval)
    times the t quantile of its degrees of freedom (blocks - 1), the same interval the report
    draws. The levels are tested in ascending load and the sequence stops at the first level not
    rejected; C is the last level rejected.
    Why the family-wise error stays <= alpha (Maurer, Hothorn & Lehmacher 1995; Westfall &
    Krishen 2001, fixed-sequence testing): a wrong claim means some level <= C has a true
    ratio >= bar; let j be the lowest such level. C >= j needs H_j rejected, and H_j is a true
    null tested at alpha/2, so P(wrong claim) <= P(reject H_j) <= alpha/2. No split over the
    levels is needed because the order (ascending load) is fixed before any data and the
    procedure only gets past j by rejecting H_j; Bonferroni (alpha / m per level) would hold
    too, but spends power on levels the ordering already protects.
    Why alpha/2 and not alpha per step: the bootstrap's blocks (~sqrt(n) prompts) miss
    correlation longer than a block, so its intervals are too narrow when a replica's slow
    stretches last longer: in the correlated sweeps of rollout.calibration.load_curve a
    one-sided 95% bound missed a ratio exactly at the bar in 0.088 of 400 sweeps (alpha 0.05).
    The other alpha/2 is that margin; the calibration measures what is left of it.
    Adaptive sweeps: which levels run depends on earlier levels' point estimates, never on a
    later level's records, and the planner (rollout.analysis.crossover.next_level) only adds a
    level below a swept one inside a bracket whose upper end failed its point estimate (ratio
    >= bar, so that level was not rejected). The bound is measured there too, not argued.
    A level without a ratio or without an interval (too few samples) stops the sequence there:
    missing data never shows a gain.

The decision it qualifies
    The objective (rollout.judge.verdicts) decides PROMOTE / ROLLBACK / INCONCLUSIVE at the
    judged concurrency; the curve only qualifies a PROMOTE. A PROMOTE with C below the top level
    swept reads "PROMOTE for concurrency <= C per replica"; a PROMOTE with C = None stays a
    PROMOTE of the judged concurrency (the sweep did not show a gain at its lowest level, which
    the objective, judged on its own larger sample, may still have shown); C never turns a
    ROLLBACK or an INCONCLUSIVE into a PROMOTE, nor the reverse.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field
from scipy import stats as scipy_stats

from rollout.judge.config import GatesConfig

__all__ = ["LevelRatio", "PromoteUpTo", "objective_bar", "promote_up_to", "promote_up_to_of", "qualified_reason",
           "upper_bound"]


class LevelRatio(Protocol):
    """One swept level as the judgement reads it (rollout.analysis.crossover.LevelResult is one)."""

    level: float
    ratio: float | None
    log_sd: float | None
    dof: int | None


class PromoteUpTo(BaseModel):
    """decision.json `promote_up_to`: the largest load at which, and at every swept load below it, the
    candidate beats the objective's bar with simultaneous confidence 1 - alpha."""

    model_config = ConfigDict(extra="forbid")

    streams_per_replica: float | None = Field(
        description="C: the claim holds at every swept level <= C (None: not even at the lowest level)")
    levels_judged: list[float] = Field(description="the swept levels, ascending: the order of the fixed sequence")
    top_level: float | None = Field(description="the top level swept: above it nothing is claimed")
    alpha: float = Field(description="family-wise error of the claim (the objective's gates.alpha)")
    bar: float = Field(description="the ratio to beat: 1 - gates.tpot_p50_min_improvement")
    upper_bounds: list[float | None] = Field(
        description="each judged level's upper end of its two-sided 1 - alpha ratio interval (None: no interval)")
    reason: str

    def below_top(self) -> bool:
        """The claim stops short of the top level swept: a PROMOTE then carries "for concurrency <= C"."""
        return (self.streams_per_replica is not None and self.top_level is not None
                and self.streams_per_replica < self.top_level)


def upper_bound(level: LevelRatio, alpha: float) -> float | None:
    """The upper end of the level's two-sided 1 - alpha interval of the TPOT ratio; None without an interval."""
    if level.ratio is None or level.log_sd is None or not level.dof or level.dof < 1 or level.ratio <= 0:
        return None
    return level.ratio * math.exp(float(scipy_stats.t.ppf(1.0 - alpha / 2.0, level.dof)) * level.log_sd)


def promote_up_to(levels: Sequence[LevelRatio], bar: float, alpha: float) -> PromoteUpTo:
    """C, the largest swept level up to which every level's upper bound is below `bar` (the module docstring)."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    ordered = sorted(levels, key=lambda r: r.level)
    bounds = [upper_bound(r, alpha) for r in ordered]
    loads = [r.level for r in ordered]
    shown = 0
    while shown < len(ordered) and bounds[shown] is not None and bounds[shown] < bar:
        shown += 1
    claim = loads[shown - 1] if shown else None
    return PromoteUpTo(
        streams_per_replica=claim, levels_judged=loads, top_level=loads[-1] if loads else None, alpha=alpha,
        bar=bar, upper_bounds=[None if b is None else round(b, 4) for b in bounds],
        reason=_reason(loads, bounds, shown, bar, alpha),
    )


def objective_bar(gates: GatesConfig) -> float:
    """The TPOT p50 ratio the objective must beat, 1 - gates.tpot_p50_min_improvement (rounded: 0.9, not 0.8999...)."""
    return round(1.0 - gates.tpot_p50_min_improvement, 6)


def promote_up_to_of(levels: Sequence[LevelRatio], gates: GatesConfig) -> PromoteUpTo:
    """`promote_up_to` at the run's own bar and alpha: the sweep phase's claim, and a resumed run's from its stored levels."""
    return promote_up_to(levels, objective_bar(gates), gates.alpha)


def _reason(loads: list[float], bounds: list[float | None], shown: int, bar: float, alpha: float) -> str:
    if not loads:
        return "no level was swept"
    confidence = f"upper ends of {1 - alpha:.0%} intervals, levels in ascending order, family-wise alpha {alpha:g}"
    passed = ", ".join(f"{load:g} ({bound:.3f})" for load, bound in zip(loads[:shown], bounds[:shown]))
    if shown == len(loads):
        return (f"the TPOT ratio is below {bar:g} at every level swept, up to the top level {loads[-1]:g} "
                f"streams per replica ({confidence}: {passed}); above {loads[-1]:g} nothing is claimed")
    stop = loads[shown]
    why = ("it has no interval (too few samples on an arm)" if bounds[shown] is None
           else f"its upper bound {bounds[shown]:.3f} is not below {bar:g}")
    if shown == 0:
        return f"not shown at the lowest level {stop:g} streams per replica: {why} ({confidence})"
    return (f"the TPOT ratio is below {bar:g} at every level up to {loads[shown - 1]:g} streams per replica "
            f"({confidence}: {passed}); not shown at {stop:g}: {why}; nothing is claimed from {stop:g} on")


def qualified_reason(decision: str | None, reason: str, claim: PromoteUpTo | None) -> str:
    """The decision's reason with the curve's qualification: only a PROMOTE whose claim stops short of the
    top level swept gains "for concurrency <= C per replica"; every other reason is returned unchanged."""
    if decision != "promote" or claim is None or not claim.below_top():
        return reason
    up_to = claim.streams_per_replica
    stop = next(load for load in claim.levels_judged if load > up_to)
    return (f"{reason}; for concurrency <= {up_to:g} per replica (the sweep shows the TPOT ratio below "
            f"{claim.bar:g} at every level up to {up_to:g}, not at {stop:g})")
