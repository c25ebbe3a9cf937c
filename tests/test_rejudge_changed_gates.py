"""`mtp-canary judge` of a run directory under gates that are not the run's own: it says which gates,
thresholds and alpha differ, and a PROMOTE under them never exits 0 without --accept-changed-gates
(a re-judgement with looser gates is a new decision rule chosen after seeing the data)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

from rollout.commands import judge as judge_command
from rollout.config import load_config
from rollout.judge.config import GatesConfig
from tests.test_rejudge import REPO, judged, write_records


def run_dir(tmp_path: Path, run_gates: dict) -> Path:
    """A run directory: a clearly faster canary's records (the demo plan's warm-up and 600 per arm) and the
    decision.json of a run judged with `run_gates`."""
    rng = np.random.default_rng(7)
    directory = tmp_path / "run"
    (directory / "experiment").mkdir(parents=True)
    write_records(directory / "experiment" / "records.jsonl",
                  {"baseline": rng.lognormal(np.log(0.03), 0.1, 640), "canary": rng.lognormal(np.log(0.02), 0.1, 640)})
    exp = load_config(REPO / "configs" / "local-cpu.yaml").experiment  # the run's look plan: the judge config's
    doc = {"run_id": "run", "decision": "inconclusive", "gates": [], "spec_decode": {}, "arms": {},
           "experiment": {"requests_per_look": exp.requests_per_look, "requests_per_arm_planned": exp.requests_per_arm,
                          "warmup_requests_per_arm": exp.warmup_requests_per_arm},
           "gates_config": GatesConfig(**{**LOCAL_GATES, **run_gates}).model_dump(mode="json")}
    (directory / "decision.json").write_text(json.dumps(doc))
    return directory


def config(tmp_path: Path, **gates) -> Path:
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    data["gates"] = {**data["gates"], **gates}
    path = tmp_path / "judge.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


LOCAL_GATES = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())["gates"]
RUNS_OWN = dict(enabled=["tpot_p50_improvement", "sample_ratio"], tpot_p50_min_improvement=0.5)


def test_a_promote_under_looser_gates_says_what_changed_and_does_not_exit_0(tmp_path, capsys):
    directory = run_dir(tmp_path, RUNS_OWN)
    looser = config(tmp_path, enabled=["tpot_p50_improvement", "sample_ratio"], tpot_p50_min_improvement=0.1, alpha=0.1)
    code, [out] = judged(capsys, str(directory), "--config", str(looser))
    assert out["decision"] == "promote", out["reason"]
    assert code == 4
    assert "tpot_p50_min_improvement 0.5 -> 0.1" in out["changed_gates"] and "alpha 0.05 -> 0.1" in out["changed_gates"]
    assert out["accepted_changed_gates"] is False
    code, [out] = judged(capsys, str(directory), "--config", str(looser), "--accept-changed-gates")
    assert code == 0 and out["decision"] == "promote" and out["accepted_changed_gates"] is True
    # the table says it too
    assert judge_command.main([str(directory), "--config", str(looser)]) == 4
    text = capsys.readouterr().out
    assert "gates differ from the run's own: " in text and "--accept-changed-gates" in text


def test_gates_enabled_or_left_out_are_named(tmp_path, capsys):
    directory = run_dir(tmp_path, dict(RUNS_OWN, enabled=["tpot_p50_improvement", "sample_ratio", "error_rate_guard"],
                                       tpot_p50_min_improvement=0.1))
    fewer = config(tmp_path, enabled=["tpot_p50_improvement", "sample_ratio"], tpot_p50_min_improvement=0.1)
    code, [out] = judged(capsys, str(directory), "--config", str(fewer))
    assert "gates no longer judged: error_rate_guard" in out["changed_gates"], out["changed_gates"]
    assert out["decision"] == "promote" and code == 4


def test_the_runs_own_gates_promote_as_before(tmp_path, capsys):
    directory = run_dir(tmp_path, dict(RUNS_OWN, tpot_p50_min_improvement=0.1))
    code, [out] = judged(capsys, str(directory))
    assert out["decision"] == "promote" and code == 0 and out["changed_gates"] == []
    same = config(tmp_path, enabled=["tpot_p50_improvement", "sample_ratio"], tpot_p50_min_improvement=0.1)
    code, [out] = judged(capsys, str(directory), "--config", str(same))
    assert out["changed_gates"] == [] and code == 0
