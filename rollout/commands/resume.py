"""`mtp-canary resume RUN_ID`: continue a run whose controller died, from what its store holds."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.commands.arguments import EXIT_USAGE, find_run, refuse_bad_environment, refuse_run_id, refuse_runs_dir

if TYPE_CHECKING:
    from rollout.config import RolloutConfig


def run(args: argparse.Namespace) -> int:
    if refuse_run_id(args.run_id, "RUN_ID", "resume") or refuse_runs_dir(args.runs_dir, "resume"):
        return EXIT_USAGE
    found = find_run(args.runs_dir, args.run_id, "resume")
    if found is None:
        return EXIT_USAGE
    store, run = found
    if run["status"] == "done":
        print(f"mtp-canary resume: run {args.run_id} already decided ({run['decision']})", file=sys.stderr)
        return EXIT_USAGE
    if run["status"] != "running":  # ended in error: torn down, its decision.json written; never reopened
        why = " ".join((run["reason"] or "").split())[:200]
        print(f"mtp-canary resume: run {args.run_id} already ended in {run['status']} ({why}): start it again",
              file=sys.stderr)
        return EXIT_USAGE
    from rollout.run.controller import Controller
    from rollout.run.store import controller_identity, run_controller_alive

    alive = run_controller_alive(run, store)  # another host's clock is not trusted: its beats are watched
    if alive or (alive is None and run.get("controller") and not args.force):
        # None: on another host without a fresh heartbeat; two controllers on one fleet tear it down
        how = "alive" if alive else "on another host, cannot tell if it is alive; --force if it is gone"
        print(f"mtp-canary resume: run {args.run_id} is still controlled by {run['controller']} ({how})", file=sys.stderr)
        return EXIT_USAGE
    config = _resume_config(args, run)
    if config is None or refuse_bad_environment("resume"):
        return EXIT_USAGE
    # the controller found gone above, compared and set: of two resumes started together one takes the run
    if not store.claim(args.run_id, controller_identity(), run["controller"]):
        now = store.run(args.run_id) or {}
        print(f"mtp-canary resume: run {args.run_id} was taken by {now.get('controller')} "
              f"(now {now.get('status')}) while this resume checked it", file=sys.stderr)
        return EXIT_USAGE
    from rollout.commands.run import drive, progress_display

    display = progress_display()
    return drive(
        Controller(config, runs_dir=Path(args.runs_dir), run_id=args.run_id, progress=display, resume=True, claimed=True),
        display=display,
    )


def _resume_config(args: argparse.Namespace, run: dict) -> RolloutConfig | None:
    """The run's config: the stored one, or (its secrets are not stored) the file given again,
    which must be the same config; None after one line on stderr."""
    from rollout.config import ConfigError, load_config, parse_config
    from rollout.record.redact import REDACTED, redact_config

    stored = json.loads(run["config_json"])
    try:
        if args.config is None:
            if REDACTED in run["config_json"]:
                print(f"mtp-canary resume: run {args.run_id}'s config has secrets, which are never stored: "
                      "give its config file again with --config FILE", file=sys.stderr)
                return None
            return resumable(parse_config(stored), args.run_id)
        config = load_config(args.config)
    except (ConfigError, ValueError) as exc:
        print(f"mtp-canary resume: the config of {args.run_id} does not validate: {exc}", file=sys.stderr)
        return None
    given = redact_config(config.model_dump(mode="json"))
    if json.dumps(given, sort_keys=True) != json.dumps(stored, sort_keys=True):
        print(f"mtp-canary resume: --config {args.config} is not the config run {args.run_id} started with", file=sys.stderr)
        return None
    return resumable(config, args.run_id)


def resumable(config: RolloutConfig, run_id: str) -> RolloutConfig | None:
    if config.candidates:  # which candidate holds the canary's seat is not part of the resume point
        print(f"mtp-canary resume: run {run_id} has candidates, and a run with candidates cannot be resumed: "
              "start it again", file=sys.stderr)
        return None
    return config


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    resume = sub.add_parser(
        "resume",
        help="continue a run whose controller died: reattach to its actors (or restart them) and reach a decision",
    )
    resume.add_argument("run_id", metavar="RUN_ID")
    resume.add_argument("--runs-dir", default="runs")
    resume.add_argument("--config", default=None, metavar="FILE",
                        help="the run's config file again (needed when it has secrets: they are never stored)")
    resume.add_argument("--force", action="store_true",
                        help="take over from a controller on another host that no heartbeat shows alive or dead")
    resume.set_defaults(handler=run)
    return resume
