"""Tests of the accuracy, divergence and acceptance judges and of the decision (rollout/judge/accuracy.py, acceptance.py, verdicts.py)."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.metrics import SpecDecodeStats
from rollout.judge.acceptance import acceptance_sd, judge_acceptance
from rollout.judge.accuracy import judge_accuracy, judge_divergence
from rollout.judge.config import GatesConfig
from rollout.judge.request_acceptance import spec_decode_of_counts
from rollout.judge.names import GATE_NAMES
from rollout.judge.verdicts import Decision, GateResult, Verdict, decide, is_final

NO_HARM_GATES = {"ttft_p95_guard", "e2e_p95_guard", "error_rate_guard", "accuracy_noninferiority", "output_divergence"}


def by_name(results: list[GateResult]) -> dict[str, GateResult]:
    return {r.name: r for r in results}


# --- config ----------------------------------------------------------------------------------------
# --- accuracy ---------------------------------------------------------------------------------------


def paired(rng: np.random.Generator, n: int, baseline_acc: float, only_baseline: float, only_canary: float):
    u = rng.random(n)
    baseline = u < baseline_acc
    canary = (u < baseline_acc - only_baseline) | ((u >= baseline_acc) & (u < baseline_acc + only_canary))
    return baseline.tolist(), canary.tolist()


def test_equal_accuracy_with_realistic_discordance_passes_on_gsm8k_size():
    rng = np.random.default_rng(10)
    baseline, canary = paired(rng, 1319, 0.95, 0.015, 0.015)
    result = judge_accuracy(baseline, canary, GatesConfig(), look=1, max_looks=1)
    assert result.verdict is Verdict.PASS
    assert result.interval[1] < 0.02 and result.threshold == 0.02
    assert result.metric == "accuracy_diff" and result.n_baseline == 1319
    assert result.p_value is not None and "McNemar" in result.detail


def test_large_drop_fails_on_the_planned_look():
    rng = np.random.default_rng(11)
    baseline, canary = paired(rng, 1319, 0.95, 0.095, 0.015)  # 8-point drop
    result = judge_accuracy(baseline, canary, GatesConfig(early_stop_alpha_fraction=0.0), look=5)
    assert result.verdict is Verdict.FAIL and result.interval[0] > 0.02


def test_broken_config_fails_within_a_few_dozen_items_on_interim_looks():
    # 95% -> 1% (a real vLLM MTP bug): checked every 5 items.
    rng = np.random.default_rng(12)
    baseline = (rng.random(1319) < 0.95).tolist()
    canary = (rng.random(1319) < 0.01).tolist()
    cfg = GatesConfig()
    for n in range(5, 1320, 5):
        result = judge_accuracy(baseline[:n], canary[:n], cfg, look=1, interim=True)
        if result.verdict is Verdict.FAIL:
            break
    assert result.verdict is Verdict.FAIL and n <= 36
    assert "Clear regression" in result.detail


def test_interim_look_never_passes():
    baseline = [True] * 500
    result = judge_accuracy(baseline, baseline, GatesConfig(), look=1, interim=True)
    assert result.verdict is Verdict.INCONCLUSIVE


def test_accuracy_rejects_unpaired_lengths():
    with pytest.raises(ValueError):
        judge_accuracy([True, False], [True], GatesConfig())


def test_no_items_is_inconclusive():
    result = judge_accuracy([], [], GatesConfig())
    assert result.verdict is Verdict.INCONCLUSIVE and result.baseline is None


@given(
    outcomes=st.lists(st.booleans(), min_size=0, max_size=400),
    look=st.integers(1, 5),
)
@settings(max_examples=60, deadline=None)
def test_identical_answers_never_fail_accuracy_or_divergence(outcomes, look):
    cfg = GatesConfig()
    assert judge_accuracy(outcomes, outcomes, cfg, look=look).verdict is not Verdict.FAIL
    assert judge_divergence(outcomes, outcomes, cfg, look=look).verdict is not Verdict.FAIL


@given(
    baseline=st.lists(st.booleans(), min_size=1, max_size=300),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_swapping_accuracy_arms_mirrors_the_difference(baseline, data):
    canary = data.draw(st.lists(st.booleans(), min_size=len(baseline), max_size=len(baseline)))
    cfg = GatesConfig(early_stop_alpha_fraction=0.0)  # symmetric levels on both sides
    forward = judge_accuracy(baseline, canary, cfg, look=2)
    backward = judge_accuracy(canary, baseline, cfg, look=2)
    assert backward.estimate == pytest.approx(-forward.estimate)
    assert backward.interval == pytest.approx((-forward.interval[1], -forward.interval[0]), abs=1e-9)
    assert backward.p_value == pytest.approx(forward.p_value)


@given(n=st.integers(1, 19))
@settings(max_examples=10, deadline=None)
def test_too_few_items_never_pass(n):
    assert judge_accuracy([True] * n, [True] * n, GatesConfig(), look=5).verdict is Verdict.INCONCLUSIVE


# --- divergence ---------------------------------------------------------------------------------------


def test_divergence_at_the_twin_noise_floor_passes():
    rng = np.random.default_rng(13)
    canary = (rng.random(1000) < 0.02).tolist()
    twin = (rng.random(1000) < 0.02).tolist()
    result = judge_divergence(canary, twin, GatesConfig(), look=5)
    assert result.verdict is Verdict.PASS and result.metric == "divergence_excess_over_twin"
    assert result.baseline == pytest.approx(np.mean(twin))


def test_garbage_outputs_fail_divergence_quickly():
    result = judge_divergence([True] * 30, [False] * 30, GatesConfig(), look=1, interim=True)
    assert result.verdict is Verdict.FAIL


def test_divergence_without_twin_is_an_absolute_cap():
    rng = np.random.default_rng(14)
    low = judge_divergence((rng.random(800) < 0.01).tolist(), None, GatesConfig(), look=5)
    high = judge_divergence((rng.random(800) < 0.3).tolist(), None, GatesConfig(), look=5)
    assert low.verdict is Verdict.PASS and low.metric == "divergence_rate" and low.baseline is None
    assert high.verdict is Verdict.FAIL


# --- acceptance ---------------------------------------------------------------------------------------


def spec(drafts: float, per_position: tuple[float, ...]) -> SpecDecodeStats:
    """Counters of `drafts` drafts in requests of 10 whose position-i acceptance rate is per_position[i]; the
    requests' accepted tokens spread as 10 independent drafts' would (half of them 1 sd over, half under)."""
    requests = max(int(drafts // 10), 1)
    per_draft = np.array(per_position, dtype=float)
    sd = acceptance_sd(SpecDecodeStats(drafts=1.0, draft_tokens=float(len(per_position)),
                                       accepted_tokens=float(per_draft.sum()), accepted_per_position=tuple(per_draft)))
    steps = np.full(requests, drafts / requests)
    # an odd count of requests gets no spread (a pair left unbalanced would move the sums)
    spread = np.where(np.arange(requests) % 2 == 0, 1.0, -1.0) * sd * np.sqrt(steps) * (requests % 2 == 0)
    # each request's profile scaled so its accepted tokens move by the spread (the sums stay the profile's)
    scale = 1.0 + spread / (steps * per_draft.sum())
    return spec_decode_of_counts(steps, steps[:, None] * per_draft[None, :] * scale[:, None])


def test_acceptance_floor():
    """Rule: the floor is judged on request-clustered bounds of the mean (not the point value)."""
    cfg = GatesConfig()
    server = SpecDecodeStats(drafts=1000, draft_tokens=2000, accepted_tokens=1400, accepted_per_position=(800, 600))
    assert judge_acceptance(server, cfg).verdict is Verdict.INCONCLUSIVE  # no per-request counters: never a pass
    assert judge_acceptance(spec(1000, (0.8, 0.6)), cfg).verdict is Verdict.PASS  # 2.4
    assert judge_acceptance(spec(1000, (0.1,)), cfg).verdict is Verdict.FAIL  # 1.1
    assert judge_acceptance(None, cfg).verdict is Verdict.INCONCLUSIVE
    assert judge_acceptance(SpecDecodeStats(), cfg).verdict is Verdict.INCONCLUSIVE  # no drafts: the caller decides
    assert judge_acceptance(spec(10, (0.9,)), cfg).verdict is Verdict.INCONCLUSIVE  # too few drafts
    # a mean just above the floor over few drafts: a point rule would pass it, the bound does not
    near = judge_acceptance(spec(200, (0.55,)), cfg)
    assert near.estimate == pytest.approx(1.55) and near.verdict is Verdict.INCONCLUSIVE
    assert near.interval[0] < 1.5 < near.interval[1]
    disabled = judge_acceptance(None, GatesConfig(min_acceptance_length=None))
    assert disabled.verdict is Verdict.PASS and "disabled" in disabled.detail


# --- decision -----------------------------------------------------------------------------------------


def result(name: str, verdict: Verdict) -> GateResult:
    return GateResult(name=name, metric="m", baseline=None, canary=None, threshold=None, verdict=verdict)


def test_decide_and_is_final_truth_table():
    P, F, I = Verdict.PASS, Verdict.FAIL, Verdict.INCONCLUSIVE
    assert decide([]) is Decision.INCONCLUSIVE and not is_final([])
    assert decide([result("a", P), result("b", P)]) is Decision.PROMOTE and is_final([result("a", P)])
    assert decide([result("a", P), result("b", I)]) is Decision.INCONCLUSIVE
    assert not is_final([result("a", P), result("b", I)])
    assert decide([result("a", I), result("b", F)]) is Decision.ROLLBACK and is_final([result("a", I), result("b", F)])


def test_decide_ignores_gates_the_config_does_not_enable():
    cfg = GatesConfig(enabled=["tpot_p50_improvement"])
    results = [result("tpot_p50_improvement", Verdict.PASS), result("ttft_p95_guard", Verdict.INCONCLUSIVE)]
    assert decide(results, cfg) is Decision.PROMOTE and is_final(results, cfg)
    assert decide(results) is Decision.INCONCLUSIVE


def test_gate_names_are_the_published_ones():
    assert set(GATE_NAMES) == {"tpot_p50_improvement", "acceptance_length_floor", "sample_ratio", "goodput_guard", "prefix_cache_guard",
                              "acceptance_profile"} | NO_HARM_GATES
