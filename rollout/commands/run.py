"""`mtp-canary run CONFIG`: a canary from start to decision, and the lines and exit code a pipeline reads.

Exit codes: 0 promote, 3 rollback, 4 inconclusive, 2 bad config or usage, 1 infrastructure
error, 130 ended by a signal (SIGINT, SIGTERM, SIGHUP: rollout.run.interrupts). A bad config or
run id is one line on stderr and exit 2 before anything starts or is written (no Ray, no runs
directory). Every other end prints the cause in one line and, last, `mtp-canary: exit_code=N
decision=X run_dir=DIR`, which decision.json, the store and the webhook agree with.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.commands.arguments import EXIT_USAGE, refuse_bad_environment, refuse_run_id, refuse_runs_dir

if TYPE_CHECKING:
    from rollout.config import RolloutConfig


def run_config(args: argparse.Namespace) -> RolloutConfig:
    """The config `run` would start: the file validated, then the command line's overrides
    validated with it. Raises rollout.config.ConfigError (one line); starts and writes nothing."""
    from rollout.config import load_config, parse_config

    config = load_config(args.config)
    overrides = {
        "window_s": args.window_s,
        "requests_per_arm": args.requests_per_arm,
        "max_duration_s": args.max_duration_s,
        "web_ui": True if args.web_ui else None,
        "web_host": args.web_host,
        "web_port": args.web_port,
    }
    updates = {key: value for key, value in overrides.items() if value is not None}
    if updates or args.ray_address:
        data = config.model_dump(mode="json")
        data["experiment"].update(updates)
        if args.ray_address:
            data["ray"]["address"] = args.ray_address
        if "requests_per_arm" in updates:
            exp = data["experiment"]
            exp["requests_per_look"] = min(exp["requests_per_look"], exp["requests_per_arm"])
            exp["min_looks"] = min(exp["min_looks"], -(-exp["requests_per_arm"] // exp["requests_per_look"]))
        config = parse_config(data, source=str(args.config))
    if args.eval_limit is not None:
        config = config.model_copy(update={"accuracy": config.accuracy.model_copy(update={"limit": args.eval_limit})})
    return config


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`run`'s arguments (the config file and its overrides)."""
    parser = sub.add_parser("run", help="run a canary: fleet, accuracy, load experiment, decision")
    parser.add_argument("config", help="YAML run config (see configs/)")
    parser.add_argument("--runs-dir", default="runs", help="where runs/<id>/ and history.db go (default: runs)")
    parser.add_argument("--run-id", default=None, help="run id (default: timestamp-name-random)")
    parser.add_argument(
        "--ray-address", default=None,
        help="override ray.address: 'auto' (the cluster this runs in, else a local one), 'local' (always a new "
        "local instance) or HOST:PORT",
    )
    parser.add_argument("--window-s", type=int, default=None, help="override experiment.window_s (seconds between looks)")
    parser.add_argument("--requests-per-arm", type=int, default=None, help="override experiment.requests_per_arm")
    parser.add_argument("--max-duration-s", type=float, default=None, help="override experiment.max_duration_s")
    parser.add_argument("--eval-limit", type=int, default=None, help="override accuracy.limit")
    parser.add_argument("--web-ui", action="store_true",
                     help="serve Locust's web UI with the Rollout console tab (experiment.web_ui) until the rollout ends")
    parser.add_argument("--web-port", type=int, default=None, metavar="P", help="override experiment.web_port (default 8089)")
    parser.add_argument("--web-host", default=None, metavar="HOST",
                     help="override experiment.web_host, the interface the web UI binds (default 127.0.0.1)")
    parser.add_argument("--junit", default=None, metavar="FILE", help="also write the run's junit.xml to FILE (for CI)")
    parser.add_argument("--decision-out", default=None, metavar="FILE", help="also write the run's decision.json to FILE")
    parser.set_defaults(handler=run)

    return parser


def run(args: argparse.Namespace) -> int:
    """The run: a checked config, a controller driven to its end, its exit code."""
    if refuse_run_id(args.run_id, "--run-id", "") or refuse_runs_dir(args.runs_dir, "run"):
        return EXIT_USAGE
    from rollout.config import ConfigError

    try:
        config = run_config(args)
    except ConfigError as exc:
        print(f"mtp-canary: bad config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if refuse_bad_environment("run") or refuse_unstaged(config):
        return EXIT_USAGE
    return start_run(config, args)


def refuse_unstaged(config: RolloutConfig) -> bool:
    """True (after one line on stderr naming model_cache) when a GPU arm serves a hub id without
    model_cache, as `plan` refuses it: every server would download the weights itself inside its
    own startup clock. Before anything starts; the node-side check (the cache usable on every GPU
    node) runs in the setup, once Ray is there (rollout.run.node_check.model_cache_failures)."""
    from rollout.run.cluster_plan import staging_failures

    for line in staging_failures(config):
        print(f"mtp-canary run: {line}", file=sys.stderr)
        return True
    return False


def start_run(config: RolloutConfig, args: argparse.Namespace) -> int:
    """The run itself (Ray, the fleet, runs/<id>/): only for a config and run id already checked."""
    from rollout.run.controller import Controller

    runs_dir = Path(args.runs_dir)
    if args.run_id and (runs_dir / args.run_id).exists():
        print(f"mtp-canary: run id {args.run_id!r} already exists in {runs_dir}", file=sys.stderr)
        return EXIT_USAGE
    copies = pipeline_copies(args)
    if copies is None:
        return EXIT_USAGE
    display = progress_display()
    controller = Controller(config, runs_dir=runs_dir, run_id=args.run_id, progress=display)
    return drive(controller, copies, display)


def progress_display():
    """Bars on a terminal, plain lines in a pipeline's log (rollout.run.progress_display)."""
    from rollout.run.progress_display import progress_for

    return progress_for(sys.stdout)


def pipeline_copies(args: argparse.Namespace) -> dict[str, Path] | None:
    """Run-directory file -> the path a pipeline asked for it at (--junit, --decision-out), or
    None after a one-line error: a directory that does not exist is refused before anything starts."""
    copies = {name: Path(path) for name, path in (("junit.xml", args.junit), ("decision.json", args.decision_out)) if path}
    for name, path in copies.items():
        if path.is_dir() or not path.parent.is_dir():
            flag = "--junit" if name == "junit.xml" else "--decision-out"
            why = "is a directory" if path.is_dir() else f"is in {str(path.parent)!r}, which is not a directory"
            print(f"mtp-canary: {flag} {str(path)!r} {why}", file=sys.stderr)
            return None
    return copies


def copy_out(run_dir: Path, copies: dict[str, Path]) -> bool:
    """Copy the run's pipeline files where they were asked for, each whole or not at all (a pipeline
    polling for it never reads half); False (with a line each) if one is missing."""
    from rollout.record.atomic_file import copy_atomically

    ok = True
    for name, path in copies.items():
        try:
            copy_atomically(run_dir / name, path)
        except (OSError, UnicodeDecodeError) as exc:
            print(f"mtp-canary: could not copy {name} to {str(path)!r}: {exc.strerror or exc}", file=sys.stderr)
            ok = False
    return ok


def drive(controller, copies: dict[str, Path] | None = None, display=None) -> int:
    """Run a controller to its end, copy its pipeline files where asked (`copies`); its exit
    code (130 when a signal ended it; 1 when a decided run's file could not be copied)."""
    from rollout.run.interrupts import INTERRUPTS

    # SIGTERM (`ray job stop`, a CI cancel, a pod deletion) and SIGHUP take Ctrl-C's path: the
    # traffic back to the stable config, teardown, the error recorded; installed again after ray.init
    INTERRUPTS.install()
    try:
        result = controller.run()
    except KeyboardInterrupt as exc:  # before the run's own handling began (its row being opened)
        result = controller.result
        result.interrupted = getattr(exc, "signal_name", "SIGINT")
        result.error = result.error or f"interrupted by {result.interrupted}"
    finally:
        if display is not None:
            display.close()  # the bars stop before the last lines: a pipeline reads the last one
    with INTERRUPTS.shielded():
        return report_end(result, copies)


def report_end(result, copies: dict[str, Path] | None) -> int:
    """The run's last lines (the last one machine-readable) and its exit code."""
    decision = result.decision.value if result.decision and not result.error else "error"
    from rollout.record.result import EXIT_INFRASTRUCTURE

    if result.error:  # the cause in one line (decision.json, the store and the webhook hold the same text)
        print(f"mtp-canary: error: {(result.error.strip().splitlines() or [''])[0][:500]}", file=sys.stderr, flush=True)
    code = result.exit_code
    if copies and not copy_out(result.run_dir, copies) and code == 0:
        code = EXIT_INFRASTRUCTURE  # a pipeline that asked for the file must not pass without it
    print(f"mtp-canary: {decision} (exit {code}) -> {result.run_dir / 'decision.json'}", flush=True)
    from rollout.record.log_line import DECISION_IN_LOG_ENV, decision_log_line

    if os.environ.get(DECISION_IN_LOG_ENV):  # set by `mtp-canary submit`: the file travels in the job's log
        print(decision_log_line(result.run_dir), flush=True)
    # machine-readable, the last line of the log: `mtp-canary submit` reads the code from it
    print(f"mtp-canary: exit_code={code} decision={decision} run_dir={result.run_dir}", flush=True)
    return code
