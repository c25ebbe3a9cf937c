"""The depth advice (rollout.analysis.depth_advice): TPOT predicted for every MTP depth from the deepest
arm's acceptance profile and the arms' step costs, on worlds whose answer is known."""

from __future__ import annotations

import random

import pytest

from rollout.analysis.depth_advice import DepthArm, advise_depth, layer_reuse

# Gemma MTP on vLLM at k=4 (published per-position acceptance), where k=2 beat k=4 at 8 streams
GEMMA = [0.84, 0.60, 0.39, 0.27]


def world(fixed: float, per_draft: float, profile: list[float], k: int) -> tuple[float, float]:
    """(acceptance length, TPOT) of an arm at depth k in a world of step cost fixed + per_draft x k."""
    length = 1 + sum(profile[:k])
    return length, (fixed + per_draft * k) / length


def arm(name: str, k: int, fixed: float, per_draft: float, profile: list[float], looks: list[float] = ()) -> DepthArm:
    length, tpot = world(fixed, per_draft, profile, k)
    return DepthArm(name, k, length, tpot, [tpot * level for level in looks])


def test_two_depths_predict_the_ones_between_and_name_the_best():
    # a drafting pass costs a quarter of a step: acceptance past position 2 does not pay for its pass
    arms = [arm("baseline", 1, 20, 5, GEMMA), arm("canary", 4, 20, 5, GEMMA)]
    advice = advise_depth(arms, GEMMA, profile_arm="canary", streams_per_replica=8)
    truth = [world(20, 5, GEMMA, k)[1] for k in range(1, 5)]
    assert [p.tpot_ms for p in advice.predictions] == pytest.approx(truth, abs=1e-3)
    assert advice.best_k == 2 and min(truth) == truth[1]
    assert (advice.fixed_step_ms, advice.per_draft_ms) == pytest.approx((20, 5))
    assert [p.measured_tpot_ms is not None for p in advice.predictions] == [True, False, False, True]
    assert advice.predictions[3].vs_best > 1.04  # k=4 is 5% slower than k=2
    assert advice.text.startswith("k=2 is predicted fastest at 8 streams per replica")
    assert "k=4 +5%" in advice.text and "past k=4 not predicted" in advice.text
    # drafting nearly free (a memory-bound GPU step): the deepest depth wins
    cheap = advise_depth([arm("b", 1, 20, 0.5, GEMMA), arm("c", 4, 20, 0.5, GEMMA)], GEMMA, profile_arm="c",
                         streams_per_replica=1)
    assert cheap.best_k == 4


def test_a_third_depth_that_ran_is_a_check_of_the_model():
    profile = [0.9, 0.8, 0.7]
    arms = [arm("b", 1, 30, 4, profile), arm("c2", 2, 30, 4, profile), arm("c3", 3, 30, 4, profile)]
    advice = advise_depth(arms, profile, profile_arm="c3", streams_per_replica=2)
    for prediction in advice.predictions:
        assert prediction.measured_tpot_ms == pytest.approx(prediction.tpot_ms, abs=1e-3)
    # a k=2 arm slower than the line through the others says so: its measurement is off its prediction
    slow = [arms[0], DepthArm("c2", 2, arms[1].acceptance_length, arms[1].tpot_ms * 1.3), arms[2]]
    off = advise_depth(slow, profile, profile_arm="c3", streams_per_replica=2).predictions[1]
    assert off.measured_tpot_ms > off.tpot_ms * 1.1


def test_the_interval_over_looks_covers_the_truth_under_correlated_look_levels():
    # The real design: per look 40 requests per arm, each request's TPOT its arm's true TPOT x the look's
    # level, which moves both arms together (shared cores), x the arm's own level that look, x its own
    # noise; the run's TPOT p50 is over all its requests, a look's over the look's. The prediction per
    # look keeps the shared level, so the looks' spread must price it in.
    rng = random.Random(7)
    truth = [world(20, 5, GEMMA, k)[1] for k in range(1, 5)]
    covered = [0] * 4
    runs = 400

    def median(values):
        ordered = sorted(values)
        return (ordered[len(ordered) // 2] + ordered[(len(ordered) - 1) // 2]) / 2

    for _ in range(runs):
        shared = [rng.lognormvariate(0, 0.15) for _ in range(8)]
        arms = []
        for name, k in (("b", 1), ("c", 4)):
            length, tpot = world(20, 5, GEMMA, k)
            looks = [[tpot * level * own * rng.lognormvariate(0, 0.3) for _ in range(40)]
                     for level, own in ((s, rng.lognormvariate(0, 0.05)) for s in shared)]
            arms.append(DepthArm(name, k, length, median([t for look in looks for t in look]),
                                 [median(look) for look in looks]))
        advice = advise_depth(arms, GEMMA, profile_arm="c", streams_per_replica=2)
        for i, p in enumerate(advice.predictions):
            covered[i] += p.interval_ms[0] <= truth[i] <= p.interval_ms[1]
    rates = [c / runs for c in covered]
    print(f"coverage of the 95% interval by depth: {rates}")
    # 400 runs: a true 95% coverage shows above 0.925 with 99.9% probability
    assert all(rate >= 0.925 for rate in rates), rates


def test_no_interval_with_fewer_than_three_looks_and_no_advice_without_two_depths():
    two_looks = [arm("b", 1, 20, 5, GEMMA, [1.0, 1.1]), arm("c", 4, 20, 5, GEMMA, [1.0, 0.9])]
    assert all(p.interval_ms is None for p in advise_depth(two_looks, GEMMA, profile_arm="c",
                                                           streams_per_replica=1).predictions)
    same_depth = [arm("b", 3, 20, 5, GEMMA), arm("c", 3, 20, 5, GEMMA)]
    assert advise_depth(same_depth, GEMMA, profile_arm="c", streams_per_replica=1) is None
    assert advise_depth(two_looks, [], profile_arm="c", streams_per_replica=1) is None
    broken = [two_looks[0], DepthArm("c", 4, 3.1, float("nan"))]
    assert advise_depth(broken, GEMMA, profile_arm="c", streams_per_replica=1) is None


def test_the_layer_reuse_signature():
    # MiMo-V2-Flash's 3-layer MTP, healthy and with wrong draft inputs (published per-position profiles)
    assert not layer_reuse([0.82, 0.75, 0.78], logged=False).signature
    reused = layer_reuse([0.77, 0.47, 0.36], logged=True)
    assert reused.signature and reused.kept == pytest.approx([0.6104, 0.766], abs=1e-3)
    advice = advise_depth([arm("b", 1, 20, 5, [0.77]), arm("c", 3, 20, 5, [0.77, 0.47, 0.36])], [0.77, 0.47, 0.36],
                          profile_arm="c", streams_per_replica=2, reuse_logged=True)
    assert advice.layer_reuse.signature and "same MTP layer" in advice.text
    assert "Layer-reuse" not in advise_depth([arm("b", 1, 20, 5, [1.0]), arm("c", 3, 20, 5, [1.0] * 3)], [1.0] * 3,
                                             profile_arm="c", streams_per_replica=2).text
