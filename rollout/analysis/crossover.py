"""Where speculation stops paying: the crossover load of a sweep, and the adaptive sweep's next level (pure).

Speculative decoding buys TPOT with spare compute, so the canary/baseline TPOT p50 ratio
grows with the load (streams per replica) and at some load crosses 1.0 (no gain) and,
before that, the objective's bar (1 - gates.tpot_p50_min_improvement). This module owns
that estimate: numbers in, estimate out, no I/O (rollout.analysis.load_sweep turns request records
into the numbers; rollout.run.phases.sweep runs the levels).

Per level: the ratio and its interval (`ratio_interval`)
    The sweep pins every prompt to both arms, back to back, so the unit of the resample is
    the prompt (its baseline and its canary TPOT together; a prompt with one arm only keeps
    that arm). Pairing lets a stall or a load burst that hits both arms at once cancel in the
    ratio instead of widening it, which per-arm bands combined as independent (MOVER, as the
    HTML report draws) cannot do. Requests close in time are correlated (a busy core, a long
    prefill, one arm's replica falling behind for a while): resampling prompts one by one
    would treat them as independent and give intervals that are too narrow. So the resample
    is a circular moving-block bootstrap over the prompts in send order (Kunsch 1989; Politis
    & Romano 1992), blocks of `block_length(n)` consecutive prompts, which keeps any
    correlation shorter than a block. The statistic is the log ratio of the two sample
    medians (no closed-form variance holds for it under correlation); the interval is the
    full sample's log ratio -/+ t(n_blocks - 1) times the bootstrap's standard deviation,
    because a spread estimated from ~sqrt(n) blocks is itself uncertain (the plain percentile
    interval covered 0.83-0.85 at 50-80 prompts in the strongly correlated scenario, this one
    0.90-0.94; see `block_length`). The bootstrap is seeded: the same records give the same
    interval.

The crossover (`crossing`)
    Between the last level below the bar and the first at or above it, the ratio is taken
    linear in log(load) (the shape "gain shrinks as the batch grows" has: a straight line in
    log streams), and the crossing is where that line meets the bar. Its interval is where the
    per-level interval band crosses: the lower end where the band's upper edge first reaches
    the bar, the upper end after the last level whose lower edge is still below it. If the
    true ratio is a line in log(load) between two levels and both levels' intervals cover it,
    the crossing interval covers the true crossing, so with 95% two-sided intervals per level
    the coverage is at least ~90%. Measured on 400 adaptive sweeps of correlated records
    (tests/test_crossover.py: a shock both arms share, AR(1) rho 0.9; each arm's own slow
    stretches, AR(1) rho 0.8): 0.983 for the bar 0.9 and 0.985 for 1.0, while the per-level
    intervals covered 0.916 of the levels. A side of the interval that lies beyond the swept
    range is None.

The adaptive sweep (`next_level`)
    Doubling from `start` until the ratio (its point estimate) reaches the highest bar or
    `max_level`, then bisection (geometric midpoint: the interpolation is in log(load))
    between the last winning and the first losing level of each bar in turn, until the
    bracket is at most `min_step` wide or `max_levels` levels ran. A pure function of the
    levels done, so the phase (or a resumed run) needs no planner state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy import stats as scipy_stats

__all__ = [
    "CONFIDENCE",
    "AdaptivePolicy",
    "Crossing",
    "LevelResult",
    "RatioInterval",
    "block_length",
    "crossing",
    "next_level",
    "ratio_interval",
]

CONFIDENCE = 0.95  # two-sided, per level: informational (no gate reads it), so no spending over levels
RESAMPLES = 1000  # the interval uses the resamples' standard deviation, which 1000 pin down to ~2%
MIN_SAMPLES_PER_ARM = 5  # fewer TPOT samples in an arm: a median ratio, but no interval


class LevelResult(BaseModel):
    """One load level of the sweep: the canary/baseline TPOT p50 ratio with its interval."""

    model_config = ConfigDict(extra="forbid")

    level: float = Field(description="closed-loop streams per replica")
    ratio: float | None = Field(description="canary/baseline TPOT p50; None: an arm has no TPOT sample")
    ratio_low: float | None = Field(description="lower end of the ratio's 95% interval (None: too few samples)")
    ratio_high: float | None = Field(description="upper end of the ratio's 95% interval")
    pairs: int = Field(description="prompts with a TPOT on both arms (the paired units of the resample)")
    block: int | None = Field(description="prompts per bootstrap block")
    # what the interval is made of, so a judgement at another confidence (rollout.judge.load_curve) needs no
    # records: the bootstrap's standard deviation of log(ratio) and its degrees of freedom (blocks - 1)
    log_sd: float | None = Field(None, description="bootstrap standard deviation of log(ratio) (None: no interval)")
    dof: int | None = Field(None, description="degrees of freedom of log_sd: bootstrap blocks - 1")
    tokens_per_s: float | None = Field(None, description="output tokens/s per replica at this level (mean of the arms)")


class Crossing(BaseModel):
    """Where the ratio crosses one bar: the load (and offered tokens/s), with its interval, or why not."""

    model_config = ConfigDict(extra="forbid")

    bar: float = Field(description="the ratio crossed: 1.0 (no gain) or the objective's 1 - tpot_p50_min_improvement")
    level: float | None = Field(description="streams per replica where the ratio reaches the bar; None: see reason")
    level_low: float | None = Field(description="lower end of its interval; None: below the lowest level swept")
    level_high: float | None = Field(description="upper end of its interval; None: above the top level swept")
    offered_tokens_per_s: float | None = Field(description="output tokens/s per replica at `level` (interpolated)")
    reason: str


class AdaptivePolicy(BaseModel):
    """How the adaptive sweep picks its levels (streams per replica)."""

    model_config = ConfigDict(extra="forbid")

    start: float = Field(gt=0, description="first level")
    max_level: float = Field(gt=0, description="doubling stops here")
    min_step: float = Field(gt=0, description="bisection stops when the bracket is at most this wide")
    max_levels: int = Field(ge=1, description="levels in all, doubling and bisection together")
    bars: tuple[float, ...] = Field(description="ratios to bracket, the first refined first (the objective's bar)")
    resolution: float = Field(gt=0, description="levels are multiples of this (one closed-loop user)")


class RatioInterval(NamedTuple):
    ratio: float | None
    low: float | None
    high: float | None
    block: int | None
    log_sd: float | None = None  # the bootstrap's standard deviation of log(ratio)
    dof: int | None = None  # its degrees of freedom: blocks - 1


def block_length(n: int) -> int:
    """Prompts per bootstrap block: ~sqrt(n), so a level of 50-200 prompts keeps correlation over 7-14
    consecutive prompts (a stall or a slow stretch of one replica), while still giving sqrt(n) blocks
    to resample. The usual n^(1/3) (optimal for the variance of smooth statistics under weak
    dependence) covered 0.83-0.91 per level in the strongly correlated scenario of the tests, sqrt(n)
    0.90-0.94 (with the t widening of `ratio_interval`); independent prompts: 0.97-0.99."""
    return max(1, round(math.sqrt(n)))


def ratio_interval(
    baseline: Sequence[float] | np.ndarray,
    canary: Sequence[float] | np.ndarray,
    *,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> RatioInterval:
    """Canary/baseline ratio of TPOT medians with a paired moving-block bootstrap interval.

    `baseline[i]` and `canary[i]` are the TPOTs of prompt i, prompts in send order; NaN where
    that arm has no sample of the prompt (a failed request, a pair split by the level's end)."""
    b = np.asarray(baseline, dtype=float)
    c = np.asarray(canary, dtype=float)
    if b.shape != c.shape or b.ndim != 1:
        raise ValueError("baseline and canary must be 1-D and aligned by prompt")
    nb, nc = int(np.sum(~np.isnan(b))), int(np.sum(~np.isnan(c)))
    if nb == 0 or nc == 0:
        return RatioInterval(None, None, None, None)
    ratio = float(np.nanmedian(c) / np.nanmedian(b))
    if min(nb, nc) < MIN_SAMPLES_PER_ARM:
        return RatioInterval(ratio, None, None, None)
    n = b.size
    block = block_length(n)
    rng = np.random.default_rng(seed)
    n_blocks = math.ceil(n / block)
    starts = rng.integers(0, n, size=(resamples, n_blocks))
    index = ((starts[:, :, None] + np.arange(block)) % n).reshape(resamples, -1)[:, :n]
    log_ratio = np.log(_medians(c[index])) - np.log(_medians(b[index]))
    log_ratio = log_ratio[np.isfinite(log_ratio)]
    if log_ratio.size < 0.99 * resamples or n_blocks < 2:  # an arm missing from many resamples: too sparse
        return RatioInterval(ratio, None, None, block)
    # the bootstrap's spread comes from n_blocks blocks, so it carries about n_blocks - 1 degrees of
    # freedom (as batch means do): t, not z, and centred on the full sample's ratio
    log_sd = float(np.std(log_ratio, ddof=1))
    half = float(scipy_stats.t.ppf(0.5 + confidence / 2.0, n_blocks - 1)) * log_sd
    return RatioInterval(ratio, ratio * math.exp(-half), ratio * math.exp(half), block, log_sd, n_blocks - 1)


def _medians(values: np.ndarray) -> np.ndarray:
    """Row medians; NaN (an arm's missing sample) left out. A row with no sample gives NaN, not a warning."""
    if not np.isnan(values).any():
        return np.median(values, axis=1)
    out = np.full(values.shape[0], np.nan)
    has = ~np.isnan(values).all(axis=1)
    out[has] = np.nanmedian(values[has], axis=1)
    return out


# -- the crossover ---------------------------------------------------------------------------------
def crossing(levels: Sequence[LevelResult], bar: float) -> Crossing:
    """Where the ratio first reaches `bar` (interpolated in log(load)), with the interval of the band."""
    usable = sorted((r for r in levels if r.ratio is not None), key=lambda r: r.level)
    left_out = sorted(r.level for r in levels if r.ratio is None)
    note = f"; levels without a TPOT ratio left out: {', '.join(f'{x:g}' for x in left_out)}" if left_out else ""
    if not usable:
        return Crossing(bar=bar, level=None, level_low=None, level_high=None, offered_tokens_per_s=None,
                        reason="no level has a TPOT ratio (no successful request on an arm)" + note)
    loads = [r.level for r in usable]
    ratios = [r.ratio for r in usable]
    # a level without an interval counts as a band covering everything: it never narrows the interval
    upper = [math.inf if r.ratio_high is None else r.ratio_high for r in usable]
    lower = [-math.inf if r.ratio_low is None else r.ratio_low for r in usable]
    low, high = _band_crossing(loads, upper, lower, bar)
    first = next((j for j, ratio in enumerate(ratios) if ratio >= bar), None)
    if first == 0:
        reason = f"not paying at the lowest level {loads[0]:g} (ratio {ratios[0]:.3f} >= {bar:g})"
        level = tokens = None
    elif first is None:
        reason = f"still paying at the top level {loads[-1]:g} (ratio {ratios[-1]:.3f} < {bar:g})"
        level = tokens = None
    else:
        t = _fraction(ratios[first - 1], ratios[first], bar)
        level = _between(loads[first - 1], loads[first], t)
        a, b = usable[first - 1].tokens_per_s, usable[first].tokens_per_s
        tokens = _between(a, b, t) if a and b else None
        reason = (f"the ratio reaches {bar:g} between {loads[first - 1]:g} ({ratios[first - 1]:.3f}) and "
                  f"{loads[first]:g} ({ratios[first]:.3f}) streams per replica")
    return Crossing(bar=bar, level=_round(level), level_low=_round(low), level_high=_round(high),
                    offered_tokens_per_s=_round(tokens, 2), reason=reason + note)


def _band_crossing(loads: list[float], upper: list[float], lower: list[float], bar: float) -> tuple[float | None, float | None]:
    """(low, high): where the band's upper edge first reaches the bar, and where its lower edge last leaves
    it from below. None: that end lies beyond the swept range."""
    first_up = next((j for j, u in enumerate(upper) if u >= bar), None)
    if first_up is None:
        low = loads[-1]  # paying, with confidence, at every level: the crossing lies above the top
    elif first_up == 0:
        low = None
    else:
        low = _between(loads[first_up - 1], loads[first_up], _fraction(upper[first_up - 1], upper[first_up], bar))
    last_below = max((i for i, lo in enumerate(lower) if lo < bar), default=None)
    if last_below is None:
        high = loads[0]  # not paying, with confidence, at any level: the crossing lies below the lowest
    elif last_below == len(loads) - 1:
        high = None
    else:
        high = _between(loads[last_below], loads[last_below + 1], _fraction(lower[last_below], lower[last_below + 1], bar))
    return low, high


def _fraction(y0: float, y1: float, bar: float) -> float:
    """Where between y0 (< bar) and y1 (>= bar) the line meets the bar; an infinite end (no interval there)
    puts the crossing at the other, finite level: the interval then cannot be narrower than the levels allow."""
    if not math.isfinite(y0):
        return 1.0
    if not math.isfinite(y1):
        return 0.0
    return min(1.0, max(0.0, (bar - y0) / (y1 - y0))) if y1 > y0 else 1.0


def _between(x0: float, x1: float, t: float) -> float:
    """The point a fraction t of the way from x0 to x1 on the log scale."""
    return math.exp(math.log(x0) + t * (math.log(x1) - math.log(x0)))


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


# -- the adaptive sweep ----------------------------------------------------------------------------
def next_level(done: Sequence[LevelResult], policy: AdaptivePolicy) -> float | None:
    """The next level to run, or None when the sweep is done (a level without a ratio ends it: it cannot steer)."""
    if len(done) >= policy.max_levels:
        return None
    if not done:
        return _snap(policy.start, policy.resolution)
    if any(r.ratio is None for r in done):
        return None
    ordered = sorted(done, key=lambda r: r.level)
    top = ordered[-1]
    if all(r.ratio < max(policy.bars) for r in ordered) and top.level < policy.max_level:
        return _snap(min(2.0 * top.level, policy.max_level), policy.resolution)
    for bar in policy.bars:
        first = next((j for j, r in enumerate(ordered) if r.ratio >= bar), None)
        if first is None or first == 0:
            continue  # never reached in range, or already at the lowest level: nothing to bisect
        lo, hi = ordered[first - 1].level, ordered[first].level
        if hi - lo <= policy.min_step:
            continue
        mid = _inside(math.sqrt(lo * hi), lo, hi, policy.resolution)
        if mid is not None:
            return mid
    return None


def _snap(level: float, resolution: float) -> float:
    return max(resolution, round(round(level / resolution) * resolution, 6))


def _inside(level: float, lo: float, hi: float, resolution: float) -> float | None:
    """`level` on the grid, strictly between lo and hi (the nearest grid point that is), else None."""
    for candidate in sorted({_snap(level, resolution), round(math.floor(level / resolution) * resolution, 6),
                             round(math.ceil(level / resolution) * resolution, 6)}, key=lambda x: abs(x - level)):
        if lo < candidate < hi:
            return candidate
    return None
