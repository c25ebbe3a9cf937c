"""Attempts at one question: a comparison retried after INCONCLUSIVE spends its alpha again, and the run
says so before it starts (rollout.run.store.same_question_runs, rollout.run.phases.setup.attempts_note)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import yaml

from rollout.config import parse_config
from rollout.record.result import RunResult, decision_document
from rollout.run.store import RunStore, same_question_runs

REPO = Path(__file__).resolve().parents[1]


def config(**changes):
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    for section, values in changes.items():
        data[section] = {**data[section], **values}
    return parse_config(data)


def add_run(store: RunStore, run_id: str, cfg, decision: str | None) -> None:
    store.create_run(run_id, cfg.name, "tiny", cfg.model_dump(mode="json"))
    if decision is not None:
        store.finish_run(run_id, status="done", decision=decision, exit_code={"inconclusive": 4, "rollback": 3}[decision],
                         reason=f"{decision} because", stable=None)


def test_attempts_at_one_comparison_are_counted_whatever_the_plan_or_gates(tmp_path):
    store = RunStore(tmp_path / "history.db")
    cfg = config()
    add_run(store, "a1", cfg, "inconclusive")
    add_run(store, "a2", config(gates={"alpha": 0.1}, experiment={"requests_per_arm": 800}), "inconclusive")
    add_run(store, "other", config(canary={"engine": {**cfg.canary.engine.model_dump(mode="json"),
                                                       "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}}),
            "rollback")
    add_run(store, "a3", cfg, None)
    rows = same_question_runs(store, "a3")
    assert [r["run_id"] for r in rows] == ["a1", "a2", "a3"]
    assert len({r["comparison"] for r in rows}) == 1 and [r["alpha"] for r in rows] == [0.05, 0.1, 0.05]
    assert [r["run_id"] for r in same_question_runs(store, "other")] == ["other"]
    assert same_question_runs(store, "missing") == []


def test_a_run_says_its_comparison_was_judged_inconclusive_and_the_alpha_spent_together(tmp_path):
    from rollout.run.phases.setup import attempts_note

    store = RunStore(tmp_path / "history.db")
    cfg = config()
    add_run(store, "a1", cfg, "inconclusive")
    add_run(store, "a2", cfg, "inconclusive")
    add_run(store, "a3", cfg, None)
    lines: list[str] = []
    ctx = SimpleNamespace(cfg=cfg, store=store, run_id="a3", say=lines.append,
                          result=RunResult(run_id="a3", run_dir=tmp_path, config=cfg))
    attempts_note(ctx)
    text = "\n".join(lines)
    assert "attempt 3 at this comparison" in text and "judged INCONCLUSIVE before: a1, a2" in text
    assert "0.15" in text  # three attempts at alpha 0.05: a false promote in any of them is bounded by 0.15
    doc = decision_document(ctx.result)
    assert doc["attempts"]["number"] == 3 and doc["attempts"]["alpha_spent_together"] == 0.15
    assert doc["attempts"]["inconclusive_before"] == ["a1", "a2"]


def test_a_first_attempt_says_nothing(tmp_path):
    from rollout.run.phases.setup import attempts_note

    store = RunStore(tmp_path / "history.db")
    cfg = config()
    add_run(store, "a1", cfg, None)
    lines: list[str] = []
    ctx = SimpleNamespace(cfg=cfg, store=store, run_id="a1", say=lines.append,
                          result=RunResult(run_id="a1", run_dir=tmp_path, config=cfg))
    attempts_note(ctx)
    assert lines == [] and "attempts" not in decision_document(ctx.result)


def test_history_says_which_attempt_at_a_comparison_each_run_was(tmp_path, capsys):
    from rollout.commands.cli import main

    store = RunStore(tmp_path / "history.db")
    cfg = config()
    add_run(store, "a1", cfg, "inconclusive")
    add_run(store, "a2", cfg, "rollback")
    add_run(store, "other", config(canary={"engine": {**cfg.canary.engine.model_dump(mode="json"),
                                                       "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}}),
            "rollback")
    store.close()
    assert main(["history", "--runs-dir", str(tmp_path)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "attempt 1/2" in lines["a1"] and "attempt 2/2" in lines["a2"] and "attempt" not in lines["other"]
