"""`mtp-canary` (same as `python -m rollout`): run a canary, answer or watch it, history, tiny model, calibrate.

Exit codes of `run`: 0 promote, 3 rollback, 4 inconclusive, 2 bad config or
usage, 1 infrastructure error, 130 ended by a signal (SIGINT, SIGTERM, SIGHUP:
rollout.run.interrupts). A bad config or run id is one line on stderr and exit 2
before anything starts or is written (no Ray, no runs directory). Every other end
prints the cause in one line and, last, `mtp-canary: exit_code=N decision=X
run_dir=DIR`, which decision.json, the store and the webhook agree with.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.run.run_id import run_id_error

if TYPE_CHECKING:
    from rollout.config import RolloutConfig

EXIT_USAGE = 2
ROUTER_HELP = "serve the router alone (no Ray) in front of servers that already run"
CALIBRATE_HELP = "simulate A/A and A/B trials through the gates; print error rates and power"
JUDGE_HELP = "re-judge runs' request records (records.jsonl or run dirs) with the controller's look logic"

MAKE_MODEL_EPILOG = """\
Measured with the default size (24 layers, hidden 1024) on vLLM 0.32 CPU, 2 cores,
MTP k=3, 16 golden prompts x 48 tokens, server /metrics deltas
(reproduce: python benchmarks/tiny_checkpoint.py --noise 0 2 4 6 8 12 16):
  --draft-noise  acceptance rate  mean acceptance length  per position
       0-4           1.000              4.00              1.00 1.00 1.00
       6             0.938              3.81              0.97 0.95 0.90
       8             0.510              2.53              0.69 0.48 0.36
      12             0.098              1.30              0.23 0.06 0.01
      16             0.029              1.09              0.08 0.01 0.00
More noise -> fewer accepted drafts, monotonically. Single-stream TPOT p50 with
perfect drafts: k=1 26.0 ms, k=3 12.2 ms (2.1x lower); server start 26-29 s.
"""


def _refuse_run_id(run_id: str | None, what: str, command: str) -> bool:
    """True (after one line on stderr) when `run_id` is given and is no run id."""
    error = None if run_id is None else run_id_error(run_id, what)
    if error:
        print(f"mtp-canary{f' {command}' if command else ''}: {error}", file=sys.stderr)
    return error is not None


# Filesystems a runs directory may not be on: SQLite's WAL needs shared memory and locks that a network
# filesystem does not give (the SQLite docs: "WAL does not work over a network filesystem"), and a rename
# there is not atomic (gcsfuse and s3fs copy, then delete): decision.json could be read half written.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "9p", "ceph", "glusterfs", "lustre", "gpfs", "beegfs",
    "fuse.gcsfuse", "fuse.s3fs", "fuse.goofys", "fuse.mountpoint-s3", "fuse.rclone", "fuse.sshfs", "fuse.blobfuse",
    "fuse.blobfuse2", "fuse.glusterfs", "fuse.cephfs", "fuse.juicefs",
})
MOUNTS = "/proc/mounts"


def filesystem_type(path: Path, mounts: str | None = None) -> str | None:
    """The type of the filesystem `path` (or, not yet created, its nearest existing parent) is on, read
    from the mount table (the longest mount point above it); None when the table cannot be read."""
    target = Path(os.path.abspath(path))
    while not target.exists() and target != target.parent:
        target = target.parent
    target = target.resolve()
    try:
        lines = Path(mounts or MOUNTS).read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (target == Path(point) or Path(point) in target.parents) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def runs_dir_error(runs_dir: str, environ=os.environ) -> str | None:
    """Why a run may not write into `runs_dir`, in one line naming --runs-dir, or None.

    Inside a Ray job (RAY_JOB_ID) the working directory is the job's temporary copy of
    --working-dir, removed with the job (a KubeRay RayJob removes the whole cluster): a relative
    runs dir would lose decision.json, the reports and history.db. A URL is refused anywhere, and so
    is a mount of a network filesystem (NFS, SMB, gcsfuse, s3fs: NETWORK_FILESYSTEMS): the history is
    SQLite in WAL mode and the files are replaced by renames, neither of which holds there. Persistent
    storage for a run is a block volume (a PVC of a block storage class, the node's disk); copy the
    run directory to shared storage after the run."""
    if "://" in runs_dir:
        return (f"--runs-dir {runs_dir!r} is a URL: runs are written to a local filesystem (SQLite history); "
                "give a local path (not a mount of the remote store) and copy the run directory out after the run")
    if environ.get("RAY_JOB_ID") and not Path(runs_dir).is_absolute():
        return (f"--runs-dir {runs_dir!r} is relative inside a Ray job (RAY_JOB_ID is set): the job's working "
                "directory is temporary and goes with the job; give an absolute path on persistent storage")
    kind = filesystem_type(Path(runs_dir))
    if kind in NETWORK_FILESYSTEMS:
        return (f"--runs-dir {runs_dir!r} is on a network filesystem ({kind}): SQLite's WAL and atomic renames "
                "need a local one (a block volume, the node's disk); copy the run directory out after the run")
    return None


def _refuse_runs_dir(runs_dir: str, command: str) -> bool:
    error = runs_dir_error(runs_dir)
    if error:
        print(f"mtp-canary {command}: {error}", file=sys.stderr)
    return error is not None


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


def _cmd_run(args: argparse.Namespace) -> int:
    if _refuse_run_id(args.run_id, "--run-id", "") or _refuse_runs_dir(args.runs_dir, "run"):
        return EXIT_USAGE
    from rollout.config import ConfigError

    try:
        config = run_config(args)
    except ConfigError as exc:
        print(f"mtp-canary: bad config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if _refuse_bad_environment("run"):
        return EXIT_USAGE
    return _start_run(config, args)


def _refuse_bad_environment(command: str) -> bool:
    """True (after one line on stderr) when an environment variable the run reads later is malformed:
    MTP_CANARY_CPU_SHARE, which the tiny model's sizing reads once the run has started."""
    from tinymodel.sizing import declared_cpu_share

    try:
        declared_cpu_share()
    except ValueError as exc:
        print(f"mtp-canary {command}: bad environment: {exc}", file=sys.stderr)
        return True
    return False


def _start_run(config: RolloutConfig, args: argparse.Namespace) -> int:
    """The run itself (Ray, the fleet, runs/<id>/): only for a config and run id already checked."""
    from rollout.run.controller import Controller

    runs_dir = Path(args.runs_dir)
    if args.run_id and (runs_dir / args.run_id).exists():
        print(f"mtp-canary: run id {args.run_id!r} already exists in {runs_dir}", file=sys.stderr)
        return EXIT_USAGE
    copies = _pipeline_copies(args)
    if copies is None:
        return EXIT_USAGE
    display = _progress_display()
    controller = Controller(config, runs_dir=runs_dir, run_id=args.run_id, progress=display)
    return _drive(controller, copies, display)


def _progress_display():
    """Bars on a terminal, plain lines in a pipeline's log (rollout.run.progress_display)."""
    from rollout.run.progress_display import progress_for

    return progress_for(sys.stdout)


def _pipeline_copies(args: argparse.Namespace) -> dict[str, Path] | None:
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


def _copy_out(run_dir: Path, copies: dict[str, Path]) -> bool:
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


def _drive(controller, copies: dict[str, Path] | None = None, display=None) -> int:
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
        return _report_end(result, copies)


def _report_end(result, copies: dict[str, Path] | None) -> int:
    """The run's last lines (the last one machine-readable) and its exit code."""
    decision = result.decision.value if result.decision and not result.error else "error"
    from rollout.record.result import EXIT_INFRASTRUCTURE

    if result.error:  # the cause in one line (decision.json, the store and the webhook hold the same text)
        print(f"mtp-canary: error: {(result.error.strip().splitlines() or [''])[0][:500]}", file=sys.stderr, flush=True)
    code = result.exit_code
    if copies and not _copy_out(result.run_dir, copies) and code == 0:
        code = EXIT_INFRASTRUCTURE  # a pipeline that asked for the file must not pass without it
    print(f"mtp-canary: {decision} (exit {code}) -> {result.run_dir / 'decision.json'}", flush=True)
    from rollout.record.log_line import DECISION_IN_LOG_ENV, decision_log_line

    if os.environ.get(DECISION_IN_LOG_ENV):  # set by `mtp-canary submit`: the file travels in the job's log
        print(decision_log_line(result.run_dir), flush=True)
    # machine-readable, the last line of the log: `mtp-canary submit` reads the code from it
    print(f"mtp-canary: exit_code={code} decision={decision} run_dir={result.run_dir}", flush=True)
    return code


def _cmd_resume(args: argparse.Namespace) -> int:
    if _refuse_run_id(args.run_id, "RUN_ID", "resume") or _refuse_runs_dir(args.runs_dir, "resume"):
        return EXIT_USAGE
    found = _find_run(args.runs_dir, args.run_id, "resume")
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
    if config is None or _refuse_bad_environment("resume"):
        return EXIT_USAGE
    # the controller found gone above, compared and set: of two resumes started together one takes the run
    if not store.claim(args.run_id, controller_identity(), run["controller"]):
        now = store.run(args.run_id) or {}
        print(f"mtp-canary resume: run {args.run_id} was taken by {now.get('controller')} "
              f"(now {now.get('status')}) while this resume checked it", file=sys.stderr)
        return EXIT_USAGE
    display = _progress_display()
    return _drive(
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
            return _resumable(parse_config(stored), args.run_id)
        config = load_config(args.config)
    except (ConfigError, ValueError) as exc:
        print(f"mtp-canary resume: the config of {args.run_id} does not validate: {exc}", file=sys.stderr)
        return None
    given = redact_config(config.model_dump(mode="json"))
    if json.dumps(given, sort_keys=True) != json.dumps(stored, sort_keys=True):
        print(f"mtp-canary resume: --config {args.config} is not the config run {args.run_id} started with", file=sys.stderr)
        return None
    return _resumable(config, args.run_id)


def _resumable(config: RolloutConfig, run_id: str) -> RolloutConfig | None:
    if config.candidates:  # which candidate holds the canary's seat is not part of the resume point
        print(f"mtp-canary resume: run {run_id} has candidates, and a run with candidates cannot be resumed: "
              "start it again", file=sys.stderr)
        return None
    return config


def _cmd_make_model(args: argparse.Namespace) -> int:
    from tinymodel.checkpoint import DEFAULT_CACHE, TinyCheckpointSpec, write_checkpoint

    layers, hidden, dtype = args.num_layers, args.hidden_size, args.dtype
    if args.auto_size:
        from rollout.config import TinyModelOptions
        from tinymodel.sizing import size_tiny_model

        try:
            options = TinyModelOptions(num_layers=layers, hidden_size=hidden, dtype=dtype)
        except ValueError as exc:
            print(f"mtp-canary make-model: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if _refuse_bad_environment("make-model"):
            return EXIT_USAGE
        sizing = size_tiny_model(DEFAULT_CACHE, print, options=options)  # explicit flags win over the probe
        layers, hidden, dtype = sizing.num_layers, sizing.hidden_size, sizing.dtype
    try:
        spec = TinyCheckpointSpec.sized(
            layers,
            hidden,
            draft_noise=args.draft_noise,
            draft_decay=args.draft_decay,
            broken=args.broken,
            mtp_layers=args.mtp_layers,
            seed=args.seed,
            **({"torch_dtype": dtype} if dtype else {}),
        )
    except ValueError as exc:
        print(f"mtp-canary make-model: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = write_checkpoint(args.dir, spec)
    print(
        f"wrote tiny MiMo-V2 checkpoint to {out}: {spec.num_layers} layers x hidden {spec.hidden_size}, "
        f"serve with --dtype {spec.torch_dtype} (golden prompts: {out / 'golden.jsonl'})"
    )
    return 0


def _open_store(runs_dir: str, command: str):
    """The runs directory's history, or None (with one line on stderr) when there is none."""
    from rollout.run.store import RunStore

    db = Path(runs_dir) / "history.db"
    if not db.exists():
        print(f"mtp-canary {command}: no runs in {runs_dir} (no history.db)", file=sys.stderr)
        return None
    return RunStore(db)


def _find_run(runs_dir: str, run_id: str, command: str):
    """(store, run row) of a run, or None after one line on stderr saying what is missing."""
    store = _open_store(runs_dir, command)
    if store is None:
        return None
    run = store.run(run_id)
    if run is None:
        print(f"mtp-canary {command}: no run {run_id!r} in {runs_dir}", file=sys.stderr)
        return None
    return store, run


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


def _when(epoch: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch)) if epoch else "-"


def _cmd_history(args: argparse.Namespace) -> int:
    store = _open_store(args.runs_dir, "history")
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
              f"{_when(run['created_at'])}  {why}")
    return 0


def _send_command(args: argparse.Namespace) -> int:
    command = args.command
    if _refuse_run_id(args.run_id, "RUN_ID", command):
        return EXIT_USAGE
    found = _find_run(args.runs_dir, args.run_id, command)
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


def _cmd_status(args: argparse.Namespace) -> int:
    if _refuse_run_id(args.run_id, "RUN_ID", "status"):
        return EXIT_USAGE
    store = _open_store(args.runs_dir, "status")
    if store is None:
        return EXIT_USAGE
    from rollout.run.status import run_status

    doc = run_status(store, args.run_id)
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
        shown = {k: v for k, v in doc.items() if k != "updated_at"}  # the heartbeat moves it
        if shown != last:
            print(f"--- {time.strftime('%H:%M:%S')}", flush=True)
            _print_status(doc, args.json)
            last = shown
        if doc["status"] != "running" or (doc["controller_alive"] is False and _confirmed_gone(store, args.run_id)):
            return _watched_exit_code(doc)
        time.sleep(args.interval_s)
        doc = run_status(store, args.run_id)


def _confirmed_gone(store, run_id: str) -> bool:
    """The controller is gone when checked again with its beats watched (another host's stale heartbeat
    may be a clock that disagrees with this one's)."""
    from rollout.run.store import run_controller_alive

    run = store.run(run_id)
    return run is not None and run_controller_alive(run, store) is False


def _watched_exit_code(doc: dict) -> int:
    """What `run` exited with for this run (stored with its decision), or 1 for a controller
    that died before it decided."""
    from rollout.record.result import EXIT_INFRASTRUCTURE

    return doc["exit_code"] if doc["status"] != "running" and doc["exit_code"] is not None else EXIT_INFRASTRUCTURE


def _print_status(doc: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(doc, indent=2, default=str), flush=True)
        return
    weight = "-" if doc["canary_weight"] is None else f"{doc['canary_weight']:g}%"
    step = "-" if doc["step"] is None else str(doc["step"])
    state = doc["decision"] or doc["status"]
    print(f"run {doc['run_id']} ({doc['model']}): {state}{' (PAUSED)' if doc['paused'] else ''}")
    print(f"  phase {doc['phase'] or '-'}, step {step}, canary weight {weight}")
    if doc["controller_alive"] is False:
        print(f"  controller {doc['controller']} is gone: `mtp-canary resume {doc['run_id']}` continues the run")
    if doc["pending_commands"]:
        print(f"  pending commands: {', '.join(doc['pending_commands'])}")
    if doc["reason"]:
        print(f"  reason: {doc['reason']}")
    if doc["latest_gates"]:
        print("  gates (latest look of each):")
        for gate in doc["latest_gates"]:
            print(f"    {gate['phase']:<17} {gate['name']:<26} {gate['verdict']:<12} {gate['detail'][:100]}")
    if doc["last_event"]:
        e = doc["last_event"]
        print(f"  last event: {_when(e['time'])} {e['phase']} {e['event']} {e['reason'] or ''}".rstrip())
    sys.stdout.flush()


def _add_status_parser(sub: argparse._SubParsersAction) -> None:
    status = sub.add_parser("status", help="a run's phase, step, canary weight and gate verdicts so far")
    status.add_argument("run_id", metavar="RUN_ID")
    status.add_argument("--runs-dir", default="runs")
    status.add_argument("--json", action="store_true", help="one JSON object (decision is null while running)")
    status.add_argument("--watch", action="store_true",
                        help="print the status again whenever it changes until the run ends; exit as `run` did")
    status.add_argument("--interval-s", type=float, default=2.0, help="--watch: seconds between reads (default 2)")
    status.set_defaults(func=_cmd_status)


def _add_resume_parser(sub: argparse._SubParsersAction) -> None:
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
    resume.set_defaults(func=_cmd_resume)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtp-canary", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a canary: fleet, accuracy, load experiment, decision")
    run.add_argument("config", help="YAML run config (see configs/)")
    run.add_argument("--runs-dir", default="runs", help="where runs/<id>/ and history.db go (default: runs)")
    run.add_argument("--run-id", default=None, help="run id (default: timestamp-name-random)")
    run.add_argument(
        "--ray-address", default=None,
        help="override ray.address: 'auto' (the cluster this runs in, else a local one), 'local' (always a new "
        "local instance) or HOST:PORT",
    )
    run.add_argument("--window-s", type=int, default=None, help="override experiment.window_s (seconds between looks)")
    run.add_argument("--requests-per-arm", type=int, default=None, help="override experiment.requests_per_arm")
    run.add_argument("--max-duration-s", type=float, default=None, help="override experiment.max_duration_s")
    run.add_argument("--eval-limit", type=int, default=None, help="override accuracy.limit")
    run.add_argument("--web-ui", action="store_true",
                     help="serve Locust's web UI with the Rollout console tab (experiment.web_ui) until the rollout ends")
    run.add_argument("--web-port", type=int, default=None, metavar="P", help="override experiment.web_port (default 8089)")
    run.add_argument("--web-host", default=None, metavar="HOST",
                     help="override experiment.web_host, the interface the web UI binds (default 127.0.0.1)")
    run.add_argument("--junit", default=None, metavar="FILE", help="also write the run's junit.xml to FILE (for CI)")
    run.add_argument("--decision-out", default=None, metavar="FILE", help="also write the run's decision.json to FILE")
    run.set_defaults(func=_cmd_run)

    _add_resume_parser(sub)

    # parsed by rollout.commands.router (see main): listed here for --help
    sub.add_parser("router", help=ROUTER_HELP, add_help=False)

    make = sub.add_parser(
        "make-model",
        help="write the tiny MiMo-V2 checkpoint (config, tokenizer, constructed weights, golden.jsonl)",
        epilog=MAKE_MODEL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    make.add_argument("dir")
    make.add_argument("--draft-noise", type=float, default=0.0, help="noise on the MTP layer: 0 = drafts always accepted")
    make.add_argument("--draft-decay", type=float, default=0.0, help="share of drafts after the first that are wrong")
    make.add_argument("--broken", action="store_true", help="greedy outputs differ from the golden continuations")
    make.add_argument("--mtp-layers", type=int, default=1, help="MTP layers in the checkpoint (vLLM 0.32 loads only layer 0)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--num-layers", type=int, default=None, help="decoder layers (default 24, or --auto-size)")
    make.add_argument("--hidden-size", type=int, default=None, help="width, a multiple of 256 (default 1024, or --auto-size)")
    make.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default=None,
        help="config.json torch_dtype, what --dtype auto serves (default bfloat16, or --auto-size: float32 without native bf16)",
    )
    make.add_argument(
        "--auto-size", action="store_true",
        help="size depth (width) and dtype for this machine by a short cached probe: k=1 TPOT ~25 ms at 1 thread; "
        "explicit --num-layers/--hidden-size/--dtype win",
    )
    make.set_defaults(func=_cmd_make_model)

    # parsed by their own modules (see main): listed here for --help
    sub.add_parser("calibrate", help=CALIBRATE_HELP, add_help=False)
    sub.add_parser("judge", help=JUDGE_HELP, add_help=False)
    sub.add_parser("plan", help="before reserving GPUs: placement, node environments, timeouts, GPU-hours", add_help=False)
    sub.add_parser("report", help="write a run's report.md and report.html again from its decision.json", add_help=False)
    sub.add_parser("compare", help="two finished runs side by side: decision, gates, latency, acceptance", add_help=False)
    sub.add_parser("submit", help="run a canary as a Ray Job; follow its log; exit with the run's own code", add_help=False)
    sub.add_parser("config-schema", help="the run config's JSON Schema (--markdown: the reference table)", add_help=False)

    hist = sub.add_parser("history", help="one line per run: id, model, arms, decision, when, why")
    hist.add_argument("--runs-dir", default="runs")
    hist.set_defaults(func=_cmd_history)

    _add_status_parser(sub)

    for name, text in (
        ("promote", "answer a paused progressive rollout: continue to the next step"),
        ("abort", "roll a running rollout back now (canary weight 0, decision rollback)"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("run_id", metavar="RUN_ID")
        cmd.add_argument("--runs-dir", default="runs")
        cmd.set_defaults(func=_send_command)
    return parser


# commands whose module parses its own arguments (and imports what it needs only when called)
DELEGATED = {
    "judge": "rollout.commands.judge",
    "plan": "rollout.commands.plan",
    "report": "rollout.record.markdown",
    "compare": "rollout.commands.compare",
    "submit": "rollout.commands.submit",
    "config-schema": "rollout.commands.config_schema",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["router"]:
        # its own parser (and cluster.router's imports) only for this command: the others start fast
        from rollout.commands import router as router_command

        return router_command.main(argv[1:])
    if argv[:1] == ["calibrate"]:
        from rollout.config import load_config
        from rollout.calibration import calibrate

        # the house loader: --config is validated as `run` validates it (one line naming the field)
        return calibrate.main(argv[1:], load_run_config=lambda path: load_config(path).model_dump(mode="json"))
    if argv[:1] and argv[0] in DELEGATED:
        return importlib.import_module(DELEGATED[argv[0]]).main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
