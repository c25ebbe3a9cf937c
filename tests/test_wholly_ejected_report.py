"""An arm whose every replica the router ejected at once is said in a line: in the log, decision.json
(`wholly_ejected`), report.md and report.html. Its requests were answered 503 by the router and
count as the arm's errors; its latency figures hold only what it served, which a reader must know.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from rollout.record.html import html_report
from rollout.record.markdown import markdown_report
from rollout.run.controller import Controller
from tests.conftest import REPO

RECORDED = REPO / "tests" / "data" / "recorded_runs" / "crash" / "decision.json"


def test_the_reports_say_an_arm_was_wholly_ejected(tmp_path):
    doc = json.loads(RECORDED.read_text())
    assert "An arm was out" not in markdown_report(doc) and "An arm was out" not in html_report(doc, tmp_path)
    doc["wholly_ejected"] = {"canary": 4}
    line = "Every replica of an arm was ejected at once: canary (4 requests answered 503)"
    assert f"**An arm was out**: {line}" in markdown_report(doc)
    assert f"An arm was out: {line}" in html_report(doc, tmp_path)


def test_the_controller_records_what_the_router_counted_before_it_stops():
    said: list[str] = []
    controller = Controller.__new__(Controller)
    controller.ctx = SimpleNamespace(router=SimpleNamespace(wholly_ejected=lambda: {"canary": 4}),
                                     result=SimpleNamespace(wholly_ejected=None), say=said.append)
    controller._note_wholly_ejected()
    assert controller.ctx.result.wholly_ejected == {"canary": 4}
    assert said == ["router: WARNING: Every replica of an arm was ejected at once: canary (4 requests answered 503); "
                    "those requests count as the arm's errors, and its latency figures hold only what it served"]
    controller.ctx.router = SimpleNamespace(wholly_ejected=lambda: None)  # a router that does not answer
    controller._note_wholly_ejected()
    assert controller.ctx.result.wholly_ejected == {"canary": 4}
