"""`mtp-canary report`: reports written again from decision.json; a page that cannot be drawn never costs the record."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from rollout.record import html as report_html, markdown as report
from tests.conftest import REPO

RECORDED = REPO / "tests" / "data" / "recorded_runs"


def test_report_writes_the_same_report_md_and_a_page_from_decision_json(tmp_path):
    run = tmp_path / "bad"
    shutil.copytree(RECORDED / "bad", run)
    (run / "report.md").unlink()
    decision_before = (run / "decision.json").read_bytes()
    out = subprocess.run([sys.executable, "-m", "rollout", "report", str(run)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (run / "report.md").read_text() == (RECORDED / "bad" / "report.md").read_text()
    assert "ROLLBACK" in (run / "report.html").read_text().upper()
    assert (run / "decision.json").read_bytes() == decision_before  # the record itself is not rewritten


def test_report_of_a_run_that_is_not_there_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rollout", "report", "nope", "--runs-dir", str(tmp_path)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "decision.json" in out.stderr


def test_a_page_that_cannot_be_drawn_leaves_a_plain_one_and_the_decision(tmp_path, monkeypatch):
    run = tmp_path / "promote"
    shutil.copytree(RECORDED / "promote", run)

    def broken(doc, run_dir):
        raise ValueError("a shape the page did not expect")

    monkeypatch.setattr(report, "write_html_report", broken)
    paths = report.regenerate_reports(run)
    page = paths["html"].read_text()
    assert "PROMOTE" in page and "ValueError: a shape the page did not expect" in page
    assert json.loads((run / "decision.json").read_text())["decision"] == "promote"
    assert report_html.write_html_report is not broken  # only the name report.py calls was replaced
