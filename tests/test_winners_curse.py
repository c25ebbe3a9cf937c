"""The winner's curse of several candidates (rollout.judge.selection): the winner's ratio is the lowest of K
estimates, and the run and its report say how far that selection may have flattered it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from rollout.judge.names import OBJECTIVE_NAME
from rollout.judge.selection import expected_max_standard_normal, winners_curse_note
from rollout.judge.verdicts import Decision, GateResult, Verdict
from tests.test_candidates import candidates_config, candidates_document


def test_the_lowest_of_k_equal_estimates_sits_below_the_truth_by_the_expected_maximum():
    rng = np.random.default_rng(1)
    se, draws = 0.05, 20_000
    for k in (2, 3, 4):
        lowest = rng.normal(0.0, se, (draws, k)).min(axis=1)
        # 3 standard errors of the mean of `draws` minima (their sd is below se)
        assert -lowest.mean() == pytest.approx(expected_max_standard_normal(k) * se, abs=3 * se / math.sqrt(draws))
    assert expected_max_standard_normal(1) == 0.0


def test_the_note_reads_the_se_off_the_winners_interval():
    note = winners_curse_note("k3", 0.70, (0.62, 0.76), 3, 0.05 / 3)
    se = math.log(0.76 / 0.70) / 2.128  # the one-sided normal quantile at alpha 0.0167
    assert "lowest of 3 estimates" in note and f"~{0.70 * math.exp(0.8463 * se):.3f}" in note
    assert winners_curse_note("k3", 0.70, None, 3, 0.0167).endswith("measures it without selection")
    assert winners_curse_note("k3", 0.70, (0.62, 0.76), 1, 0.05) is None


def gates(ratio: float, interval: tuple[float, float]) -> list[GateResult]:
    return [GateResult(name=OBJECTIVE_NAME, metric="tpot_p50_ratio", baseline=None, canary=None, threshold=0.9,
                       verdict=Verdict.PASS, estimate=ratio, interval=interval)]


def test_the_run_says_it_and_the_report_prints_it(monkeypatch, tmp_path):
    from rollout.run.phases import candidate_choice as phase
    from rollout.record.markdown import markdown_report
    from rollout.record.html import html_report
    from rollout.record.result import RunResult, decision_document

    cfg = candidates_config()
    cfg = cfg.model_copy(update={"gates": cfg.gates.model_copy(update={"enabled": [OBJECTIVE_NAME]})})
    lines: list[str] = []
    ctx = SimpleNamespace(
        cfg=cfg, result=RunResult(run_id="c", run_dir=tmp_path, config=cfg), say=lines.append,
        event=lambda *a: None, experiment_capped=None, standing=None,
        engines={c.name: SimpleNamespace(num_speculative_tokens=c.engine.num_speculative_tokens,
                                           speculation=c.engine.speculation) for c in cfg.candidates},
        candidate_gates={c.name: gates(0.70 + 0.05 * i, (0.62 + 0.05 * i, 0.76 + 0.05 * i))
                         for i, c in enumerate(reversed(cfg.candidates))},
    )
    monkeypatch.setattr(phase, "take_the_seat", lambda ctx, winner: None)
    decided = phase.choose_now(ctx)
    winner = ctx.result.winner
    assert winner is not None and decided is None and ctx.result.decision is None
    assert any(line.startswith(f"candidates: winner's curse: {winner}'s TPOT p50 ratio 0.700") for line in lines)
    doc = decision_document(ctx.result)
    assert doc["winner_note"] == ctx.result.winner_note
    again = RunResult.from_document(doc, cfg, tmp_path)
    assert again.winner_note == ctx.result.winner_note

    report = candidates_document("k3")
    report["winner_note"] = ctx.result.winner_note
    assert "winner's curse" in markdown_report(report)
    assert "winner&#x27;s curse" in html_report(report, tmp_path) or "winner's curse" in html_report(report, tmp_path)
    assert "winner_note" not in candidates_document("k3")  # a run without the note has no key
