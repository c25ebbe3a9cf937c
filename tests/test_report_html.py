"""report.html (rollout.record.html): the recorded runs render, each section only where its data are,
nothing is fetched at view time, user text is escaped, and the page shows in a real headless Chromium."""

from __future__ import annotations

import copy
import json
import random
import re
import shutil
from pathlib import Path

import pytest
import yaml

from loadtests.records import RequestRecord, write_records
from rollout.config import parse_config
from rollout.record.markdown import write_reports
from rollout.record.html import expected_lengths, html_report, write_html_report
from rollout.record.result import RunResult
from tests.conftest import REPO

RECORDED = REPO / "tests" / "data" / "recorded_runs"
RUNS = sorted(p.name for p in RECORDED.iterdir() if (p / "decision.json").exists())
FIGURES = ("fig-latency", "fig-looks", "fig-acceptance", "fig-sweep", "fig-progressive")
SECTIONS = ("gates", "looks", "latency", "acceptance", "sweep", "accuracy", "progressive", "engine-warnings")
# What each recorded run holds (decision.json only, no records): the sections and figures that follow.
EXPECTED = {
    "promote": ({"gates", "looks", "latency", "acceptance", "sweep", "accuracy", "engine-warnings"}, {"fig-acceptance", "fig-sweep"}),
    "bad": ({"gates", "looks", "latency", "acceptance", "accuracy", "engine-warnings"}, {"fig-acceptance"}),
    "broken": ({"gates", "accuracy", "engine-warnings"}, set()),
    "abort": ({"gates", "accuracy", "engine-warnings"}, set()),
    "intr": ({"gates", "accuracy", "engine-warnings"}, set()),
    "crash": ({"gates", "progressive", "engine-warnings"}, {"fig-progressive"}),
}


def _doc(run: str) -> dict:
    return json.loads((RECORDED / run / "decision.json").read_text())


def _record(i: int, arm: str, t: float, rng: random.Random, ok: bool = True, level: float | None = None,
            tag: str = "experiment") -> RequestRecord:
    tpot = rng.lognormvariate(-3.1 if arm == "baseline" else -3.6, 0.3)
    ttft = rng.lognormvariate(-1.8, 0.4)
    return RequestRecord(request_id=f"r{i}", tag=tag, worker="w0", arm=arm, level=level, sent_at=t,
                         ttft_s=ttft if ok else None, e2e_s=ttft + 63 * tpot, output_tokens=64 if ok else None,
                         chunks=20, ok=ok, status=200 if ok else 500, error=None if ok else "HTTP 500")


def _experiment_records(run_dir: Path, doc: dict, canary_failures: int = 0) -> dict[str, int]:
    """Records that hold the run's per-look counts (so the replay's looks fall where the run's did),
    canary failures spread over the first look; returns the failed count per arm."""
    rng, recs, t, i = random.Random(0), [], 1796153900.0, 0
    for n, look in enumerate([k["requests"] for k in doc["experiment"]["looks"]] + [{"baseline": 5, "canary": 5}]):
        for k in range(max(look.values())):
            for arm in ("baseline", "canary"):
                if k < look.get(arm, 0):
                    i, t = i + 1, t + 0.05
                    failed = arm == "canary" and n == 0 and k % 3 == 0 and k < 3 * canary_failures
                    recs.append(_record(i, arm, t, rng, ok=not failed))
    (run_dir / "experiment").mkdir(parents=True, exist_ok=True)
    write_records(run_dir / "experiment" / "records.jsonl", recs)
    return {arm: sum(1 for r in recs if r.arm == arm and not r.ok) for arm in ("baseline", "canary")}


def _run_dir(tmp_path: Path, run: str) -> Path:
    run_dir = tmp_path / run
    shutil.copytree(RECORDED / run, run_dir)
    return run_dir


def _ids(page: str) -> set[str]:
    return set(re.findall(r'<(?:h2|figure) id="([^"]+)"', page))


@pytest.mark.parametrize("run", RUNS)
def test_a_recorded_run_renders_the_sections_its_data_hold(run, tmp_path):
    assert set(RUNS) == set(EXPECTED)
    doc = _doc(run)
    page = html_report(doc, _run_dir(tmp_path, run))
    sections, figures = EXPECTED[run]
    assert _ids(page) & set(SECTIONS) == sections
    assert _ids(page) & set(FIGURES) == figures
    decision = re.search(r'<p id="decision"[^>]*>(.*?)</p>', page).group(1)
    assert decision.startswith(str(doc["decision"] or "error").upper())
    for g in doc["gates"]:
        assert f"<td>{g['name']}</td>" in page
    if doc["decision"] == "rollback" and any(g["verdict"] == "fail" for g in doc["gates"]):
        failed = [g["name"] for g in doc["gates"] if g["verdict"] == "fail"]
        assert all(f"{name} fail:" in decision for name in failed)
    if "latency" in sections:  # an experiment ran, its records are not in the recorded run
        assert "records were unreadable" in page and "records.jsonl is absent" in page


@pytest.mark.parametrize("run", RUNS)
def test_nothing_is_fetched_when_the_page_is_viewed(run, tmp_path):
    run_dir = _run_dir(tmp_path, run)
    if _doc(run)["experiment"].get("looks"):
        _experiment_records(run_dir, _doc(run), canary_failures=2)
    page = html_report(_doc(run), run_dir)
    lowered = page.lower()
    for fetching in ("<script", "<link", "<iframe", "<img", "<object", "<embed", "@import"):
        assert fetching not in lowered, fetching
    # the SVGs refer to their own markers and clip paths (#id) only; nothing else is loaded
    assert re.findall(r'(?:src|href)\s*=\s*(?!["\']?#)', lowered) == []
    assert re.findall(r"url\(\s*(?!['\"]?#)", lowered) == []
    assert "<svg" in page or not EXPECTED[run][1]


def test_user_text_is_escaped(tmp_path):
    doc = copy.deepcopy(_doc("promote"))
    evil = '<script>alert("x")</script>'
    doc["reason"] = f"every gate passed {evil}"
    doc["run_id"] = f"run{evil}"
    doc["arms"]["canary"]["engine"]["served_model_name"] = f"tiny{evil}"
    doc["arms"]["canary"]["engine"]["model"] = '/m/<img src=x onerror="alert(1)">'
    doc["preflight"]["notable_warnings"]["canary-0"].append(f"warning {evil}")
    doc["gates"][0]["detail"] = f"detail {evil}"
    page = html_report(doc, tmp_path)
    assert "<script" not in page.lower() and "<img" not in page.lower()
    assert page.count("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;") >= 5  # title, h1, decision, detail, arm, warning


def test_the_records_give_ecdfs_per_arm_with_the_failures_counted(tmp_path):
    run_dir = _run_dir(tmp_path, "promote")
    doc = _doc("promote")
    failed = _experiment_records(run_dir, doc, canary_failures=3)
    assert failed == {"baseline": 0, "canary": 3}
    page = html_report(doc, run_dir)
    assert {"fig-latency", "fig-looks"} <= _ids(page)
    total = {arm: sum(k["requests"][arm] for k in doc["experiment"]["looks"]) + 5 for arm in ("baseline", "canary")}
    assert f"failed baseline 0 of {total['baseline']}, canary 3 of {total['canary']}" in page
    # the curves hold the successful requests only (svg.fonttype none keeps the legend as text)
    assert f"baseline (n={total['baseline']})" in page and f"canary (n={total['canary'] - 3})" in page
    assert "The request records were unreadable" not in page


def test_the_looks_are_re_judged_from_the_records_with_the_bar_drawn(tmp_path):
    run_dir = _run_dir(tmp_path, "promote")
    doc = _doc("promote")
    _experiment_records(run_dir, doc)
    page = html_report(doc, run_dir)
    looks = re.search(r'<figure id="fig-looks">.*?</figure>', page, re.S).group(0)
    assert "bar 1" in looks  # the objective's threshold
    assert "TPOT p50 ratio canary/baseline" in looks


def test_a_broken_records_file_leaves_the_run_s_artifacts_and_says_so(tmp_path):
    run_dir = _run_dir(tmp_path, "promote")
    doc = _doc("promote")
    (run_dir / "experiment").mkdir()
    (run_dir / "experiment" / "records.jsonl").write_text('{"request_id": "r1"\nnot json\n')
    config = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    config.update(name=doc["name"], gates=doc["gates_config"])
    paths = write_reports(RunResult.from_document(doc, parse_config(config), run_dir))
    assert set(paths) == {"decision", "report", "html", "junit", "metrics"}
    assert json.loads(paths["decision"].read_text())["decision"] == "promote"
    page = paths["html"].read_text()
    assert paths["html"] == run_dir / "report.html"
    assert "The request records were unreadable" in page and "records.jsonl:1" in page
    assert "the looks were not re-judged" in page
    assert "fig-latency" not in _ids(page) and "fig-acceptance" in _ids(page)


def test_expected_acceptance_length_for_every_shorter_k():
    conditional, lengths = expected_lengths([0.8, 0.6, 0.3])
    assert conditional == pytest.approx([0.8, 0.75, 0.5])
    assert lengths == pytest.approx([1.8, 2.4, 2.7])  # 1 + sum_(i<=k') prod_(j<=i) a_j
    assert expected_lengths([0.5, 0.0, 0.0]) == ([0.5, 0.0, None], pytest.approx([1.5, 1.5, 1.5]))
    for run in RUNS:  # the engine's own per-k numbers (cluster.metrics) agree
        for sd in _doc(run)["spec_decode"].values():
            if sd.get("expected_length_by_k"):
                want = [sd["expected_length_by_k"][str(k)] for k in range(1, len(sd["per_position"]) + 1)]
                assert expected_lengths(sd["per_position"])[1] == pytest.approx(want)


def test_the_sweep_s_records_give_intervals_around_each_ratio(tmp_path):
    run_dir = _run_dir(tmp_path, "promote")
    rng, recs = random.Random(1), []
    for level in (1.0, 2.0, 4.0):
        for i in range(40):
            for arm in ("baseline", "canary"):
                recs.append(_record(len(recs), arm, 1796154100.0 + len(recs), rng, level=level, tag="sweep"))
    (run_dir / "sweep").mkdir()
    write_records(run_dir / "sweep" / "records.jsonl", recs)
    page = html_report(_doc("promote"), run_dir)
    intervals = re.findall(r"<td>\[([0-9.]+), ([0-9.]+)\]</td><td>\d+/\d+</td></tr>", page)
    assert len(intervals) == 3
    for lower, upper in intervals:  # canary TPOT exp(-3.6) vs baseline exp(-3.1): ratio ~0.61
        assert float(lower) < 0.61 < float(upper) < 1.0
    assert "no intervals" not in page


def test_write_html_report_replaces_the_page_in_one_step(tmp_path):
    (tmp_path / "report.html").write_text("old")
    path = write_html_report(_doc("bad"), tmp_path)
    assert path.read_text().startswith("<!DOCTYPE html>")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no temporary file left beside it


def test_the_page_renders_in_headless_chromium(tmp_path):
    """A real browser (Chromium from the OS packages) loads the pages from file://: the decision is
    visible text, every figure's SVG has a size, and the console shows no error."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("no chromium binary on PATH (.ci/run installs the OS package)")
    from playwright.sync_api import sync_playwright

    pages = {}  # with every figure (promote, records added), the progressive one (crash), none (broken)
    for run in ("promote", "crash", "broken"):
        run_dir = _run_dir(tmp_path, run)
        if run == "promote":
            _experiment_records(run_dir, _doc(run), canary_failures=2)
        pages[run] = write_html_report(_doc(run), run_dir)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=binary, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            for run, path in pages.items():
                page.goto(path.as_uri())
                decision = page.locator("#decision")
                assert decision.is_visible()
                assert decision.inner_text().startswith(str(_doc(run)["decision"]).upper())
                figures = {f.get_attribute("id") for f in page.query_selector_all("figure")}
                assert figures == _ids(path.read_text()) & set(FIGURES)
                for fig_id in figures:
                    box = page.locator(f"#{fig_id} svg").bounding_box()
                    assert box is not None and box["width"] > 100 and box["height"] > 100, (run, fig_id, box)
        finally:
            browser.close()
    assert errors == []


def test_the_depth_advice_is_a_table_under_the_acceptance_profile(tmp_path):
    from tests.test_result import depth_advice_of

    doc = _doc("promote")
    doc["experiment"]["depth_advice"] = depth_advice_of(doc)
    page = html_report(doc, _run_dir(tmp_path, "promote"))
    section = page[page.index('id="depth-advice"'):]
    section = section[:section.index("</p>")]
    assert "k=3 is predicted fastest at 2 streams per replica" in section
    assert section.count("<tr>") == 1 + 3  # the header and k = 1, 2, 3
