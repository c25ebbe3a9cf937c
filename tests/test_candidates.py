"""Several candidates against one baseline (rollout.judge.candidates): the alpha split, the winner, each loser's
reason, and the simulated world's candidate arms (rollout.calibration.scenarios) calibrate judges them in."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from cluster.arms import BASELINE, CANARY
from rollout.calibration import calibrate
from rollout.judge.candidates import CandidateResult, candidate_gates, choose_winner
from rollout.judge.config import GatesConfig
from rollout.judge.names import OBJECTIVE_NAME
from rollout.calibration.scenarios import TrialSpec, candidate_arms, simulate_records
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


# -- the run path's pure parts: the config, each candidate's view, the record --------------------------------------
def candidates_config(**changes):
    import yaml

    from rollout.config import parse_config
    from tests.conftest import REPO

    data = yaml.safe_load((REPO / "configs" / "examples" / "local-candidates.yaml").read_text())
    if changes.get("candidates") == []:  # the one-canary form: mtp3 as the canary
        changes["canary"] = {k: v for k, v in data["candidates"][0].items() if k != "name"}
    data.update(changes)
    return parse_config(data)


def test_candidates_take_the_canary_seat_in_turn_and_a_stored_config_reads_back():
    from rollout.config import parse_config

    cfg = candidates_config()
    assert cfg.experiment_arms == (BASELINE, "mtp3", "ngram3", "plain")
    assert cfg.arm("mtp3").engine.num_speculative_tokens == 3 and cfg.arm(BASELINE) is cfg.baseline
    # the seat starts as the first candidate's config: every check of `canary` holds for it
    assert cfg.canary == cfg.candidates[0].arm()
    # decision.json and the store keep the dumped config (with that copy): it validates again
    again = parse_config(cfg.model_dump(mode="json"))
    assert again.experiment_arms == cfg.experiment_arms and again.canary == cfg.canary
    # and the one-canary form is what it was
    assert candidates_config(candidates=[]).experiment_arms == (BASELINE, CANARY)


def test_a_candidates_view_is_the_baseline_and_that_candidate_as_the_canary():
    from loadtests.records import RequestRecord
    from rollout.judge.candidates import candidate_view

    def record(i: int, arm: str) -> RequestRecord:
        return RequestRecord(request_id=f"r{i}", tag="experiment", worker="w", status=200, sent_at=float(i), e2e_s=1.0,
                             ok=True, arm=arm, pinned_arm=arm)

    records = [record(0, BASELINE), record(1, "k2"), record(2, "k3"), record(3, BASELINE), record(4, "k3")]
    looks_of = [1, 1, 1, 2, 2]
    view, looks = candidate_view(records, looks_of, "k3")
    assert [(r.request_id, r.arm, r.pinned_arm) for r in view] == [
        ("r0", BASELINE, BASELINE), ("r2", CANARY, CANARY), ("r3", BASELINE, BASELINE), ("r4", CANARY, CANARY)]
    assert looks == [1, 1, 2, 2]
    assert records[2].arm == "k3", "the records themselves are left as they are"


def candidates_document(winner: str | None) -> dict:
    """A decision.json of a run with two candidates: k3 won (k2 passed but slower), or none did."""
    from rollout.record.result import CandidateSummary, RunResult, decision_document

    k2 = CandidateSummary(name="k2", speculative_tokens=2, alpha=0.025, decision=Decision.PROMOTE if winner else
                          Decision.ROLLBACK, reason="passed, but k3 is faster" if winner else "rolled back: x failed",
                          gates=[gate(OBJECTIVE_NAME, Verdict.PASS, 0.64)])
    k3 = CandidateSummary(name="k3", speculative_tokens=3, speculation="mtp k=3", alpha=0.025,
                          decision=Decision.PROMOTE if winner else Decision.INCONCLUSIVE,
                          reason="promoted: TPOT p50 ratio 0.500" if winner else "inconclusive: y",
                          gates=[gate(OBJECTIVE_NAME, Verdict.PASS if winner else Verdict.INCONCLUSIVE, 0.5)])
    from pathlib import Path

    result = RunResult(run_id="cands", run_dir=Path("/tmp/cands"), config=candidates_config(),
                       decision=Decision.PROMOTE if winner else Decision.INCONCLUSIVE, reason="r",
                       candidates=[k2, k3], winner=winner)
    return decision_document(result)


def test_decision_json_holds_each_candidate_and_the_winner_and_reads_back():
    from pathlib import Path

    from rollout.record.result import RunResult, decision_document

    doc = candidates_document("k3")
    assert doc["winner"] == "k3"
    assert [(c["name"], c["alpha"], c["decision"]) for c in doc["candidates"]] == [("k2", 0.025, "promote"),
                                                                                     ("k3", 0.025, "promote")]
    back = RunResult.from_document(doc, candidates_config(), Path("/tmp/cands"))
    assert decision_document(back) == doc
    # a one-canary run's document has neither key (its key paths are the recorded runs')
    from rollout.record.result import RunResult as Result

    plain = decision_document(Result(run_id="one", run_dir=Path("/tmp/one"), config=candidates_config(candidates=[])))
    assert "candidates" not in plain and "winner" not in plain


def test_junit_metrics_and_report_name_every_candidate_and_why():
    import xml.etree.ElementTree as ET

    from rollout.record.junit import junit_xml
    from rollout.record.markdown import markdown_report

    won = ET.fromstring(junit_xml(candidates_document("k3")))
    cases = {c.get("name"): c for c in won.iter("testcase")}
    # with a winner every candidate's case passes: losing to a better one is the selection working
    assert {"candidate k2", "candidate k3"} <= set(cases) and won.get("failures") == won.get("errors") == "0"
    assert "k3 is faster" in cases["candidate k2"].find("system-out").text
    lost = ET.fromstring(junit_xml(candidates_document(None)))
    cases = {c.get("name"): c for c in lost.iter("testcase")}
    assert cases["candidate k2"].find("failure") is not None and cases["candidate k3"].find("error") is not None
    from rollout.record.prometheus import metrics_text

    prom = metrics_text(candidates_document("k3"))
    assert 'mtp_canary_candidate_winner{candidate="k3",run_id="cands"} 1.0' in prom
    assert 'mtp_canary_candidate_decision{candidate="k2",decision="promote",run_id="cands"} 1.0' in prom
    report = markdown_report(candidates_document("k3"))
    assert "## Candidates (winner: k3)" in report and "passed, but k3 is faster" in report and "### k2: gates" in report
    # each candidate named by its speculative config (a document written before that field: by its k)
    assert "| k3 | mtp k=3 |" in report and "| k2 | k=2 |" in report
    assert [c.get("speculation") for c in candidates_document("k3")["candidates"]] == ["", "mtp k=3"]


def test_a_run_with_candidates_is_not_resumed_nor_replayed_as_one_canary(tmp_path, capsys):
    import json

    from rollout.commands import resume as resume_command
    from rollout.analysis.replay import BadInput, load_input

    assert resume_command.resumable(candidates_config(), "run-1") is None
    assert "cannot be resumed" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    (run / "decision.json").write_text(json.dumps(candidates_document("k3")))
    (run / "experiment").mkdir()
    (run / "experiment" / "records.jsonl").write_text("")
    with pytest.raises(BadInput, match="a run with candidates"):
        load_input(str(run), None)


def test_status_shows_each_candidates_gates_of_each_look(tmp_path):
    from rollout.run.status import run_status
    from rollout.run.store import RunStore

    store = RunStore(tmp_path / "history.db")
    store.create_run("c", "cands", "tiny", {})
    look = {name: [gate(OBJECTIVE_NAME, verdict, ratio).model_dump(mode="json")]
            for name, verdict, ratio in (("k2", Verdict.INCONCLUSIVE, 0.7), ("k3", Verdict.PASS, 0.5))}
    store.put_phase_result("c", "experiment_candidates", 1, look)
    latest = {g.name: g.verdict for g in run_status(store, "c").latest_gates}
    assert latest == {f"k2/{OBJECTIVE_NAME}": "inconclusive", f"k3/{OBJECTIVE_NAME}": "pass"}


def test_report_html_of_a_run_with_candidates_and_a_sweep_on_the_winner(tmp_path):
    import json

    from rollout.record.html import html_report
    from tests.conftest import REPO

    recorded = json.loads((REPO / "tests" / "data" / "recorded_runs" / "promote" / "decision.json").read_text())
    doc = candidates_document("k3")
    doc["experiment"] = recorded["experiment"]  # with a sweep whose arms are baseline and canary (the winner)
    engine = {"model": "tiny", "served_model_name": "tiny", "speculative_config": {"num_speculative_tokens": 1}}
    # decision.json's arms of such a run, in its order: the baseline, each candidate, then the winner's seat
    doc["arms"] = {arm: {"replicas": 1, "engine": engine} for arm in ("baseline", "k2", "k3", "canary")}
    page = html_report(doc, tmp_path)
    assert 'id="candidates"' in page and 'id="sweep"' in page, "a section fell back or is missing"
    assert "passed, but k3 is faster" in page


def test_candidates_that_already_lost_do_not_hold_the_experiments_stop():
    from rollout.judge.candidates import CandidateLooks
    from rollout.judge.experiment_looks import LookPlan

    plan = LookPlan(requests_per_look=10, requests_per_arm=100, min_interval_s=0.0, min_looks=1, max_duration_s=60.0)
    looks = CandidateLooks(("k2", "k3"), candidate_gates(CFG, 2), plan, settled_at={"k2": 0, "k3": 0})
    assert looks.look(1, [], [], [0.1], spec_of=lambda name: None, speculative={}) == "evidence"
    assert looks.gates == {}, "a candidate that lost before the experiment is not judged again"


def test_a_candidate_is_lost_before_the_experiment_only_by_a_gate_the_run_judges():
    """Rule: a candidate drops out of the experiment when its gates so far already decide a rollback, as the
    final choice decides it: a failed preflight check or a judged accuracy gate. A FAIL of a gate the config
    does not judge (output_divergence in gates.disabled, as sampled runs must) loses nothing; before, any
    FAIL did, and the candidate's experiment gates were then never judged."""
    from types import SimpleNamespace

    from rollout.run.phases.candidate_choice import lost_candidates

    cfg = SimpleNamespace(gates=GatesConfig(disabled=["output_divergence"]))
    ctx = SimpleNamespace(cfg=cfg, candidate_gates={
        "k2": [gate("accuracy_noninferiority", Verdict.PASS), gate("output_divergence", Verdict.FAIL)],
        "k3": [gate("accuracy_noninferiority", Verdict.FAIL), gate("output_divergence", Verdict.PASS)],
        "k4": [gate("preflight_speculation", Verdict.FAIL)],
    })
    assert lost_candidates(ctx) == {"k3", "k4"}


def test_a_candidate_without_speculation_is_judged_without_the_acceptance_floor():
    """Rule: "no speculation" is a candidate; its acceptance-length floor does not apply (no drafts) and says so.
    Judged as a speculating arm's it stays INCONCLUSIVE for ever, and the arm could never win."""
    from rollout.judge.candidates import NOT_APPLICABLE, not_applicable_acceptance
    from rollout.judge.names import ACCEPTANCE_NAME

    cfg = GatesConfig(enabled=[OBJECTIVE_NAME, ACCEPTANCE_NAME])
    judged = [gate(OBJECTIVE_NAME, Verdict.PASS, 0.9), gate(ACCEPTANCE_NAME, Verdict.INCONCLUSIVE)]
    assert CandidateResult("none", 0, judged).decision(cfg) is Decision.INCONCLUSIVE
    marked = not_applicable_acceptance(judged, "none")
    floor = next(g for g in marked if g.name == ACCEPTANCE_NAME)
    assert floor.detail.startswith(NOT_APPLICABLE + "none does not speculate") and floor.verdict is Verdict.PASS
    assert marked[0] == judged[0], "the other gates are left as judged"
    assert CandidateResult("none", 0, marked).decision(cfg) is Decision.PROMOTE


def test_the_looks_mark_the_floor_not_applicable_only_for_a_candidate_that_does_not_speculate(monkeypatch):
    import rollout.judge.candidates as candidates
    from rollout.judge.experiment_looks import LookPlan
    from rollout.judge.names import ACCEPTANCE_NAME

    def judged(*args, **kwargs):
        return [gate(OBJECTIVE_NAME, Verdict.INCONCLUSIVE, 0.9), gate(ACCEPTANCE_NAME, Verdict.INCONCLUSIVE)], None

    monkeypatch.setattr(candidates, "judge_look_with_floor", judged)
    plan = LookPlan(requests_per_look=10, requests_per_arm=100, min_interval_s=0.0, min_looks=1, max_duration_s=60.0)
    looks = candidates.CandidateLooks(("none", "ngram"), candidate_gates(CFG, 2), plan)
    looks.look(1, [], [], [0.1], spec_of=lambda name: None, speculative={"none": False, "ngram": True})
    floors = {name: next(g for g in gates if g.name == ACCEPTANCE_NAME) for name, gates in looks.gates.items()}
    assert floors["none"].detail.startswith("not applicable") and floors["none"].verdict is Verdict.PASS
    assert floors["ngram"].verdict is Verdict.INCONCLUSIVE, "a speculating candidate's floor is judged as it was"


def test_candidates_of_other_methods_are_named_with_their_config_and_no_speculation_drafts_least():
    """The tie rule's cost is the draft tokens per step whatever the method; no speculation drafts none."""
    from cluster.speculation import speculative_label

    def of(name, config, ratio):
        from cluster.speculation import speculative_tokens
        return CandidateResult(name, speculative_tokens(config), candidate(name, 0, ratio).gates, speculative_label(config))

    choice = choose_winner([
        of("mtp3", {"method": "mtp", "num_speculative_tokens": 3}, 0.700),
        of("ngram", {"method": "ngram", "num_speculative_tokens": 3}, 0.900),
        of("plain", None, 0.710),
    ], CFG)
    assert choice.winner == "plain"  # within 2% of mtp k=3 and drafts nothing
    assert choice.reasons["plain"] == "promoted: TPOT p50 ratio 0.710 (no speculation)"
    assert choice.reasons["mtp3"].startswith("passed, tied with plain (no speculation) (TPOT p50 ratio 0.700 vs 0.710")
    assert choice.reasons["ngram"] == "passed, but plain (no speculation) is faster (TPOT p50 ratio 0.710 vs 0.900)"
    unnamed = choose_winner([candidate("k2", 2, 0.8), candidate("k3", 3, 0.7)], CFG)
    assert unnamed.reasons["k2"] == "passed, but k3 is faster (TPOT p50 ratio 0.700 vs 0.800)", "no label: as before"
