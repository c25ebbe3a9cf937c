"""The experiment phase: one continuous Locust load, looks by evidence, the wall-clock cap.

The pure parts (when a look is due, information fractions, the duty cycle) are tested
directly. The phase itself runs with real parts: a real Router actor on local Ray, a
real Locust swarm, a real SQLite store; the replicas are the named benchmark target
(benchmarks/stream_target.py), whose TPOT is set exactly, so the size of the effect is
known (the vLLM tests judge real engines).
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request

import pytest
import ray

from benchmarks.stream_target import TargetProcess
from cluster.router import RouterClient
from loadtests.records import RequestRecord
from loadtests.swarm import free_port
from rollout.config import ExperimentConfig
from rollout.judge.config import SloConfig
from rollout.judge.verdicts import Verdict
from rollout.run.phases.experiment_loop import LookPlan, duty_cycle
from rollout.run.context import InfrastructureError
from rollout.run.store import RunStore
from tests.experiment_harness import GATES, once_the_load_flows, routed, run_experiment


# -- pure parts -----------------------------------------------------------------
def plan(**kw) -> LookPlan:
    base = dict(requests_per_look=40, requests_per_arm=120, min_interval_s=10.0, min_looks=1, max_duration_s=600.0)
    return LookPlan(**{**base, **kw})


def test_a_look_waits_for_every_arm_and_for_the_interval():
    p = plan()
    assert not p.look_due({"baseline": 40, "canary": 39}, {"baseline": 40, "canary": 39}, 60.0)
    assert not p.look_due({"baseline": 45, "canary": 41}, {"baseline": 45, "canary": 41}, 9.0)
    assert p.look_due({"baseline": 45, "canary": 41}, {"baseline": 45, "canary": 41}, 10.0)


def test_the_plan_reached_is_a_look_even_with_fewer_new_requests():
    p = plan(requests_per_look=50, requests_per_arm=120)  # looks at 50, 100, then 120
    assert p.planned_looks == 3
    assert p.look_due({"baseline": 20, "canary": 21}, {"baseline": 120, "canary": 121}, 30.0)
    assert not p.look_due({"baseline": 19, "canary": 21}, {"baseline": 119, "canary": 121}, 30.0)


def test_information_is_the_least_served_arm_over_the_plan_capped_at_one():
    p = plan()
    assert p.information({"baseline": 60, "canary": 30}) == pytest.approx(0.25)
    assert p.information({"baseline": 500, "canary": 130}) == 1.0


def record(sent_at: float, e2e: float) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{sent_at}-{e2e}", tag="experiment", worker="w", sent_at=sent_at, e2e_s=e2e, ok=True,
        status=200, arm="baseline", ttft_s=0.01, output_tokens=4,
    )


def test_duty_cycle_counts_time_with_a_request_in_flight_once():
    # [0, 4] and [2, 6] overlap, a gap from 6 to 8, then [8, 10]
    records = [record(0, 4), record(2, 4), record(8, 2)]
    assert duty_cycle(records, 0.0, 10.0) == pytest.approx(0.8)
    assert duty_cycle(records, 0.0, 6.0) == pytest.approx(1.0)
    assert duty_cycle([], 0.0, 10.0) == 0.0


# -- the phase, with real Ray, Router, Locust and SQLite ------------------------------
@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    yield
    ray.shutdown()


def verdicts(outcome) -> dict[str, Verdict]:
    return {g.name: g.verdict for g in outcome.gates}


def test_a_big_effect_stops_early_and_every_request_has_one_record(local_ray, tmp_path):
    exp = ExperimentConfig(requests_per_look=30, requests_per_arm=180, window_s=1, users_per_replica=3, max_tokens=12,
                           max_duration_s=300, workers=1, worker_placement="local")
    # the same spread, a big effect (TPOT ratio 0.4): shown long before the plan's end
    with TargetProcess(ttft_ms=20, tpot_ms=20, tpot_jitter=0.3, seed=1) as baseline, \
            TargetProcess(ttft_ms=20, tpot_ms=8, tpot_jitter=0.3, seed=2) as canary:
        with routed(baseline.url, canary.url) as (router, url):
            before = sum(RouterClient(router, url).request_counts().values())
            ticks: list[tuple[str, int, int]] = []
            outcome, store, lines = run_experiment(tmp_path, router, url, exp, GATES, ticks=ticks)
            received = sum(RouterClient(router, url).request_counts().values()) - before
    summary = outcome.summary
    # the progress bar follows the fewest-requests arm against the plan, never backwards
    done = [d for task, d, total in ticks if task.startswith("experiment requests") and total == exp.requests_per_arm]
    assert done and done == sorted(done) and done[-1] >= exp.requests_per_look, ticks[-3:]
    assert verdicts(outcome)["tpot_p50_improvement"] == Verdict.PASS
    # shown before the plan's end, and the phase stops there: not at look 1 (one look is one
    # block, and a level shared by a look's requests cannot be told from the effect: the latency
    # judge needs looks to compare), but with looks to spare
    assert len(summary["looks"]) < summary["planned_looks"] == 6, lines
    assert summary["information"] < 1.0
    assert any("stopping early" in line for line in lines)
    # none lost between looks: every request the router received is one stored record
    assert summary["records_stored"] == received == summary["requests_received"] > 0
    assert store.count_request_samples("exp", "experiment") == received
    # looks are slices of one load: each look's requests add up to what the arms completed
    judged = sum(sum(look["requests"].values()) for look in summary["looks"])
    warm = sum(summary["warmup_requests"].values())  # the default warm-up: stored, never in a look
    assert judged + warm + summary["records_after_last_look"] >= received - 2 * exp.users_per_replica
    assert summary["duty_cycle"] >= 0.95


def test_a_small_effect_keeps_looking_to_the_plan(local_ray, tmp_path):
    exp = ExperimentConfig(requests_per_look=30, requests_per_arm=90, window_s=1, users_per_replica=3, max_tokens=12,
                           max_duration_s=300, workers=1, worker_placement="local")
    # TPOT ratio 0.85 against the 0.9 bar, with per-request spread (log-sd 0.3). Both targets draw
    # the same spread sequence (same seed), so the observed ratio sits at 0.85 while the judge,
    # which must assume independent arms, sees the spread: the first look (~35 per arm,
    # O'Brien-Fleming z ~3.7) puts the upper bound near 1.15, and the phase keeps looking
    with TargetProcess(ttft_ms=20, tpot_ms=20, tpot_jitter=0.3, seed=7) as baseline, \
            TargetProcess(ttft_ms=20, tpot_ms=17, tpot_jitter=0.3, seed=7) as canary:
        with routed(baseline.url, canary.url) as (router, url):
            # with an SLO every request meets (20 ms TTFT against 5 s): each look's goodput is reported per arm
            gates = GATES.model_copy(update={"slo": SloConfig(ttft_s=5.0)})
            outcome, _, lines = run_experiment(tmp_path, router, url, exp, gates)
    summary = outcome.summary
    looks = summary["looks"]
    assert len(looks) >= 2, lines
    assert looks[0]["verdicts"]["tpot_p50_improvement"] == "inconclusive"
    assert all(look["goodput"] == {"baseline": 1.0, "canary": 1.0} for look in looks), looks
    # it stopped only on a verdict or at the plan's end, and never claimed the improvement absent
    assert verdicts(outcome)["tpot_p50_improvement"] != Verdict.FAIL
    assert verdicts(outcome)["tpot_p50_improvement"] == Verdict.PASS or summary["information"] == 1.0
    fractions = [look["information"] for look in looks]
    assert fractions == sorted(fractions) and 0 < fractions[0] < fractions[-1] <= 1.0
    assert outcome.capped_reason is None


def test_the_wall_clock_cap_ends_the_phase_with_the_counts_in_the_reason(local_ray, tmp_path):
    # no warm-up: the cap is to come after a look (a cap inside the warm-up has a reason of its own)
    exp = ExperimentConfig(requests_per_look=100, requests_per_arm=5000, window_s=1, users_per_replica=2, max_tokens=12,
                           max_duration_s=12, workers=1, worker_placement="local", warmup_requests_per_arm=0)
    with TargetProcess(ttft_ms=20, tpot_ms=20) as baseline, TargetProcess(ttft_ms=20, tpot_ms=19) as canary:
        with routed(baseline.url, canary.url) as (router, url):
            outcome, _, _ = run_experiment(tmp_path, router, url, exp, GATES)
    reason = outcome.capped_reason
    assert reason is not None and "max_duration_s (12 s)" in reason
    assert f"the plan needs {exp.requests_per_arm} per arm" in reason
    judged = {arm: sum(look["requests"][arm] for look in outcome.summary["looks"]) for arm in ("baseline", "canary")}
    assert f"baseline {judged['baseline']}, canary {judged['canary']} completed requests" in reason
    assert outcome.summary["information"] < 1.0
    # at a quarter speed the cap can come before the first look of 100: then no gate was judged at all
    # (KeyError seen under benchmarks/slowed.sh 0.5); either way the objective did not pass
    assert verdicts(outcome).get("tpot_p50_improvement") != Verdict.PASS


def test_a_replica_that_dies_mid_phase_ends_it_as_an_error_naming_it_with_its_records_kept(local_ray, tmp_path):
    exp = ExperimentConfig(requests_per_look=100, requests_per_arm=3000, window_s=1, users_per_replica=3, max_tokens=12,
                           max_duration_s=240, workers=1, worker_placement="local")
    with TargetProcess(ttft_ms=20, tpot_ms=20) as baseline, TargetProcess(ttft_ms=20, tpot_ms=10) as canary:
        servers = {"baseline-0": baseline._process, "canary-0": canary._process}

        def alive() -> dict[str, bool]:  # what the replica actors' liveness says: the server process
            return {name: proc.poll() is None for name, proc in servers.items()}

        records = tmp_path / "experiment" / "records.jsonl"
        # mid-phase on any machine: after records exist
        with once_the_load_flows(records, servers["baseline-0"].kill) as killed:
            with routed(baseline.url, canary.url) as (router, url):
                with pytest.raises(InfrastructureError, match="replica baseline-0 died"):
                    run_experiment(tmp_path, router, url, exp, GATES, replicas_alive=alive)
        assert killed
    # what arrived before the death is kept (a post-mortem has it), not judged into a verdict
    store = RunStore(tmp_path / "history.db")
    assert store.count_request_samples("exp", "experiment") > 0


def test_the_web_ui_stays_at_one_url_from_the_first_look_to_the_last(local_ray, tmp_path):
    exp = ExperimentConfig(requests_per_look=25, requests_per_arm=100, window_s=2, users_per_replica=2, max_tokens=12,
                           max_duration_s=300, workers=1, worker_placement="local")
    port = free_port()
    polls: list[tuple[float, int]] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
                    polls.append((time.time(), response.status))
            except OSError:
                polls.append((time.time(), 0))
            time.sleep(0.5)

    # the small effect's setup: undecided at the first look, so there are several looks to poll across
    with TargetProcess(ttft_ms=20, tpot_ms=20, tpot_jitter=0.3, seed=7) as baseline, \
            TargetProcess(ttft_ms=20, tpot_ms=17, tpot_jitter=0.3, seed=7) as canary:
        with routed(baseline.url, canary.url) as (router, url):
            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            try:
                outcome, store, _ = run_experiment(tmp_path, router, url, exp, GATES, web_port=port)
            finally:
                done.set()
                poller.join(10)
    looks = outcome.summary["looks"]
    assert len(looks) >= 2
    # polled every 0.5 s from before the load to after it: up at one URL from the first look to the last
    between = [status for at, status in polls if looks[0]["at"] <= at <= looks[-1]["at"]]
    assert len(between) >= 2 and all(status == 200 for status in between), polls


def test_a_capped_experiment_is_inconclusive_and_its_reason_has_the_counts(tmp_path):
    from rollout.config import load_config
    from rollout.run.controller import Controller
    from rollout.judge.verdicts import Decision, GateResult
    from rollout.run.decision import decide_now

    ctx = Controller(load_config("configs/local-cpu.yaml"), runs_dir=tmp_path, run_id="capped").ctx
    ctx.experiment_capped = "experiment.max_duration_s (240 s) reached after 2 look(s): baseline 61, canary 60"
    ctx.result.gates = [
        GateResult(name="tpot_p50_improvement", metric="tpot_p50_ratio", baseline=1.0, canary=0.5, threshold=0.9,
                   verdict=Verdict.PASS),
        GateResult(name="error_rate_guard", metric="error_rate_diff", baseline=0.0, canary=0.0, threshold=0.05,
                   verdict=Verdict.INCONCLUSIVE),
    ]
    decided = decide_now(ctx.result.gates, ctx.cfg, ctx.experiment_capped)
    assert decided.decision == Decision.INCONCLUSIVE
    assert decided.reason.startswith("experiment.max_duration_s (240 s) reached")
    assert "baseline 61, canary 60" in decided.reason and "error_rate_guard" in decided.reason


def test_a_warm_up_is_stored_as_look_0_and_the_looks_judge_only_what_follows(local_ray, tmp_path):
    exp = ExperimentConfig(requests_per_look=20, requests_per_arm=40, window_s=1, users_per_replica=2, max_tokens=8,
                           max_duration_s=300, workers=1, worker_placement="local", warmup_requests_per_arm=15)
    scrapes: list[float] = []
    with TargetProcess(ttft_ms=20, tpot_ms=10) as baseline, TargetProcess(ttft_ms=20, tpot_ms=10) as canary:
        with routed(baseline.url, canary.url) as (router, url):
            before = sum(RouterClient(router, url).request_counts().values())
            outcome, store, lines = run_experiment(tmp_path, router, url, exp, GATES,
                                                   scrape=lambda: scrapes.append(time.monotonic()) or {})
            received = sum(RouterClient(router, url).request_counts().values()) - before
    summary = outcome.summary
    stored = store.request_samples("exp", "experiment")
    warm = [RequestRecord.model_validate_json(row) for look, row in stored if look == 0]
    # the warm-up: the first records, until every arm had its 15 completed requests, stored as look 0
    assert summary["warmup_requests_per_arm"] == 15
    assert all(summary["warmup_requests"][arm] >= 15 for arm in ("baseline", "canary")), summary["warmup_requests"]
    assert min(summary["warmup_requests"].values()) == 15  # it ends at the record that completes the last arm
    assert {r.request_id for r in warm} == {r.request_id for r in outcome.warmup_records}
    # ...and never judged: the looks and the summary's requests count only what followed it
    judged_ids = {r.request_id for r in outcome.records}
    assert not judged_ids & {r.request_id for r in warm}
    assert summary["looks"][0]["requests"]["baseline"] >= exp.requests_per_look
    assert summary["requests"] == {arm: sum(1 for r in outcome.records if r.arm == arm and not r.cancelled)
                                   for arm in ("baseline", "canary")}
    # none lost: warm-up + judged + after the last look is every request the router received
    assert summary["records_stored"] == received == len(warm) + len(outcome.records)
    # the acceptance counters begin again at the warm-up's end: one scrape at the start, one
    # at the end of the warm-up, one per look, and one after the load (whose acceptance it was)
    assert len(scrapes) == 3 + len(summary["looks"]), (len(scrapes), lines)
    assert any(line.startswith("experiment: warm-up over:") for line in lines), lines
    assert lines.index(next(line for line in lines if "warm-up over" in line)) < lines.index(
        next(line for line in lines if line.startswith("experiment: look 1/")))


def test_several_candidates_share_one_load_and_each_is_judged_against_the_baseline_at_its_share_of_alpha(
        local_ray, tmp_path):
    from rollout.judge.candidates import CandidateResult, candidate_gates, candidate_view, choose_winner
    from rollout.judge.experiment_looks import judge_look_with_floor

    exp = ExperimentConfig(requests_per_look=30, requests_per_arm=150, window_s=1, users_per_replica=3, max_tokens=12,
                           max_duration_s=300, workers=1, worker_placement="local")
    # baseline 20 ms TPOT; candidate "fast" 8 ms (ratio 0.4, far past the 0.9 bar); "same" 20 ms (no gain)
    with TargetProcess(ttft_ms=20, tpot_ms=20, tpot_jitter=0.3, seed=1) as baseline, \
            TargetProcess(ttft_ms=20, tpot_ms=8, tpot_jitter=0.3, seed=2) as fast, \
            TargetProcess(ttft_ms=20, tpot_ms=20, tpot_jitter=0.3, seed=3) as same:
        with routed(baseline.url, "", fast=fast.url, same=same.url) as (router, url):
            before = sum(RouterClient(router, url).request_counts().values())
            outcome, store, lines = run_experiment(tmp_path, router, url, exp, GATES, candidates=("fast", "same"))
            received = sum(RouterClient(router, url).request_counts().values()) - before
    summary = outcome.summary
    # one load, three pinned arms: every arm served, none lost
    assert set(summary["requests"]) == {"baseline", "fast", "same"} and min(summary["requests"].values()) >= 30, summary
    assert summary["records_stored"] == received == store.count_request_samples("exp", "experiment") > 0
    assert outcome.gates == [], "a run with candidates has no canary of its own"
    objective = {name: next(g for g in gates if g.name == "tpot_p50_improvement")
                 for name, gates in outcome.candidate_gates.items()}
    assert objective["fast"].verdict == Verdict.PASS, lines
    assert objective["same"].verdict != Verdict.PASS, lines
    # each look names every candidate's verdicts
    assert all({"fast/tpot_p50_improvement", "same/tpot_p50_improvement"} <= set(look["verdicts"]) for look in
               summary["looks"]), summary["looks"]
    # fast's gates are the one-candidate judge's on its view of the records at alpha / 2, at the look where they
    # became final (they stand from there), and not what the whole alpha gives
    final = next(look["look"] for look in summary["looks"] if look["verdicts"]["fast/tpot_p50_improvement"] == "pass")
    judged = [(r, look) for r, look in zip(outcome.records, outcome.looks_of) if look <= final]
    records, looks_of = candidate_view([r for r, _ in judged], [look for _, look in judged], "fast")
    assert {r.served_arm for r in records} == {"baseline", "canary"}
    fractions = [look["information"] for look in summary["looks"][:final]]
    plan = LookPlan.of(exp)
    half = candidate_gates(GATES, 2)

    def objective_at(cfg):
        gates, _ = judge_look_with_floor(records, looks_of, fractions, cfg, plan, None, False)
        return next(g for g in gates if g.name == "tpot_p50_improvement")

    assert objective_at(half).interval == pytest.approx(objective["fast"].interval, rel=1e-3)
    assert objective_at(GATES).interval != pytest.approx(objective["fast"].interval, rel=1e-3)
    choice = choose_winner([CandidateResult(n, 1, gates) for n, gates in outcome.candidate_gates.items()], half)
    assert choice.winner == "fast", choice
    assert "same" in choice.reasons and choice.reasons["same"] != choice.reasons["fast"]
