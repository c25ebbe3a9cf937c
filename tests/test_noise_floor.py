"""The twin baseline as the latency noise floor (rollout/judge/noise_floor.py), through the controller's look function.

Pure functions on synthetic request records: a canary whose TPOT p50 ratio passes the
objective on its own, judged by `experiment_looks.judge_look_with_floor` with and
without a twin arm. The rule under test: the objective cannot PASS while the A/A ratio
twin / baseline excludes 1, nor before it has an interval; otherwise nothing changes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from cluster.arms import BASELINE, CANARY
from loadtests.records import RequestRecord
from rollout.config import TWIN
from rollout.judge.config import GatesConfig
from rollout.judge.experiment_looks import LookPlan, judge_look, judge_look_with_floor, next_information, requests_by_arm
from rollout.judge.latency import LatencySamples
from rollout.judge.names import OBJECTIVE_NAME, TWIN_ARM
from rollout.judge.noise_floor import NoiseFloor, apply_noise_floor, judge_noise_floor
from rollout.judge.verdicts import Verdict

GATES = GatesConfig(tpot_p50_min_improvement=0.0, ttft_p95_max_ratio=3.5, min_requests_per_arm=30)
LOOKS, PER_LOOK, TOKENS = 5, 60, 32


def plan(twin: bool) -> LookPlan:
    return LookPlan(PER_LOOK, LOOKS * PER_LOOK, 0.0, 1, 1e9, twin=twin)


def records(seed: int, tpot_factor: dict[str, float]) -> tuple[list[RequestRecord], list[int]]:
    """PER_LOOK requests per arm per look, arms interleaved, TPOT lognormal x the arm's factor."""
    rng = np.random.default_rng(seed)
    out, looks_of, clock = [], [], 0.0
    for look in range(1, LOOKS + 1):
        for i in range(PER_LOOK):
            for arm, factor in tpot_factor.items():
                tpot = 0.03 * factor * rng.lognormal(0.0, 0.25)
                ttft = 0.15 * rng.lognormal(0.0, 0.6)
                clock += 0.01
                out.append(RequestRecord(
                    request_id=f"{arm}-{look}-{i}", tag="experiment", worker="w", sent_at=clock, e2e_s=ttft + tpot * (TOKENS - 1),
                    ttft_s=ttft, output_tokens=TOKENS, chunks=TOKENS, ok=True, status=200, arm=arm, pinned_arm=arm,
                    dataset_index=look * PER_LOOK + i,
                ))
                looks_of.append(look)
    return out, looks_of


def judge_all(recs, looks_of, twin: bool):
    """Every look as the controller makes them; the last look's gates and floor."""
    p, fractions, gates, floor = plan(twin), [], [], None
    for look in range(1, LOOKS + 1):
        end = max(i for i, lk in enumerate(looks_of) if lk == look) + 1
        fractions.append(next_information(fractions, p.information(requests_by_arm(recs[:end], p.arms))))
        gates, floor = judge_look_with_floor(recs[:end], looks_of[:end], fractions, GATES, p, None, False)
    return {g.name: g for g in gates}, floor


def test_the_twin_name_is_the_configs():
    assert TWIN_ARM == TWIN


def test_a_twin_slower_cored_baseline_blocks_a_pass_the_objective_would_give():
    """Rule: identical configs measured apart (the baseline on slower cores than the twin and the canary) make the
    objective INCONCLUSIVE, with the A/A ratio in its reason; without the twin the same data pass."""
    recs, looks_of = records(1, {BASELINE: 1.0, CANARY: 0.8, TWIN_ARM: 0.8})
    two_arms = [r for r in recs if r.arm != TWIN_ARM]
    two_looks = [lk for r, lk in zip(recs, looks_of) if r.arm != TWIN_ARM]
    alone, no_floor = judge_all(two_arms, two_looks, twin=False)
    assert alone[OBJECTIVE_NAME].verdict is Verdict.PASS and no_floor is None
    gates, floor = judge_all(recs, looks_of, twin=True)
    assert floor is not None and floor.excludes_one and floor.blocks_pass
    assert floor.upper is not None and floor.upper < 1.0 and 0.7 < floor.ratio < 0.9
    objective = gates[OBJECTIVE_NAME]
    assert objective.verdict is Verdict.INCONCLUSIVE
    assert "A/A TPOT p50 ratio twin/baseline" in objective.detail and f"{floor.ratio:.4f}" in objective.detail
    assert set(floor.design_effect) == {"baseline", "twin"}


def test_a_true_twin_leaves_a_clear_improvement_passing():
    """Rule: an A/A interval that contains 1 changes no verdict; the objective's detail still reports the floor."""
    recs, looks_of = records(2, {BASELINE: 1.0, CANARY: 0.7, TWIN_ARM: 1.0})
    gates, floor = judge_all(recs, looks_of, twin=True)
    assert floor is not None and not floor.excludes_one and not floor.blocks_pass
    assert floor.lower is not None and floor.lower < 1.0 < floor.upper
    assert gates[OBJECTIVE_NAME].verdict is Verdict.PASS
    assert "Noise floor: A/A TPOT p50 ratio" in gates[OBJECTIVE_NAME].detail


def test_a_twin_without_an_interval_yet_blocks_the_pass():
    """Rule (fail closed): a floor that cannot be bounded (too few twin samples) does not let the objective pass."""
    recs, looks_of = records(3, {BASELINE: 1.0, CANARY: 0.7, TWIN_ARM: 1.0})
    baseline = [r for r in recs if r.arm == BASELINE]
    twin = LatencySamples(ttft_s=np.array([0.1] * 5), tpot_s=np.array([0.03] * 5), e2e_s=np.array([1.0] * 5),
                          n_errors=0, n_total=5, window=np.ones(5, dtype=int))
    base = LatencySamples(
        ttft_s=np.array([r.ttft_s for r in baseline]), tpot_s=np.array([r.tpot_s for r in baseline]),
        e2e_s=np.array([r.e2e_s for r in baseline]), n_errors=0, n_total=len(baseline),
        window=np.array([lk for r, lk in zip(recs, looks_of) if r.arm == BASELINE]),
    )
    floor = judge_noise_floor(base, twin, GATES, look=LOOKS, max_looks=LOOKS, information=[0.2, 0.4, 0.6, 0.8, 1.0])
    assert floor.lower is None and floor.blocks_pass and "no interval yet" in floor.detail
    gates, _ = judge_all(recs, looks_of, twin=True)
    assert gates[OBJECTIVE_NAME].verdict is Verdict.PASS  # with the twin's real samples it passes
    blocked = apply_noise_floor(list(gates.values()), floor)
    assert {g.name: g.verdict for g in blocked}[OBJECTIVE_NAME] is Verdict.INCONCLUSIVE


def test_a_fail_stays_a_fail_and_other_gates_are_untouched():
    recs, looks_of = records(4, {BASELINE: 1.0, CANARY: 1.6, TWIN_ARM: 0.8})
    gates, floor = judge_all(recs, looks_of, twin=True)
    assert floor is not None and floor.excludes_one
    assert gates[OBJECTIVE_NAME].verdict is Verdict.FAIL
    without, _ = judge_all([r for r in recs], looks_of, twin=False)
    for name in ("ttft_p95_guard", "error_rate_guard"):
        assert gates[name].verdict == without[name].verdict


def test_the_twin_is_an_arm_of_the_looks_and_of_the_sample_ratio():
    """A look waits for the twin's requests too, and the sample-ratio check counts three arms."""
    p = plan(twin=True)
    assert p.arms == (BASELINE, CANARY, TWIN_ARM)
    assert not p.look_due({BASELINE: PER_LOOK, CANARY: PER_LOOK, TWIN_ARM: 0}, {}, 1.0)
    recs, looks_of = records(5, {BASELINE: 1.0, CANARY: 1.0, TWIN_ARM: 1.0})
    gates = judge_look(recs, looks_of, [1.0] * 1, GATES, LookPlan(PER_LOOK * LOOKS, PER_LOOK * LOOKS, 0.0, 1, 1e9, twin=True),
                       None, False)
    sample_ratio = {g.name: g for g in gates}["sample_ratio"]
    assert sample_ratio.verdict is Verdict.PASS


def test_the_floor_serialises_into_the_experiment_summary():
    from rollout.record.result import ExperimentSummary

    recs, looks_of = records(6, {BASELINE: 1.0, CANARY: 0.8, TWIN_ARM: 0.8})
    _, floor = judge_all(recs, looks_of, twin=True)
    base = dict(
        looks=[], planned_looks=5, requests_per_look=60, requests_per_arm_planned=300, information=1.0, requests={},
        records_after_last_look=0, requests_received=None, records_stored=0, duty_cycle=None, load_start_s=None,
        duration_s=1.0, generator_warnings=[], generator_send_lag_p99_ms=None, latency_ms={}, client_tokens_per_chunk={},
        stopped_by="evidence",
    )
    without = ExperimentSummary(**base).document()
    assert "noise_floor" not in without  # a run without a twin writes what it wrote before
    doc = ExperimentSummary(**base, noise_floor=floor).document()
    again = NoiseFloor(**json.loads(json.dumps(doc["noise_floor"])))
    assert again == floor and doc["noise_floor"]["excludes_one"] is True


@pytest.mark.parametrize("seed", [7, 8])
def test_without_a_twin_the_look_is_judged_as_before(seed):
    """plan.twin False: judge_look ignores twin records entirely (the default demo's path is unchanged)."""
    recs, looks_of = records(seed, {BASELINE: 1.0, CANARY: 0.85, TWIN_ARM: 0.5})
    two = [(r, lk) for r, lk in zip(recs, looks_of) if r.arm != TWIN_ARM]
    with_twin_records, _ = judge_all(recs, looks_of, twin=False)
    plain, _ = judge_all([r for r, _ in two], [lk for _, lk in two], twin=False)
    for name, gate in plain.items():
        assert with_twin_records[name].verdict == gate.verdict
        assert with_twin_records[name].interval == gate.interval


def test_a_pass_against_the_baseline_alone_is_not_enough_the_twin_must_agree():
    """Rule (intersection): an A/A interval that contains 1 lets the objective pass only if it also
    passes with the twin as the reference; a missing or undecided twin comparison blocks it."""
    recs, looks_of = records(4, {BASELINE: 1.0, CANARY: 0.7, TWIN_ARM: 1.0})
    gates, floor = judge_all(recs, looks_of, twin=True)
    assert floor is not None and not floor.blocks_pass and gates[OBJECTIVE_NAME].verdict is Verdict.PASS
    objective = gates[OBJECTIVE_NAME]
    undecided = objective.model_copy(update={"verdict": Verdict.INCONCLUSIVE, "detail": "interval straddles the bar"})
    for against_twin in (undecided, None):
        out = {g.name: g for g in apply_noise_floor(list(gates.values()), floor, against_twin)}
        assert out[OBJECTIVE_NAME].verdict is Verdict.INCONCLUSIVE and "Against the twin" in out[OBJECTIVE_NAME].detail
    kept = {g.name: g for g in apply_noise_floor(list(gates.values()), floor, objective)}
    assert kept[OBJECTIVE_NAME].verdict is Verdict.PASS
