"""`mtp-canary` (same as `python -m rollout`): run a canary, write the tiny model, calibrate, history.

Exit codes of `run`: 0 promote, 3 rollback, 4 inconclusive, 2 bad config or
usage, 1 infrastructure error.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

EXIT_USAGE = 2

MAKE_MODEL_EPILOG = """\
Measured draft acceptance (k=3, default size, vLLM 0.32 CPU, golden prompts;
reproduce with `python benchmarks/tiny_checkpoint.py --noise-curve`):
  --draft-noise   acceptance rate   mean acceptance length
  see README.md "The tiny MiMo-V2 checkpoint" for the table of this build.
More noise -> fewer accepted drafts, monotonically.
"""


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _cmd_run(args: argparse.Namespace) -> int:
    from rollout.config import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"mtp-canary: bad config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.window_s is not None or args.max_windows is not None:
        updates = {}
        if args.window_s is not None:
            updates["window_s"] = args.window_s
        if args.max_windows is not None:
            updates["max_windows"] = args.max_windows
            updates["min_windows"] = min(config.experiment.min_windows, args.max_windows)
        config = config.model_copy(update={"experiment": config.experiment.model_copy(update=updates)})
    if args.eval_limit is not None:
        config = config.model_copy(update={"accuracy": config.accuracy.model_copy(update={"limit": args.eval_limit})})

    from rollout.controller import Controller

    runs_dir = Path(args.runs_dir)
    if args.run_id and (runs_dir / args.run_id).exists():
        print(f"mtp-canary: run id {args.run_id!r} already exists in {runs_dir}", file=sys.stderr)
        return EXIT_USAGE
    # SIGTERM (e.g. `ray job stop`) takes the same path as Ctrl-C: tear down, then exit.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    controller = Controller(config, runs_dir=runs_dir, run_id=args.run_id, progress=lambda m: print(m, flush=True))
    try:
        result = controller.run()
    except KeyboardInterrupt:
        print("mtp-canary: interrupted; replicas, router and Locust stopped", file=sys.stderr)
        return 130
    decision = result.decision.value if result.decision and not result.error else "error"
    print(f"mtp-canary: {decision} (exit {result.exit_code}) -> {result.run_dir / 'decision.json'}", flush=True)
    return result.exit_code


def _cmd_make_model(args: argparse.Namespace) -> int:
    from rollout.tiny_checkpoint import TinyCheckpointSpec, write_checkpoint

    try:
        spec = TinyCheckpointSpec(
            draft_noise=args.draft_noise,
            broken=args.broken,
            mtp_layers=args.mtp_layers,
            seed=args.seed,
            **({"num_layers": args.num_layers} if args.num_layers else {}),
        )
    except ValueError as exc:
        print(f"mtp-canary make-model: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = write_checkpoint(args.dir, spec)
    print(f"wrote tiny MiMo-V2 checkpoint to {out} (golden prompts: {out / 'golden.jsonl'})")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from rollout.calibrate import format_table, run_calibration

    result = run_calibration(trials=args.trials, seed=args.seed)
    print(json.dumps(result, indent=2, default=float) if args.json else format_table(result))
    return 0


def _cmd_history(args: argparse.Namespace) -> int:
    from rollout.store import RunStore

    db = Path(args.runs_dir) / "history.db"
    if not db.exists():
        print(f"mtp-canary history: no runs in {args.runs_dir}", file=sys.stderr)
        return EXIT_USAGE
    store = RunStore(db)
    for run in store.runs():
        import time as _time

        when = _time.strftime("%Y-%m-%d %H:%M", _time.localtime(run["created_at"]))
        print(f"{run['run_id']}  {run['name']}  {run['model']}  {run['decision'] or run['status']}  {when}  {run['reason'] or ''}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtp-canary", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a canary: fleet, accuracy, load experiment, decision")
    run.add_argument("config", help="YAML run config (see configs/)")
    run.add_argument("--runs-dir", default="runs", help="where runs/<id>/ and history.db go (default: runs)")
    run.add_argument("--run-id", default=None, help="run id (default: timestamp-name-random)")
    run.add_argument("--window-s", type=int, default=None, help="override experiment.window_s")
    run.add_argument("--max-windows", type=int, default=None, help="override experiment.max_windows")
    run.add_argument("--eval-limit", type=int, default=None, help="override accuracy.limit")
    run.set_defaults(func=_cmd_run)

    make = sub.add_parser(
        "make-model",
        help="write the tiny MiMo-V2 checkpoint (config, tokenizer, constructed weights, golden.jsonl)",
        epilog=MAKE_MODEL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    make.add_argument("dir")
    make.add_argument("--draft-noise", type=float, default=0.0, help="noise on the MTP layer: 0 = drafts always accepted")
    make.add_argument("--broken", action="store_true", help="greedy outputs differ from the golden continuations")
    make.add_argument("--mtp-layers", type=int, default=1, help="MTP layers in the checkpoint (vLLM 0.32 loads only layer 0)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--num-layers", type=int, default=None, help="decoder layers (default sized for 2 CPU cores)")
    make.set_defaults(func=_cmd_make_model)

    cal = sub.add_parser("calibrate", help="simulate A/A and A/B trials through the gates; print error rates and power")
    cal.add_argument("--trials", type=int, default=2000)
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--json", action="store_true")
    cal.set_defaults(func=_cmd_calibrate)

    hist = sub.add_parser("history", help="one line per run")
    hist.add_argument("--runs-dir", default="runs")
    hist.set_defaults(func=_cmd_history)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
