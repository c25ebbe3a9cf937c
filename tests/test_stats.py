"""Tests of rollout/judge/stats.py: each method against published values or an independent computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize
from scipy import stats as sps

from rollout.judge import stats

Z95 = sps.norm.isf(0.025)


# --- group-sequential boundaries ---------------------------------------------------


def test_obrien_fleming_boundaries_match_published_values():
    # Lan-DeMets O'Brien-Fleming-type spending, 5 equally spaced looks, one-sided
    # 0.025 (the familiar two-sided 0.05 design): 4.877, 3.357, 2.680, 2.290, 2.031.
    expected = [4.877, 3.357, 2.680, 2.290, 2.031]
    assert stats.sequential_boundaries(0.025, 5) == pytest.approx(expected, abs=2e-3)


def test_pocock_type_boundaries_match_published_values():
    expected = [2.438, 2.427, 2.410, 2.397, 2.386]
    assert stats.sequential_boundaries(0.025, 5, "pocock") == pytest.approx(expected, abs=2e-3)


def test_single_look_is_the_fixed_sample_critical_value():
    assert stats.sequential_boundaries(0.05, 1)[0] == pytest.approx(sps.norm.isf(0.05), abs=1e-9)


def test_boundaries_hold_alpha_over_all_looks_by_monte_carlo():
    looks, alpha = 5, 0.05
    c = stats.sequential_boundaries(alpha, looks)
    rng = np.random.default_rng(3)
    increments = rng.standard_normal((200_000, looks)) * math.sqrt(1 / looks)
    z = np.cumsum(increments, axis=1) / np.sqrt(np.arange(1, looks + 1) / looks)
    crossed = (z >= c).any(axis=1).mean()
    assert crossed == pytest.approx(alpha, abs=3 * math.sqrt(alpha * (1 - alpha) / 200_000))
    # Testing every look at the fixed-sample value would not: the reason for spending.
    naive = (z >= sps.norm.isf(alpha)).any(axis=1).mean()
    assert naive > 0.1


def test_boundaries_decrease_over_looks_and_looks_past_the_plan_reuse_the_last():
    c = stats.sequential_boundaries(0.05, 8)
    assert np.all(np.diff(c) < 0)
    assert stats.critical_value(0.05, 12, 8) == c[-1]
    assert stats.critical_value(0.0, 1, 8) == math.inf


def test_spending_is_zero_at_start_and_alpha_at_the_end():
    for spending in ("obrien_fleming", "pocock"):
        assert stats.spent_alpha(0.0, 0.05, spending) == 0.0
        assert stats.spent_alpha(1.0, 0.05, spending) == pytest.approx(0.05)


# --- quantiles ------------------------------------------------------------------------


def test_log_quantile_point_estimate_is_numpys_default_quantile():
    rng = np.random.default_rng(0)
    x = np.sort(rng.lognormal(size=257))
    for q in (0.5, 0.9, 0.95):
        log_q, se = stats.log_quantile_with_se(x, q)
        assert math.exp(float(log_q)) == pytest.approx(np.quantile(x, q))
        assert se > 0


def test_quantile_se_tracks_the_sampling_spread_of_the_median():
    # Exponential(1): asymptotic SD of log median = sqrt(1/(4n)) / (f(m) m) with m = ln 2, f(m) = 1/2.
    rng = np.random.default_rng(1)
    n = 400
    x = np.sort(rng.exponential(size=(4000, n)), axis=-1)
    log_q, se = stats.log_quantile_with_se(x, 0.5)
    asymptotic = math.sqrt(1 / (4 * n)) / (0.5 * math.log(2))
    assert float(np.std(log_q)) == pytest.approx(asymptotic, rel=0.08)
    assert float(np.median(se)) == pytest.approx(asymptotic, rel=0.15)


def test_quantile_interval_coverage_for_heavy_tailed_latency():
    rng = np.random.default_rng(2)
    trials, n = 4000, 300

    def draw():
        x = rng.lognormal(0, 0.6, (trials, n))
        stall = rng.random((trials, n)) < 0.03
        return np.sort(np.where(stall, x * (1 + rng.pareto(1.5, (trials, n))), x), axis=-1)

    a, b = draw(), draw()
    for q in (0.5, 0.95):
        la, sa = stats.log_quantile_with_se(a, q)
        lb, sb = stats.log_quantile_with_se(b, q)
        _, _, lower, upper = stats.log_ratio_interval(la, sa, lb, sb, 1.645, 1.645)
        # Each one-sided error <= 5% within simulation error.
        assert np.mean(lower > 0) < 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
        assert np.mean(upper < 0) < 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)


def test_log_ratio_interval_mirrors_when_arms_swap():
    ratio, se, lower, upper = stats.log_ratio_interval(1.0, 0.1, 1.2, 0.2, 1.7, 2.1)
    ratio_s, se_s, lower_s, upper_s = stats.log_ratio_interval(1.2, 0.2, 1.0, 0.1, 2.1, 1.7)
    assert ratio_s == pytest.approx(-ratio) and se_s == pytest.approx(se)
    assert (lower_s, upper_s) == pytest.approx((-upper, -lower))


# --- paired proportions ------------------------------------------------------------------


def _tango_z_by_numerical_mle(n12: int, n21: int, n: int, delta: float) -> float:
    """Tango's score statistic with the restricted MLE found numerically (independent check)."""
    concordant = n - n12 - n21

    def negative_log_likelihood(p21: float) -> float:
        p12 = p21 + delta
        rest = 1 - p12 - p21
        terms = [(n12, p12), (n21, p21), (concordant, rest)]
        return -sum(count * math.log(max(prob, 1e-300)) for count, prob in terms if count > 0)

    low = max(0.0, -delta) + 1e-12
    high = (1 - delta) / 2 - 1e-12
    p21 = optimize.minimize_scalar(negative_log_likelihood, bounds=(low, high), method="bounded", options={"xatol": 1e-12}).x
    return (n12 - n21 - n * delta) / math.sqrt(n * (2 * p21 + delta * (1 - delta)))


@pytest.mark.parametrize("n12,n21,n,delta", [(10, 3, 100, 0.02), (25, 5, 300, 0.1), (4, 9, 60, -0.05), (7, 0, 50, 0.3)])
def test_tango_closed_form_mle_matches_numerical_mle(n12, n21, n, delta):
    assert float(stats.tango_z(n12, n21, n, delta)) == pytest.approx(_tango_z_by_numerical_mle(n12, n21, n, delta), abs=1e-4)


def test_tango_interval_with_no_discordant_pairs_has_closed_form():
    lower, upper = stats.tango_interval(0, 0, 100, Z95, Z95)
    bound = Z95**2 / (100 + Z95**2)
    assert float(upper) == pytest.approx(bound, abs=1e-9)
    assert float(lower) == pytest.approx(-bound, abs=1e-9)


@given(
    n12=st.integers(0, 60),
    n21=st.integers(0, 60),
    concordant=st.integers(0, 300),
    z=st.floats(0.5, 4.0),
)
@settings(max_examples=60, deadline=None)
def test_tango_interval_contains_estimate_and_solves_the_score_equation(n12, n21, concordant, z):
    n = n12 + n21 + concordant
    if n == 0:
        return
    lower, upper = (float(v) for v in stats.tango_interval(n12, n21, n, z, z))
    estimate = (n12 - n21) / n
    assert -1 <= lower <= estimate + 1e-9 and estimate - 1e-9 <= upper <= 1
    if lower > -1 + 1e-9:
        assert float(stats.tango_z(n12, n21, n, lower)) == pytest.approx(z, abs=1e-6)
    # Swapping the members mirrors the interval.
    lower_s, upper_s = (float(v) for v in stats.tango_interval(n21, n12, n, z, z))
    assert (lower_s, upper_s) == pytest.approx((-upper, -lower), abs=1e-9)


def test_mcnemar_exact_matches_binomial_test():
    for n12, n21 in [(10, 2), (0, 0), (5, 5), (0, 7), (30, 12)]:
        expected = sps.binomtest(n21, n12 + n21, 0.5).pvalue if n12 + n21 else 1.0
        assert float(stats.mcnemar_exact_pvalue(n12, n21)) == pytest.approx(expected)


# --- independent proportions -----------------------------------------------------------------


def test_wilson_and_newcombe_match_newcombe_1998_examples():
    # Newcombe (1998) Stat Med 17:857 and 17:873, worked examples.
    lower, upper = stats.wilson_interval(81, 263, Z95)
    assert (float(lower), float(upper)) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    diff, lower, upper = stats.newcombe_difference_interval(48, 80, 56, 70, Z95, Z95)
    assert (float(diff), float(lower), float(upper)) == pytest.approx((0.2, 0.0524, 0.3339), abs=1e-4)
    _, lower, upper = stats.newcombe_difference_interval(0, 10, 0, 10, Z95, Z95)
    assert (float(lower), float(upper)) == pytest.approx((-0.2775, 0.2775), abs=1e-4)


def test_infinite_z_leaves_that_side_unbounded():
    lower, upper = stats.wilson_interval(3, 10, math.inf)
    assert (float(lower), float(upper)) == (0.0, 1.0)


# --- always-valid betting ---------------------------------------------------------------------


def test_betting_rule_holds_its_level_under_the_null_whatever_the_checks():
    rng = np.random.default_rng(5)
    margin, level = 0.02, 0.01
    # Paired loss with mean exactly at the margin: +1 w.p. 0.035, -1 w.p. 0.015.
    u = rng.random((4000, 1000))
    x = np.where(u < 0.035, 1.0, np.where(u < 0.05, -1.0, 0.0))
    wealth = stats.betting_log_wealth(x, margin, -1.0)
    assert np.mean(wealth.max(axis=1) >= math.log(1 / level)) <= level + 3 * math.sqrt(level / 4000)


def test_betting_rule_catches_a_broken_config_within_a_few_dozen_items():
    rng = np.random.default_rng(6)
    x = (rng.random((500, 60)) < 0.95).astype(float) - (rng.random((500, 60)) < 0.01)
    wealth = stats.betting_log_wealth(x, 0.02, -1.0)
    assert (wealth.max(axis=1) >= math.log(100)).all()


# --- Holm ----------------------------------------------------------------------------------------


def _holm_by_p_values(p: np.ndarray, alpha: float) -> np.ndarray:
    order = np.argsort(p)
    m = len(p)
    rejected = np.zeros(m, bool)
    for i, j in enumerate(order):
        if p[j] <= alpha / (m - i):
            rejected[j] = True
        else:
            break
    return rejected


@given(st.lists(st.floats(0.0, 0.2), min_size=1, max_size=5))
@settings(max_examples=80, deadline=None)
def test_holm_from_crossings_equals_holm_on_p_values(p_values):
    p = np.array(p_values)
    alpha, m = 0.05, len(p)
    levels = np.array([alpha / (m - i) for i in range(m)])
    crossings = p[:, None] <= levels[None, :]
    assert np.array_equal(stats.holm_step_down(crossings), _holm_by_p_values(p, alpha))


# --- comparators -------------------------------------------------------------------------------


def test_comparator_p_values_point_the_right_way():
    rng = np.random.default_rng(7)
    base = rng.lognormal(0, 0.3, 500)
    assert stats.mann_whitney_less_pvalue(base, base * 0.8) < 0.01
    assert stats.mann_whitney_less_pvalue(base * 0.8, base) > 0.5
    assert stats.two_proportion_less_pvalue(950, 900, 1000) < 0.01
    assert stats.two_proportion_less_pvalue(900, 950, 1000) > 0.5


# --- exact, block-robust quantile bands --------------------------------------------------------


@pytest.mark.parametrize("n,q", [(30, 0.5), (80, 0.95), (200, 0.95), (200, 0.5)])
def test_exact_rank_band_is_the_tightest_binomial_band(n, q):
    """Rule: the bounds are the exact order-statistic ones (binomial), not a band read as a Wald SE."""
    level = 0.05
    lower, upper = stats.exact_rank_band(n, q, level)
    if upper <= n:
        assert sps.binom.cdf(upper - 1, n, q) >= 1 - level > sps.binom.cdf(upper - 2, n, q)
    if lower >= 1:
        assert sps.binom.cdf(lower - 1, n, q) < level <= sps.binom.cdf(lower, n, q)


def test_exact_rank_band_covers_by_monte_carlo():
    """Rule: each one-sided bound errs with probability <= its level for any continuous latency distribution."""
    rng = np.random.default_rng(21)
    trials, level = 20_000, 0.05
    for n, q in ((60, 0.95), (120, 0.5)):
        x = np.sort(rng.exponential(size=(trials, n)), axis=-1)
        truth = -math.log(1 - q)
        lower, upper = stats.exact_rank_band(n, q, level)
        tolerance = 3 * math.sqrt(level * (1 - level) / trials)
        assert np.mean(x[:, upper - 1] < truth) <= level + tolerance
        assert np.mean(x[:, lower - 1] > truth) <= level + tolerance


def test_a_p95_band_is_never_clipped_at_the_sample_maximum():
    """Rule: below the n its band needs, a quantile has no bound (the old band was clipped at the max: coverage 0.77
    at n = 30); samples_needed says how many it takes: the smallest n with 0.95^n < level."""
    lower, upper = stats.exact_rank_band(30, 0.95, 0.05)
    assert upper > 30
    assert stats.samples_needed(0.95, 0.05) == 59  # 0.95^58 = 0.0510, 0.95^59 = 0.0485
    band = stats.quantile_band(np.arange(1.0, 31.0), 0.95, 0.05)
    assert not band.in_sample and band.log_upper == math.inf


def test_design_effect_is_one_for_independent_requests_and_grows_with_a_shared_level():
    """Rule: the design effect estimates variance(blocks) / variance(iid) of the quantile: ~1 when requests are
    independent, large when a block's requests share a latency level."""
    rng = np.random.default_rng(22)
    blocks = np.repeat(np.arange(10), 20)
    iid = [stats.design_effect(rng.lognormal(0, 0.25, 200), blocks, 0.5) for _ in range(2000)]
    assert np.mean(iid) == pytest.approx(1.0, abs=0.06)
    shared = [stats.design_effect(rng.lognormal(0, 0.25, 200) * np.repeat(rng.lognormal(0, 0.1, 10), 20), blocks, 0.5) for _ in range(500)]
    assert np.mean(shared) > 2.0
    assert math.isnan(stats.design_effect(np.ones(5), np.zeros(5), 0.5))  # one block: not identifiable


def test_design_effect_does_not_read_the_arrival_order_of_ties():
    """Rule: a tied group at the quantile counts by its share below rank n q, not by its order (which runs with the
    blocks): 200 equal values have no between-block variance at all."""
    blocks = np.repeat(np.arange(10), 20)
    assert stats.design_effect(np.full(200, 0.03), blocks, 0.5) == pytest.approx(0.0, abs=1e-12)


@given(
    n=st.integers(10, 2000),
    q=st.sampled_from([0.5, 0.9, 0.95]),
    level=st.floats(1e-5, 0.2),
    deff=st.floats(0.0, 8.0),
    blocks=st.integers(2, 40),
)
@settings(max_examples=80, deadline=None)
def test_block_band_is_never_narrower_than_the_exact_band(n, q, level, deff, blocks):
    """Rule: the block-robust band contains the iid exact band, whatever the estimated design effect."""
    l_exact, u_exact = stats.exact_rank_band(n, q, level)
    l_block, u_block = stats.block_rank_band(n, q, level, deff, blocks)
    assert l_block <= l_exact and u_block >= u_exact


def test_one_block_gives_no_band():
    assert stats.block_rank_band(500, 0.5, 0.05, 1.0, 1) == (0, 501)


def test_tied_bounds_move_to_the_neighbouring_distinct_values():
    """Rule: with a measurement tick the latent latency of a tied value lies anywhere in its tick, so a bound on a
    tied value moves outwards to the next distinct value (past the last one: one resolution step)."""
    values = np.sort(np.repeat([0.028, 0.029, 0.030, 0.031, 0.032], [50, 100, 200, 100, 50]))
    band = stats.quantile_band(values, 0.5, 0.05)
    assert band.tie_widened
    assert math.exp(band.log_lower) == pytest.approx(0.029) and math.exp(band.log_upper) == pytest.approx(0.031)
    assert not band.degenerate
    continuous = stats.quantile_band(np.sort(np.random.default_rng(3).lognormal(size=500)), 0.5, 0.05)
    assert not continuous.tie_widened


def test_failed_requests_as_inf_remove_the_upper_bound_they_reach():
    """Rule: failed requests are +inf ranks; a bound whose rank falls on one does not exist."""
    values = np.concatenate([np.linspace(0.1, 1.0, 97), np.full(3, np.inf)])
    band = stats.quantile_band(values, 0.95, 0.05)
    assert band.in_sample and band.log_upper == math.inf and math.isfinite(band.log_lower)
    assert stats.quantile_band(np.concatenate([values[:90], np.full(10, np.inf)]), 0.95, 0.05).among_failures


def test_mover_bounds_mirror_when_arms_swap_and_are_wald_for_symmetric_bands():
    a = stats.QuantileBand(0.0, -0.2, 0.3, 1, 2, 100, True, False)
    b = stats.QuantileBand(0.5, 0.4, 0.55, 1, 2, 100, True, False)
    ratio, lower, upper = stats.mover_log_ratio_bounds(a, b)
    ratio_s, lower_s, upper_s = stats.mover_log_ratio_bounds(b, a)
    assert (ratio_s, lower_s, upper_s) == pytest.approx((-ratio, -upper, -lower))
    assert upper == pytest.approx(0.5 + math.hypot(0.05, 0.2)) and lower == pytest.approx(0.5 - math.hypot(0.1, 0.3))
    symmetric = stats.QuantileBand(1.0, 0.9, 1.1, 1, 2, 100, True, False)
    _, lower, upper = stats.mover_log_ratio_bounds(symmetric, symmetric)
    assert (lower, upper) == pytest.approx((-0.1 * math.sqrt(2), 0.1 * math.sqrt(2)))


def test_welch_df_lies_between_the_smaller_and_the_sum():
    assert stats.welch_df(1.0, 4, 1.0, 4) == pytest.approx(8.0)
    assert 4 <= stats.welch_df(1.0, 4, 0.2, 9) <= 13
    assert stats.welch_df(math.inf, 4, 1.0, 9) == 4


def test_paired_block_variance_factor_is_about_one_for_independent_arms_and_moves_with_a_shared_or_opposed_level():
    """Rule: the paired-by-look variance of a ratio over the arms' own is ~1 when the arms' block sums are
    independent, ~0 when every block moves both arms alike (it cancels in the ratio), ~2 when it moves them
    apart, and counts a block only one arm has as 0 for the other."""
    rng = np.random.default_rng(5)
    looks = np.arange(1, 201)
    a, b = rng.normal(0, 1, 200), rng.normal(0, 1, 200)
    assert 0.8 < stats.paired_block_variance_factor(looks, a, 1.0, looks, b, 1.0) < 1.2
    assert stats.paired_block_variance_factor(looks, a, 1.0, looks, a, 1.0) == pytest.approx(0.0)
    assert stats.paired_block_variance_factor(looks, a, 1.0, looks, -a, 1.0) == pytest.approx(2.0)
    # scales weigh the arms: the same sums at twice the baseline's scale no longer cancel
    assert stats.paired_block_variance_factor(looks, a, 2.0, looks, a, 1.0) == pytest.approx(1.0 / 5.0)
    # disjoint looks: nothing pairs; 4 blocks' 4/3 x 4 over each arm's own 2/1 x 2, twice
    one, other = (np.array([1, 2]), np.array([3, 4])), np.array([1.0, -1.0])
    disjoint = stats.paired_block_variance_factor(one[0], other, 1.0, one[1], other, 1.0)
    assert disjoint == pytest.approx(2.0 / 3.0)
    assert math.isnan(stats.paired_block_variance_factor(np.array([1]), np.array([1.0]), 1.0, looks, b, 1.0))
