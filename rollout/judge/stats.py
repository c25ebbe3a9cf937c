"""Pure statistics behind the canary gates: no I/O, numpy/scipy only.

Every function here is a plain function of numbers. Most accept numpy arrays
with any leading "batch" shape, so the same code judges one canary run (the
gates call it with 1-D samples) and thousands of simulated runs at once
(``rollout.calibration.calibrate`` calls it with a leading trials axis). That is how the
calibration proves the error rates of the code the controller actually runs.

Methods, and why these ones
---------------------------
Repeated looks -- group-sequential boundaries with alpha spending.
    The controller looks after every window and stops as soon as a verdict is
    reached. Testing each look at z = 1.645 would inflate the error rate
    (five looks at 1.96 give ~14% instead of 5%). We spend alpha over the
    ``max_looks`` planned looks with the Lan-DeMets O'Brien-Fleming-type
    spending function alpha(t) = 2 - 2 Phi(z_{1-alpha/2} / sqrt(t))
    (Lan & DeMets 1983, "Discrete sequential boundaries for clinical trials",
    Biometrika 70:659-663), which keeps early looks strict (a lucky first
    window cannot promote) and the final look close to the fixed-sample
    critical value. Boundaries come from the canonical joint distribution of
    the z statistics, Corr(Z_j, Z_k) = sqrt(t_j / t_k), by the recursive
    numerical integration of Armitage, McPherson & Rowe (1969) as described in
    Jennison & Turnbull (2000), "Group Sequential Methods with Applications
    to Clinical Trials", ch. 19. The canonical distribution holds for any
    asymptotically linear estimator (Scharfstein, Tsiatis & Robins 1997,
    JASA 92:1342-1350), which covers sample quantiles (Bahadur
    representation) and paired proportion differences.
    Intervals are repeated confidence intervals (Jennison & Turnbull 1989,
    JRSS B 51:305-361): estimate -/+ c_k * SE with the look-k boundary, so
    with probability >= 1 - 2 alpha every look's interval covers the truth;
    each one-sided decision (promote side, rollback side) errs with
    probability <= alpha over all looks together.

Looks that are not independent -- a long-run variance over the looks.
    A replica's level persists (its neighbours, its batch mix, drift), so consecutive
    looks are alike, and a cluster variance that treats G looks as independent is
    biased down; t on G - 1 df does not fix a bias. The arms' per-look contrast gets the
    Bartlett long-run variance with the whole series as bandwidth (Kiefer, Vogelsang &
    Bunzel 2000), whose null law is simulated per look count as the worst case over
    AR(1) look-to-look correlations up to a bound (``drift_long_run_variance``,
    ``drift_critical_value``): a look count's critical values are fixed numbers, the same
    in the controller and in every calibration worker.

Latency quantile ratios -- exact order-statistic bounds, widened for blocks.
    Latency is heavy-tailed (queueing, preemption stalls), so no parametric
    model. Each arm's q-quantile gets one-sided distribution-free bounds at
    the look's level a = 1 - Phi(c_k): the order statistics Y_(l), Y_(u) with
    P(Y_(u) >= xi_q) = P(Binomial(n, q) <= u - 1) >= 1 - a and likewise for l,
    exact whatever the latency distribution (``quantile_band``). A bound
    whose rank lies outside the sample does not exist (``samples_needed``
    says when the exact band fits); nothing is clipped at the sample maximum.
    Requests are not independent: a stall or a load level hits a run of
    consecutive requests. The unit of independence is a block (a look, or a
    run of consecutive requests); the variance of the share of samples below
    the quantile is estimated cluster-robustly from per-block sums of the
    centred indicators (the quantile's influence function up to the density,
    which cancels), ``design_effect`` = that variance over the binomial one.
    The rank band then becomes q -/+ t_{df, a} sqrt(deff q (1 - q) / n)
    (Woodruff 1952, "Confidence intervals for medians and other position
    measures", JASA 47:635-646; the survey-sampling interval for quantiles
    under clustering), df the Welch-Satterthwaite combination of the two
    arms' G - 1 (``welch_df``), and the band used is the wider of it and the
    exact one, so never narrower than iid. Fewer than 2 blocks: no band.
    Ties from a measurement tick move each bound to the neighbouring distinct
    value (the latent latency of a tied value lies anywhere in its tick).
    The two arms' bounds are combined on the log scale by MOVER (Zou & Donner
    2008, "Construction of confidence limits about effect measures: a
    general approach", Stat. Med. 27:1693-1702; Newcombe's interval below is
    the same construction for proportions): the ratio's upper bound is
    log Q_c - log Q_b + sqrt((U_c - log Q_c)^2 + (log Q_b - L_b)^2), exact
    per arm, asymmetric where the data are.
    ``log_quantile_with_se`` (the older symmetric, Wald-type SE read off a
    +-2 sigma band, McKean & Schrader 1984) stays for the vectorised copy in
    ``calibrate``; the judge no longer uses it.

Paired accuracy -- exact McNemar and the Tango score interval.
    Both arms answer the same items, so only discordant pairs carry
    information about the difference. The exact McNemar test (binomial test on
    the discordant pairs) says whether the arms differ at all; the
    non-inferiority verdict uses Tango's score interval for the difference of
    paired proportions (Tango 1998, "Equivalence test and confidence interval
    for the difference in proportions for the paired-sample design",
    Stat. Med. 17:891-908), recommended by Fagerland, Lydersen & Laake (2014,
    Stat. Med. 33:2850-2875) for its coverage with few discordant pairs and
    proportions near 0 or 1 (accuracies near 95%).

Clear regressions -- an always-valid betting test.
    A broken config (95% -> 1%) must fail within a few dozen items, whatever
    the look schedule. A nonnegative supermartingale ("wealth" of a bettor
    against H0: mean paired loss <= margin) can be checked after every item;
    by Ville's inequality it crosses 1/a with probability <= a under H0, for
    any number of checks (Waudby-Smith & Ramdas 2024, "Estimating means of
    bounded random variables by betting", JRSS B 86:1-27). A fixed mixture
    over betting fractions keeps it simple and free of tuning.

Error rates -- Newcombe's hybrid score interval for a difference of
    independent proportions (Newcombe 1998, Stat. Med. 17:873-890, method 10),
    built from Wilson score intervals (Wilson 1927, JASA 22:209-212): good
    coverage with zero or one error per arm, closed form.

Several guardrails -- Holm's step-down procedure (Holm 1979, Scand. J.
    Statist. 6:65-70) on the rollback side, applied to repeated (all-looks)
    tests, so the chance that any guardrail falsely fails stays <= alpha
    however many guardrails are enabled (Maurer & Bretz 2013, "Multiple
    testing in group sequential trials using graphical approaches",
    Stat. Biopharm. Res. 5:311-320).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np
from scipy import optimize, special, stats

__all__ = [
    "SpendingFunction",
    "spent_alpha",
    "sequential_boundaries",
    "critical_value",
    "boundaries_at_information",
    "log_quantile_with_se",
    "log_ratio_interval",
    "QuantileBand",
    "exact_rank_band",
    "block_rank_band",
    "samples_needed",
    "design_effect",
    "design_effect_sorted",
    "quantile_block_sums",
    "design_effect_of_block_sums",
    "paired_block_variance_factor",
    "paired_look_series",
    "drift_long_run_variance",
    "drift_critical_value",
    "lag_one_autocorrelation",
    "look_correlation_estimate",
    "folded_look_correlation",
    "count_design_effect",
    "dense_block_index",
    "tie_groups",
    "welch_df",
    "quantile_band",
    "mover_log_ratio_bounds",
    "tango_z",
    "tango_interval",
    "mcnemar_exact_pvalue",
    "wilson_interval",
    "newcombe_difference_interval",
    "betting_log_wealth",
    "holm_step_down",
    "mann_whitney_less_pvalue",
    "two_proportion_less_pvalue",
]

SpendingFunction = Literal["obrien_fleming", "pocock"]

#: Largest number of planned looks we compute boundaries for (keeps the
#: numerical integration grid fine enough and cheap).
MAX_PLANNED_LOOKS = 50


# ---------------------------------------------------------------------------
# Alpha spending and group-sequential boundaries
# ---------------------------------------------------------------------------


def spent_alpha(t: np.ndarray | float, alpha: float, spending: SpendingFunction = "obrien_fleming") -> np.ndarray:
    """Cumulative one-sided type-I error spent by information fraction ``t``.

    O'Brien-Fleming type: alpha(t) = 2 - 2 Phi(z_{1-alpha/2} / sqrt(t));
    Pocock type: alpha(t) = alpha * log(1 + (e - 1) t)  (Lan & DeMets 1983).
    Both equal ``alpha`` at t = 1 and 0 at t = 0.
    """
    t = np.clip(np.asarray(t, dtype=float), 0.0, 1.0)
    if spending == "obrien_fleming":
        z = stats.norm.isf(alpha / 2.0)
        with np.errstate(divide="ignore"):
            spent = 2.0 * stats.norm.sf(z / np.sqrt(np.where(t > 0, t, np.nan)))
        return np.where(t > 0, spent, 0.0)
    if spending == "pocock":
        return alpha * np.log1p((math.e - 1.0) * t)
    raise ValueError(f"unknown spending function {spending!r}")


def _std_normal_pdf(x: np.ndarray) -> np.ndarray:
    """stats.norm.pdf(x), the same formula, without the wrapper (a grid of ~10^6 points per look)."""
    return np.exp(-(x**2) / 2.0) / math.sqrt(2.0 * math.pi)


@lru_cache(maxsize=512)
def _boundaries_cached(alpha: float, max_looks: int, spending: str) -> tuple[float, ...]:
    return _boundaries_at_cached(alpha, tuple(float(k) / max_looks for k in range(1, max_looks + 1)), spending)


@lru_cache(maxsize=65536)
def _boundaries_at_cached(alpha: float, fractions: tuple[float, ...], spending: str) -> tuple[float, ...]:
    return _boundary_state(alpha, fractions, spending).boundaries


@dataclass(frozen=True)
class _BoundaryState:
    """The recursion after its last look: the boundaries so far and the continuation sub-density.

    ``grid``/``density``/``weights``: the sub-density of the score process S(t) = Z sqrt(t)
    (Brownian motion in information time) on the region where no boundary was crossed,
    at the last look's information, with its trapezoid weights.
    """

    boundaries: tuple[float, ...]
    grid: np.ndarray
    density: np.ndarray
    weights: np.ndarray


# A look's boundary depends only on the fractions up to it (Lan-DeMets), so the state after
# looks 1..k is cached per prefix: the controller's next look (and every simulated trial's)
# extends the schedule by one fraction and costs one step of the recursion, not k. Each step
# is computed exactly as a recursion from scratch would compute it (the same arrays in the
# same operations), so the boundaries are bit-identical to the uncached ones. Simulated trials
# look at count-dependent fractions: thousands of distinct prefixes, each state ~30 KB.
@lru_cache(maxsize=8192)
def _boundary_state(alpha: float, fractions: tuple[float, ...], spending: str) -> _BoundaryState:
    info = np.asarray(fractions, dtype=float)
    k = info.size - 1
    cumulative = spent_alpha(info, alpha, spending)  # type: ignore[arg-type]
    increments = np.diff(np.concatenate([[0.0], cumulative]))
    previous = _boundary_state(alpha, fractions[:-1], spending) if k > 0 else None
    previous_t = float(info[k - 1]) if k > 0 else 0.0
    step_sd = math.sqrt(info[k] - previous_t)
    sd_total = math.sqrt(info[k])
    increment = float(increments[k])

    if previous is None:
        z = stats.norm.isf(increment) if increment > 1e-15 else math.inf
        b = z * sd_total
    elif increment <= 1e-15:
        b = math.inf
    else:
        grid, density, weights = previous.grid, previous.density, previous.weights
        mass = weights * density

        def exceed(b_: float) -> float:
            # special.ndtr(-x) is stats.norm.sf(x) without the distribution wrapper's
            # per-call argument checks, which dominated calibrate's time
            return float(np.sum(mass * special.ndtr((grid - b_) / step_sd))) - increment

        lo, hi = -12.0 * sd_total, 40.0 * sd_total
        if exceed(lo) < 0:  # cannot spend that much (numerically): boundary at -inf
            b = lo
        else:
            b = optimize.brentq(exceed, lo, hi, xtol=1e-10, rtol=1e-12)

    # Propagate the continuation sub-density to this look's grid.
    upper = min(b, 12.0 * sd_total)
    lower = -12.0 * sd_total
    h = min(0.02, step_sd / 8.0)
    n_points = max(int(math.ceil((upper - lower) / h)) + 1, 3)
    new_grid = np.linspace(lower, upper, n_points)
    new_weights = np.full(n_points, (upper - lower) / (n_points - 1))
    new_weights[[0, -1]] *= 0.5
    if previous is None:
        new_density = stats.norm.pdf(new_grid, scale=sd_total)
    else:
        kernel = _std_normal_pdf((new_grid[:, None] - previous.grid[None, :]) / step_sd) / step_sd
        new_density = kernel @ (previous.weights * previous.density)
    for array in (new_grid, new_density, new_weights):
        array.flags.writeable = False  # shared by every schedule that extends this one
    earlier = previous.boundaries if previous is not None else ()
    return _BoundaryState((*earlier, b / sd_total), new_grid, new_density, new_weights)


def sequential_boundaries(
    alpha: float, max_looks: int, spending: SpendingFunction = "obrien_fleming"
) -> np.ndarray:
    """One-sided critical z values c_1..c_K for ``max_looks`` equally spaced looks.

    Under H0, P(Z_k >= c_k for some k <= K) = alpha, where Z_1..Z_K have the
    canonical joint distribution with information fractions k/K. ``inf``
    marks a look that spends no alpha. Cached: the judges call this on every
    look.
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if not 1 <= max_looks <= MAX_PLANNED_LOOKS:
        raise ValueError(f"max_looks must be in [1, {MAX_PLANNED_LOOKS}], got {max_looks}")
    return np.array(_boundaries_cached(float(alpha), int(max_looks), str(spending)))


def boundaries_at_information(
    alpha: float, fractions: Sequence[float], spending: SpendingFunction = "obrien_fleming"
) -> np.ndarray:
    """One-sided critical z values for looks at the observed information fractions.

    Lan-DeMets: the boundary of look k depends only on t_1..t_k, so a
    controller that looks when the data arrive (not on a fixed grid) spends
    alpha(t_k) - alpha(t_{k-1}) at look k. ``fractions`` must increase
    strictly within (0, 1]; a last fraction below 1 leaves alpha unspent
    (conservative), one at 1 spends all of it.
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    # rounded so that cached schedules are shared; 1e-4 of information is far below any look's step
    info = tuple(round(float(t), 4) for t in fractions)
    if not info or len(info) > MAX_PLANNED_LOOKS:
        raise ValueError(f"between 1 and {MAX_PLANNED_LOOKS} information fractions are needed, got {len(info)}")
    if info[0] <= 0.0 or info[-1] > 1.0 or any(b <= a for a, b in zip(info, info[1:])):
        raise ValueError(f"information fractions must increase strictly within (0, 1], got {info}")
    return np.array(_boundaries_at_cached(float(alpha), info, str(spending)))


def critical_value(
    alpha: float, look: int, max_looks: int, spending: SpendingFunction = "obrien_fleming"
) -> float:
    """Critical z at ``look`` of ``max_looks``; looks past the plan reuse the last one.

    ``alpha`` <= 0 means "this side spends nothing": +inf.
    """
    if alpha <= 0.0:
        return math.inf
    if look < 1:
        raise ValueError(f"look must be >= 1, got {look}")
    return float(sequential_boundaries(alpha, max_looks, spending)[min(look, max_looks) - 1])


# ---------------------------------------------------------------------------
# Latency: quantiles and their ratios
# ---------------------------------------------------------------------------

#: Half-width, in binomial standard deviations, of the order-statistic band
#: used to estimate a quantile's standard error. 2 is Price & Bonett's choice
#: for the median (c = (n+1)/2 - sqrt(n)); narrower bands are noisier, wider
#: ones reach into the tail where heavy-tailed latencies are erratic.
ORDER_STATISTIC_BAND_Z = 2.0


@lru_cache(maxsize=65536)
def _order_statistic_plan(n: int, q: float, band_z: float) -> tuple[int, float, int, int, float]:
    """(lo index, interpolation fraction, band l index, band u index, z of the band)."""
    position = (n - 1) * q  # Hyndman & Fan type 7 (numpy's default) point estimate
    lo = int(math.floor(position))
    frac = position - lo
    half = band_z * math.sqrt(n * q * (1.0 - q))
    l_rank = max(1, int(math.floor(n * q - half)))
    u_rank = min(n, int(math.ceil(n * q + half)) + 1)
    if u_rank <= l_rank:
        u_rank = min(n, l_rank + 1)
        l_rank = max(1, u_rank - 1)
    # P(Y_(l) <= xi_q < Y_(u)) = P(l <= B <= u - 1), B ~ Binomial(n, q): exact,
    # whatever the latency distribution.
    coverage = stats.binom.cdf(u_rank - 1, n, q) - stats.binom.cdf(l_rank - 1, n, q)
    coverage = min(max(coverage, 1e-12), 1.0 - 1e-16)
    z_band = float(stats.norm.isf((1.0 - coverage) / 2.0))
    return lo, frac, l_rank - 1, u_rank - 1, z_band


def log_quantile_with_se(
    sorted_samples: np.ndarray, q: float, band_z: float = ORDER_STATISTIC_BAND_Z
) -> tuple[np.ndarray, np.ndarray]:
    """Log of the q-quantile and a Wald-type standard error read off an order-statistic band.

    ``sorted_samples``: positive values sorted along the last axis (any leading
    batch shape, the last axis is one arm's samples, at least 2).
    Returns (log quantile, SE of log quantile), each of the batch shape.

    Kept for ``calibrate``'s vectorised copy only: the band is clipped at the
    sample's ends (below n ~ 190 for a p95) and a symmetric SE is read off an
    asymmetric band, so intervals built from it are not the exact binomial
    ones; ties make the SE zero; and it assumes independent requests. The
    judge uses ``quantile_band`` and ``mover_log_ratio_bounds`` instead.
    """
    x = np.asarray(sorted_samples, dtype=float)
    n = x.shape[-1]
    if n < 2:
        raise ValueError("need at least 2 samples for a quantile standard error")
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q}")
    lo, frac, l_idx, u_idx, z_band = _order_statistic_plan(n, float(q), float(band_z))
    hi = min(lo + 1, n - 1)
    value = x[..., lo] + frac * (x[..., hi] - x[..., lo])
    log_value = np.log(value)
    se = (np.log(x[..., u_idx]) - np.log(x[..., l_idx])) / (2.0 * z_band)
    return log_value, se


def log_ratio_interval(
    log_baseline: np.ndarray,
    se_baseline: np.ndarray,
    log_canary: np.ndarray,
    se_canary: np.ndarray,
    z_lower: float | np.ndarray,
    z_upper: float | np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Ratio canary/baseline with an interval from independent log estimates.

    Returns (log ratio, SE, log lower bound, log upper bound); the lower bound
    uses ``z_lower``, the upper ``z_upper`` (each may be inf: unbounded).
    Swapping the arms negates the log ratio and swaps the bounds exactly.
    """
    log_ratio = np.asarray(log_canary) - np.asarray(log_baseline)
    se = np.sqrt(np.asarray(se_baseline) ** 2 + np.asarray(se_canary) ** 2)
    with np.errstate(invalid="ignore"):
        lower = log_ratio - np.where(np.isinf(z_lower), np.inf, np.asarray(z_lower) * se)
        upper = log_ratio + np.where(np.isinf(z_upper), np.inf, np.asarray(z_upper) * se)
    return log_ratio, se, lower, upper


@lru_cache(maxsize=65536)
def exact_rank_band(n: int, q: float, level: float) -> tuple[int, int]:
    """1-based ranks (l, u) of the exact one-sided order-statistic bounds of the q-quantile.

    P(Y_(l) <= xi_q) >= 1 - level and P(Y_(u) >= xi_q) >= 1 - level for any
    continuous distribution, because the count of samples below xi_q is
    Binomial(n, q). A rank outside 1..n (l < 1 or u > n) means that bound
    does not exist in a sample of n: ``samples_needed`` says how many it takes.
    """
    if level <= 0.0:
        return 0, n + 1
    u = int(stats.binom.ppf(1.0 - level, n, q)) + 1
    # ppf(level) is the smallest k with cdf(k) >= level, so cdf(l - 1) < level.
    l = max(int(stats.binom.ppf(level, n, q)), 0)
    return l, u


def welch_df(variance_a: float, df_a: float, variance_b: float, df_b: float) -> float:
    """Welch-Satterthwaite degrees of freedom of the sum of two independent variance estimates.

    Between min(df_a, df_b) and df_a + df_b; a non-finite variance leaves the
    other arm no say (the df of the non-finite one).
    """
    if not (math.isfinite(variance_a) and math.isfinite(variance_b)):
        return float(df_a if not math.isfinite(variance_a) else df_b)
    denominator = variance_a**2 / df_a + variance_b**2 / df_b
    if denominator <= 0.0:
        return float(min(df_a, df_b))
    return float((variance_a + variance_b) ** 2 / denominator)


@lru_cache(maxsize=4096)
def _t_upper_quantile(level: float, df: float) -> float:
    return -float(special.stdtrit(df, level))  # by symmetry, exact for tiny levels


def block_rank_band(
    n: int, q: float, level: float, deff: float, n_blocks: int, df: float | None = None, critical: float | None = None
) -> tuple[int, int]:
    """Ranks (l, u) of the block-robust band: the wider of the exact band and Woodruff's.

    Woodruff's band is n q -/+ t_df sqrt(deff n q (1 - q)) with the one-sided
    t quantile at ``level``; ``df`` defaults to G - 1 = ``n_blocks`` - 1 (the
    cluster variance is estimated from G block sums; a ratio of two arms may
    pass the Welch-Satterthwaite df of the pair, `welch_df`). Taking the
    wider of it and the exact binomial band keeps it never narrower than iid.
    Fewer than 2 blocks: no band (0, n + 1). ``critical``, when given, replaces the t
    quantile (the drift-robust law of blocks that are time-ordered looks).
    """
    l_exact, u_exact = exact_rank_band(n, q, level)
    if n_blocks < 2 or not math.isfinite(deff) or level <= 0.0:
        return 0, n + 1
    if critical is None:
        df = float(n_blocks - 1) if df is None else max(float(df), 1.0)
        critical = _t_upper_quantile(level, round(df, 2))
    if not math.isfinite(critical):
        return 0, n + 1
    half = critical * math.sqrt(max(deff, 0.0) * n * q * (1.0 - q))
    l_block = int(math.floor(n * q - half))
    u_block = int(math.ceil(n * q + half)) + 1
    return min(l_exact, l_block), max(u_exact, u_block)


@lru_cache(maxsize=4096)
def samples_needed(q: float, level: float) -> int:
    """Smallest n whose exact band at ``level`` lies inside the sample: q^n < level and (1 - q)^n < level."""
    if not 0.0 < level < 1.0:
        return 0 if level >= 1.0 else 10**9
    n = max(1, int(math.ceil(math.log(level) / math.log(max(q, 1.0 - q)))) - 1)
    while True:
        l, u = exact_rank_band(n, q, level)
        if l >= 1 and u <= n:
            return n
        n += 1


def design_effect(values: np.ndarray, blocks: np.ndarray, q: float) -> float:
    """Variance of the share of samples below the q-quantile, block-robust over binomial (iid).

    ``values``: one arm's samples (+inf allowed: failed requests), any order;
    ``blocks``: the block (look, or run of consecutive requests) of each.
    The indicator 1{y <= Q} (a tied group at Q counted by the share of it
    below rank n q, so ties do not leak the order of arrival into it) is the
    quantile's influence function up to the density, which cancels in the
    ratio. Cluster-robust sum over blocks with the G / (G - 1) small-sample
    factor. 1 for independent requests on average; a stall run or a per-block
    latency level makes it larger. NaN with fewer than 2 blocks.
    """
    y = np.asarray(values, dtype=float).ravel()
    b = np.asarray(blocks).ravel()
    if y.size != b.size:
        raise ValueError(f"one block id per value needed: {b.size} for {y.size}")
    n = y.size
    if n == 0 or not 0.0 < q < 1.0:
        return float("nan")
    block_index, n_blocks = dense_block_index(b)
    if n_blocks < 2:
        return float("nan")
    order = np.argsort(y, kind="stable")
    return design_effect_sorted(y[order], order, block_index, n_blocks, q)


def dense_block_index(blocks: np.ndarray) -> tuple[np.ndarray, int]:
    """(dense 0-based index of each block id in sorted order, number of blocks): np.unique's inverse.

    Non-negative integer ids (looks, runs of requests) are counted by bincount instead
    of sorted; the index is the same.
    """
    if blocks.size and blocks.dtype.kind in "iu" and int(blocks.min()) >= 0:
        present = np.bincount(blocks) > 0
        rank = np.cumsum(present) - 1
        return rank[blocks], int(present.sum())
    block_index = np.unique(blocks, return_inverse=True)[1]
    return block_index, int(block_index.max()) + 1 if block_index.size else 0


def tie_groups(sorted_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first index, size) of every run of equal values in a sorted array: np.unique's
    ``return_index`` / ``return_counts`` on it, without sorting it again."""
    n = sorted_values.size
    starts = np.empty(n, dtype=bool)
    if n:
        starts[0] = True
        np.not_equal(sorted_values[1:], sorted_values[:-1], out=starts[1:])
    first = np.flatnonzero(starts)
    return first, np.diff(np.append(first, n))


def design_effect_sorted(
    sorted_values: np.ndarray,
    order: np.ndarray,
    block_index: np.ndarray,
    n_blocks: int,
    q: float,
    groups: tuple[np.ndarray, np.ndarray] | None = None,
) -> float:
    """`design_effect` of values already sorted: ``sorted_values = values[order]`` (a stable argsort),
    ``block_index`` the dense block index of each value in the original order, ``n_blocks`` >= 2,
    ``groups`` its `tie_groups` when the caller has them."""
    block_sums = quantile_block_sums(sorted_values, order, block_index, n_blocks, q, groups)
    return design_effect_of_block_sums(block_sums, sorted_values.size, q)


def design_effect_of_block_sums(block_sums: np.ndarray, n: int, q: float) -> float:
    """`design_effect` from the blocks' `quantile_block_sums` (at least 2 blocks) of n samples."""
    g = block_sums.size
    return g / (g - 1) * float(np.sum(block_sums**2)) / (n * q * (1.0 - q))


def quantile_block_sums(
    sorted_values: np.ndarray,
    order: np.ndarray,
    block_index: np.ndarray,
    n_blocks: int,
    q: float,
    groups: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """Per block, the sum of 1{y <= Q} - q over its samples (arguments as `design_effect_sorted`).

    The q-quantile's estimation error is -(these sums' total) / (n density): the
    quantile's influence per block, which `design_effect_sorted` squares and two arms'
    paired blocks difference (`paired_block_variance_factor`).
    """
    n = sorted_values.size
    first, counts = groups if groups is not None else tie_groups(sorted_values)
    below_share = np.clip((n * q - first) / counts, 0.0, 1.0)
    indicator = np.empty(n)
    indicator[order] = np.repeat(below_share, counts)
    return np.bincount(block_index, weights=indicator - q, minlength=n_blocks)


def paired_block_variance_factor(
    ids_a: np.ndarray, sums_a: np.ndarray, scale_a: float, ids_b: np.ndarray, sums_b: np.ndarray, scale_b: float
) -> float:
    """Block-robust variance of log Q_b - log Q_a over the sum of the arms' own: 1 when the arms' blocks are
    independent, < 1 when a block's level is shared by both arms, > 1 when it is opposed between them.

    ``ids_*``: the blocks (looks: the same time windows for both arms) with samples;
    ``sums_*``: `quantile_block_sums` per block; ``scale_*``: 1 / (n density of the log)
    of that arm's quantile, so scale x sum is the block's share of the log quantile's
    error. A block one arm lacks counts 0 for it. Cluster-robust with G / (G - 1) over
    the union of blocks, each arm's own over its blocks. NaN without 2 blocks or
    without variance.
    """
    if ids_a.size < 2 or ids_b.size < 2:
        return float("nan")
    a, b, contrast = paired_look_series(ids_a, sums_a, scale_a, ids_b, sums_b, scale_b)
    g = contrast.size
    own = ids_a.size / (ids_a.size - 1) * float(np.sum(a**2)) + ids_b.size / (ids_b.size - 1) * float(np.sum(b**2))
    if not (math.isfinite(own) and own > 0.0):
        return float("nan")
    return g / (g - 1) * float(np.sum(contrast**2)) / own


def paired_look_series(
    ids_a: np.ndarray, sums_a: np.ndarray, scale_a: float, ids_b: np.ndarray, sums_b: np.ndarray, scale_b: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arm a's, arm b's, the contrast b - a) share of the log quantiles' error per look, in look order.

    Arguments as `paired_block_variance_factor`; a look one arm lacks counts 0 for it.
    """
    ids = np.union1d(ids_a, ids_b)
    a = np.zeros(ids.size)
    b = np.zeros(ids.size)
    a[np.searchsorted(ids, ids_a)] = scale_a * sums_a
    b[np.searchsorted(ids, ids_b)] = scale_b * sums_b
    return a, b, b - a


def drift_long_run_variance(series: np.ndarray) -> np.ndarray:
    """Long-run variance of the sum of a time-ordered series (last axis), robust to dependence across it.

    The Bartlett-kernel HAC estimator with the bandwidth the whole series
    (Kiefer, Vogelsang & Bunzel 2000, "Simple robust testing of regression
    hypotheses", Econometrica 68:695-714): sum_l (1 - |l|/G) sum_t u_t u_t+l of the
    demeaned series, equal to (2 / G) sum_t S_t^2 over its partial sums S_t, here
    times 3 G^2 / (G^2 - 1) so that it is on the scale of the sum of squares that
    treats the looks as independent (both have mean G sigma^2 for independent looks).
    Every autocovariance enters, so a level that persists across looks widens the
    interval instead of hiding in G independent-looking blocks; its null law is
    not a t: `drift_critical_value` gives the critical values.
    """
    x = np.asarray(series, dtype=float)
    g = x.shape[-1]
    u = x - x.mean(axis=-1, keepdims=True)
    partial = np.cumsum(u, axis=-1)[..., :-1]
    return 2.0 / g * np.sum(partial**2, axis=-1) * (3.0 * g * g / max(g * g - 1, 1))


def lag_one_autocorrelation(series: np.ndarray) -> float:
    """The lag-1 autocorrelation of a time-ordered series (NaN with fewer than 3 points or no variance)."""
    x = np.asarray(series, dtype=float).ravel()
    if x.size < 3:
        return float("nan")
    u = x - x.mean()
    denominator = float(np.sum(u**2))
    return float(np.sum(u[1:] * u[:-1]) / denominator) if denominator > 0.0 else float("nan")


#: gates.look_correlation_max's default: the laws every run's critical values are drawn from.
LOOK_CORRELATION_DEFAULT = 0.5
#: Looks before a contrast's own look-to-look correlation is read (fewer: too noisy to say anything).
LOOK_CORRELATION_MIN_LOOKS = 6
#: The largest look-to-look correlation the critical values are folded up to; a series that looks more
#: persistent than this (a random walk, a trend) is beyond what any of them covers.
LOOK_CORRELATION_CEILING = 0.9
#: Folded correlations are rounded up to this grid: few distinct laws to simulate, none below the estimate.
LOOK_CORRELATION_STEP = 0.05


def look_correlation_estimate(series: np.ndarray) -> float:
    """The look-to-look correlation of a short time-ordered series, its lag-1 autocorrelation corrected for
    the small-sample bias (E r ~ rho - (1 + 3 rho) / G, Marriott & Pope 1954, solved for rho); at most 1.

    NaN before `LOOK_CORRELATION_MIN_LOOKS` points or without variance.
    """
    x = np.asarray(series, dtype=float).ravel()
    g = x.size
    r = lag_one_autocorrelation(x)
    if g < LOOK_CORRELATION_MIN_LOOKS or not math.isfinite(r):
        return float("nan")
    return float(min((g * r + 1.0) / (g - 3.0), 1.0))


def folded_look_correlation(estimate: float, planned: float) -> float:
    """The correlation the critical values hold for: the plan's, or the estimate rounded up to the next
    `LOOK_CORRELATION_STEP` when it is larger (at most `LOOK_CORRELATION_CEILING`)."""
    if not math.isfinite(estimate) or estimate <= planned:
        return planned
    steps = math.ceil(round(estimate / LOOK_CORRELATION_STEP, 9))
    return max(planned, min(round(steps * LOOK_CORRELATION_STEP, 3), LOOK_CORRELATION_CEILING))


def count_design_effect(events_per_block: np.ndarray, trials_per_block: np.ndarray) -> float:
    """Variance of an event count (errors) over blocks (looks), cluster-robust over binomial; at least 1.

    Errors come in bursts (a stalled replica times out everything in flight at once): a burst
    of B errors in one look is one piece of evidence, not B. Cluster-robust with G / (G - 1)
    over the blocks with trials; 1 with fewer than 2 such blocks or no events (nothing to
    measure a burst by: the binomial count).
    """
    events = np.asarray(events_per_block, dtype=float).ravel()
    trials = np.asarray(trials_per_block, dtype=float).ravel()
    keep = trials > 0
    events, trials = events[keep], trials[keep]
    g, n, k = events.size, float(trials.sum()), float(events.sum())
    if g < 2 or k <= 0.0 or k >= n:
        return 1.0
    p = k / n
    clustered = g / (g - 1) * float(np.sum((events - p * trials) ** 2))
    return max(1.0, clustered / (n * p * (1.0 - p)))


# Critical values of t = G mean / sqrt(drift_long_run_variance) at one-sided levels, by simulation.
_DRIFT_LEVELS = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.025, 0.01, 0.005, 0.0025, 0.001, 0.0005, 0.00025])
_DRIFT_DRAWS = 400_000  # both tails pooled: 800,000 per law, >= 200 beyond the smallest level
_DRIFT_CHUNK = 50_000


@lru_cache(maxsize=256)
def _drift_null_quantiles(g: int, rho: float) -> np.ndarray:
    """Upper quantiles (at `_DRIFT_LEVELS`) of t over G looks of a stationary AR(1) series with lag-1
    correlation ``rho`` (0: independent looks): the precomputed law (rollout.judge.drift_table) where the
    table has it, else simulated here, with the same fixed seed either way."""
    from rollout.judge.drift_table import DRIFT_QUANTILES  # ~100 KB of constants: only when a look needs them

    known = DRIFT_QUANTILES.get((g, rho))
    return np.array(known) if known is not None else simulate_drift_null_quantiles(g, rho)


def simulate_drift_null_quantiles(g: int, rho: float) -> np.ndarray:
    """`_drift_null_quantiles` by simulation. A fixed seed per (G, rho): every process, the controller's
    and each calibration worker's, gets the very same critical values."""
    rng = np.random.default_rng([20261207, g, int(round(rho * 1000))])
    draws = []
    innovation_sd = math.sqrt(1.0 - rho * rho)
    for _ in range(_DRIFT_DRAWS // _DRIFT_CHUNK):
        e = rng.standard_normal((_DRIFT_CHUNK, g))
        for t in range(1, g):
            e[:, t] = rho * e[:, t - 1] + innovation_sd * e[:, t]
        lrv = drift_long_run_variance(e)
        t_stat = e.sum(axis=1) / np.sqrt(np.maximum(lrv, 1e-300))
        draws.append(t_stat)
        draws.append(-t_stat)
    pooled = np.concatenate(draws)
    return np.quantile(pooled, 1.0 - _DRIFT_LEVELS)


@lru_cache(maxsize=4096)
def drift_critical_value(level: float, looks: int, correlation: float) -> float:
    """One-sided critical value at ``level`` of the drift-robust t over ``looks`` paired looks.

    The largest over look-to-look correlations 0 .. ``correlation`` of an AR(1) level, so a
    gate holds its level for any such dependence (the worst case is the pure AR(1) series;
    sampling noise inside a look only lowers the correlation the looks see). Levels below
    the simulated ones extend the tail as a power law through its last two points (the
    statistic's tail is polynomial, as a t's), which errs toward wider bounds there.
    """
    if looks < 2:
        return math.inf
    if level >= 0.5:
        return 0.0
    # a correlation folded above the plan's default (`folded_look_correlation`) adds its own law to the default's
    # grid: the quantiles rise with the correlation, so the laws in between add nothing but simulation time
    base = min(correlation, LOOK_CORRELATION_DEFAULT)
    grid = (0.0,) if correlation <= 0.0 else tuple(sorted({0.0, base / 2.0, base, correlation}))
    quantiles = np.max([_drift_null_quantiles(int(looks), round(float(rho), 3)) for rho in grid], axis=0)
    log_levels, log_values = np.log(_DRIFT_LEVELS), np.log(np.maximum(quantiles, 1e-12))
    x = math.log(max(level, 1e-300))
    if x <= log_levels[-1]:  # past the simulated tail: a power law through the last two points
        slope = (log_values[-1] - log_values[-2]) / (log_levels[-1] - log_levels[-2])
        return float(math.exp(log_values[-1] + slope * (x - log_levels[-1])))
    if x >= log_levels[0]:
        return float(quantiles[0])
    return float(math.exp(np.interp(x, log_levels[::-1], log_values[::-1])))


@dataclass(frozen=True)
class QuantileBand:
    """One arm's q-quantile with its one-sided bounds at one level (log scale).

    ``log_lower`` = -inf / ``log_upper`` = +inf where that bound does not
    exist (its rank lies outside the sample, or on a failed request's +inf).
    ``in_sample``: both ranks inside 1..n. ``tie_widened``: the bounds moved
    to the neighbouring distinct values because the sample has ties.
    """

    log_estimate: float
    log_lower: float
    log_upper: float
    lower_rank: int
    upper_rank: int
    n: int
    in_sample: bool
    tie_widened: bool

    @property
    def among_failures(self) -> bool:
        """Even the lower bound falls on failed requests: the quantile is +inf, no finite bound exists."""
        return self.log_lower == math.inf

    @property
    def degenerate(self) -> bool:
        """A zero-width band proves nothing (every sample in it tied, no resolution to widen by)."""
        return not self.among_failures and not self.log_lower < self.log_upper


def _log(value: float) -> float:
    if value <= 0.0:
        return -math.inf
    return math.log(value)


def quantile_band(
    sorted_values: np.ndarray,
    q: float,
    level: float,
    deff: float = 1.0,
    n_blocks: int | None = None,
    df: float | None = None,
    distinct: np.ndarray | None = None,
    critical: float | None = None,
) -> QuantileBand:
    """The q-quantile of one arm and its one-sided bounds at ``level``, from its sorted samples.

    ``sorted_values``: positive samples in ascending order, failed requests as
    +inf at the end (they count as the slowest, so dropping a slow tail as
    errors cannot lower a quantile). ``n_blocks`` None: independent requests
    (the exact band); else the block-robust band with design effect ``deff``
    (t on ``df`` degrees of freedom, default ``n_blocks`` - 1).
    With ties (quantised latencies) a bound moves to the next distinct value
    outwards (past the last one: one resolution step, the smallest gap), since
    the latent latency of a tied value may lie anywhere in its tick.
    ``distinct``: the distinct finite values, when the caller has them (an arm's
    bands at several levels share them), else computed here. ``critical``: the
    block-robust band's critical value in place of t's (`drift_critical_value`).
    """
    y = np.asarray(sorted_values, dtype=float)
    n = int(y.size)
    if n < 1:
        raise ValueError("need at least one sample for a quantile band")
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q}")
    position = (n - 1) * q  # Hyndman & Fan type 7 (numpy's default) point estimate
    lo = int(math.floor(position))
    hi = min(lo + 1, n - 1)
    if math.isinf(y[hi]):
        estimate = y[hi] if position > lo or math.isinf(y[lo]) else y[lo]
    else:
        estimate = y[lo] + (position - lo) * (y[hi] - y[lo])
    if n_blocks is None:
        l, u = exact_rank_band(n, float(q), float(level))
    else:
        l, u = block_rank_band(n, float(q), float(level), float(deff), int(n_blocks), df, critical)
    lower = float(y[l - 1]) if 1 <= l <= n else 0.0
    upper = float(y[u - 1]) if 1 <= u <= n else math.inf
    finite_mask = np.isfinite(y)
    n_finite = int(np.count_nonzero(finite_mask))
    if distinct is None:
        distinct = np.unique(y[finite_mask])
    tied = distinct.size < n_finite
    # One distinct value has no resolution to widen by: the band stays degenerate (never a pass).
    if tied and distinct.size > 1:
        resolution = float(np.min(np.diff(distinct)))
        if lower > 0.0:
            i = int(np.searchsorted(distinct, lower, side="left")) - 1
            lower = float(distinct[i]) if i >= 0 else max(lower - resolution, 0.0)
        if math.isfinite(upper):
            i = int(np.searchsorted(distinct, upper, side="right"))
            upper = float(distinct[i]) if i < distinct.size else upper + resolution
    return QuantileBand(
        log_estimate=_log(float(estimate)),
        log_lower=_log(lower),
        log_upper=_log(upper),
        lower_rank=int(l),
        upper_rank=int(u),
        n=n,
        in_sample=bool(l >= 1 and u <= n),
        tie_widened=bool(tied),
    )


def mover_log_ratio_bounds(baseline: QuantileBand, canary: QuantileBand) -> tuple[float, float, float]:
    """(log ratio, lower, upper) of canary / baseline from the arms' bounds at one level (MOVER).

    upper = r + sqrt((U_c - c)^2 + (b - L_b)^2), lower = r - sqrt((c - L_c)^2 + (U_b - b)^2),
    r = c - b: each arm's own (asymmetric, exact) distance to its bound, as
    Newcombe's interval combines Wilson limits. A side whose ingredients are
    not all finite is unbounded. Swapping the arms mirrors the bounds exactly.
    """
    b, c = baseline.log_estimate, canary.log_estimate
    ratio = c - b if (math.isfinite(b) or math.isfinite(c)) else math.nan
    up_parts = (canary.log_upper, c, b, baseline.log_lower)
    low_parts = (canary.log_lower, c, b, baseline.log_upper)
    upper = ratio + math.hypot(canary.log_upper - c, b - baseline.log_lower) if all(map(math.isfinite, up_parts)) else math.inf
    lower = ratio - math.hypot(c - canary.log_lower, baseline.log_upper - b) if all(map(math.isfinite, low_parts)) else -math.inf
    return ratio, lower, upper


# ---------------------------------------------------------------------------
# Paired proportions: McNemar and Tango
# ---------------------------------------------------------------------------


def tango_z(n12: np.ndarray, n21: np.ndarray, n: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """Tango's score statistic for H0: p12 - p21 = delta (paired design).

    ``n12``: pairs where only the first member succeeds (e.g. baseline right,
    canary wrong); ``n21`` the reverse; ``n`` all pairs. Decreasing in delta.
    The nuisance p21 is its maximum-likelihood value under H0 (closed form,
    Tango 1998 eq. 6).
    """
    n12, n21, n, delta = np.broadcast_arrays(*(np.asarray(a, dtype=float) for a in (n12, n21, n, delta)))
    w = -n12 - n21 + (2.0 * n - n12 + n21) * delta
    disc = np.maximum(w * w + 8.0 * n * n21 * delta * (1.0 - delta), 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        p21 = (np.sqrt(disc) - w) / (4.0 * n)
        variance = n * (2.0 * p21 + delta * (1.0 - delta))
        numerator = n12 - n21 - n * delta
        z = np.where(variance > 1e-300, numerator / np.sqrt(np.maximum(variance, 1e-300)), np.sign(numerator) * np.inf)
    return np.where(numerator == 0.0, 0.0, z)


def _solve_decreasing(func, target: np.ndarray, lo: float, hi: float, iterations: int = 60) -> np.ndarray:
    """Vectorised bisection for func(x) = target with func decreasing on (lo, hi)."""
    target = np.asarray(target, dtype=float)
    a = np.full(target.shape, lo, dtype=float)
    b = np.full(target.shape, hi, dtype=float)
    for _ in range(iterations):
        mid = 0.5 * (a + b)
        go_right = func(mid) > target
        a = np.where(go_right, mid, a)
        b = np.where(go_right, b, mid)
    return 0.5 * (a + b)


def tango_interval(
    n12: np.ndarray, n21: np.ndarray, n: np.ndarray, z_lower: float | np.ndarray, z_upper: float | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Score interval for p12 - p21: {delta : -z_upper <= Z(delta) <= z_lower}.

    Because Z is decreasing, the lower bound solves Z(L) = z_lower and the
    upper bound Z(U) = -z_upper. An infinite z leaves that side at -1 or 1.
    """
    n12, n21, n, z_lower, z_upper = np.broadcast_arrays(
        *(np.asarray(a, dtype=float) for a in (n12, n21, n, z_lower, z_upper))
    )
    lower = _solve_decreasing(lambda d: tango_z(n12, n21, n, d), z_lower, -1.0, 1.0)
    upper = _solve_decreasing(lambda d: tango_z(n12, n21, n, d), -z_upper, -1.0, 1.0)
    return lower, upper


def mcnemar_exact_pvalue(n12: np.ndarray, n21: np.ndarray) -> np.ndarray:
    """Two-sided exact McNemar p-value: binomial test of n12 vs n21 at 1/2."""
    n12 = np.asarray(n12, dtype=float)
    n21 = np.asarray(n21, dtype=float)
    discordant = n12 + n21
    smaller = np.minimum(n12, n21)
    p = np.minimum(1.0, 2.0 * stats.binom.cdf(smaller, discordant, 0.5))
    return np.where(discordant > 0, p, 1.0)


# ---------------------------------------------------------------------------
# Independent proportions: Wilson and Newcombe
# ---------------------------------------------------------------------------


def wilson_interval(k: np.ndarray, n: np.ndarray, z: float | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval for a binomial proportion (z may be inf: (0, 1))."""
    k = np.asarray(k, dtype=float)
    n = np.asarray(n, dtype=float)
    z = np.asarray(z, dtype=float)
    finite = np.isfinite(z)
    zf = np.where(finite, z, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = k / n
        denom = 1.0 + zf * zf / n
        centre = (p + zf * zf / (2.0 * n)) / denom
        half = zf * np.sqrt(p * (1.0 - p) / n + zf * zf / (4.0 * n * n)) / denom
    lower = np.where(finite, np.clip(centre - half, 0.0, 1.0), 0.0)
    upper = np.where(finite, np.clip(centre + half, 0.0, 1.0), 1.0)
    return lower, upper


def newcombe_difference_interval(
    k_baseline: np.ndarray,
    n_baseline: np.ndarray,
    k_canary: np.ndarray,
    n_canary: np.ndarray,
    z_lower: float | np.ndarray,
    z_upper: float | np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Newcombe hybrid score interval for p_canary - p_baseline.

    Returns (difference, lower, upper); the lower bound is built from Wilson
    limits at ``z_lower``, the upper bound from Wilson limits at ``z_upper``.
    """
    kb, nb, kc, nc = (np.asarray(a, dtype=float) for a in (k_baseline, n_baseline, k_canary, n_canary))
    pb, pc = kb / nb, kc / nc
    diff = pc - pb
    lb_lo, ub_lo = wilson_interval(kb, nb, z_lower)
    lc_lo, uc_lo = wilson_interval(kc, nc, z_lower)
    lb_hi, ub_hi = wilson_interval(kb, nb, z_upper)
    lc_hi, uc_hi = wilson_interval(kc, nc, z_upper)
    lower = diff - np.sqrt((pc - lc_lo) ** 2 + (ub_lo - pb) ** 2)
    upper = diff + np.sqrt((uc_hi - pc) ** 2 + (pb - lb_hi) ** 2)
    return diff, lower, upper


# ---------------------------------------------------------------------------
# Always-valid early stop: betting wealth
# ---------------------------------------------------------------------------

#: Betting fractions (of the largest safe bet) mixed with equal weight.
BETTING_FRACTIONS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9)


def betting_log_wealth(x: np.ndarray, null_mean: float, lower_bound: float) -> np.ndarray:
    """Log wealth after each observation of a bettor against H0: E[x] <= null_mean.

    ``x``: observations along the last axis, each >= ``lower_bound``. The
    wealth is the equal-weight mixture over ``BETTING_FRACTIONS`` of
    prod_i (1 + lambda (x_i - null_mean)), lambda = fraction / (null_mean -
    lower_bound), a nonnegative supermartingale under H0 (Waudby-Smith &
    Ramdas 2024). By Ville's inequality P(max_t wealth_t >= 1/a) <= a under H0,
    however often it is checked. Returns log wealth, same shape as ``x``.
    """
    x = np.asarray(x, dtype=float)
    if null_mean <= lower_bound:
        raise ValueError("null_mean must exceed the lower bound of the observations")
    scale = 1.0 / (null_mean - lower_bound)
    total: np.ndarray | None = None
    for fraction in BETTING_FRACTIONS:
        log_wealth = np.cumsum(np.log1p(fraction * scale * (x - null_mean)), axis=-1)
        total = log_wealth if total is None else np.logaddexp(total, log_wealth)
    assert total is not None
    return total - math.log(len(BETTING_FRACTIONS))


# ---------------------------------------------------------------------------
# Multiplicity
# ---------------------------------------------------------------------------


def holm_step_down(crossings: np.ndarray) -> np.ndarray:
    """Holm's step-down rejections from level-wise test outcomes.

    ``crossings[..., j, i]`` says whether hypothesis j is rejected by its own
    test at level alpha / (m - i), i = 0..m-1 (monotone in i: a rejection at
    a smaller level implies one at every larger level). Holm's step i passes
    when at least i + 1 hypotheses are rejected at alpha / (m - i), i.e. the
    (i+1)-th smallest p-value is <= alpha / (m - i). Returns rejected[..., j].
    """
    crossings = np.asarray(crossings, dtype=bool)
    m = crossings.shape[-1]
    if crossings.shape[-2] != m:
        raise ValueError("crossings must be (..., m, m): hypotheses x Holm steps")
    if m == 0:
        return np.zeros(crossings.shape[:-1], dtype=bool)
    counts = crossings.sum(axis=-2)
    step_ok = counts >= np.arange(1, m + 1)
    n_rejected = np.cumprod(step_ok, axis=-1).sum(axis=-1)
    step = np.clip(n_rejected - 1, 0, m - 1)
    index = np.broadcast_to(step[..., None, None], crossings.shape[:-1] + (1,))
    at_final_level = np.take_along_axis(crossings, index, axis=-1)[..., 0]
    return at_final_level & (n_rejected > 0)[..., None]


# ---------------------------------------------------------------------------
# Comparators used by the calibration (what other canary tools do)
# ---------------------------------------------------------------------------


def mann_whitney_less_pvalue(baseline: np.ndarray, canary: np.ndarray) -> np.ndarray:
    """One-sided Mann-Whitney p-value that the canary is stochastically smaller.

    Kayenta's judge runs a two-sided Mann-Whitney per metric at 98%
    confidence; a one-sided p < 0.01 in the good direction is the same call.
    Normal approximation with tie correction, along the last axis.
    """
    return stats.mannwhitneyu(canary, baseline, alternative="less", axis=-1, method="asymptotic").pvalue


def two_proportion_less_pvalue(k_baseline: np.ndarray, k_canary: np.ndarray, n: int | np.ndarray) -> np.ndarray:
    """One-sided pooled two-proportion z-test p-value that canary accuracy is lower.

    The unpaired test a tool that ignores the pairing would run on the same
    items (fixed horizon).
    """
    kb = np.asarray(k_baseline, dtype=float)
    kc = np.asarray(k_canary, dtype=float)
    n = np.asarray(n, dtype=float)
    pooled = (kb + kc) / (2.0 * n)
    se = np.sqrt(pooled * (1.0 - pooled) * 2.0 / n)
    with np.errstate(invalid="ignore", divide="ignore"):
        z = (kb - kc) / n / se
    z = np.where(se > 0, z, 0.0)
    return special.ndtr(-z)
