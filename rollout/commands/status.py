"""`mtp-canary status RUN_ID [--watch]`: a run's phase, step, canary weight and gates so far, from the store."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

from rollout.commands.arguments import EXIT_USAGE, local_time, open_store, refuse_run_id

if TYPE_CHECKING:
    from rollout.run.status import RunStatus


def run(args: argparse.Namespace) -> int:
    if refuse_run_id(args.run_id, "RUN_ID", "status"):
        return EXIT_USAGE
    store = open_store(args.runs_dir, "status")
    if store is None:
        return EXIT_USAGE
    import dataclasses

    from rollout.run.status import run_status

    # one-shot: a controller on another host that looks gone by the wall clocks is watched for two
    # beats first (--watch confirms a stale one the same way before it exits)
    doc = run_status(store, args.run_id) if args.watch else run_status(store, args.run_id, watch_beats=True)
    if doc is None:
        print(f"mtp-canary status: no run {args.run_id!r} in {args.runs_dir}", file=sys.stderr)
        return EXIT_USAGE
    if not args.watch:
        _print_status(doc, args.json)
        return 0
    # --watch: a line-oriented log (no screen clearing: it goes to CI logs), printed when the
    # status changes, until the run is decided or its controller is gone; exits as `run` does
    last = None
    while True:
        shown = dataclasses.replace(doc, updated_at=0.0)  # the heartbeat moves it
        if shown != last:
            print(f"--- {time.strftime('%H:%M:%S')}", flush=True)
            _print_status(doc, args.json)
            last = shown
        if doc.status != "running" or (doc.controller_alive is False and _confirmed_gone(store, args.run_id)):
            return _watched_exit_code(doc)
        time.sleep(args.interval_s)
        doc = run_status(store, args.run_id)


def _confirmed_gone(store, run_id: str) -> bool:
    """The controller is gone when checked again with its beats watched (another host's stale heartbeat
    may be a clock that disagrees with this one's)."""
    from rollout.run.store import run_controller_alive

    run = store.run(run_id)
    return run is not None and run_controller_alive(run, store) is False


def _watched_exit_code(doc: RunStatus) -> int:
    """What `run` exited with for this run (stored with its decision), or 1 for a controller
    that died before it decided."""
    from rollout.record.result import EXIT_INFRASTRUCTURE

    return doc.exit_code if doc.status != "running" and doc.exit_code is not None else EXIT_INFRASTRUCTURE


def _print_status(doc: RunStatus, as_json: bool) -> None:
    if as_json:
        print(json.dumps(doc.document(), indent=2, default=str), flush=True)
        return
    weight = "-" if doc.canary_weight is None else f"{doc.canary_weight:g}%"
    step = "-" if doc.step is None else str(doc.step)
    state = doc.decision or doc.status
    print(f"run {doc.run_id} ({doc.model}): {state}{' (PAUSED)' if doc.paused else ''}")
    print(f"  phase {doc.phase or '-'}, step {step}, canary weight {weight}")
    if doc.controller_alive is False:
        print(f"  controller {doc.controller} is gone: `mtp-canary resume {doc.run_id}` continues the run")
    if doc.pending_commands:
        print(f"  pending commands: {', '.join(doc.pending_commands)}")
    if doc.reason:
        print(f"  reason: {doc.reason}")
    if doc.latest_gates:
        print("  gates (latest look of each):")
        for gate in doc.latest_gates:
            print(f"    {gate.phase:<17} {gate.name:<26} {gate.verdict:<12} {gate.detail[:100]}")
    if doc.last_event:
        e = doc.last_event
        print(f"  last event: {local_time(e.time)} {e.phase} {e.event} {e.reason or ''}".rstrip())
    sys.stdout.flush()


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    status = sub.add_parser("status", help="a run's phase, step, canary weight and gate verdicts so far")
    status.add_argument("run_id", metavar="RUN_ID")
    status.add_argument("--runs-dir", default="runs")
    status.add_argument("--json", action="store_true", help="one JSON object (decision is null while running)")
    status.add_argument("--watch", action="store_true",
                        help="print the status again whenever it changes until the run ends; exit as `run` did")
    status.add_argument("--interval-s", type=float, default=2.0, help="--watch: seconds between reads (default 2)")
    status.set_defaults(handler=run)
    return status
