"""The prefix-cache gate (``prefix_cache_guard``): the canary's prefix-cache hit rate against the baseline's, look by look.

Why a gate: speculative decoding and the prefix cache interact (vLLM issues report a lower
hit rate with MTP, and spec decode silently zeroing hits on some models); under the same
shared-prefix load a canary that hits far less recomputes prompts the baseline serves from
its cache, a cost the latency gates see only as noise in TTFT. The hit rate is what vLLM
counts on /metrics: ``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``
(prompt tokens), summed over an arm's replicas, from the phase's start.

The judgement, built as the goodput gate's: the drop, baseline hit rate - canary hit rate,
against ``gates.prefix_cache_max_drop`` (absolute):

* PASS          the drop's upper bound is below the margin;
* FAIL          the drop's lower bound is above the margin;
* INCONCLUSIVE  otherwise, and always with counters from fewer than 2 looks, fewer than
                ``MIN_QUERIES`` queried tokens per arm, an arm whose counters were not
                read or went backwards (a restarted replica): unknown, never zero; and
                when neither arm hits (both under ``MIN_HIT_RATE``): the load shares no
                prefix the engines can hit, and 0 against 0 shows nothing.

The bounds: the two arms' looks are the same time windows under the same prompts, so the
drop is paired by look: each look's difference of the arms' hit rates, a level shared by
both arms in a look (a burst of one prefix group) cancelling in it, and the drop judged is
the mean of those differences over the looks (looks come by requests, so each carries about
the same prompt tokens; a token-weighted ratio of sums with a cluster-robust variance was
tried and, with per-look token counts that vary 3x, false-failed 0.07 at the margin). Its
standard error is the looks' spread (a paired t), the critical value the t quantile on
looks - 1 degrees of freedom at the look's alpha-spending level times a small-df correction
sized by simulation (`_t_inflation`: the nominal-level t bounds alone erred 0.055-0.063 at
alpha 0.05 over 10 looks), and the repeated intervals
of all looks are intersected (a verdict once reached is never taken back). Both sides at
``alpha``; its rollback side is a family of its own (as the goodput gate's). A look in which
an arm queried nothing has no rate: the gate is then INCONCLUSIVE.

Claimed only as far as `tests/test_prefix_cache_guard.py` simulates it: a canary exactly
at the margin, per-look rates that swing with the load and with each other.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rollout.judge.config import GatesConfig
from rollout.judge.latency import cumulative_bounds
from rollout.judge.looks import CODE_TO_VERDICT, interval_or_none, resolve_information, t_critical, upper_is_good_verdict, z
from rollout.judge.names import PREFIX_CACHE_NAME
from rollout.judge.verdicts import GateResult, Verdict

__all__ = ["MIN_QUERIES", "PrefixCacheLooks", "judge_prefix_cache"]

# fewer queried prompt tokens per arm: a few requests' worth, no rate to judge
MIN_QUERIES = 1000.0
# both arms hitting less than this: the load shares no prefix the engines can hit, nothing to compare
# (a pass on 0 against 0 would say nothing; vLLM on a hybrid model hits no prefix under ~2 blocks)
MIN_HIT_RATE = 0.01
# paths of the simulation that sizes the small-df correction of the t boundaries (`_t_inflation`)
INFLATION_PATHS = 100_000


@dataclass(frozen=True)
class PrefixCacheLooks:
    """Each arm's prefix-cache counters, cumulative from the phase's start, read at every look
    1..n (None: not read at that look, or a counter went backwards: unknown from then on)."""

    baseline: Sequence[tuple[float, float] | None]  # (hits, queries) at each look
    canary: Sequence[tuple[float, float] | None]

    def increments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """Per look (hits, queries) of baseline then canary, or None when some look is unknown."""
        columns = []
        for series in (self.baseline, self.canary):
            if not series or any(point is None for point in series):
                return None
            values = np.array(series, dtype=float)
            steps = np.diff(np.vstack([[0.0, 0.0], values]), axis=0)
            if np.any(steps < 0):  # a replica restarted: its counters began again
                return None
            columns += [steps[:, 0], steps[:, 1]]
        return columns[0], columns[1], columns[2], columns[3]


def _drop_and_se(bh: np.ndarray, bq: np.ndarray, ch: np.ndarray, cq: np.ndarray) -> tuple[float, float, float, float]:
    """(baseline rate, canary rate, drop, its standard error) over the looks given: the rates over
    all of them (hits / queries), the drop as the mean over the looks of each look's rate
    difference, and its standard error from the looks' spread (a paired t on looks - 1 df)."""
    rate_b, rate_c = bh.sum() / bq.sum(), ch.sum() / cq.sum()
    differences = bh / bq - ch / cq
    g = differences.size
    se = float(np.std(differences, ddof=1)) / math.sqrt(g) if g > 1 else math.inf
    return float(rate_b), float(rate_c), float(differences.mean()), se


@functools.lru_cache(maxsize=64)
def _t_inflation(alpha: float, planned: int, spending: str) -> float:
    """The factor (>= 1) on every look's t critical value that holds the one-sided error of the
    whole sequence of looks at ``alpha``.

    Why: a look's t bound is the t quantile on looks - 1 df at the tail probability of the
    look's z boundary (the nominal-level conversion); with as few as 1-9 df that sequence of t
    tests errs more often than the z boundaries promise (simulated: 0.055-0.063 at alpha 0.05
    over 10 looks). The t statistics of a sequence of looks of iid normal differences are
    pivotal (their joint law does not depend on the variance), so one simulation of
    ``INFLATION_PATHS`` sequences on the planned equal grid of looks, seeded, sizes the factor
    exactly for that grid; looks that come by requests are close to it.
    """
    if planned < 2 or alpha <= 0.0:
        return 1.0
    cfg = GatesConfig(alpha=alpha, spending=spending)
    rng = np.random.default_rng(20261204)
    draws = rng.standard_normal((INFLATION_PATHS, planned))
    k = np.arange(1, planned + 1)
    means = np.cumsum(draws, axis=1) / k
    squares = np.cumsum(draws**2, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        variances = (squares - k * means**2) / (k - 1)
        t_stats = means / np.sqrt(variances / k)
    ratios = []
    for look in range(2, planned + 1):  # a verdict needs 2 looks
        crit = t_critical(z(alpha, look, planned, cfg), look - 1)
        ratios.append(t_stats[:, look - 1] / crit if math.isfinite(crit) else np.zeros(INFLATION_PATHS))
    worst = np.max(np.vstack(ratios), axis=0)
    # the factor f with P(some look's t > f x its bound) = alpha: the (1 - alpha) quantile of the worst ratio
    return max(1.0, float(np.quantile(worst, 1.0 - alpha)))


def judge_prefix_cache(
    counters: PrefixCacheLooks | None,
    cfg: GatesConfig,
    look: int = 1,
    max_looks: int | None = None,
    information: Sequence[float] | None = None,
) -> GateResult:
    """Gate ``prefix_cache_guard``: canary hit rate >= baseline hit rate - ``prefix_cache_max_drop``."""
    margin = cfg.prefix_cache_max_drop
    common = dict(name=PREFIX_CACHE_NAME, metric="prefix_cache_hit_rate_drop", threshold=margin, look=look)
    if margin is None:
        return GateResult(**common, baseline=None, canary=None, verdict=Verdict.INCONCLUSIVE,
                          detail="No margin configured (gates.prefix_cache_max_drop): no prefix cache to judge.")
    steps = counters.increments() if counters is not None else None
    if steps is None:
        return GateResult(**common, baseline=None, canary=None, verdict=Verdict.INCONCLUSIVE,
                          detail="An arm's prefix-cache counters were not read at every look, or went backwards (a "
                          "restarted replica): its hit rate is unknown, so the gate cannot pass.")
    bh, bq, ch, cq = steps
    boundary_look, planned, note, fractions = resolve_information(look, max_looks, cfg, information)
    looks = min(len(bh), boundary_look)
    lower_own, upper_own = np.full(looks, -np.inf), np.full(looks, np.inf)
    usable = np.zeros(looks, dtype=bool)
    why_not = ""
    for i in range(looks):
        upto = slice(0, i + 1)
        if np.any(bq[upto] <= 0) or np.any(cq[upto] <= 0):
            why_not = "A look in which an arm queried its prefix cache for no prompt token: no rate to pair."
            break
        if bq[upto].sum() < MIN_QUERIES or cq[upto].sum() < MIN_QUERIES:
            why_not = f"Fewer than {MIN_QUERIES:g} prompt tokens queried in an arm's prefix cache: no rate to judge."
            continue
        if i < 1:
            why_not = "Needs counters from at least 2 looks: one look's rate has no spread to judge it by."
            continue
        _, _, drop, se = _drop_and_se(bh[upto], bq[upto], ch[upto], cq[upto])
        crit = t_critical(z(cfg.alpha, i + 1, planned, cfg, fractions), i) * _t_inflation(cfg.alpha, planned, cfg.spending)
        lower_own[i], upper_own[i] = drop - crit * se, drop + crit * se
        usable[i] = True
        why_not = ""
    known = np.all(bq[:looks] > 0) and np.all(cq[:looks] > 0) and looks > 0
    rate_b, rate_c, drop, _ = _drop_and_se(bh[:looks], bq[:looks], ch[:looks], cq[:looks]) if known \
        else (math.nan, math.nan, math.nan, math.nan)
    queried = looks and bq[:looks].sum() >= MIN_QUERIES and cq[:looks].sum() >= MIN_QUERIES
    if queried and known and rate_b < MIN_HIT_RATE and rate_c < MIN_HIT_RATE:
        usable[:] = False
        why_not = (f"Neither arm's prefix cache hit (baseline {rate_b:.4f}, canary {rate_c:.4f} < {MIN_HIT_RATE:g}): the "
                   "load shares no prefix the engines can hit, so there is nothing to compare.")
    lower_all, upper_all = cumulative_bounds(lower_own, upper_own, usable)
    lower, upper = (float(lower_all[-1]), float(upper_all[-1])) if looks else (-math.inf, math.inf)
    any_usable = bool(usable.any())
    verdict = CODE_TO_VERDICT[int(upper_is_good_verdict(lower, upper, margin, any_usable, any_usable))]
    if verdict is Verdict.PASS:
        reason = f"Hit-rate drop upper bound {upper:.4f} < {margin:g}: the canary's prefix cache hits as the baseline's."
    elif verdict is Verdict.FAIL:
        reason = f"Hit-rate drop lower bound {lower:.4f} > {margin:g}: the canary's prefix cache hits far less."
    elif not any_usable:
        reason = why_not
    else:
        reason = f"Hit-rate drop interval [{lower:.4f}, {upper:.4f}] holds {margin:g}."
    detail = (
        f"{reason} Prefix-cache hit rate baseline {rate_b:.4f} ({bh[:looks].sum():.0f}/{bq[:looks].sum():.0f} prompt "
        f"tokens), canary {rate_c:.4f} ({ch[:looks].sum():.0f}/{cq[:looks].sum():.0f}); the drop is the mean of "
        f"the {looks} look(s)' rate differences (paired by look), t on looks - 1 df at alpha {cfg.alpha:g} each side, "
        f"look {boundary_look}/{planned} ({cfg.spending} spending), intersected over the looks.{note}"
    )
    bounded = any_usable and math.isfinite(lower) and math.isfinite(upper)
    return GateResult(
        **common, baseline=None if math.isnan(rate_b) else rate_b, canary=None if math.isnan(rate_c) else rate_c,
        estimate=None if math.isnan(drop) else drop, n_baseline=int(bq[:looks].sum()), n_canary=int(cq[:looks].sum()),
        verdict=verdict, interval=interval_or_none(lower, upper) if bounded and lower <= upper else None, detail=detail,
    )
