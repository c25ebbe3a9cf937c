"""No path to a PROMOTE on missing, failed or lopsided data (rollout/judge: verdicts, accuracy, acceptance,
sample_ratio, experiment_looks; rollout/run/phases/decide.py).

Each test names the rule it guards; the statistical ones show their claim by seeded simulation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cluster.metrics import SpecDecodeStats
from loadtests.records import RequestRecord
from rollout.config import load_config
from rollout.judge.acceptance import judge_acceptance
from rollout.judge.accuracy import judge_accuracy, judge_divergence
from rollout.judge.config import GatesConfig
from rollout.judge.request_acceptance import spec_decode_of_counts
from rollout.judge.experiment_looks import LookPlan, judge_look
from rollout.judge.names import GATE_NAMES, SAMPLE_RATIO_NAME
from rollout.judge.sample_ratio import judge_sample_ratio
from rollout.judge.verdicts import Decision, GateResult, Verdict, decide, is_final, missing_gates
from rollout.run.decision import decide_now

REPO = Path(__file__).resolve().parents[1]


def gate(name: str, verdict: Verdict = Verdict.PASS) -> GateResult:
    return GateResult(name=name, metric="m", baseline=None, canary=None, threshold=None, verdict=verdict)


# -- rule 1: every enabled gate must be present for PROMOTE --------------------------------------
EXPERIMENT_GATES = ["tpot_p50_improvement", "ttft_p95_guard", "error_rate_guard", "acceptance_length_floor", "sample_ratio"]


def test_an_enabled_gate_that_was_never_judged_blocks_promote():
    """Rule 1: without the accuracy gates (phase disabled) the experiment's passes alone do not promote."""
    cfg = GatesConfig()
    results = [gate(name) for name in EXPERIMENT_GATES]
    assert decide(results) is Decision.PROMOTE  # without a config: what was judged, as before
    assert decide(results, cfg) is Decision.INCONCLUSIVE
    assert missing_gates(results, cfg) == ["accuracy_noninferiority", "output_divergence"]
    assert decide(results + [gate("accuracy_noninferiority", Verdict.FAIL)], cfg) is Decision.ROLLBACK
    # the user who removes them from gates.enabled promotes without them, as does one who disables them
    narrowed = GatesConfig(enabled=EXPERIMENT_GATES)
    assert decide(results, narrowed) is Decision.PROMOTE and missing_gates(results, narrowed) == []
    disabled = GatesConfig(disabled=["accuracy_noninferiority", "output_divergence"])
    assert decide(results, disabled) is Decision.PROMOTE and missing_gates(results, disabled) == []
    # disabling one gate leaves every other default gate needed (a list in `enabled` would not)
    only_one = GatesConfig(disabled=["accuracy_noninferiority"])
    assert missing_gates(results, only_one) == ["output_divergence"]
    assert decide(results, only_one) is Decision.INCONCLUSIVE
    # a phase asks is_final about its own gates only
    assert is_final(results, cfg)


def test_the_decision_names_the_missing_gates_and_the_way_out():
    """Rule 1 through decide_now: accuracy.enabled false -> INCONCLUSIVE, the reason says what to change."""
    cfg = load_config(REPO / "configs" / "local-cpu.yaml")
    cfg = cfg.model_copy(update={"accuracy": cfg.accuracy.model_copy(update={"enabled": False})})
    gates = [gate(n) for n in EXPERIMENT_GATES]
    decided = decide_now(gates, cfg)
    assert decided.decision is Decision.INCONCLUSIVE
    reason = decided.reason
    assert "accuracy_noninferiority, output_divergence (accuracy.enabled is false)" in reason
    assert "name them in gates.disabled" in reason and "\n" not in reason
    # the same run with those gates named in gates.disabled promotes
    off = ["accuracy_noninferiority", "output_divergence"]
    cfg = cfg.model_copy(update={"gates": cfg.gates.model_copy(update={"disabled": off})})
    assert decide_now(gates, cfg).decision is Decision.PROMOTE


def test_preflight_gates_still_count_with_a_narrowed_gate_list():
    """Rule 1's filter keeps gates the config cannot name (preflight): a failed preflight is a rollback."""
    cfg = GatesConfig(enabled=["tpot_p50_improvement"])
    assert decide([gate("tpot_p50_improvement"), gate("preflight_chat", Verdict.FAIL)], cfg) is Decision.ROLLBACK


# -- rule 2: eval pairs with a baseline error are left out ------------------------------------------
def paired_with_baseline_errors(rng, n: int, acc: float, drop: float, baseline_error_rate: float):
    """Canary loses `drop` of accuracy (items only the baseline got right); some baseline requests time out."""
    u = rng.random(n)
    baseline_right = u < acc
    canary_right = u < acc - drop
    errored = rng.random(n) < baseline_error_rate
    return (baseline_right & ~errored).tolist(), canary_right.tolist(), errored.tolist()


def test_baseline_timeouts_no_longer_mask_an_accuracy_drop():
    """Rule 2: 3% baseline timeouts counted as 'only the canary was right' hide a 2.8-point drop (margin 2).

    Simulated on gsm8k's 1319 items: with the errors counted the drop passes most of the
    time; with them left out (and 3% > max_baseline_eval_error_rate) it never passes.
    """
    rng = np.random.default_rng(20261201)
    cfg = GatesConfig()
    trials, old_pass, new_pass = 200, 0, 0
    for _ in range(trials):
        baseline, canary, errored = paired_with_baseline_errors(rng, 1319, 0.95, 0.028, 0.03)
        old_pass += judge_accuracy(baseline, canary, cfg, look=1, max_looks=1).verdict is Verdict.PASS
        new = judge_accuracy(baseline, canary, cfg, look=1, max_looks=1, baseline_errored=errored)
        new_pass += new.verdict is Verdict.PASS
    assert old_pass / trials > 0.5
    assert new_pass == 0


def test_few_baseline_errors_are_left_out_and_the_rest_is_judged():
    """Rule 2: under the 2% limit the errored pairs are dropped (n shrinks), the gate still decides."""
    rng = np.random.default_rng(7)
    baseline, canary, errored = paired_with_baseline_errors(rng, 1319, 0.95, 0.0, 0.01)
    result = judge_accuracy(baseline, canary, GatesConfig(), look=1, max_looks=1, baseline_errored=errored)
    assert result.n_baseline == 1319 - sum(errored)
    assert result.verdict is Verdict.PASS and "left out" in result.detail
    # more than 2%: no pass, and the detail says why
    baseline, canary, errored = paired_with_baseline_errors(rng, 1319, 0.95, 0.0, 0.05)
    result = judge_accuracy(baseline, canary, GatesConfig(), look=1, max_looks=1, baseline_errored=errored)
    assert result.verdict is Verdict.INCONCLUSIVE and "max_baseline_eval_error_rate" in result.detail


def test_a_canary_error_stays_a_wrong_canary_answer_and_a_clear_regression_still_fails():
    """Rule 2: only reference errors are dropped; a canary that fails every request is rolled back."""
    n = 200
    cfg = GatesConfig()
    errored = [i % 10 == 0 for i in range(n)]  # 10% baseline errors: too many to pass, not enough to hide a FAIL
    result = judge_accuracy([True] * n, [False] * n, cfg, look=1, max_looks=1, baseline_errored=errored)
    assert result.verdict is Verdict.FAIL
    divergence = judge_divergence([False] * n, None, cfg, look=1, max_looks=1, reference_errored=errored)
    assert divergence.verdict is Verdict.INCONCLUSIVE


# -- rule 3: the acceptance floor on a lower confidence bound -----------------------------------------
def simulated_counters(rng, drafts: int, per_position: tuple[float, ...]) -> SpecDecodeStats:
    """Counters of `drafts` independent drafts in requests of 10 (each request's own kept, as the servers'
    per-request metrics give them); position i accepted only after i-1 was (P(A>=i) = prod of rates)."""
    k = len(per_position)
    conditional = [per_position[0]] + [per_position[i] / per_position[i - 1] for i in range(1, k)]
    u = rng.random((drafts, k)) < np.array(conditional)
    accepted = np.cumprod(u, axis=1)  # a position counts only if every earlier one did
    by_request = accepted.reshape(drafts // 10, 10, k).sum(axis=1)
    return spec_decode_of_counts(np.full(drafts // 10, 10.0), by_request)


def test_a_canary_exactly_at_the_floor_passes_at_most_alpha_of_the_time():
    """Rule 3: at the floor (true mean 1.5: P(A>=1)=0.35, P(A>=2)=0.1, P(A>=3)=0.05) the old point
    rule promotes about half the time; the lower-bound rule at most alpha (0.05)."""
    rng = np.random.default_rng(3)
    cfg = GatesConfig()
    trials, point_pass, bound_pass = 2000, 0, 0
    for _ in range(trials):
        delta = simulated_counters(rng, 400, (0.35, 0.10, 0.05))
        point_pass += delta.mean_acceptance_length >= cfg.min_acceptance_length
        bound_pass += judge_acceptance(delta, cfg).verdict is Verdict.PASS
    assert 0.4 < point_pass / trials < 0.6
    assert bound_pass / trials <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / trials)
    # and a healthy canary (mean 2.5) passes every time; a broken one (1.2) fails every time
    assert judge_acceptance(simulated_counters(rng, 400, (0.8, 0.5, 0.2)), cfg).verdict is Verdict.PASS
    assert judge_acceptance(simulated_counters(rng, 400, (0.15, 0.04, 0.01)), cfg).verdict is Verdict.FAIL


# -- rule 4: the sample-ratio mismatch check ---------------------------------------------------------
def test_a_fair_random_split_is_flagged_at_most_at_its_level():
    """Rule 4: arms assigned by coin flip (worse than alternating pinning) trip the check <= 0.1% of the time."""
    rng = np.random.default_rng(11)
    cfg = GatesConfig()
    trials = 20000
    canary = rng.binomial(400, 0.5, size=trials)
    # each distinct split judged once, counted as often as the coin gave it (the same sum, 100x fewer calls)
    values, counts = np.unique(canary, return_counts=True)
    flagged = sum(
        int(n)
        for c, n in zip(values, counts)
        if judge_sample_ratio({"baseline": 400 - int(c), "canary": int(c)}, cfg).verdict is Verdict.INCONCLUSIVE
    )
    assert flagged / trials <= 0.001 + 3 * np.sqrt(0.001 / trials)


def test_a_lost_arm_share_is_inconclusive_and_named():
    """Rule 4: one of the canary's two replicas ejected and its pinned requests served by the baseline
    (a third of the canary's share moves): 200 vs 100 requests is flagged, naming arms and counts."""
    cfg = GatesConfig()
    result = judge_sample_ratio({"baseline": 200, "canary": 100}, cfg)
    assert result.verdict is Verdict.INCONCLUSIVE
    assert "baseline 200" in result.detail and "canary 100" in result.detail
    assert judge_sample_ratio({"baseline": 120, "canary": 118}, cfg).verdict is Verdict.PASS
    assert judge_sample_ratio({"baseline": 0, "canary": 0}, cfg).verdict is Verdict.INCONCLUSIVE
    assert SAMPLE_RATIO_NAME in GATE_NAMES


def rec(i: int, arm: str, tpot: float) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{i}", tag="experiment", worker="w", arm=arm, pinned_arm=arm, sent_at=float(i),
        ttft_s=0.05, e2e_s=0.05 + tpot * 31, output_tokens=32, ok=True, status=200,
    )


def test_the_experiment_look_judges_the_sample_ratio_and_a_mismatch_blocks_promote():
    """Rule 4 wired: judge_look returns a sample_ratio gate; a lopsided split is undecided and cannot promote,
    the same records with the promised equal split pass."""
    cfg = GatesConfig(enabled=["sample_ratio"])
    plan = LookPlan(requests_per_look=100, requests_per_arm=300, min_interval_s=0, min_looks=1, max_duration_s=1e9)

    def look(arms: list[str]) -> list[GateResult]:
        records = [rec(i, arm, 0.03 if arm == "baseline" else 0.015) for i, arm in enumerate(arms)]
        looks_of = [1 + 2 * i // len(records) for i in range(len(records))]  # two looks
        return judge_look(records, looks_of, [0.25, 0.5], cfg, plan, SpecDecodeStats(), False)

    lopsided = look(["baseline", "baseline", "canary"] * 150)  # the canary lost a third of its share
    srm = {g.name: g for g in lopsided}["sample_ratio"]
    assert srm.verdict is Verdict.INCONCLUSIVE and srm.n_baseline == 300 and srm.n_canary == 150
    assert not is_final(lopsided, cfg) and decide(lopsided, cfg) is Decision.INCONCLUSIVE
    fair = look(["baseline", "canary"] * 150)
    assert decide(fair, cfg) is Decision.PROMOTE


def test_with_users_kept_on_their_arm_a_faster_arm_passes_and_a_lost_share_is_inconclusive():
    """experiment.arm_users: 2 users per arm, each always busy; the canary twice as fast serves twice the
    requests (its share of busy time is the same): a pass. The canary losing a third of its records
    (the same speed, fewer requests) is flagged, as is the equal split the default pinning promises."""
    cfg = GatesConfig(enabled=["sample_ratio"])
    plan = LookPlan(requests_per_look=100, requests_per_arm=300, min_interval_s=0, min_looks=1, max_duration_s=1e9,
                    arm_users=True)

    def sample_ratio(arms: list[str]) -> GateResult:
        records = [rec(i, arm, 0.03 if arm == "baseline" else 0.015) for i, arm in enumerate(arms)]
        looks_of = [1 + 2 * i // len(records) for i in range(len(records))]
        return {g.name: g for g in judge_look(records, looks_of, [0.25, 0.5], cfg, plan, SpecDecodeStats(), False)}["sample_ratio"]

    assert sample_ratio(["baseline", "canary", "canary"] * 150).verdict is Verdict.PASS  # 150 vs 300 by speed
    lost = sample_ratio(["baseline", "canary"] * 150 + ["canary"] * 40)
    assert lost.verdict is Verdict.INCONCLUSIVE  # 150 vs 190: a third of the canary's ~290 gone
    assert sample_ratio(["baseline", "canary"] * 150).verdict is Verdict.INCONCLUSIVE  # equal counts, unequal speed


@pytest.mark.parametrize("drafts", [0.0])
def test_a_speculative_canary_without_drafts_still_fails(drafts):
    """Rule 3 wiring: the no-drafts-under-load rule survives the move to counters."""
    plan = LookPlan(requests_per_look=10, requests_per_arm=20, min_interval_s=0, min_looks=1, max_duration_s=1e9)
    records = [rec(i, arm, 0.02) for i, arm in enumerate(["baseline", "canary"] * 10)]
    gates = judge_look(records, [1] * 20, [1.0], GatesConfig(), plan, SpecDecodeStats(drafts=drafts), True)
    assert {g.name: g.verdict for g in gates}["acceptance_length_floor"] is Verdict.FAIL
