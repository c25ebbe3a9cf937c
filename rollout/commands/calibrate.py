"""`mtp-canary calibrate`: the judge's error rates and power for a run config's design, by simulation.

    mtp-canary calibrate [--config RUN.yaml] [--trials N] [--seed S] [--json] [--workers W] [--sets PATTERN]

The simulation is ``rollout.calibration.calibrate``; this module reads the run config with the
house loader (a bad one is one line naming the field, exit 2), times the run and reports progress
on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from rollout.commands.arguments import EXIT_USAGE, parse_alone


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser("calibrate", help="simulate A/A and A/B trials through the gates; print error rates and power",
                            description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("--config", help="the run config whose design to calibrate (default: the demo's, local-cpu.yaml)")
    parser.add_argument("--trials", type=int, default=2000, help="simulated runs per row (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: every CPU)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--sets", metavar="PATTERN", help="simulate only the trial sets matching this pattern "
                        "(e.g. 'ar1_*'; the other rows read nan): a quick look at some rows")
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """The table (or one JSON object) on stdout; exit 2 for a config that does not load."""
    from rollout.calibration.calibrate import CHUNK_TRIALS, default_design, design_from_run_config, format_table, \
        run_calibration
    from rollout.config import ConfigError, load_config

    try:
        design = (design_from_run_config(load_config(args.config).model_dump(mode="json"), args.config)
                  if args.config else default_design())
    except (ConfigError, OSError, ValueError) as exc:
        sys.stderr.write(f"mtp-canary calibrate: {exc}\n".replace("\n", " ").rstrip() + "\n")
        return EXIT_USAGE
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        if done == total or done % max(total // 20, 1) == 0:
            sys.stderr.write(f"calibrate: {done}/{total} chunks of {CHUNK_TRIALS} trials, "
                             f"{time.perf_counter() - started:.0f} s\n")

    result = run_calibration(design, trials=args.trials, seed=args.seed, workers=args.workers, progress=progress,
                             only=args.sets)
    result["wall_s"] = round(time.perf_counter() - started, 2)
    result["workers"] = args.workers
    sys.stdout.write(json.dumps(result, indent=2) + "\n" if args.json else format_table(result) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`mtp-canary calibrate ...` parsed alone (`python -m rollout.commands.calibrate`, tests)."""
    return run(parse_alone(register, argv))


if __name__ == "__main__":
    sys.exit(main())
