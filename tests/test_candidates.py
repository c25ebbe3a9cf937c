"""Several candidates against one baseline (rollout.judge.candidates): the alpha split, the winner, each loser's
reason, and the simulated world's candidate arms (rollout.judge.scenarios) calibrate judges them in."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from cluster.arms import BASELINE, CANARY
from rollout.judge import calibrate
from rollout.judge.candidates import CandidateResult, candidate_gates, choose_winner
from rollout.judge.config import GatesConfig
from rollout.judge.names import OBJECTIVE_NAME
from rollout.judge.scenarios import TrialSpec, candidate_arms, simulate_records
from rollout.judge.verdicts import Decision, GateResult, Verdict

# the experiment's gates only: the accuracy phase's would be missing evidence in these hand-made results
CFG = GatesConfig(enabled=[OBJECTIVE_NAME, "ttft_p95_guard", "error_rate_guard"])


def gate(name: str, verdict: Verdict, estimate: float | None = None) -> GateResult:
    return GateResult(name=name, metric="m", baseline=None, canary=None, threshold=None, verdict=verdict, estimate=estimate)


def candidate(name: str, k: int, ratio: float | None, objective: Verdict = Verdict.PASS,
              ttft: Verdict = Verdict.PASS, errors: Verdict = Verdict.PASS) -> CandidateResult:
    return CandidateResult(name, k, [gate(OBJECTIVE_NAME, objective, ratio), gate("ttft_p95_guard", ttft),
                                     gate("error_rate_guard", errors)])


def test_each_candidate_is_judged_at_its_share_of_alpha():
    cfg = GatesConfig(alpha=0.06)
    assert candidate_gates(cfg, 1) is cfg
    assert candidate_gates(cfg, 3).alpha == pytest.approx(0.02)
    assert candidate_gates(cfg, 3).tpot_p50_min_improvement == cfg.tpot_p50_min_improvement
    with pytest.raises(ValueError, match="candidates must be >= 1"):
        candidate_gates(cfg, 0)


def test_the_fastest_passing_candidate_wins_and_every_other_says_why_it_lost():
    choice = choose_winner([
        candidate("k2", 2, 0.80),
        candidate("k3", 3, 0.70),
        candidate("k4", 4, 0.60, ttft=Verdict.FAIL),
        candidate("k5", 5, 0.65, objective=Verdict.INCONCLUSIVE),
    ], CFG)
    assert choice.decision is Decision.PROMOTE and choice.winner == "k3"
    assert list(choice.reasons) == ["k2", "k3", "k4", "k5"]
    assert choice.reasons["k3"] == "promoted: TPOT p50 ratio 0.700"
    assert choice.reasons["k2"] == "passed, but k3 is faster (TPOT p50 ratio 0.700 vs 0.800)"
    assert choice.reasons["k4"] == "rolled back: ttft_p95_guard failed"  # faster, but a guardrail stopped it
    assert choice.reasons["k5"] == f"inconclusive: {OBJECTIVE_NAME}"


def test_a_tie_goes_to_the_candidate_that_drafts_fewer_tokens():
    choice = choose_winner([candidate("k3", 3, 0.700), candidate("k2", 2, 0.710)], CFG)
    assert choice.winner == "k2"  # 0.710 is within 2% of 0.700
    assert choice.reasons["k3"].startswith("passed, tied with k2 (TPOT p50 ratio 0.700 vs 0.710, within 2%)")
    # within the tolerance at the same cost, the faster one wins and the other is told so
    same_cost = choose_winner([candidate("a", 3, 0.700), candidate("b", 3, 0.705)], CFG)
    assert same_cost.winner == "a" and same_cost.reasons["b"] == "passed, but a is faster (TPOT p50 ratio 0.700 vs 0.705)"
    # beyond the tolerance the faster one wins whatever it costs
    assert choose_winner([candidate("k3", 3, 0.70), candidate("k2", 2, 0.75)], CFG).winner == "k3"
    assert choose_winner([candidate("k3", 3, 0.70), candidate("k2", 2, 0.75)], CFG, tie_tolerance=0.1).winner == "k2"


def test_without_a_winner_the_run_rolls_back_only_when_every_candidate_did():
    all_failed = choose_winner([candidate("k2", 2, 1.2, objective=Verdict.FAIL), candidate("k3", 3, 0.7, errors=Verdict.FAIL)], CFG)
    assert all_failed.decision is Decision.ROLLBACK and all_failed.winner is None
    assert all_failed.reasons == {"k2": f"rolled back: {OBJECTIVE_NAME} failed", "k3": "rolled back: error_rate_guard failed"}
    # one candidate undecided: it might still have passed, so the evidence is incomplete
    mixed = choose_winner([candidate("k2", 2, 1.2, objective=Verdict.FAIL), candidate("k3", 3, 0.9, objective=Verdict.INCONCLUSIVE)], CFG)
    assert mixed.decision is Decision.INCONCLUSIVE and mixed.winner is None


def test_a_gate_never_judged_is_missing_evidence_not_a_pass():
    unjudged = CandidateResult("k3", 3, [gate(OBJECTIVE_NAME, Verdict.PASS, 0.7), gate("ttft_p95_guard", Verdict.PASS)])
    choice = choose_winner([unjudged], CFG)
    assert choice.decision is Decision.INCONCLUSIVE
    assert choice.reasons["k3"] == "inconclusive: error_rate_guard not judged"
    with pytest.raises(ValueError, match="unique"):
        choose_winner([candidate("k3", 3, 0.7), candidate("k3", 3, 0.7)], CFG)
    with pytest.raises(ValueError, match="no candidates"):
        choose_winner([], CFG)


def test_the_simulated_candidates_share_the_baselines_loop():
    design = calibrate.default_design()
    three = simulate_records(np.random.default_rng(4), design.latency, TrialSpec(candidates=3), design.shape, calibrate._TEMPLATE)
    assert candidate_arms(3) == (CANARY, f"{CANARY}-2", f"{CANARY}-3")
    counts = Counter(r.arm for r in three)
    assert set(counts) == {BASELINE, *candidate_arms(3)} and min(counts.values()) >= design.shape.requests_per_arm


def test_a_candidates_trial_judges_each_candidate_against_the_shared_baseline():
    design = calibrate.default_design()
    fast = calibrate.simulate_trial(design, TrialSpec(tpot_ratio=0.7, candidates=2), np.random.default_rng(1))
    assert fast.decision == "promote" and fast.unadjusted_decision == "promote"
    assert {name.split(":")[0] for name in fast.verdicts} == {CANARY, f"{CANARY}-2"}
    assert fast.verdicts[f"{CANARY}-2:{OBJECTIVE_NAME}"] == "pass"
    slow = calibrate.simulate_trial(design, TrialSpec(tpot_ratio=1.3, candidates=2), np.random.default_rng(1))
    assert slow.decision == "rollback" and slow.verdicts[f"{CANARY}:{OBJECTIVE_NAME}"] == "fail"
