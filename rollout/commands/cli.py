"""`mtp-canary` (same as `python -m rollout`): the list of commands, and the parser made of them.

Every command is a module of `rollout.commands` with `register(subparsers)` (its arguments;
light imports only, so `mtp-canary --help` stays fast) and `run(args) -> int` (its work, with its
heavy imports inside). This module only lists them, in the order `--help` shows them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

DESCRIPTION = "a canary between vLLM engine configs: run it, watch and answer it, plan, re-judge, calibrate"
COMMANDS = (
    "run", "resume", "status", "history", "promote_abort",
    "plan", "submit", "judge", "report", "compare", "calibrate",
    "router", "make_model", "config_schema",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtp-canary", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"rollout.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
