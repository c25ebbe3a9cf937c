"""Up to which load the candidate pays: promote_up_to judged from a sweep, in decision.json and every rendering.

The simulated sweeps are rollout.calibration.load_curve's (correlated records, a known true TPOT
ratio at every load); `mtp-canary calibrate` measures the wrong-claim rate and power over many
more of them than a test can.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from rollout.analysis.crossover import LevelResult, ratio_interval
from rollout.analysis.load_sweep import level_results
from rollout.calibration.load_curve import BAR, WORLDS, level_records, load_curve_rows, load_curve_trial, sweep
from rollout.config import parse_config
from rollout.judge.load_curve import PromoteUpTo, promote_up_to, qualified_reason, upper_bound
from rollout.record.document import DecisionDocument
from rollout.record.html import html_report
from rollout.record.junit import junit_xml
from rollout.record.markdown import markdown_report
from rollout.record.prometheus import metrics_text
from rollout.record.result import RunResult, decision_document
from tests.test_config import minimal
from tests.test_result import RECORDED, config_of

ALPHA = 0.05
WORLD = {world.name: world for world in WORLDS}


def at(level: float, ratio: float | None, log_sd: float | None = 0.05, dof: int | None = 9) -> LevelResult:
    return LevelResult(level=level, ratio=ratio, ratio_low=None, ratio_high=None, pairs=50, block=7,
                       log_sd=log_sd, dof=dof)


# -- the judgement -----------------------------------------------------------------------------
def test_the_claim_stops_before_the_first_level_not_shown_below_the_bar_whatever_comes_after():
    # upper bounds: 0.7 e^(2.262 x 0.05) = 0.78, 0.80 -> 0.89, 0.85 -> 0.95 (>= 0.9): the sequence stops at 4,
    # and the level 8 below the bar again is not claimed (the claim is "every level up to C")
    levels = [at(8, 0.6), at(1, 0.7), at(4, 0.85), at(2, 0.8)]
    got = promote_up_to(levels, BAR, ALPHA)
    assert got.streams_per_replica == 2 and got.levels_judged == [1, 2, 4, 8] and got.top_level == 8
    assert got.upper_bounds[0] == pytest.approx(0.7 * math.exp(2.2622 * 0.05), abs=1e-3)
    assert got.below_top() and "not shown at 4" in got.reason and "nothing is claimed from 4 on" in got.reason
    everywhere = promote_up_to([at(1, 0.7), at(2, 0.75)], BAR, ALPHA)
    assert everywhere.streams_per_replica == 2 and not everywhere.below_top()
    assert "above 2 nothing is claimed" in everywhere.reason


def test_nothing_is_claimed_when_the_lowest_level_is_not_shown_or_has_no_interval():
    assert promote_up_to([at(1, 0.88), at(2, 0.7)], BAR, ALPHA).streams_per_replica is None  # bound 0.98
    no_interval = promote_up_to([at(1, 0.5, log_sd=None, dof=None), at(2, 0.5)], BAR, ALPHA)
    assert no_interval.streams_per_replica is None and "no interval" in no_interval.reason
    no_ratio = promote_up_to([at(1, 0.5), at(2, None), at(4, 0.5)], BAR, ALPHA)
    assert no_ratio.streams_per_replica == 1  # missing data stops the sequence: it never shows a gain
    none = promote_up_to([], BAR, ALPHA)
    assert none.streams_per_replica is None and none.top_level is None and none.reason == "no level was swept"
    with pytest.raises(ValueError, match="alpha"):
        promote_up_to([at(1, 0.5)], BAR, 0.0)


def test_a_level_s_bound_is_the_upper_end_of_the_interval_the_report_draws():
    rng = np.random.default_rng(1)
    base = 0.03 * np.exp(rng.normal(0, 0.1, 64))
    got = ratio_interval(base, base * 0.8 * np.exp(rng.normal(0, 0.05, 64)))
    level = at(1, got.ratio, got.log_sd, got.dof)
    assert got.dof == 7 and upper_bound(level, 0.05) == pytest.approx(got.high, rel=1e-9)
    assert upper_bound(level, 0.01) > got.high  # a smaller alpha, a wider bound


def test_the_claim_qualifies_a_promote_and_nothing_else():
    short = promote_up_to([at(1, 0.7), at(2, 0.8), at(4, 0.95)], BAR, ALPHA)
    assert qualified_reason("promote", "every gate passed", short) == (
        "every gate passed; for concurrency <= 2 per replica (the sweep shows the TPOT ratio below 0.9 at every "
        "level up to 2, not at 4)")
    top = promote_up_to([at(1, 0.7), at(2, 0.8)], BAR, ALPHA)
    nothing = promote_up_to([at(1, 0.95)], BAR, ALPHA)
    assert qualified_reason("promote", "every gate passed", top) == "every gate passed"  # up to the top: no limit
    assert qualified_reason("promote", "every gate passed", nothing) == "every gate passed"  # the objective decides
    assert qualified_reason("rollback", "failed: x", short) == "failed: x"
    assert qualified_reason("promote", "every gate passed", None) == "every gate passed"


# -- simulated sweeps with a known true curve ------------------------------------------------------
def test_a_sweep_whose_ratio_crosses_the_bar_between_levels_is_claimed_up_to_the_level_below():
    """Quiet records (noise 0.2): the true ratio crosses 0.9 at 7.39, between the levels 4 and 8."""
    rng = np.random.default_rng(3)
    levels = [r for level in (1, 2, 4, 8, 16) for r in level_results(
        level_records(rng, level, 0.6 + 0.15 * math.log(level), noise=0.2), ("baseline", "canary"), 10.0, 1)]
    got = promote_up_to(levels, BAR, ALPHA)
    assert got.streams_per_replica == 4 and got.below_top()


def test_correlated_worlds_that_try_to_break_the_claim():
    """40 sweeps per world (calibrate runs thousands): a ratio flat at the bar is claimed rarely (at most 6 of 40:
    P(>= 7) is 0.003 at a true rate of 0.05), and a crossing between levels is often found up to its level below."""
    rows = {row["world"]: row for row in load_curve_rows(ALPHA, 40, seed=5, worlds=[WORLD["flat_at_bar"],
                                                                                  WORLD["crosses_between"]])}
    assert rows["flat_at_bar"]["wrong_claim_rate"] <= 6 / 40 and rows["flat_at_bar"]["power"] is None
    assert rows["crosses_between"]["wrong_claim_rate"] <= 6 / 40
    assert rows["crosses_between"]["power"] >= 0.3  # reaching 4 (true ratio 0.81 vs 0.9): about half the time


def test_an_adaptive_sweep_s_claim_judges_the_levels_the_planner_picked():
    rng = np.random.default_rng(8)
    levels = sweep(WORLD["adaptive"], rng)
    assert sorted(r.level for r in levels)[:4] == [1, 2, 4, 8] and len(levels) > 5  # doubling, then bisection
    wrong, reaches = load_curve_trial(WORLD["adaptive"], np.random.default_rng(8), ALPHA)
    assert wrong is False and reaches is not None


# -- decision.json and its renderings ------------------------------------------------------------------
def promote_with_sweep(claim: PromoteUpTo) -> dict:
    doc = json.loads((RECORDED / "promote" / "decision.json").read_text())
    result = RunResult.from_document(doc, config_of(doc), Path("/tmp/promote"))
    result.promote_up_to = claim
    return decision_document(result)


def test_promote_up_to_is_typed_in_decision_json_and_absent_without_a_sweep():
    recorded = json.loads((RECORDED / "promote" / "decision.json").read_text())
    assert "promote_up_to" not in decision_document(RunResult.from_document(recorded, config_of(recorded), Path("/tmp")))
    claim = promote_up_to([at(1, 0.6), at(2, 0.8), at(4, 0.95)], BAR, ALPHA)
    doc = promote_with_sweep(claim)
    assert doc["promote_up_to"]["streams_per_replica"] == 2 and doc["promote_up_to"]["alpha"] == ALPHA
    assert RunResult.from_document(doc, config_of(doc), Path("/tmp")).promote_up_to == claim  # reads back
    assert DecisionDocument.of(doc).promote_up_to == claim
    with pytest.raises(ValueError, match="promote_up_to"):
        DecisionDocument.of({**doc, "promote_up_to": {"streams_per_replica": "many"}})


def test_every_rendering_shows_the_claim(tmp_path):
    doc = promote_with_sweep(promote_up_to([at(1, 0.6), at(2, 0.8), at(4, 0.95)], BAR, ALPHA))
    report = markdown_report(doc)
    assert "Promote up to (judged): the candidate beats the objective's bar 0.9 at every swept load up to 2 streams " \
           "per replica; the TPOT ratio is below 0.9 at every level up to 2 streams per replica (upper ends of 95% " \
           "intervals, levels in ascending order, family-wise alpha 0.05: 1 (0.672), 2 (0.896)); not shown at 4" in report
    assert report.index("## Speedup vs load") < report.index("Promote up to")
    page = html_report(doc, tmp_path)
    assert 'id="promote-up-to"' in page and "pays up to 2 (judged)" in page  # the plot's mark, its legend
    props = {p.get("name"): p.get("value") for p in ET.fromstring(junit_xml(doc).split("\n", 1)[1]).iter("property")}
    assert props["promote_up_to_streams_per_replica"] == "2" and "not shown at 4" in props["promote_up_to_reason"]
    assert 'mtp_canary_promote_up_to_streams_per_replica{run_id="' in metrics_text(doc)
    assert [line for line in metrics_text(doc).splitlines() if line.startswith("mtp_canary_promote_up_to")][0] \
        .endswith(" 2.0")
    none = promote_with_sweep(promote_up_to([at(1, 0.95)], BAR, ALPHA))
    assert "at no swept level" in markdown_report(none)
    assert [line for line in metrics_text(none).splitlines() if line.startswith("mtp_canary_promote_up_to")][0] \
        .endswith(" 0.0")
    assert "promote_up_to" not in junit_xml(json.loads((RECORDED / "promote" / "decision.json").read_text()))


# -- the phases: a sweep with a known crossover, then the decision ---------------------------------------
def test_a_sweep_with_a_known_crossover_writes_promote_up_to_and_qualifies_the_promote(tmp_path, monkeypatch):
    """Fixed levels 1, 2, 4, 8, 16 of quiet correlated records whose true ratio crosses 0.9 at 7.39: C = 4,
    below the top level, so the PROMOTE reads "for concurrency <= 4 per replica"."""
    from rollout.judge.verdicts import Decision, GateResult
    from rollout.record.result import ExperimentSummary
    from rollout.run.context import RunContext
    from rollout.run.phases.decide import Decide
    from rollout.run.phases.sweep import Sweep
    from rollout.run.resume import ResumePoint
    from rollout.run.store import RunStore

    cfg = parse_config(minimal(experiment={"sweep": {"step_s": 10, "levels": [1, 2, 4, 8, 16]}},
                               gates={"tpot_p50_min_improvement": 0.1}))
    store = RunStore(tmp_path / "history.db")
    store.create_run("r", cfg.name, "tiny", cfg.model_dump(mode="json"))
    ctx = RunContext(cfg=cfg, run_id="r", run_dir=tmp_path / "r", store=store,
                     result=RunResult(run_id="r", run_dir=tmp_path / "r", config=cfg), progress=lambda line: None,
                     cache_dir=tmp_path, point=ResumePoint.fresh(), namespace="test")
    recorded = json.loads((RECORDED / "promote" / "decision.json").read_text())
    ctx.result.experiment = ExperimentSummary.model_validate({**recorded["experiment"], "sweep": None})
    rng = np.random.default_rng(4)

    def load(self, ctx, steps, top_level, path, log_dir):  # the stepped load's records, drawn instead of measured
        return [r for level in map(float, steps.split(",")) for r in
                level_records(rng, level, 0.6 + 0.15 * math.log(level), noise=0.2)]

    monkeypatch.setattr(Sweep, "_load", load)
    Sweep().run(ctx)
    claim = ctx.result.promote_up_to
    assert claim.streams_per_replica == 4 and claim.levels_judged == [1, 2, 4, 8, 16] and claim.bar == 0.9
    assert claim.streams_per_replica < math.exp((0.9 - 0.6) / 0.15) < 8  # the true crossing lies above C
    ctx.result.gates = [GateResult.model_validate(g) for g in recorded["gates"]]  # every gate passed
    decided = Decide().run(ctx)
    assert decided.decision == Decision.PROMOTE, decided.reason
    assert decided.reason.endswith("; for concurrency <= 4 per replica (the sweep shows the TPOT ratio below 0.9 at "
                                   "every level up to 4, not at 8)")
    ctx.result.decision, ctx.result.reason = decided.decision, decided.reason
    doc = decision_document(ctx.result)
    assert doc["promote_up_to"]["streams_per_replica"] == 4
    assert "for concurrency <= 4 per replica" in markdown_report(doc).split("\n## ")[0]
    # a resumed run restores the judgement (the sweep does not run again): its claim is judged again from the levels
    from rollout.run.phases.decide import RestoreJudgement
    from rollout.run.resume import load_resume_point

    point = load_resume_point(store, "r")
    assert point.judgement is not None and point.judgement.reason == decided.reason
    again = RunContext(cfg=cfg, run_id="r", run_dir=tmp_path / "r", store=store,
                       result=RunResult(run_id="r", run_dir=tmp_path / "r", config=cfg), progress=lambda line: None,
                       cache_dir=tmp_path, point=replace(point, attempt=2), namespace="test")
    restored = RestoreJudgement().run(again)
    assert restored.reason == decided.reason and again.result.promote_up_to == claim


def test_calibrate_reports_the_wrong_claim_rate_per_world_whatever_the_workers():
    from rollout.calibration.calibrate import format_table, run_calibration

    one = run_calibration(trials=2, seed=4, workers=1, only="load_curve/*")
    assert one["load_curve"] == run_calibration(trials=2, seed=4, workers=2, only="load_curve/*")["load_curve"]
    assert [row["world"] for row in one["load_curve"]] == [world.name for world in WORLDS]
    assert all(0.0 <= row["wrong_claim_rate"] <= 1.0 and row["trials"] == 2 for row in one["load_curve"])
    table = format_table({**one, "wall_s": 1.0})
    assert 'P(a wrong "up to C" claim' in table and "flat_at_bar" in table
    assert run_calibration(trials=2, seed=4, workers=1, only="no_such_set")["load_curve"] == []
