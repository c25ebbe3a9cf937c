"""junit.xml from decision.json: one case per gate, inconclusive never reads as a pass."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

from rollout.record.junit import junit_xml, write_junit

RUNS = Path(__file__).parent / "data" / "recorded_runs"


def _doc(name: str) -> dict:
    return json.loads((RUNS / name / "decision.json").read_text())


def _cases(xml: str) -> dict[str, ET.Element]:
    suite = ET.fromstring(xml)
    assert suite.tag == "testsuite" and suite.get("name") == "mtp-canary"
    return {case.get("name"): case for case in suite.iter("testcase")}


def test_rollback_has_one_failure_per_failed_gate():
    doc = _doc("bad")
    failed = [g["name"] for g in doc["gates"] if g["verdict"] == "fail"]
    assert failed, "the recorded bad run has failed gates"
    xml = junit_xml(doc)
    cases = _cases(xml)
    assert set(cases) == {g["name"] for g in doc["gates"]} | {"decision"}
    got = sorted(name for name, case in cases.items() if case.find("failure") is not None and name != "decision")
    assert got == sorted(failed)
    suite = ET.fromstring(xml)
    assert int(suite.get("tests")) == len(doc["gates"]) + 1
    assert int(suite.get("failures")) == len(failed) + 1  # the decision case fails on rollback too
    gate = next(g for g in doc["gates"] if g["verdict"] == "fail")
    assert " ".join(gate["detail"].split()) in cases[gate["name"]].find("failure").get("message")


def test_promote_passes_every_case():
    suite = ET.fromstring(junit_xml(_doc("promote")))
    assert suite.get("failures") == "0" and suite.get("errors") == "0"
    assert all(case.find("failure") is None and case.find("error") is None for case in suite.iter("testcase"))


def test_inconclusive_and_missing_verdicts_are_errors_not_passes():
    doc = _doc("promote")
    doc["decision"], doc["exit_code"] = "inconclusive", 4
    doc["gates"][0]["verdict"] = "inconclusive"
    doc["gates"][1].pop("verdict")
    cases = _cases(junit_xml(doc))
    assert cases[doc["gates"][0]["name"]].find("error") is not None
    assert cases[doc["gates"][1]["name"]].find("error") is not None
    assert cases["decision"].find("error") is not None


def test_infrastructure_error_run_is_an_error_case():
    doc = _doc("intr")
    assert doc["error"]
    cases = _cases(junit_xml(doc))
    assert cases["decision"].find("error") is not None
    assert "interrupted" in cases["decision"].find("error").get("message")


def test_hostile_text_is_escaped_and_parses(tmp_path):
    doc = _doc("broken")
    nasty = 'a <b> & "c" \' ]]> \n line'
    doc["run_id"] = nasty
    doc["reason"] = nasty
    doc["gates"][0]["detail"] = nasty
    path = write_junit(doc, tmp_path)
    assert path == tmp_path / "junit.xml"
    suite = ET.parse(path).getroot()
    assert suite.get("id") == nasty
    first = next(suite.iter("testcase"))
    assert "a <b> & \"c\" ' ]]> line" in first.find("failure").get("message")
    assert not list(tmp_path.glob(".junit.xml.tmp-*"))


def test_pipeline_artifacts_writes_both_files(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from rollout.record.pipeline_artifacts import write_pipeline_artifacts

    paths = write_pipeline_artifacts(_doc("broken"), tmp_path)
    assert paths == {"junit": tmp_path / "junit.xml", "metrics": tmp_path / "metrics.prom"}
    assert ET.parse(paths["junit"]).getroot().get("failures") == "3"
    names = {f.name for f in text_string_to_metric_families(paths["metrics"].read_text())}
    assert "mtp_canary_decision" in names
