"""`mtp-canary history`: one line per run of a runs directory: id, model, arms, decision, attempt, when, why."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, NamedTuple

from rollout.commands.arguments import EXIT_USAGE, local_time, open_store

if TYPE_CHECKING:
    from rollout.run.store import RunStore


class HistoryRow(NamedTuple):
    """One run of a runs directory, as `history` prints it."""

    run_id: str
    model: str
    arms: str  # "baseline k=1 x1, canary k=3 x1" (rollout.commands.history._arms_of)
    decision: str  # the run's decision, else its status (running, failed, ...)
    stable: bool  # the model's stable run (promoted and marked)
    attempt: int  # which run of the same comparison this was (1-based), of `attempts`
    attempts: int
    created_at: float | None
    reason: str  # on one line

    def line(self) -> str:
        stable = " (stable)" if self.stable else ""
        # a comparison asked again spends its alpha again: which attempt at it this run was
        tries = f"  attempt {self.attempt}/{self.attempts}" if self.attempts > 1 else ""
        return (f"{self.run_id}  {self.model}  [{self.arms}]  {self.decision}{stable}{tries}  "
                f"{local_time(self.created_at)}  {self.reason}")


def history_rows(store: "RunStore") -> list[HistoryRow]:
    """Every run of the store, oldest first, typed."""
    from rollout.run.store import same_question_runs

    stable = store.stable_run_ids()
    rows = []
    for run in store.runs():
        same = [r["run_id"] for r in same_question_runs(store, run["run_id"])]
        rows.append(HistoryRow(
            run_id=run["run_id"], model=run["model"], arms=_arms_of(run["config_json"]),
            decision=run["decision"] or run["status"], stable=run["run_id"] in stable,
            attempt=same.index(run["run_id"]) + 1 if run["run_id"] in same else 1, attempts=max(len(same), 1),
            created_at=run["created_at"], reason=" ".join((run["reason"] or "").split())))
    return rows


def _arms_of(config_json: str | None) -> str:
    """'baseline k=1 x1, canary k=3 x1' from a stored run config (k: speculative tokens, 0 = none)."""
    try:
        config = json.loads(config_json or "{}")
    except ValueError:
        return "?"
    parts = []
    arms = [("baseline", config.get("baseline"))] + (
        [(c.get("name", "?"), c) for c in config["candidates"] if isinstance(c, dict)]
        if isinstance(config.get("candidates"), list) and config["candidates"] else [("canary", config.get("canary"))])
    for arm, spec in arms:
        spec = spec if isinstance(spec, dict) else {}
        engine = spec.get("engine") or {}
        k = (engine.get("speculative_config") or {}).get("num_speculative_tokens", 0) or 0
        parts.append(f"{arm} k={k} x{spec.get('replicas', 1)}")
    if config.get("twin_baseline"):
        parts.append("twin")
    return ", ".join(parts)


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    hist = sub.add_parser("history", help="one line per run: id, model, arms, decision, when, why")
    hist.add_argument("--runs-dir", default="runs")
    hist.set_defaults(handler=run)
    return hist


def run(args: argparse.Namespace) -> int:
    store = open_store(args.runs_dir, "history")
    if store is None:
        return EXIT_USAGE
    for row in history_rows(store):
        print(row.line())
    return 0
