"""Tests of `mtp-canary calibrate`: it simulates the design the controller runs, through the controller's functions.

Few trials here (the full 2,000-trial table is a command: see the module docstring of
rollout/calibration/calibrate.py); these tests check the harness, not that today's
statistics meet alpha:

* the JSON has the published keys and types, and one seed gives one result whatever
  the number of workers;
* a judge broken on purpose shows up as a false-promote rate near 1 (the harness can fail);
* a real run's records, judged through the harness's per-look path, give the verdicts
  and intervals the controller stored (tests/data/calibrate/, a `make demo` run);
* the accuracy loop makes the controller's calls (rollout.run.phases.accuracy.judge_outcomes);
* ``--config`` changes the simulated design, and the embedded default is configs/local-cpu.yaml.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from cluster.arms import BASELINE, CANARY
from cluster.metrics import SpecDecodeStats
from loadtests.records import RequestRecord
from rollout.config import ExperimentConfig, load_config
from rollout.evals import ItemOutcome
from rollout.calibration import calibrate
from rollout.judge import experiment_looks
from rollout.calibration.calibrate import default_design, design_from_run_config, format_table, run_calibration
from rollout.commands.calibrate import main
from rollout.calibration.trial import look_ends, run_accuracy_batches, run_experiment_looks
from rollout.judge.config import GatesConfig
from rollout.judge.experiment_looks import LookPlan, record_arm
from rollout.judge.names import OBJECTIVE_NAME
from rollout.calibration.scenarios import LATENCY_SCENARIOS, TrialSpec
from rollout.judge.verdicts import Verdict
from rollout.run.phases.accuracy import judge_outcomes
from rollout.run.phases.experiment_loop import ExperimentPhase
from tests.conftest import REPO

DATA = Path(__file__).parent / "data" / "calibrate"
TRIALS = 4


@pytest.fixture(scope="module")
def small_calibration() -> dict:
    return run_calibration(trials=TRIALS, seed=11, workers=1)


def test_the_result_has_the_published_keys_and_types(small_calibration):
    """The JSON contract of `calibrate --json` (docs/calibration.md's generator and other tools read these keys)."""
    result = json.loads(json.dumps(small_calibration))
    assert {"alpha", "trials", "seed", "config", "simulation_se", "scenarios", "pass_at_limit", "power", "decision"} <= set(result)
    assert result["alpha"] == 0.05 and result["trials"] == TRIALS and result["seed"] == 11
    assert [row["name"] for row in result["scenarios"]] == list(LATENCY_SCENARIOS)
    for row in result["scenarios"]:
        assert set(row) == {"name", "false_promote_rate", "false_rollback_rate", "trials"}
        assert 0.0 <= row["false_promote_rate"] <= 1.0 and 0.0 <= row["false_rollback_rate"] <= 1.0
    gates = [row["gate"] for row in result["pass_at_limit"]]
    # the demo enables no E2E guard, so it has no row
    assert gates == [
        "tpot_p50_improvement", "ttft_p95_guard", "error_rate_guard", "accuracy_noninferiority", "output_divergence",
        "acceptance_length_floor",
    ]
    assert all(isinstance(row["pass_rate"], float) and row["trials"] == TRIALS for row in result["pass_at_limit"])
    assert [row["true_tpot_ratio"] for row in result["power"]] == [0.8, 0.7]
    for row in result["power"]:
        # the controller judges at least one look of requests_per_look and at most the plan plus a look's overshoot
        assert 40 <= row["mean_requests_per_arm"] <= 600 + 40
    assert set(result["decision"]) >= {"false_promote_rate", "false_rollback_rate"}
    assert [(row["candidates"], row["scenario"]) for row in result["candidates"]] == list(calibrate.CANDIDATE_ROWS)
    for row in result["candidates"]:
        assert row["rule"] == "bonferroni" and row["candidate_alpha"] == pytest.approx(0.05 / row["candidates"])
        assert 0.0 <= row["false_promote_rate"] <= row["unadjusted_false_promote_rate"] <= 1.0 and row["trials"] == TRIALS
    assert result["config"]["requests_per_look"] == 40 and result["config"]["requests_per_arm"] == 600
    table = format_table({**result, "wall_s": 1.0})
    assert "false promote" in table and "Pass at the limit" in table and "P(PROMOTE)" in table
    assert "Several candidates" in table


def test_one_seed_one_result_whatever_the_workers():
    """Every trial has its own seeded stream, so parallel workers cannot change a published number."""
    design = default_design()
    one = run_calibration(design, trials=2, seed=5, workers=1)
    two = run_calibration(design, trials=2, seed=5, workers=2)
    assert one == two
    assert run_calibration(design, trials=2, seed=6, workers=1) != one


def test_a_judge_broken_on_purpose_is_caught(monkeypatch):
    """The harness can fail: an objective that passes whatever the data makes every false-promote rate 1, and a
    guardrail that fails whatever the data makes every A/A false-rollback rate 1.

    The harness calls the controller's judge (experiment_looks.judge_look ->
    judge_latency) rather than a copy, so breaking that function is what it measures.
    """
    honest = run_calibration(trials=TRIALS, seed=3, workers=1)
    real_judge = experiment_looks.judge_latency

    def always_passes(*args, **kwargs):
        return [g.model_copy(update={"verdict": Verdict.PASS}) if g.name == OBJECTIVE_NAME else g for g in real_judge(*args, **kwargs)]

    monkeypatch.setattr(experiment_looks, "judge_latency", always_passes)
    broken = run_calibration(trials=TRIALS, seed=3, workers=1)
    assert all(row["false_promote_rate"] == 1.0 for row in broken["scenarios"])
    # every candidate's objective passes, so a winner is named unless a guardrail is still undecided at alpha / K
    assert all(row["false_promote_rate"] >= 0.75 for row in broken["candidates"])
    assert all(row["false_promote_rate"] < 0.75 for row in honest["candidates"])
    assert honest["scenarios"][0]["false_promote_rate"] < 1.0  # iid at the bar
    assert next(r for r in broken["pass_at_limit"] if r["gate"] == OBJECTIVE_NAME)["pass_rate"] == 1.0

    def guard_always_fails(*args, **kwargs):
        return [g.model_copy(update={"verdict": Verdict.FAIL}) if g.name == "ttft_p95_guard" else g for g in real_judge(*args, **kwargs)]

    monkeypatch.setattr(experiment_looks, "judge_latency", guard_always_fails)
    rolled_back = run_calibration(trials=2, seed=3, workers=1)
    assert all(row["false_rollback_rate"] == 1.0 for row in rolled_back["scenarios"])
    assert rolled_back["decision"]["false_rollback_rate"] == 1.0


# -- the replay of a real run ---------------------------------------------------------------
def _recorded_run() -> tuple[list[RequestRecord], dict]:
    records = [RequestRecord.model_validate(json.loads(line)) for line in (DATA / "records.jsonl").read_text().splitlines()]
    return records, json.loads((DATA / "decision.json").read_text())


def _ends_by_stored_counts(records: list[RequestRecord], looks: list[dict]) -> list[int]:
    """Where each stored look ended: the record at which every arm reached that look's completed count."""
    ends, i = [], 0
    for look in looks:
        got = {BASELINE: 0, CANARY: 0}
        while any(got[arm] < look["requests"][arm] for arm in got):
            if not records[i].cancelled:
                got[record_arm(records[i])] += 1
            i += 1
        ends.append(i)
    return ends


def _replay_setup():
    records, decision = _recorded_run()
    cfg = GatesConfig(**decision["gates_config"])
    exp = decision["experiment"]
    plan = LookPlan(exp["requests_per_look"], exp["requests_per_arm_planned"], 10.0, 1, 480.0)
    spec = decision["spec_decode"]["canary"]
    canary_spec = SpecDecodeStats(drafts=spec["drafts"], draft_tokens=spec["draft_tokens"], accepted_tokens=spec["accepted_tokens"])
    return records, decision, cfg, plan, canary_spec, _ends_by_stored_counts(records, exp["looks"])


def _controller_looks(records, ends, cfg, canary_spec) -> list[list]:
    """The live controller's own look (rollout.run.phases.experiment_loop.ExperimentPhase._look) over the same slices,
    with a store and a scrape that do nothing but hold the records and the canary's counters."""
    store = SimpleNamespace(add_request_samples=lambda run_id, phase, look, rows: len(rows), put_phase_result=lambda *a: None)
    ctx = SimpleNamespace(
        run_id="replay", config=ExperimentConfig(requests_per_look=40, requests_per_arm=200, window_s=10, max_duration_s=480),
        gates=cfg, store=store, scrape=lambda: {}, replica_arms={}, speculative_canary=True,
        say=lambda message: None, event=lambda kind, text: None, replicas_alive=lambda: {}, replica_node=lambda name: None, twin=False, candidates=(), speculative={},
        lost=frozenset(),
    )
    phase = ExperimentPhase(ctx)
    phase._scrape_acceptance = lambda: phase.spec_delta.update({CANARY: canary_spec})
    looks, start = [], 0
    for end in ends:
        phase.pending = list(records[start:end])
        final = phase._look(phase.plan.information(experiment_looks.requests_by_arm(records[:end])))
        looks.append(list(phase.gates))
        start = end
        if final:
            break
    return looks


def test_the_harness_judges_a_real_run_as_the_controller_does():
    """Replay: the demo run's records through the harness's per-look path (run_experiment_looks, the path every
    simulated trial takes) give, look by look, exactly the GateResults of the controller's own look code on the same
    records (and of `mtp-canary judge`'s shared replay), and stop where it stops. Whatever the statistics become,
    the simulation judges what the controller would."""
    records, decision, cfg, plan, canary_spec, ends = _replay_setup()
    run = run_experiment_looks(records, ends, plan, cfg, lambda end: canary_spec, speculative_canary=True)
    assert run.looks == _controller_looks(records, ends, cfg, canary_spec)
    shared = experiment_looks.replay_looks(
        records, plan, cfg, canary_spec, True, stored_counts=[look["requests"] for look in decision["experiment"]["looks"]]
    )
    assert [look.gates for look in shared.looks] == run.looks


def test_the_harness_reproduces_what_the_recorded_run_stored():
    """The same replay against the run's decision.json: the looks fall where the run's did (its per-look
    requests), with its information fractions and sample counts; the gates the recording's judge (commit 4c0ffa0)
    does not share with today's -- the latency statistics are being replaced -- are compared where they are
    unchanged: every stored verdict, interval and stop when today's latency judge still gives the recorded
    look-1 interval (a sign the statistics are those that judged the run); the acceptance floor, clustered by
    request since, cannot pass on the recording's server counters at any look."""
    records, decision, cfg, plan, canary_spec, ends = _replay_setup()
    exp = decision["experiment"]
    run = run_experiment_looks(records, ends, plan, cfg, lambda end: canary_spec, speculative_canary=True)
    assert [experiment_looks.requests_by_arm(records[s:e]) for s, e in zip([0, *ends], ends)] == [look["requests"] for look in exp["looks"]]
    assert [round(t, 4) for t in run.information[: len(exp["looks"])]] == [look["information"] for look in exp["looks"]]
    # the recording's records carry no per-request spec-decode counters: on the server's alone the floor (its
    # interval clustered by request since) is inconclusive at every look, where the recording passed it
    assert all(
        {g.name: g.verdict.value for g in gates}["acceptance_length_floor"] == "inconclusive"
        for gates, look in zip(run.looks, exp["looks"])
    )
    stored = {g["name"]: g for g in decision["gates"]}
    final = {g.name: g for g in run_experiment_looks(records, ends, plan, cfg, lambda end: canary_spec).looks[-1]}
    for name in ("tpot_p50_improvement", "ttft_p95_guard", "error_rate_guard"):
        if len(run.looks) == len(exp["looks"]):
            assert (final[name].n_baseline, final[name].n_canary) == (stored[name]["n_baseline"], stored[name]["n_canary"])
    if final["error_rate_guard"].interval == pytest.approx(stored["error_rate_guard"]["interval"], rel=1e-9) and (
        final["tpot_p50_improvement"].detail == stored["tpot_p50_improvement"]["detail"]
    ):
        floor = "acceptance_length_floor"
        judged = [{g.name: g.verdict.value for g in gates if g.name in look["verdicts"] and g.name != floor}
                  for gates, look in zip(run.looks, exp["looks"])]
        assert judged == [{k: v for k, v in look["verdicts"].items() if k != floor} for look in exp["looks"]]
        assert run.stopped_by == exp["stopped_by"]
        for name, gate in final.items():
            if name in stored and stored[name]["interval"] is not None and name != floor:
                assert gate.interval == pytest.approx(stored[name]["interval"], rel=1e-9), name


def test_the_simulated_look_rule_is_the_controllers():
    """look_ends applies LookPlan.look_due on the records' clock: on the real run's records it puts the looks where
    the shared replay's boundary rule does, each after every arm's requests_per_look-th new request."""
    records, decision = _recorded_run()
    cfg = GatesConfig(**decision["gates_config"])
    plan = LookPlan(40, 200, 10.0, 1, 480.0)
    ends = look_ends(records, plan)
    replay = experiment_looks.replay_looks(records, plan, cfg, None, False)
    counts = [look.requests for look in replay.looks]
    rule = run_experiment_looks(records, ends, plan, cfg, lambda end: None, speculative_canary=False)
    assert [{arm: n for arm, n in look_requests.items()} for look_requests in counts] == [
        experiment_looks.requests_by_arm(records[start:end]) for start, end in zip([0, *ends], ends)
    ][: len(counts)]
    assert [g for g in rule.looks] == [look.gates for look in replay.looks]
    assert all(min(c.values()) >= 40 for c in counts[:-1])


# -- the accuracy phase -----------------------------------------------------------------------
def test_the_accuracy_loop_makes_the_controllers_calls():
    """run_accuracy_batches judges every batch as rollout.run.phases.accuracy.judge_outcomes does (same verdicts,
    intervals and estimates; interim before the last batch), so a change there the harness misses shows here."""
    rng = np.random.default_rng(4)
    n, batch = 70, 32
    base, canary = rng.random(n) < 0.9, rng.random(n) < 0.85
    diverged = rng.random(n) < 0.03  # under the 0.05 cap: no early stop, so every batch is judged
    cfg = GatesConfig(min_eval_items=16, accuracy_margin=0.05)

    def outcomes(correct, arm, differs):
        return [
            ItemOutcome(item_id=str(i), arm=arm, output_text="other" if d else "same", correct=bool(c), latency_s=0.1)
            for i, (c, d) in enumerate(zip(correct, differs))
        ]

    by_arm = {BASELINE: outcomes(base, BASELINE, np.zeros(n, bool)), CANARY: outcomes(canary, CANARY, diverged)}
    ctx = SimpleNamespace(cfg=SimpleNamespace(gates=cfg))
    run = run_accuracy_batches(base, canary, diverged, None, cfg, batch_size=batch)
    assert not run.stopped_early and len(run.looks) == 3
    for look, done in zip(run.looks, (32, 64, 70)):
        theirs = judge_outcomes(ctx, {arm: o[:done] for arm, o in by_arm.items()}, interim=done < n)
        assert [(g.name, g.verdict, g.interval, g.estimate, g.n_canary) for g in look] == [
            (g.name, g.verdict, g.interval, g.estimate, g.n_canary) for g in theirs
        ]


# -- the config -------------------------------------------------------------------------------
def test_the_embedded_default_is_the_demo_config():
    """The default design is configs/local-cpu.yaml's (make demo), as rollout.config reads it: an edit of the demo
    config that the embedded copy misses fails here."""
    from_file = design_from_run_config(load_config(REPO / "configs" / "local-cpu.yaml").model_dump(), "x")
    assert from_file == design_from_run_config(calibrate.DEMO_RUN_CONFIG, "x")


@pytest.mark.parametrize("name", ["local-cpu.yaml", "mimo-v2.5-mtp.yaml", "examples/local-progressive.yaml"])
def test_a_run_config_file_reads_as_the_house_loader_reads_it(name):
    """A run config as plain YAML data gives the same design as the house loader's (defaults filled in)."""
    path = REPO / "configs" / name
    assert design_from_run_config(yaml.safe_load(path.read_text()), "x") == design_from_run_config(
        load_config(path).model_dump(), "x"
    )


def test_config_changes_the_simulated_design(tmp_path, capsys):
    """`--config RUN.yaml` calibrates that run's plan: its requests_per_look, requests_per_arm, min_looks, batches
    and gates appear in `config`, and the looks the simulation makes follow them."""
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    data["experiment"].update(requests_per_look=60, requests_per_arm=180, min_looks=2)
    data["accuracy"].update(limit=48, batch_size=16)
    data["gates"]["alpha"] = 0.10
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["--config", str(path), "--trials", "1", "--seed", "2", "--json", "--workers", "1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    cfg = printed["config"]
    assert (cfg["requests_per_look"], cfg["requests_per_arm"], cfg["planned_looks"], cfg["min_looks"]) == (60, 180, 3, 2)
    assert (cfg["eval_items"], cfg["batch_size"], cfg["source"]) == (48, 16, str(path))
    assert printed["alpha"] == 0.10 and cfg["gates"]["alpha"] == 0.10
    assert printed["wall_s"] > 0
    design = design_from_run_config(data, str(path))
    outcome = calibrate.simulate_trial(design, TrialSpec(tpot_ratio=0.7), np.random.default_rng(1))
    assert 2 <= outcome.looks <= 3 and 60 <= outcome.requests_per_arm <= 200


def test_a_bad_config_is_one_line_and_exit_2(tmp_path, capsys):
    """A config the design cannot use is refused before any simulation, in one line."""
    path = tmp_path / "bad.yaml"
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    data["experiment"].update(requests_per_look=300, requests_per_arm=200)
    path.write_text(yaml.safe_dump(data))
    assert main(["--config", str(path), "--trials", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "requests_per_look" in err and "\n" not in err
    path.write_text("experiment: [unclosed\n")
    assert main(["--config", str(path), "--trials", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "invalid YAML" in err and "\n" not in err


# -- the simulated world's limits -------------------------------------------------------------
def test_the_limits_the_world_is_put_at_are_the_true_values():
    """pass_at_limit is only as good as 'at the limit': the simulated canary's mean acceptance length is the floor
    (counters summed as /metrics would), and with an E2E guard configured the solved TTFT factor puts the true
    E2E p95 ratio at its limit (checked on a fresh sample)."""
    from rollout.calibration.scenarios import spec_decode_by_request

    rng = np.random.default_rng(8)
    drafts, accepted = spec_decode_by_request(rng, 4000, 32, 3, 1.5)
    assert 1.0 + accepted.sum() / drafts.sum() == pytest.approx(1.5, abs=0.005)

    design = default_design()
    design = calibrate.replace(design, gates=design.gates.model_copy(update={"e2e_p95_max_ratio": 1.3}))
    spec = calibrate.trial_sets(design)["limit/e2e_p95_guard"]
    world, tokens = design.latency, design.shape.output_tokens
    ttft = world.ttft_median_s * np.exp(rng.normal(0.0, world.ttft_sigma, 400_000))
    tpot = world.tpot_median_s * np.exp(rng.normal(0.0, world.tpot_sigma, 400_000))
    base, canary = ttft[::2] + tpot[::2] * (tokens - 1), spec.ttft_ratio * ttft[1::2] + spec.tpot_ratio * tpot[1::2] * (tokens - 1)
    assert np.quantile(canary, 0.95) / np.quantile(base, 0.95) == pytest.approx(1.3, rel=0.01)


# -- the twin baseline's noise floor and the goodput guard's A/A rows ------------------------------
def test_the_noise_floor_rows_run_the_experiment_with_a_twin(small_calibration):
    """The rows simulate a third arm (the twin), and with the baseline on cores 1/0.8 slower than the twin's and the
    canary's (canary at the bar against the twin) the objective does not pass: without the floor it passes with
    the power of a true 0.8 ratio (test below)."""
    rows = {row["name"]: row for row in small_calibration["noise_floor"]}
    assert set(rows) == {"aa_placement_0.8", "aa_placement_0.95", "twin_power_0.7"}
    assert rows["aa_placement_0.8"]["objective_pass_rate"] == 0.0
    assert rows["aa_placement_0.8"]["twin_tpot_ratio"] == 0.8 and rows["aa_placement_0.8"]["trials"] == TRIALS
    assert "Noise floor" in format_table({**small_calibration, "wall_s": 1.0})
    design = default_design()
    spec = calibrate.trial_sets(design)["noise_floor/aa_placement_0.8"]
    records = calibrate.simulate_records(np.random.default_rng(3), design.latency, spec, design.shape, calibrate._TEMPLATE)
    assert {r.arm for r in records} == {BASELINE, CANARY, "twin"}
    # the same world judged without the twin's veto: the placement alone passes the objective
    no_twin = calibrate.replace(spec, twin_tpot_ratio=None)
    passes = [calibrate.simulate_trial(design, no_twin, np.random.default_rng(t)).verdicts[OBJECTIVE_NAME] for t in range(3)]
    assert passes.count("pass") >= 2


def test_goodput_aa_rows_appear_with_an_slo_and_not_without(small_calibration):
    assert small_calibration["goodput_aa"] == []  # the demo sets no SLO
    data = json.loads(json.dumps(calibrate.DEMO_RUN_CONFIG))
    data["gates"]["slo"] = {"ttft_s": 0.4}
    design = design_from_run_config(data, "with an SLO")
    result = run_calibration(design, trials=1, seed=3, workers=1)
    assert [row["scenario"] for row in result["goodput_aa"]] == list(LATENCY_SCENARIOS)
    assert all(0.0 <= row["false_rollback_rate"] <= 1.0 and row["trials"] == 1 for row in result["goodput_aa"])
    assert "family of its own" in format_table({**result, "wall_s": 1.0})


def test_the_calibration_page_shows_every_table_with_its_run(small_calibration, tmp_path, capsys):
    """benchmarks/calibration_table.py renders docs/calibration.md from `calibrate --json`: every table, the
    command, trials, seed, commit and machine; a file that is not a calibration is one line and exit 2."""
    from benchmarks import calibration_table

    path = tmp_path / "calibrate.json"
    path.write_text(json.dumps({**small_calibration, "wall_s": 12.5, "workers": 1}))
    assert calibration_table.main([str(path), "--commit", "abc123", "--machine", "test CPU"]) == 0
    page = capsys.readouterr().out
    for heading in ("## Latency scenarios", "## Pass at the limit", "## Power", "## The whole decision", "## Noise floor",
                    "## Several candidates"):
        assert heading in page
    assert f"--trials {TRIALS} --seed 11 --workers 1 --json" in page and "`abc123`" in page and "test CPU" in page
    assert "| arm_level_0.10 |" in page and "| aa_placement_0.8 |" in page
    (tmp_path / "other.json").write_text("{}")
    assert calibration_table.main([str(tmp_path / "other.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a calibrate --json output" in err and "\n" not in err
