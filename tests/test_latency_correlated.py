"""The latency judge's error rates when requests are not independent, measured through judge_latency (seeded).

Each test simulates a few hundred canary runs with the demo's design (15 looks x 40
requests per arm, information n/600, default GatesConfig) by the generator of
benchmarks/latency_calibration.py, which runs the same rows at 2,000 trials. The bound
is the brief's target, alpha + 2 simulation SE at alpha. The judge before block-robust
bands (its exact-rank band read as a Wald SE, requests taken as independent) measured on
these seeds and trials: look level sd 0.05: 0.133, sd 0.10: 0.257, drift: 0.187, stall
runs: 0.147, TTFT guard at its limit with stall runs: 0.213, with 1% timeouts: 0.080 --
each above the bound (0.075), so each of those tests fails without the change. The
other rows (iid, 1 ms ticks at 200 per arm, unequal arms, heavy tails) it passed too;
they guard the new bands against being anti-conservative there. Ties at 1,500 per arm,
where the old judge passed at look 1, are tested in test_latency_gates.py.

A look is one stretch of time for both arms. The judge that took the arms' block
variances as independent passed the objective at its threshold in 0.096 of 2,000 runs
with per-look levels opposed between the arms (replicas fighting for the same cores)
and in 0.003 with levels shared by them; the arms paired by look hold both.
"""

from __future__ import annotations

import math

import pytest

from benchmarks.latency_calibration import SCENARIOS, pass_rate
from rollout.judge.config import GatesConfig

ALPHA = GatesConfig().alpha
ERROR_TRIALS = 300
POWER_TRIALS = 120
BY_NAME = {s.name: s for s in SCENARIOS}


def _bound(trials: int) -> float:
    return ALPHA + 2.0 * math.sqrt(ALPHA * (1.0 - ALPHA) / trials)


@pytest.mark.parametrize(
    "name",
    [
        "iid",
        "level_0.05",
        "level_0.10",
        "level_0.10_shared",
        "level_0.10_opposed",
        "drift_0.10",
        "stall_runs_10",
        "tick_1ms",
        "unequal_n_60_40",
        "heavy_lognormal_sd1",
        "heavy_pareto_1.5",
    ],
)
def test_the_objective_at_its_threshold_passes_at_most_alpha(name):
    """Rule: the promote side errs with probability <= alpha for a canary exactly at TPOT ratio 0.90, whatever the
    correlation between requests (per-look arm levels, drift within a look, stall runs), ties from a 1 ms tick,
    unequal arms or heavy tails. Guards the block-robust band (blocks = looks), the tie widening and MOVER."""
    rate, _ = pass_rate(BY_NAME[name], ERROR_TRIALS, seed=11)
    assert rate <= _bound(ERROR_TRIALS), f"{name}: false promote {rate:.3f}"


@pytest.mark.parametrize("name", ["ttft_guard_stall_runs", "ttft_guard_timeouts_1pct", "ttft_guard_level_0.10_opposed"])
def test_the_ttft_guard_at_its_limit_passes_at_most_alpha(name):
    """Rule: a canary at exactly 1.25 x TTFT p95 passes its guard with probability <= alpha, with stalls in runs of 10
    (the design effect of a p95) and when it times out its slowest 1% (errors are +inf ranks, not dropped)."""
    rate, _ = pass_rate(BY_NAME[name], ERROR_TRIALS, seed=12)
    assert rate <= _bound(ERROR_TRIALS), f"{name}: guard passes {rate:.3f}"


@pytest.mark.parametrize("name", ["power_0.7_iid", "power_0.7_level_0.05"])
def test_a_30_percent_tpot_improvement_is_shown_within_the_demos_600_requests_per_arm(name):
    """Rule: fail-closed statistics still promote a real improvement: power >= 0.9 at TPOT ratio 0.7 within the
    planned 600 requests per arm (the demo's plan), iid and with a per-look arm level of sd 0.05. Guards against a band so wide
    (e.g. t on too few df, or no verdict before the last look) that nothing ever passes."""
    rate, _ = pass_rate(BY_NAME[name], POWER_TRIALS, seed=13)
    assert rate >= 0.9, f"{name}: power {rate:.3f}"


def test_the_benchmark_prints_its_table_and_json(capsys):
    """Rule: benchmarks/latency_calibration.py reports every row it runs, as a table and as JSON (the full-size
    measurement docs/performance.md quotes comes from it)."""
    import json

    from benchmarks.latency_calibration import main

    assert main(["--trials", "4", "--only", "iid", "tick_1ms", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [row["scenario"] for row in result["rows"]] == ["iid", "tick_1ms"] and result["trials"] == 4
    assert main(["--trials", "4", "--only", "power_0.7_iid"]) == 0
    assert "power_0.7_iid" in capsys.readouterr().out


def test_a_level_shared_by_both_arms_cancels_in_the_ratio():
    """Rule: a per-look level both arms share (a disturbance of the whole machine) is no evidence against the
    canary: with TTFT unchanged, the TTFT p95 guard clears its limit about as often as with no level at all.
    Arms taken as independent cleared it in 0.26 of 2,000 runs (0.58 without the level), the paired ones in 0.51."""
    shared, _ = pass_rate(BY_NAME["ttft_guard_power_1.0_level_0.10_shared"], POWER_TRIALS, seed=14)
    assert shared >= 0.38, f"TTFT guard power with a shared level {shared:.3f}"
