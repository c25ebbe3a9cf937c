"""Tests of the latency judge (rollout/judge/latency.py) and the gates config: verdicts, their numbers, and their invariants."""

from __future__ import annotations

import math

import numpy as np
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rollout.judge.config import GatesConfig
from rollout.judge.latency import LatencySamples, judge_latency
from rollout.judge.verdicts import Decision, GateResult, Verdict, decide, is_final



def arm(
    rng: np.random.Generator,
    n: int,
    *,
    tpot_ratio: float = 1.0,
    ttft_ratio: float = 1.0,
    errors: int = 0,
    windows: int | None = None,
) -> LatencySamples:
    tpot = 0.03 * tpot_ratio * rng.lognormal(0.0, 0.25, n)
    ttft = 0.25 * ttft_ratio * rng.lognormal(0.0, 0.6, n)
    window = None if windows is None else np.repeat(np.arange(1, windows + 1), math.ceil(n / windows))[:n]
    return LatencySamples(ttft_s=ttft, tpot_s=tpot, e2e_s=ttft + 150 * tpot, n_errors=errors, n_total=n + errors, window=window)


def by_name(results: list[GateResult]) -> dict[str, GateResult]:
    return {r.name: r for r in results}


# --- config ----------------------------------------------------------------------------------------


def test_config_defaults_and_documented_fields():
    cfg = GatesConfig()
    assert cfg.alpha == 0.05 and cfg.max_looks == 5 and cfg.e2e_p95_max_ratio is None
    for name, field in GatesConfig.model_fields.items():
        assert field.description, f"{name} lacks a description"


@pytest.mark.parametrize(
    "bad",
    [
        {"alpha": 0.0},
        {"alpha": 0.7},
        {"accuracy_margin": -0.01},
        {"tpot_p50_min_improvement": 1.0},
        {"ttft_p95_max_ratio": 0.9},
        {"min_requests_per_arm": 1},
        {"max_looks": 0},
        {"max_looks": 500},
        {"enabled": ["tpot_p50_improvement", "no_such_gate"]},
        {"enabled": []},
        {"unknown_field": 1},
    ],
)
def test_config_rejects_bad_values(bad):
    with pytest.raises(pydantic.ValidationError):
        GatesConfig(**bad)


# --- latency ---------------------------------------------------------------------------------------


def test_clear_tpot_improvement_with_quiet_guardrails_promotes_at_the_last_look():
    rng = np.random.default_rng(1)
    cfg = GatesConfig()
    results = judge_latency(arm(rng, 1500), arm(rng, 1500, tpot_ratio=0.7), cfg, look=5)
    gates = by_name(results)
    assert set(gates) == {"tpot_p50_improvement", "ttft_p95_guard", "error_rate_guard"}
    objective = gates["tpot_p50_improvement"]
    assert objective.verdict is Verdict.PASS
    assert objective.estimate == pytest.approx(0.7, abs=0.05)
    assert objective.interval[1] < 0.9 and objective.threshold == 0.9
    assert objective.baseline == pytest.approx(30.0, rel=0.1)  # ms
    assert objective.n_baseline == objective.n_canary == 1500 and objective.look == 5
    assert decide(results) is Decision.PROMOTE and is_final(results)


def test_no_improvement_fails_the_objective_but_not_the_guardrails():
    rng = np.random.default_rng(2)
    results = judge_latency(arm(rng, 1500), arm(rng, 1500), GatesConfig(), look=5)
    gates = by_name(results)
    assert gates["tpot_p50_improvement"].verdict is Verdict.FAIL
    assert gates["ttft_p95_guard"].verdict is not Verdict.FAIL
    assert decide(results) is Decision.ROLLBACK


def test_ttft_regression_fails_its_guardrail_with_holm_level_in_detail():
    rng = np.random.default_rng(3)
    cfg = GatesConfig(e2e_p95_max_ratio=5.0)
    gates = by_name(judge_latency(arm(rng, 2000), arm(rng, 2000, ttft_ratio=2.0), cfg, look=5))
    guard = gates["ttft_p95_guard"]
    assert guard.verdict is Verdict.FAIL
    assert guard.interval[0] > 1.25
    assert "Holm over 3 guardrail(s)" in guard.detail


def test_error_burst_fails_even_with_few_requests():
    rng = np.random.default_rng(4)
    baseline = arm(rng, 10)
    canary = LatencySamples(np.array([]), np.array([]), np.array([]), n_errors=20, n_total=20)
    gates = by_name(judge_latency(baseline, canary, GatesConfig(), look=1, max_looks=1))
    assert gates["error_rate_guard"].verdict is Verdict.FAIL
    assert gates["tpot_p50_improvement"].verdict is Verdict.INCONCLUSIVE
    assert gates["ttft_p95_guard"].verdict is Verdict.INCONCLUSIVE


def test_early_look_is_stricter_than_the_last():
    rng = np.random.default_rng(5)
    baseline, canary = arm(rng, 300), arm(rng, 300, tpot_ratio=0.8)
    first = by_name(judge_latency(baseline, canary, GatesConfig(), look=1))["tpot_p50_improvement"]
    last = by_name(judge_latency(baseline, canary, GatesConfig(), look=5))["tpot_p50_improvement"]
    assert first.interval[1] - first.interval[0] > last.interval[1] - last.interval[0]


def test_look_past_the_plan_is_judged_at_the_last_boundary_and_says_so():
    rng = np.random.default_rng(6)
    baseline, canary = arm(rng, 300), arm(rng, 300, tpot_ratio=0.8)
    at_plan = by_name(judge_latency(baseline, canary, GatesConfig(), look=5))["tpot_p50_improvement"]
    past = by_name(judge_latency(baseline, canary, GatesConfig(), look=7))["tpot_p50_improvement"]
    assert past.interval == at_plan.interval and past.look == 7
    assert "past the 5 planned looks" in past.detail


def test_enabled_subset_limits_the_gates_and_the_holm_family():
    rng = np.random.default_rng(7)
    cfg = GatesConfig(enabled=["tpot_p50_improvement", "ttft_p95_guard"])
    results = judge_latency(arm(rng, 200), arm(rng, 200), cfg, look=5)
    assert [r.name for r in results] == ["tpot_p50_improvement", "ttft_p95_guard"]
    assert "Holm over 1 guardrail(s)" in results[1].detail


def test_non_finite_samples_are_dropped_and_reported():
    rng = np.random.default_rng(8)
    baseline = arm(rng, 200)
    tpot = baseline.tpot_s.copy()
    tpot[:5] = np.nan  # one-token outputs have no TPOT
    baseline = LatencySamples(baseline.ttft_s, tpot, baseline.e2e_s, 0, 200)
    objective = by_name(judge_latency(baseline, arm(rng, 200), GatesConfig(), look=5))["tpot_p50_improvement"]
    assert objective.n_baseline == 195
    assert "Dropped non-finite" in objective.detail


def test_judge_output_serialises_to_json():
    rng = np.random.default_rng(9)
    for result in judge_latency(arm(rng, 40), arm(rng, 40), GatesConfig(), look=1):
        GateResult.model_validate_json(result.model_dump_json())


positive_latencies = hnp.arrays(
    np.float64, st.integers(0, 120), elements=st.floats(1e-3, 30.0, allow_nan=False, allow_infinity=False)
)


@given(values=positive_latencies, errors=st.integers(0, 5), look=st.integers(1, 6))
@settings(max_examples=60, deadline=None)
def test_identical_samples_never_fail(values, errors, look):
    samples = LatencySamples(values, values, values, errors, values.size + errors)
    cfg = GatesConfig(tpot_p50_min_improvement=0.0, e2e_p95_max_ratio=1.1, min_requests_per_arm=5)
    for result in judge_latency(samples, samples, cfg, look=look):
        assert result.verdict is not Verdict.FAIL, result.detail
        if result.estimate is not None and result.name != "error_rate_guard":
            assert result.estimate == pytest.approx(1.0)


@given(
    base=hnp.arrays(np.float64, st.integers(30, 150), elements=st.floats(1e-3, 30.0)),
    other=hnp.arrays(np.float64, st.integers(30, 150), elements=st.floats(1e-3, 30.0)),
)
@settings(max_examples=60, deadline=None)
def test_swapping_arms_mirrors_ratio_and_interval(base, other):
    cfg = GatesConfig(tpot_p50_min_improvement=0.0)
    a = LatencySamples(base, base, base, 0, base.size)
    b = LatencySamples(other, other, other, 0, other.size)
    forward = by_name(judge_latency(a, b, cfg, look=3))["tpot_p50_improvement"]
    backward = by_name(judge_latency(b, a, cfg, look=3))["tpot_p50_improvement"]
    assert backward.estimate == pytest.approx(1.0 / forward.estimate)
    if forward.interval is not None:
        assert backward.interval == pytest.approx((1.0 / forward.interval[1], 1.0 / forward.interval[0]))
    expected = {Verdict.PASS: Verdict.FAIL, Verdict.FAIL: Verdict.PASS, Verdict.INCONCLUSIVE: Verdict.INCONCLUSIVE}
    assert backward.verdict is expected[forward.verdict]


@given(seed=st.integers(0, 2**32 - 1), ratio=st.floats(0.7, 1.4), per_window=st.integers(30, 80))
@settings(max_examples=25, deadline=None)
def test_more_data_never_widens_an_interval(seed, ratio, per_window):
    # With window ids the judge intersects the repeated confidence intervals of
    # all looks: each look's interval lies inside the previous one.
    rng = np.random.default_rng(seed)
    looks = 5
    baseline = arm(rng, looks * per_window, windows=looks)
    canary = arm(rng, looks * per_window, tpot_ratio=ratio, ttft_ratio=ratio, windows=looks)
    cfg = GatesConfig(enabled=["tpot_p50_improvement", "ttft_p95_guard"], min_requests_per_arm=30)

    def upto(samples: LatencySamples, k: int) -> LatencySamples:
        keep = samples.window <= k
        return LatencySamples(samples.ttft_s[keep], samples.tpot_s[keep], samples.e2e_s[keep], 0, int(keep.sum()), samples.window[keep])

    previous: dict[str, tuple[float, float]] = {}
    previous_verdict: dict[str, Verdict] = {}
    for k in range(1, looks + 1):
        for result in judge_latency(upto(baseline, k), upto(canary, k), cfg, look=k):
            if result.interval is not None and result.name in previous:
                lo, hi = previous[result.name]
                assert result.interval[0] >= lo - 1e-12 and result.interval[1] <= hi + 1e-12
            if result.name in previous_verdict and previous_verdict[result.name] is not Verdict.INCONCLUSIVE:
                assert result.verdict is previous_verdict[result.name]  # decisions are never taken back
            if result.interval is not None:
                previous[result.name] = result.interval
            previous_verdict[result.name] = result.verdict


@given(n=st.integers(0, 29))
@settings(max_examples=15, deadline=None)
def test_too_few_requests_never_pass(n):
    rng = np.random.default_rng(n)
    results = judge_latency(arm(rng, n), arm(rng, n, tpot_ratio=0.5), GatesConfig(), look=5)
    assert all(r.verdict is not Verdict.PASS for r in results)
    assert decide(results) is not Decision.PROMOTE
