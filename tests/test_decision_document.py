"""decision.json read back typed (rollout.record.document): recorded runs read, unknown keys are kept aside,
a document that is not one is refused in one line naming the field."""

from __future__ import annotations

import json

import pytest

from rollout.commands.report import main as report_main
from rollout.record.document import BadDocument, DecisionDocument
from rollout.record.markdown import markdown_report
from tests.conftest import REPO

RECORDED = REPO / "tests" / "data" / "recorded_runs"
RUNS = sorted(p.name for p in RECORDED.iterdir())


@pytest.mark.parametrize("run", RUNS)
def test_every_recorded_run_reads_and_renders_its_report_md(run):
    doc = DecisionDocument.read(RECORDED / run)
    raw = json.loads((RECORDED / run / "decision.json").read_text())
    assert doc.run_id == raw["run_id"] and len(doc.gates) == len(raw["gates"])
    # a phase that did not run is written as {}: absent when read
    assert (doc.experiment is None) == (raw["experiment"] == {})
    assert markdown_report(doc) == (RECORDED / run / "report.md").read_text()


def test_unknown_top_level_keys_and_verdicts_are_kept_not_refused():
    raw = json.loads((RECORDED / "promote" / "decision.json").read_text())
    raw["written_by_a_later_version"] = {"x": 1}
    raw["gates"][0]["verdict"] = "maybe"
    doc = DecisionDocument.of(raw)
    assert doc.model_extra == {"written_by_a_later_version": {"x": 1}}
    assert doc.gates[0].verdict == "maybe"


def test_a_document_that_is_not_one_is_refused_in_one_line_naming_the_field(tmp_path, capsys):
    raw = json.loads((RECORDED / "bad" / "decision.json").read_text())
    raw["gates"][2]["interval"] = "wide"
    with pytest.raises(BadDocument, match=r"^not a decision\.json: gates\.2\.interval: ") as caught:
        DecisionDocument.of(raw)
    assert "\n" not in str(caught.value)
    (tmp_path / "decision.json").write_text(json.dumps(raw))
    assert report_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gates.2.interval" in err
    assert not (tmp_path / "report.md").exists()
