"""`mtp-canary history`: one line per run of a runs directory: id, model, arms, decision, attempt, when, why."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from rollout.commands.arguments import EXIT_USAGE, local_time, open_store

if TYPE_CHECKING:
    pass


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
    from rollout.run.store import same_question_runs

    stable = store.stable_run_ids()
    for run in store.runs():
        decision = run["decision"] or run["status"]
        if run["run_id"] in stable:
            decision += " (stable)"
        # a comparison asked again spends its alpha again: which attempt at it this run was
        same = [r["run_id"] for r in same_question_runs(store, run["run_id"])]
        tries = f"  attempt {same.index(run['run_id']) + 1}/{len(same)}" if len(same) > 1 else ""
        why = " ".join((run["reason"] or "").split())
        print(f"{run['run_id']}  {run['model']}  [{_arms_of(run['config_json'])}]  {decision}{tries}  "
              f"{local_time(run['created_at'])}  {why}")
    return 0
