"""decision.json and report.md of recorded runs, read back into the typed result and written again.

tests/data/recorded_runs/ holds the decision.json and report.md of six real runs (real vLLM CPU
replicas through the whole controller: promote, bad drafts, broken canary, abort during accuracy,
SIGINT, and a kill -9 mid-progressive then resume), recorded before the phase-runner redesign
(machine paths replaced). Every key, value and type of each document must survive the typed
RunResult (rollout.record.result) unchanged, and the report must be the same text: the redesign changed
where the numbers are made, not what decision.json and report.md say.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from cluster.metrics import KvCacheStats
from cluster.replica_environment import ReplicaEnvironment
from rollout.config import parse_config
from rollout.analysis.crossover import LevelResult, crossing
from rollout.analysis.depth_advice import DepthArm, advise_depth
from rollout.judge.config import GatesConfig
from rollout.judge.load_curve import promote_up_to
from rollout.judge.verdicts import Decision, is_enabled
from rollout.record.markdown import markdown_report
from rollout.record.result import RunResult, SweepCrossover, UsageSummary, decision_document
from tests.conftest import REPO

RECORDED = REPO / "tests" / "data" / "recorded_runs"
RUNS = sorted(p.name for p in RECORDED.iterdir() if (p / "decision.json").exists())


# what varies from run to run in the paths themselves: the probe's keys (layer counts it timed),
# and the arg names a server logged as non-default (they follow the config and vLLM's version)
VARIABLE_SUBTREES = ("prepare.tiny_model.",)
# and the acceptance slices' items (none in a recorded run: its records had no counters of their own), and
# the objective's own correlation estimate (written from 6 looks on; `beyond_plan` only when true)
VARIABLE_PATHS = re.compile(r"^arms\.[^.]+\.servers\.[^.]+\.non_default_args\.|^spec_decode\.[^.]+\.by_(prompt_length|turn)\[\]\."
                            r"|^experiment\.dependence\.(correlation_estimate|critical_correlation|beyond_plan)$")


def key_paths(value, prefix: str = "") -> set[str]:
    """Every key path of a JSON document ("experiment.looks[].verdicts.tpot_p50_improvement"), values
    aside (a list's items share one path; a null and a number are both just a value): two runs of
    one config have the same paths whatever their numbers."""
    paths: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}{key}"
            if not path.startswith(VARIABLE_SUBTREES) and not VARIABLE_PATHS.match(path):
                paths |= {path} | key_paths(item, f"{path}.")
    elif isinstance(value, list):
        for item in value:
            paths |= key_paths(item, f"{prefix.rstrip('.')}[].")
    return paths


# experiment fields added since the runs were recorded, with their defaults: a run today writes them
ADDED_CPU_FIELDS = {"worker_process": False}
# tiny-model options added since (tiny_model.draft_decay: the layer-reuse profile)
ADDED_TINY_MODEL_FIELDS = {"draft_decay": 0.0}
ADDED_EXPERIMENT_FIELDS = {
    "arm_users": False, "warmup_requests_per_arm": 0, "warmup_requests": {},
    # the judged load and the TPOT p50's dependence across looks, written since (their key paths)
    "judged_load": {"kind": "closed_loop", "streams_per_replica": 2, "rate_per_replica": None, "arm_users": False, "text": ""},
    "dependence": {"looks": 0, "autocorrelation": {"baseline": None, "canary": None, "contrast": None},
                   "design_effect": None, "look_correlation_max": 0.5},
}
# what the plan could decide, per gate with power figures (rollout.judge.power), written since
POWER_GATES = ("accuracy_noninferiority", "tpot_p50_improvement", "error_rate_guard", "acceptance_length_floor")
ADDED_DETECTABLE_EFFECT = {"gate": "", "metric": "", "threshold": None, "sample": 0, "passed_at": None, "failed_at": None,
                           "power": 0.8, "decidable": True, "assumptions": "", "text": "", "warning": None}
# each look's prefix-cache counters per arm, recorded since (for `mtp-canary judge`'s prefix-cache gate)
ADDED_LOOK_PREFIX_CACHE = {"baseline": None, "canary": None}
# whose acceptance each arm's spec_decode is (rollout.judge.request_acceptance), unknown in the recorded runs
ADDED_SPEC_DECODE_FIELDS = {"counted_from": None, "server_drafts": None, "server_mean_acceptance_length": None,
                            "other_traffic_steps": None, "other_traffic": None, "by_prompt_length": [], "by_turn": []}
ADDED_ENGINE_FIELDS = {"per_request_spec_decode_metrics": True, "pipeline_parallel_size": 1, "memory": None}
# what preflight records since of each replica's server (rollout.engine_parity.EngineRun)
ADDED_SERVER_FIELDS = {"vllm_version": None, "non_default_args": {}, "unparsed": None}
# what the experiment records since of each arm's KV cache (arms.<arm>.kv)
ADDED_KV_FIELDS = KvCacheStats().to_dict()



def with_added_spec_decode_fields(doc: dict) -> dict:
    for summary in (doc.get("spec_decode") or {}).values():
        for key, default in ADDED_SPEC_DECODE_FIELDS.items():
            summary.setdefault(key, default)
    return doc


def recorded_document(run: str) -> dict:
    """A recorded run's decision.json as a run today writes it (fields added since take their defaults)."""
    doc = json.loads((RECORDED / run / "decision.json").read_text())
    # gates options added since (e.g. slo, goodput_max_decrease) are written with their defaults
    doc["gates_config"] = GatesConfig(**doc["gates_config"]).model_dump(mode="json")
    if doc.get("experiment"):
        doc["experiment"] = {**doc["experiment"], **{k: v for k, v in ADDED_EXPERIMENT_FIELDS.items() if k not in doc["experiment"]}}
        if not doc["experiment"]["warmup_requests"]:  # a warm-up of one look is the default since: each arm's count
            doc["experiment"]["warmup_requests"] = {"baseline": 0, "canary": 0}
        for look in doc["experiment"].get("looks") or []:
            look.setdefault("prefix_cache", dict(ADDED_LOOK_PREFIX_CACHE))
        if doc["experiment"].get("sweep") and "sweep_crossover" not in doc["experiment"]:
            doc["experiment"]["sweep_crossover"] = sweep_crossover_of(doc["experiment"]["sweep"])
        if doc["experiment"].get("sweep") and "promote_up_to" not in doc:  # a sweep's judged claim, written since
            doc["promote_up_to"] = promote_up_to_of(doc["experiment"]["sweep_crossover"])
        for row in doc["experiment"].get("sweep") or []:  # goodput vs load (null without an SLO)
            for arm in row["arms"].values():
                arm.setdefault("goodput", None)
        if "depth_advice" not in doc["experiment"] and doc["experiment"].get("latency_ms"):
            advice = depth_advice_of(doc)
            if advice is not None:
                doc["experiment"]["depth_advice"] = advice
    with_added_spec_decode_fields(doc)
    # the plan's figures are per gate the config enables (whether or not the run got to judge it)
    gates_cfg = GatesConfig(**doc["gates_config"])
    doc.setdefault("detectable_effect", {name: dict(ADDED_DETECTABLE_EFFECT) for name in POWER_GATES
                                         if is_enabled(name, gates_cfg)})
    for record in doc.get("arms", {}).values():  # engine fields added since, at their defaults
        if record.get("tiny_model"):
            record["tiny_model"] = {**record["tiny_model"], **{
                k: v for k, v in ADDED_TINY_MODEL_FIELDS.items() if k not in record["tiny_model"]}}
        if "engine" in record:
            record["engine"] = {**record["engine"], **{
                k: v for k, v in ADDED_ENGINE_FIELDS.items() if k not in record["engine"]}}
        if "cpu" in record.get("engine", {}):
            record["engine"]["cpu"] = {**record["engine"]["cpu"], **{
                k: v for k, v in ADDED_CPU_FIELDS.items() if k not in record["engine"]["cpu"]}}
    if doc.get("timings", {}).get("fleet_start_s") is not None:  # a run whose fleet started: what it held
        doc.setdefault("usage", UsageSummary.held(gpus=0, replicas=2, held_s=1.0).document())
    if doc.get("experiment"):  # the KV cache each arm had during the experiment (cluster.metrics.kv_stats)
        for record in doc["arms"].values():
            record.setdefault("kv", dict(ADDED_KV_FIELDS))
    if doc.get("preflight"):
        for arm, record in doc["arms"].items():
            record.setdefault("servers", {f"{arm}-{i}": dict(ADDED_SERVER_FIELDS) for i in range(record["replicas"])})
            record.setdefault("environment", {f"{arm}-{i}": ReplicaEnvironment().model_dump(mode="json")
                                              for i in range(record["replicas"])})
    return doc


def depth_advice_of(doc: dict) -> dict | None:
    """The depth advice a run writes since (experiment.depth_advice), from a recorded run's TPOT p50s
    and acceptance (no per-look TPOTs were kept, so no interval: its key paths are what matter)."""
    arms = []
    for arm in ("baseline", "canary"):
        k = (doc["arms"][arm]["engine"].get("speculative_config") or {}).get("num_speculative_tokens", 0)
        spec = doc["spec_decode"].get(arm) or {}
        length = 1.0 if k == 0 else spec.get("mean_acceptance_length")
        tpot = doc["experiment"]["latency_ms"][arm]["tpot_p50"]
        if length is None or tpot is None:
            return None
        arms.append(DepthArm(arm, k, length, tpot))
    deepest = max(arms, key=lambda a: a.k)
    profile = (doc["spec_decode"].get(deepest.name) or {}).get("per_position")
    advice = advise_depth(arms, profile or [], profile_arm=deepest.name, streams_per_replica=2.0)
    return advice.model_dump(mode="json") if advice is not None else None


def sweep_crossover_of(rows: list[dict]) -> dict:
    """The crossover a sweep writes since (experiment.sweep_crossover), from a recorded sweep's rows
    (their ratios; the intervals need the records, which were not kept: its key paths are what matter)."""
    levels = [LevelResult(level=r["level"], ratio=r["tpot_ratio"], ratio_low=None, ratio_high=None, pairs=0, block=None)
              for r in rows]
    return SweepCrossover(ratio_1=crossing(levels, 1.0), objective_bar=crossing(levels, 1.0), levels=levels,
                          adaptive=False).document()


def promote_up_to_of(crossover: dict) -> dict:
    """decision.json `promote_up_to` a sweep writes since (rollout.judge.load_curve), from its crossover's levels
    (a recorded sweep's levels have no interval, so nothing is shown: its key paths are what matter)."""
    levels = [LevelResult.model_validate(level) for level in crossover["levels"]]
    return promote_up_to(levels, crossover["objective_bar"]["bar"], 0.05).model_dump(mode="json")


def config_of(doc: dict):
    """A config with the recorded run's name and gates (all decision.json shows of the config)."""
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    data.update(name=doc["name"], gates=doc["gates_config"])
    return parse_config(data)


def test_the_recorded_runs_cover_every_decision_and_phase():
    docs = [json.loads((RECORDED / run / "decision.json").read_text()) for run in RUNS]
    assert len(RUNS) == 6
    assert {d["decision"] for d in docs} == {"promote", "rollback", None}
    for section in ("preflight", "accuracy", "experiment", "progressive"):
        assert any(d[section] for d in docs), section
    assert any(d["experiment"].get("sweep") for d in docs)
    assert any(d["error"] for d in docs)


@pytest.mark.parametrize("run", RUNS)
def test_a_recorded_decision_document_survives_the_typed_result(run):
    doc = json.loads((RECORDED / run / "decision.json").read_text())
    # a gates option added since the run was recorded is written with its default: the rest must not move
    doc["gates_config"] = GatesConfig(**doc["gates_config"]).model_dump(mode="json")
    # so is an experiment field added since (ADDED_EXPERIMENT_FIELDS: any other key that moves fails)
    for key, default in ADDED_EXPERIMENT_FIELDS.items():
        if doc["experiment"]:
            doc["experiment"].setdefault(key, default)
    for row in (doc["experiment"] or {}).get("sweep") or []:  # and each sweep level's goodput (null: no SLO)
        for arm in row["arms"].values():
            arm.setdefault("goodput", None)
    for look in (doc["experiment"] or {}).get("looks") or []:  # and a look's prefix-cache counters (none then)
        look.setdefault("prefix_cache", {})
    with_added_spec_decode_fields(doc)  # and whose acceptance it is
    result = RunResult.from_document(doc, config_of(doc), Path("/tmp") / run)
    # typed, not dicts: a phase that changes a shape fails here, not in a user's pipeline
    assert result.decision is None or isinstance(result.decision, Decision)
    again = decision_document(result)
    assert json.dumps(again, sort_keys=True) == json.dumps(doc, sort_keys=True)


@pytest.mark.parametrize("run", RUNS)
def test_a_recorded_report_is_written_again_word_for_word(run):
    doc = json.loads((RECORDED / run / "decision.json").read_text())
    result = RunResult.from_document(doc, config_of(doc), Path("/tmp") / run)
    assert markdown_report(decision_document(result)) == (RECORDED / run / "report.md").read_text()


def test_unknown_keys_in_a_phase_summary_are_refused():
    doc = json.loads((RECORDED / "promote" / "decision.json").read_text())
    doc["experiment"]["no_such_key"] = 1
    with pytest.raises(ValueError, match="no_such_key"):
        RunResult.from_document(doc, config_of(doc), Path("/tmp/promote"))


def test_key_paths_see_a_moved_or_missing_key_but_not_other_numbers():
    doc = recorded_document("promote")
    other = json.loads(json.dumps(doc))
    other["experiment"]["duty_cycle"] = 0.5
    other["experiment"]["looks"].append(dict(other["experiment"]["looks"][0]))
    assert key_paths(other) == key_paths(doc)
    for look in other["experiment"]["looks"]:
        del look["information"]
    assert "experiment.looks[].information" in key_paths(doc) - key_paths(other)


def test_usage_is_what_the_fleet_held_and_reads_back():
    doc = recorded_document("promote")
    doc["usage"] = UsageSummary.held(gpus=8, replicas=2, held_s=5400.0).document()
    assert doc["usage"] == {"gpus": 8, "replicas": 2, "held_s": 5400.0, "gpu_hours": 12.0, "replica_hours": 3.0}
    for key, default in ADDED_EXPERIMENT_FIELDS.items():
        doc["experiment"].setdefault(key, default)
    doc["gates_config"] = GatesConfig(**doc["gates_config"]).model_dump(mode="json")
    result = RunResult.from_document(doc, config_of(doc), Path("/tmp/promote"))
    again = decision_document(result)
    assert again["usage"] == doc["usage"]
    assert "12 GPU-hours, 3 replica-hours" in markdown_report(again)
