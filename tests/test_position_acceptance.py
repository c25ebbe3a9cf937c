"""The per-position acceptance gate (gates.acceptance_profile): the layer-0 reuse signature fails and is named,
a canary at the profile passes, missing per-request counters never pass, and the errors hold under per-prompt
acceptance (each request's conditional rate at every position a Beta of concentration 4 around the canary's).

The counters reach the gate as in the experiment: per request, from the records' acceptance histograms
(``spec_decode_of_requests``) or the calibration's arrays (``spec_decode_of_counts``), inside ``judge_look``.
"""

from __future__ import annotations

import math

import numpy as np
import pydantic
import pytest

from cluster.arms import BASELINE, CANARY
from loadtests.records import RequestRecord
from rollout.calibration.scenarios import conditional_means_for_profile, profile_truth, spec_decode_by_profile
from rollout.judge.config import GatesConfig
from rollout.judge.experiment_looks import LookPlan, judge_look
from rollout.judge.names import GATE_NAMES, PROFILE_NAME
from rollout.judge.acceptance import clustered_se
from rollout.judge.looks import t_critical
from rollout.judge.position_acceptance import (
    judge_acceptance_profile,
    judge_profile_of_counters,
    position_bounds,
    residual_skewness,
)
from rollout.judge.request_acceptance import spec_decode_of_counts, spec_decode_of_requests
from rollout.judge.verdicts import Verdict, is_enabled

K = 2
CONCENTRATION = 4.0


def histograms(rng: np.random.Generator, n: int, steps: int, rates: tuple[float, ...]) -> np.ndarray:
    """Verify steps by drafts accepted (n, k + 1): each request's conditional rates a Beta around ``rates``."""
    k = len(rates)
    conditional = np.column_stack([rng.beta(CONCENTRATION * r, CONCENTRATION * (1 - r), n) for r in rates])
    accepted = np.cumprod(rng.random((n, steps, k)) < conditional[:, None, :], axis=-1).sum(axis=-1)
    return np.stack([(accepted == j).sum(axis=1) for j in range(k + 1)], axis=1)


def records_of(histogram: np.ndarray, arm: str = CANARY) -> list[RequestRecord]:
    k = histogram.shape[1] - 1
    return [RequestRecord(
        request_id=f"{arm}{i}", tag="experiment", worker="w", arm=arm, pinned_arm=arm, sent_at=float(i), ttft_s=0.1,
        e2e_s=0.5, output_tokens=16, requested_max_tokens=16, ok=True, status=200,
        acceptance_histogram=[int(x) for x in row], draft_tokens=int(row.sum()) * k)
        for i, row in enumerate(histogram)]


def layer0_reuse(seed: int = 0, n: int = 600):
    """MiMo-7B k=2 under vLLM's layer-0 reuse: position 1 accepts ~0.88, position 2 ~0.18 (vLLM PR #25136)."""
    return spec_decode_of_requests(records_of(histograms(np.random.default_rng(seed), n, 8, (0.88, 0.18 / 0.88))),
                                   CANARY)


def test_per_request_positions_follow_the_histograms_as_vllm_counts_them():
    """Rule: a step that accepted j drafts accepted positions 1..j; each request's counts sum to the arm's."""
    records = records_of(np.array([[1, 2, 3], [4, 0, 1]]))
    spec = spec_decode_of_requests(records, CANARY)
    assert spec.per_request_positions == ((5.0, 3.0), (1.0, 1.0))
    assert spec.position_counts() == ((6.0, (5.0, 3.0)), (5.0, (1.0, 1.0)))
    assert spec.accepted_per_position == (6.0, 4.0)
    same = spec_decode_of_counts([6, 5], np.array([[5, 3], [1, 1]]))
    assert same.position_counts() == spec.position_counts()


def test_the_layer0_reuse_signature_fails_and_names_the_position():
    """Rule: position 2 at ~0.18 against a profile of 0.70 fails; the detail names it with estimate and bounds."""
    gate = judge_profile_of_counters(layer0_reuse(), True, GatesConfig(acceptance_profile=[0.88, 0.70]))
    assert gate.verdict is Verdict.FAIL and gate.name == PROFILE_NAME
    assert "position 2 accepts 0.1" in gate.detail and "profile 0.70 - margin 0.10" in gate.detail
    assert "position 1 accepts" not in gate.detail  # only the failing position is named
    assert gate.threshold == pytest.approx(0.60) and gate.interval[1] < 0.60 and gate.estimate < 0.25


def test_a_canary_at_its_profile_passes_and_a_mean_length_floor_would_not_have_seen_the_collapse():
    """Rule: every position's lower bound above profile - margin passes; a profile matching position 1 alone
    (shorter than k) judges position 1 only and says so."""
    spec = layer0_reuse(seed=1)
    at_profile = judge_profile_of_counters(spec, True, GatesConfig(acceptance_profile=[0.88, 0.18]))
    assert at_profile.verdict is Verdict.PASS
    first_only = judge_profile_of_counters(spec, True, GatesConfig(acceptance_profile=[0.88]))
    assert first_only.verdict is Verdict.PASS and "the profile gives 1: those are judged" in first_only.detail


def test_a_profile_longer_than_k_judges_the_first_k_positions_and_says_so():
    gate = judge_profile_of_counters(layer0_reuse(seed=2), True, GatesConfig(acceptance_profile=[0.88, 0.70, 0.5]))
    assert gate.verdict is Verdict.FAIL and "the canary drafts 2: the first 2 are judged" in gate.detail


def test_without_per_request_counters_the_gate_never_passes():
    """Rule: server counters alone, however good, are no interval: INCONCLUSIVE, with the point values said."""
    spec = layer0_reuse(seed=3)
    cfg = GatesConfig(acceptance_profile=[0.5, 0.1])
    assert judge_profile_of_counters(spec, True, cfg).verdict is Verdict.PASS
    server = judge_profile_of_counters(spec.sums(), True, cfg)
    assert server.verdict is Verdict.INCONCLUSIVE and "server counters only" in server.detail
    assert "position 2 0.1" in server.detail
    assert judge_profile_of_counters(None, True, cfg).verdict is Verdict.INCONCLUSIVE
    assert judge_acceptance_profile([], [0.5], 0.1, cfg).verdict is Verdict.INCONCLUSIVE
    few = spec_decode_of_counts(np.full(10, 8.0), np.full((10, 2), 7.0))
    assert judge_profile_of_counters(few, True, cfg).verdict is Verdict.INCONCLUSIVE


def test_a_canary_that_does_not_speculate_is_not_applicable_and_one_that_made_no_drafts_fails():
    cfg = GatesConfig(acceptance_profile=[0.8])
    none = judge_profile_of_counters(spec_decode_of_counts(np.zeros(30), np.zeros((30, 0))), False, cfg)
    assert none.verdict is Verdict.PASS and none.detail.startswith("not applicable: the canary does not speculate")
    silent = judge_profile_of_counters(spec_decode_of_counts(np.zeros(30), np.zeros((30, 1))), True, cfg)
    assert silent.verdict is Verdict.FAIL and "no drafts" in silent.detail


def test_the_profile_is_validated_and_off_by_default():
    assert GatesConfig().acceptance_profile is None and not is_enabled(PROFILE_NAME, GatesConfig())
    assert PROFILE_NAME in GATE_NAMES and is_enabled(PROFILE_NAME, GatesConfig(acceptance_profile=[0.9, 0.7]))
    assert not is_enabled(PROFILE_NAME, GatesConfig(acceptance_profile=[0.9], disabled=[PROFILE_NAME]))
    for bad, words in (([0.7, 0.9], "non-increasing"), ([1.2], "in [0, 1]"), ([], "at least one position")):
        with pytest.raises(pydantic.ValidationError, match="acceptance_profile") as err:
            GatesConfig(acceptance_profile=bad)
        assert words in str(err.value)
    with pytest.raises(pydantic.ValidationError, match="acceptance_profile is null"):
        GatesConfig(enabled=[PROFILE_NAME])
    with pytest.raises(pydantic.ValidationError, match="acceptance_profile_margin"):
        GatesConfig(acceptance_profile=[0.9], acceptance_profile_margin=-0.1)


def test_judge_look_judges_the_profile_only_when_set_on_the_requests_own_counters():
    """Rule: the look carries the gate when gates.acceptance_profile is set; the records' counters and the
    calibration's arrays of the same requests give the same verdict and numbers."""
    histogram = histograms(np.random.default_rng(4), 200, 8, (0.88, 0.18 / 0.88))
    records = [r for pair in zip(records_of(histogram), records_of(histogram, BASELINE)) for r in pair]
    plan = LookPlan(50, 200, 0.0, 1, 1e9)
    looks_of = [1] * len(records)
    spec = spec_decode_of_requests(records, CANARY)
    assert PROFILE_NAME not in {g.name for g in judge_look(records, looks_of, [1.0], GatesConfig(), plan, spec, True)}
    cfg = GatesConfig(acceptance_profile=[0.88, 0.70])
    gate = next(g for g in judge_look(records, looks_of, [1.0], cfg, plan, spec, True) if g.name == PROFILE_NAME)
    assert gate.verdict is Verdict.FAIL
    steps = histogram.sum(axis=1)
    arrays = spec_decode_of_counts(steps, np.column_stack([histogram[:, 1:].sum(axis=1), histogram[:, 2]]))
    same = next(g for g in judge_look(records, looks_of, [1.0], cfg, plan, arrays, True) if g.name == PROFILE_NAME)
    assert same == gate


def test_rates_piled_near_one_widen_the_pass_side_bound_and_never_narrow_the_other():
    """Rule: left-skewed residuals (most prompts accept nearly all, a tail of hard ones) put the lower bound
    below the plain t bound; the upper bound stays the plain t bound (only ever widened)."""
    rng = np.random.default_rng(7)
    steps = np.full(200, 8.0)
    accepted = rng.binomial(8, rng.beta(3.6, 0.4, 200)).astype(float)
    ratio, se, n = clustered_se(np.column_stack([steps, accepted]))
    assert residual_skewness(steps, accepted, ratio) < -1.0
    (bound,) = position_bounds([(s, (a,)) for s, a in zip(steps, accepted)], [0.9], 0.1, 1.645, 1.645)
    t = t_critical(1.645, n - 1)
    assert bound.lower < ratio - t * se - 1e-3
    assert bound.upper == pytest.approx(ratio + t * se)


def _rate(target, verdict: Verdict, trials: int, seed: int, looks: int = 5, per_look: int = 120) -> float:
    """Share of trials the gate gave ``verdict`` at some look, the canary's counters converging to ``target``."""
    cfg = GatesConfig(acceptance_profile=[0.90, 0.70, 0.50], acceptance_profile_margin=0.10, alpha=0.05)
    means = conditional_means_for_profile(np.array(target), CONCENTRATION, 16)
    assert profile_truth(means, CONCENTRATION, 16) == pytest.approx(target, abs=1e-6)
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(trials):
        drafts, accepted = spec_decode_by_profile(rng, looks * per_look, 16, means, CONCENTRATION)
        for look in range(1, looks + 1):
            gate = judge_profile_of_counters(spec_decode_of_counts(drafts[:look * per_look], accepted[:look * per_look]),
                                             True, cfg, look=look, max_looks=looks,
                                             information=[i / looks for i in range(1, look + 1)])
            if gate.verdict is not Verdict.INCONCLUSIVE:
                hits += gate.verdict is verdict
                break
    return hits / trials


def test_a_canary_exactly_at_the_threshold_at_one_position_passes_at_most_alpha():
    """Rule: position 1 at profile - margin (the others at the profile; the most skewed position), per-prompt
    Beta rates: false PASS <= alpha + 2 SE (the intersection-union test owes no multiplicity)."""
    trials = 300
    share = _rate((0.80, 0.70, 0.50), Verdict.PASS, trials, seed=5)
    assert share <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / trials)


def test_a_canary_at_the_threshold_at_every_position_fails_at_most_alpha():
    """Rule: every position at profile - margin: false FAIL <= alpha + 2 SE (Bonferroni over the positions)."""
    trials = 300
    share = _rate((0.80, 0.60, 0.40), Verdict.FAIL, trials, seed=6)
    assert share <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / trials)
