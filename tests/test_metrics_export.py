"""metrics.prom from decision.json: parsed back with prometheus_client's own parser."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from rollout.record.prometheus import write_metrics, metrics_text

RUNS = Path(__file__).parent / "data" / "recorded_runs"


def _doc(name: str) -> dict:
    return json.loads((RUNS / name / "decision.json").read_text())


def _samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def _value(samples, **labels) -> float:
    found = [s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (labels, found)
    return found[0]


def test_rollback_run_exports_decision_gates_and_exit_code():
    doc = _doc("bad")
    s = _samples(metrics_text(doc))
    assert _value(s["mtp_canary_decision"], decision="rollback", run_id="bad") == 1
    assert _value(s["mtp_canary_decision"], decision="promote") == 0
    assert _value(s["mtp_canary_exit_code"]) == 3
    for gate in doc["gates"]:
        assert _value(s["mtp_canary_gate_status"], gate=gate["name"], status=gate["verdict"]) == 1
        others = [v for v in ("pass", "fail", "inconclusive") if v != gate["verdict"]]
        assert all(_value(s["mtp_canary_gate_status"], gate=gate["name"], status=v) == 0 for v in others)


def test_promote_run_exports_arms_latency_ratio_and_acceptance():
    doc = _doc("promote")
    s = _samples(metrics_text(doc))
    assert _value(s["mtp_canary_requests"], arm="canary") == doc["experiment"]["requests"]["canary"]
    lat = doc["experiment"]["latency_ms"]
    ratio = lat["canary"]["tpot_p50"] / lat["baseline"]["tpot_p50"]
    assert abs(_value(s["mtp_canary_latency_ratio"], metric="tpot_p50") - ratio) < 1e-9
    per_position = doc["spec_decode"]["canary"]["per_position"]
    assert len([x for x in s["mtp_canary_acceptance_rate"] if x.labels["arm"] == "canary"]) == len(per_position)
    gate = next(g for g in doc["gates"] if g["name"] == "tpot_p50_improvement")
    assert _value(s["mtp_canary_gate_interval"], gate=gate["name"], bound="upper") == gate["interval"][1]


def test_error_run_and_hostile_labels(tmp_path):
    doc = _doc("intr")
    doc["run_id"] = 'x"} 1\nmtp_canary_decision{decision="promote'
    path = write_metrics(doc, tmp_path)
    assert path == tmp_path / "metrics.prom"
    s = _samples(path.read_text())
    # the run id stays one label value: no injected series
    assert {x.labels["run_id"] for x in s["mtp_canary_decision"]} == {doc["run_id"]}
    assert _value(s["mtp_canary_decision"], decision="error") == 1
    assert _value(s["mtp_canary_decision"], decision="promote") == 0
    assert _value(s["mtp_canary_exit_code"]) == 1
