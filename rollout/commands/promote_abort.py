"""`mtp-canary promote|abort RUN_ID`: answer a paused progressive rollout, or roll a running one back now.

Both are commands queued in the run's store for its controller; a finished run refuses them.
"""

from __future__ import annotations

import argparse
import sys

from rollout.commands.arguments import EXIT_USAGE, find_run, refuse_run_id


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`promote` and `abort` (the same arguments); the last one registered."""
    for name, text in (
        ("promote", "answer a paused progressive rollout: continue to the next step"),
        ("abort", "roll a running rollout back now (canary weight 0, decision rollback)"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("run_id", metavar="RUN_ID")
        cmd.add_argument("--runs-dir", default="runs")
        cmd.set_defaults(handler=run)
    return cmd


def run(args: argparse.Namespace) -> int:
    command = args.command
    if refuse_run_id(args.run_id, "RUN_ID", command):
        return EXIT_USAGE
    found = find_run(args.runs_dir, args.run_id, command)
    if found is None:
        return EXIT_USAGE
    store, run = found
    if run["status"] != "running":
        outcome = run["decision"] or run["status"]
        print(f"mtp-canary {command}: run {args.run_id} already finished ({outcome})", file=sys.stderr)
        return EXIT_USAGE
    from rollout.run.store import CommandRefused

    try:
        store.add_command(args.run_id, command)
    except CommandRefused as exc:
        print(f"mtp-canary {command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    when = "answers its pause" if command == "promote" else "rolls it back at its next guard check"
    print(f"mtp-canary {command}: sent to run {args.run_id} ({when})")
    return 0
