"""The goodput gate (rollout/judge/goodput.py) and where it is wired: gates.slo, experiment looks,
decision.json's per-arm goodput, report.md, `mtp-canary judge`, the calibration's boundary scenario.

No vLLM: records are made here (or simulated by rollout.calibration.scenarios) with the effect known.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from loadtests.records import RequestRecord
from rollout.commands import judge as judge_command
from rollout.config import ConfigError, load_config, parse_config
from rollout.calibration import calibrate
from rollout.calibration.trial import look_ends, run_experiment_looks
from rollout.judge.config import GatesConfig, SloConfig
from rollout.judge.experiment_looks import LookPlan, judge_look, requests_by_arm
from rollout.judge.goodput import arm_goodput, goodput_by_arm, goodput_samples, judge_goodput, meets_slo
from rollout.judge.names import GATE_NAMES, GATE_PHASES, GOODPUT_NAME
from rollout.calibration.scenarios import (
    LatencyWorld,
    StreamShape,
    TrialSpec,
    _arm_latencies,
    goodput_boundary_spec,
    goodput_share,
    simulate_records,
)
from rollout.judge.verdicts import Decision, Verdict, decide, is_enabled, missing_gates
from rollout.record.markdown import markdown_report
from rollout.record.result import ExperimentSummary, LookSummary, RunResult, decision_document

REPO = Path(__file__).resolve().parents[1]
SLO = SloConfig(ttft_s=0.3, tpot_s=0.05, e2e_s=2.0)


def record(arm: str = "baseline", *, ok: bool = True, ttft: float | None = 0.1, e2e: float = 1.0, tokens: int | None = 32,
           cancelled: bool = False, index: int | None = 0, n: int = 0) -> RequestRecord:
    return RequestRecord(
        request_id=f"{arm}-{index}-{n}", tag="experiment", worker="w", arm=arm, pinned_arm=arm, dataset_index=index,
        sent_at=1000.0 + n, ttft_s=ttft if ok else None, e2e_s=e2e, output_tokens=tokens if ok else None, ok=ok,
        status=200 if ok else 500, cancelled=cancelled,
    )


# -- counting ----------------------------------------------------------------------------------
def test_a_request_meets_the_slo_only_if_it_succeeded_and_every_configured_bound_holds():
    fast = record(ttft=0.1, e2e=1.0)  # TPOT (1.0 - 0.1) / 31 = 29 ms
    assert meets_slo(fast, SLO)
    assert not meets_slo(record(ok=False, e2e=0.01), SLO)  # failed: a miss however fast
    assert not meets_slo(record(ttft=0.31, e2e=1.0), SLO)  # TTFT over
    assert not meets_slo(record(ttft=0.1, e2e=1.99), SLO)  # TPOT (1.89 / 31 = 61 ms) over, E2E within
    assert meets_slo(record(ttft=0.1, e2e=1.99), SloConfig(ttft_s=0.3, e2e_s=2.0))  # no TPOT bound: meets
    assert not meets_slo(record(ttft=0.01, e2e=2.01, tokens=100), SLO)  # E2E over (TPOT 20 ms within)
    assert not meets_slo(record(ttft=None, e2e=0.5), SLO)  # no first token measured: cannot be shown to meet it
    assert meets_slo(record(ttft=0.1, e2e=0.1, tokens=1), SLO)  # one token: no time per output token to miss
    assert not meets_slo(record(ttft=0.1, e2e=1.0, tokens=None), SLO)  # no token count: TPOT unknown, a miss
    assert meets_slo(record(ttft=0.1, e2e=1.0, tokens=None), SloConfig(ttft_s=0.3))  # ... unless TPOT is not bounded
    assert not meets_slo(record(ttft=0.3000001, e2e=1.0), SloConfig(ttft_s=0.3)) and meets_slo(record(ttft=0.3), SloConfig(ttft_s=0.3))


def test_goodput_per_arm_counts_failed_requests_as_misses_and_cancelled_ones_not_at_all():
    records = [
        record("baseline", n=0), record("baseline", n=1, ttft=0.5), record("baseline", n=2, ok=False),
        record("baseline", n=3, cancelled=True, ttft=0.5),
        record("canary", n=4), record("canary", n=5),
    ]
    assert arm_goodput(records, SLO, "baseline").model_dump() == {"share": pytest.approx(1 / 3), "met": 1, "of": 3}
    assert arm_goodput(records, SLO, "canary").model_dump() == {"share": 1.0, "met": 2, "of": 2}
    assert goodput_by_arm(records[:4], SLO)["canary"].model_dump() == {"share": None, "met": 0, "of": 0}


# -- pairing -----------------------------------------------------------------------------------
def test_requests_pair_by_prompt_and_the_unpaired_are_counted_not_compared():
    records = [
        record("baseline", index=7, n=0), record("canary", index=3, n=1, ttft=0.5), record("baseline", index=3, n=2),
        record("canary", index=7, n=3, ok=False),
        record("baseline", index=7, n=4, ttft=0.5), record("canary", index=7, n=5),  # prompt 7 served again: a second pair
        record("baseline", index=9, n=6),  # its canary request still in flight
        record("canary", index=None, n=7),  # no prompt index: cannot be paired
        record("canary", index=9, n=8, cancelled=True),  # cancelled: not a request, no partner
    ]
    samples = goodput_samples(records, SLO, looks_of=[1, 1, 1, 2, 2, 2, 2, 3, 3])
    assert samples.pairs == 3
    # in completion order of the pair's later request: prompt 3 (n=2), prompt 7 first (n=3), prompt 7 again (n=5)
    assert samples.baseline_met.tolist() == [True, True, False]
    assert samples.canary_met.tolist() == [False, False, True]
    assert samples.look.tolist() == [1, 2, 2]
    assert samples.unpaired == {"baseline": 1, "canary": 1}
    assert samples.arms["canary"].model_dump() == {"share": 0.5, "met": 2, "of": 4}
    with pytest.raises(ValueError, match="one look per record"):
        goodput_samples(records, SLO, looks_of=[1])


def shared_prompt_records(rng: np.random.Generator, looks: int, per_look: int, canary_extra_miss: float = 0.0,
                          arm_level_sd: float = 0.0, shuffle_canary_prompts: bool = False):
    """Both arms serve the same prompts; a prompt's length makes it slow on both (the pairing's gain).

    ``arm_level_sd``: a log-level per look and arm on TTFT (a block effect); ``canary_extra_miss``: the
    canary's TTFT is pushed over the SLO on that share of requests.
    """
    records, looks_of = [], []
    for look in range(1, looks + 1):
        level = {arm: rng.normal(0.0, arm_level_sd) for arm in ("baseline", "canary")}
        for j in range(per_look):
            i = (look - 1) * per_look + j
            hard = rng.random() < 0.3  # a long prompt: TTFT over the SLO on either arm, mostly
            for arm in ("baseline", "canary"):
                ttft = (0.5 if hard else 0.1) * math.exp(level[arm] + rng.normal(0.0, 0.2))
                if arm == "canary" and rng.random() < canary_extra_miss:
                    ttft = 0.6
                index = i if arm == "baseline" or not shuffle_canary_prompts else int(rng.integers(10**6, 10**7))
                records.append(record(arm, ttft=ttft, e2e=ttft + 0.6, index=index, n=2 * i + (arm == "canary")))
                looks_of.append(look)
    return records, looks_of


def judge_at_last_look(records, looks_of, cfg: GatesConfig, planned: int | None = None):
    looks = max(looks_of)
    planned = planned or looks
    fractions = [k / planned for k in range(1, looks + 1)]
    return judge_goodput(goodput_samples(records, cfg.goodput_slo, looks_of), cfg, look=looks, max_looks=planned,
                         information=fractions)


CFG = GatesConfig(slo=SloConfig(ttft_s=0.3), goodput_max_decrease=0.05)


def test_pairing_by_prompt_narrows_the_interval_on_the_same_requests():
    """Prompts slow on both arms cancel in the pair; with the canary's prompt ids scrambled nothing pairs."""
    records, looks_of = shared_prompt_records(np.random.default_rng(3), looks=10, per_look=40)
    paired = judge_at_last_look(records, looks_of, CFG)
    assert paired.verdict is Verdict.PASS and paired.n_baseline == 400
    width = paired.interval[1] - paired.interval[0]
    scrambled, looks_of_2 = shared_prompt_records(np.random.default_rng(3), looks=10, per_look=40, shuffle_canary_prompts=True)
    unpaired = judge_at_last_look(scrambled, looks_of_2, CFG)
    assert unpaired.verdict is Verdict.INCONCLUSIVE and "Too few prompts served by both arms (0 < 30 pairs)" in unpaired.detail
    # the same requests as independent pairs (the canary's list rotated by one prompt): no shared difficulty
    rotated = [r.model_copy(update={"dataset_index": (r.dataset_index + 1) % 400}) if r.arm == "canary" else r for r in records]
    loose = judge_at_last_look(rotated, looks_of, CFG)
    assert loose.interval[1] - loose.interval[0] > 1.5 * width


def test_verdicts_pass_fail_and_inconclusive():
    same, looks_of = shared_prompt_records(np.random.default_rng(1), looks=10, per_look=40)
    passed = judge_at_last_look(same, looks_of, CFG)
    assert passed.verdict is Verdict.PASS and passed.interval[1] < 0.05 and passed.name == GOODPUT_NAME
    assert passed.metric == "goodput_drop" and passed.estimate == pytest.approx(passed.baseline - passed.canary)

    worse, looks_of = shared_prompt_records(np.random.default_rng(1), looks=10, per_look=40, canary_extra_miss=0.25)
    failed = judge_at_last_look(worse, looks_of, CFG)
    assert failed.verdict is Verdict.FAIL and failed.interval[0] > 0.05

    # the canary about 5 points worse: the interval holds the margin
    near, looks_of = shared_prompt_records(np.random.default_rng(1), looks=10, per_look=40, canary_extra_miss=0.07)
    open_ = judge_at_last_look(near, looks_of, CFG)
    assert open_.verdict is Verdict.INCONCLUSIVE and "holds 0.05" in open_.detail

    # one look is one block: no verdict however many pairs (a level shared by the look hides in it)
    first = judge_at_last_look(worse[:800], [1] * 800, CFG, planned=10)
    assert first.verdict is Verdict.INCONCLUSIVE and "at least 2 blocks" in first.detail and first.interval is None
    # few pairs: no verdict
    few = judge_at_last_look(worse[:40], [1] * 20 + [2] * 20, CFG, planned=10)
    assert few.verdict is Verdict.INCONCLUSIVE and "20 < 30 pairs" in few.detail


def test_a_verdict_once_reached_stays_and_early_looks_are_strict():
    """Repeated intervals intersected over the looks: a PASS at look 6 is still a PASS at look 10, and the
    interval never widens; at look 2 (t on 1 df at the O'Brien-Fleming level) nothing short of all-or-none decides."""
    records, looks_of = shared_prompt_records(np.random.default_rng(5), looks=10, per_look=40)
    widths, verdicts = [], []
    for look in range(2, 11):
        upto = [i for i, k in enumerate(looks_of) if k <= look]
        g = judge_at_last_look([records[i] for i in upto], [looks_of[i] for i in upto], CFG, planned=10)
        verdicts.append(g.verdict)
        widths.append(g.interval[1] - g.interval[0])
    assert verdicts[0] is Verdict.INCONCLUSIVE and verdicts[-1] is Verdict.PASS
    first_pass = verdicts.index(Verdict.PASS)
    assert all(v is Verdict.PASS for v in verdicts[first_pass:])
    assert all(b <= a + 1e-12 for a, b in zip(widths, widths[1:]))


def test_a_per_look_level_widens_the_bounds_by_its_design_effect():
    """Block-robust: per-look arm levels make the pair differences correlated within a look; the detail's
    design effect rises above 1 and the interval is wider than the same pairs judged with shuffled looks."""
    rng = np.random.default_rng(11)
    records, looks_of = shared_prompt_records(rng, looks=10, per_look=40, arm_level_sd=0.6)
    blocked = judge_at_last_look(records, looks_of, CFG)
    shuffled_looks = list(np.random.default_rng(0).permutation(looks_of))
    mixed = judge_at_last_look(records, shuffled_looks, CFG)
    deff = float(blocked.detail.split("design effect ")[1].split(" ")[0])
    assert deff > 2.0
    assert (blocked.interval[1] - blocked.interval[0]) > 1.3 * (mixed.interval[1] - mixed.interval[0])


# -- config ------------------------------------------------------------------------------------
def write_config(tmp_path: Path, gates: dict) -> Path:
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    data["gates"] = {**data["gates"], **gates}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "gates, field",
    [
        ({"slo": {"ttft_s": 0}}, "gates.slo.ttft_s"),
        ({"slo": {"tpot_s": -0.01}}, "gates.slo.tpot_s"),
        ({"slo": {"e2e": 2.0}}, "gates.slo.e2e"),
        ({"slo": {"e2e_s": "fast"}}, "gates.slo.e2e_s"),
        ({"slo": 0.3}, "gates.slo"),
        ({"goodput_max_decrease": 1.0}, "gates.goodput_max_decrease"),
        ({"goodput_max_decrease": -0.1}, "gates.goodput_max_decrease"),
        ({"enabled": ["goodput"]}, "gates.enabled"),
        ({"disabled": ["goodput"]}, "gates.disabled"),
        ({"enabled": ["goodput_guard"], "disabled": ["goodput_guard"], "slo": {"e2e_s": 1}},
         "both enabled and disabled"),
        # named but never judged: it would silently drop out of the gates that must pass
        ({"enabled": ["tpot_p50_improvement", "goodput_guard"]}, "gates.slo sets no bound"),
    ],
)
def test_a_bad_goodput_config_is_one_line_naming_the_field(tmp_path, gates, field):
    with pytest.raises(ConfigError) as raised:
        load_config(write_config(tmp_path, gates))
    message = str(raised.value)
    assert "\n" not in message and field in message, message


def test_without_an_slo_the_gate_is_absent_and_with_one_it_is_judged_and_needed():
    assert GOODPUT_NAME in GATE_NAMES and GATE_PHASES[GOODPUT_NAME] == "experiment"
    for cfg in (GatesConfig(), GatesConfig(slo=SloConfig()), GatesConfig(slo=SloConfig(ttft_s=0.3), enabled=["sample_ratio"]),
                GatesConfig(slo=SloConfig(ttft_s=0.3), disabled=[GOODPUT_NAME])):
        assert not is_enabled(GOODPUT_NAME, cfg)
    assert is_enabled(GOODPUT_NAME, CFG) and missing_gates([], CFG)[-1] == GOODPUT_NAME

    records, looks_of = shared_prompt_records(np.random.default_rng(2), looks=2, per_look=40)
    plan = LookPlan(requests_per_look=40, requests_per_arm=80, min_interval_s=0, min_looks=1, max_duration_s=1e9)
    plain = judge_look(records, looks_of, [0.5, 1.0], GatesConfig(), plan, None, False)
    assert GOODPUT_NAME not in {g.name for g in plain}
    # disabled: not judged, and not needed for a promote (the per-arm goodput is still reported: rollout.record.result)
    off = CFG.model_copy(update={"disabled": [GOODPUT_NAME]})
    assert GOODPUT_NAME not in {g.name for g in judge_look(records, looks_of, [0.5, 1.0], off, plan, None, False)}
    assert GOODPUT_NAME not in missing_gates([], off)
    gates = judge_look(records, looks_of, [0.5, 1.0], CFG, plan, None, False)
    goodput = {g.name: g for g in gates}[GOODPUT_NAME]
    assert goodput.look == 2 and goodput.n_baseline == 80
    # an enabled goodput gate that did not pass keeps the run from promoting
    others = [g.model_copy(update={"verdict": Verdict.PASS}) for g in gates if g.name != GOODPUT_NAME]
    narrowed = CFG.model_copy(update={"enabled": [g.name for g in gates]})
    assert decide(others, narrowed) is Decision.INCONCLUSIVE
    assert decide([*others, goodput.model_copy(update={"verdict": Verdict.PASS})], narrowed) is Decision.PROMOTE


# -- decision.json, report.md, rejudge -----------------------------------------------------------
def simulated_run(tmp_path: Path):
    """A run directory as the controller writes it: simulated records judged look by look by the controller's
    functions, decision.json from the typed result (rollout.record.result), records.jsonl in arrival order."""
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    data["gates"].update(slo={"ttft_s": 0.3, "tpot_s": 0.05}, goodput_max_decrease=0.05,
                         enabled=["tpot_p50_improvement", "sample_ratio", GOODPUT_NAME])
    data["experiment"].update(requests_per_look=40, requests_per_arm=200)
    config = parse_config(data)
    shape = StreamShape(requests_per_arm=200, requests_per_look=40, users_per_arm=2, output_tokens=32)
    template = RequestRecord(request_id="t", tag="experiment", worker="w", sent_at=0.0, e2e_s=0.0, ok=True, status=200)
    records = simulate_records(np.random.default_rng(4), LatencyWorld(), TrialSpec(tpot_ratio=0.7), shape, template)
    plan = LookPlan.of(config.experiment)
    ends = look_ends(records, plan)
    run = run_experiment_looks(records, ends, plan, config.gates, lambda end: None, speculative_canary=False)
    judged = records[: ends[len(run.looks) - 1]]
    starts = [0, *ends]
    looks = [LookSummary(look=k + 1, at=0.0, information=round(run.information[k], 4),
                         requests=requests_by_arm(records[starts[k]:ends[k]]),
                         verdicts={g.name: g.verdict.value for g in gates},
                         goodput={arm: g.share for arm, g in goodput_by_arm(records[starts[k]:ends[k]],
                                                                            config.gates.goodput_slo).items()})
             for k, gates in enumerate(run.looks)]
    summary = ExperimentSummary(
        looks=looks, planned_looks=plan.planned_looks, requests_per_look=40, requests_per_arm_planned=200,
        information=run.information[-1], requests=requests_by_arm(judged), records_after_last_look=len(records) - len(judged),
        requests_received=None, records_stored=len(records), duty_cycle=None, load_start_s=None, duration_s=1.0,
        generator_warnings=[], generator_send_lag_p99_ms=None,
        latency_ms={arm: {f"{m}_p{q}": None for m in ("ttft", "tpot", "e2e") for q in (50, 95, 99)} for arm in ("baseline", "canary")},
        client_tokens_per_chunk={"baseline": None, "canary": None}, stopped_by="evidence",
        goodput=goodput_by_arm(judged, config.gates.goodput_slo),
    )
    arms = {arm: {"replicas": 1, "engine": {"model": "m", "speculative_config": None}} for arm in ("baseline", "canary")}
    result = RunResult(run_id="sim", run_dir=tmp_path, config=config, decision=decide(run.gates, config.gates),
                       gates=run.gates, experiment=summary, arms=arms)
    doc = decision_document(result)
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "records.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in records))
    (tmp_path / "decision.json").write_text(json.dumps(doc))
    return doc, run


def test_decision_json_holds_each_arms_goodput_and_the_report_a_line_per_arm(tmp_path):
    doc, run = simulated_run(tmp_path)
    goodput = doc["experiment"]["goodput"]
    assert set(goodput) == {"baseline", "canary"} and set(goodput["baseline"]) == {"share", "met", "of"}
    assert goodput["canary"]["share"] == pytest.approx(goodput["canary"]["met"] / goodput["canary"]["of"])
    assert doc["gates_config"]["slo"] == {"ttft_s": 0.3, "tpot_s": 0.05, "e2e_s": None}
    gate = {g["name"]: g for g in doc["gates"]}[GOODPUT_NAME]
    assert f"baseline {goodput['baseline']['share']:.3f} ({goodput['baseline']['met']}/{goodput['baseline']['of']})" in gate["detail"]
    assert all(GOODPUT_NAME in look["verdicts"] for look in doc["experiment"]["looks"])
    # each look's own share per arm, where the experiment loop writes it (absent without an SLO: see below)
    assert all(set(look["goodput"]) == {"baseline", "canary"} for look in doc["experiment"]["looks"])
    # read back unchanged (the typed result keeps it), and a document without an SLO has no goodput key
    again = decision_document(RunResult.from_document(doc, parse_config({**yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text()), "gates": doc["gates_config"]}), tmp_path))
    assert again["experiment"]["goodput"] == goodput
    plain = ExperimentSummary.model_validate({**doc["experiment"], "goodput": None, "looks": [
        {**look, "goodput": None} for look in doc["experiment"]["looks"]]}).document()
    assert "goodput" not in plain and all("goodput" not in look for look in plain["looks"])
    report = markdown_report(doc)
    assert "Goodput (judged requests meeting the SLO: TTFT <= 0.3 s, TPOT <= 0.05 s; failed requests miss it):" in report
    assert f"- canary: {goodput['canary']['share']:.3f} ({goodput['canary']['met']} of {goodput['canary']['of']} requests)" in report


def test_mtp_canary_judge_reproduces_the_goodput_gate_from_the_records(tmp_path, capsys):
    doc, run = simulated_run(tmp_path)
    assert judge_command.main([str(tmp_path), "--json"]) == {"promote": 0, "rollback": 3, "inconclusive": 4}[doc["decision"]]
    out = json.loads(capsys.readouterr().out)
    mine = {g["name"]: g for g in out["gates"]}[GOODPUT_NAME]
    stored = {g["name"]: g for g in doc["gates"]}[GOODPUT_NAME]
    assert mine == stored
    assert [look["verdicts"] for look in out["looks"]] == [look["verdicts"] for look in doc["experiment"]["looks"]]
    assert out["goodput"] == doc["experiment"]["goodput"]
    assert judge_command.main([str(tmp_path)]) in (0, 3, 4)
    assert "goodput (judged requests meeting the SLO): baseline" in capsys.readouterr().out


# -- calibration ---------------------------------------------------------------------------------
def test_the_boundary_scenario_puts_the_true_drop_exactly_at_the_margin():
    """goodput_share integrates the per-look level out exactly: a large simulation of the same world agrees,
    and the boundary spec's drop is the margin (so the calibration row measures the gate at its limit)."""
    world, shape = LatencyWorld(), StreamShape(requests_per_arm=200_000, requests_per_look=40, users_per_arm=2, output_tokens=32)
    bounds = {"ttft_s": 0.3, "tpot_s": 0.05, "e2e_s": 1.6}
    spec = goodput_boundary_spec(world, TrialSpec(scenario="arm_level_0.10", tpot_ratio=0.7), shape, bounds, 0.05)
    assert spec.ttft_ratio > 1.0 and spec.tpot_ratio == 0.7
    truth = {canary: goodput_share(world, spec, shape, bounds, canary) for canary in (False, True)}
    assert truth[False] - truth[True] == pytest.approx(0.05, abs=1e-9)
    rng = np.random.default_rng(0)
    for canary in (False, True):
        ttft, tpot, ok = _arm_latencies(rng, 200_000, world, spec, shape, canary)
        share = np.mean(ok & (ttft <= 0.3) & (tpot <= 0.05) & (ttft + tpot * 31 <= 1.6))
        assert share == pytest.approx(truth[canary], abs=0.006)  # ~4 SE of 200,000 requests in 5,000 looks
    with pytest.raises(ValueError, match="iid and arm_level"):
        goodput_share(world, TrialSpec(scenario="stall_runs"), shape, bounds, False)


def test_calibrate_registers_the_goodput_boundary_only_with_an_slo():
    assert GOODPUT_NAME not in calibrate._limit_specs(calibrate.default_design())
    data = copy.deepcopy(calibrate.DEMO_RUN_CONFIG)
    data["gates"].update(slo={"ttft_s": 0.3, "tpot_s": 0.05}, goodput_max_decrease=0.05)
    design = calibrate.design_from_run_config(data, "test")
    spec = calibrate._limit_specs(design)[GOODPUT_NAME]
    assert spec.scenario == calibrate.GOODPUT_SCENARIO == "arm_level_0.10"
    assert "limit/goodput_guard" in calibrate.trial_sets(design)
    outcome = calibrate.simulate_trial(design, spec, np.random.default_rng(0))
    assert outcome.verdicts[GOODPUT_NAME] in {"pass", "fail", "inconclusive"} and outcome.looks >= 1
