"""`mtp-canary judge`: re-judge past runs' request records with the controller's own look logic.

    mtp-canary judge RECORDS.jsonl|RUN_DIR... [--config RUN.yaml] [--json]

The replay itself (what it reads from a run directory, and which gates it can judge) is
``rollout.analysis.replay``; this module is the command: its arguments, its table and its exit code.

Output: one verdict object per input (``--json``: one JSON object per line with
input, decision, reason, gates, looks, stopped_by, changed_gates,
accepted_changed_gates, notes), else a table. Exit code as ``run``: 0 every input
promotes (under its run's own gates, or accepted), 3 any rolls back, 4 otherwise; a
bad input (a missing file, a line that is not a record: named by its number) is one
line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rollout.commands.arguments import parse_alone

if TYPE_CHECKING:
    from rollout.analysis.replay import JudgeOutcome
    from rollout.judge.verdicts import Decision

__all__ = ["register", "run", "main", "table", "exit_code"]

EXIT_BAD_INPUT = 2


# -- output ------------------------------------------------------------------------------------
def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def table(outcome: JudgeOutcome) -> str:
    r = outcome.replay
    lines = [
        f"{outcome.label}: {outcome.decision.value.upper()} ({outcome.reason})",
        f"  {len(r.looks)} look(s), stopped by {r.stopped_by}; "
        + (f"{r.warmup_records} warm-up records not judged, " if r.warmup_records else "")
        + f"{r.judged_records} records judged, {r.unjudged_records} after the last look",
        f"  {'gate':<26} {'verdict':<13} {'estimate':>9} {'interval':>21} {'threshold':>9}",
    ]
    for g in outcome.gates:
        interval = "-" if g.interval is None else f"[{g.interval[0]:.4g}, {g.interval[1]:.4g}]"
        lines.append(f"  {g.name:<26} {g.verdict.value:<13} {_number(g.estimate):>9} {interval:>21} {_number(g.threshold):>9}")
    if outcome.goodput is not None:
        lines.append("  goodput (judged requests meeting the SLO): " + ", ".join(
            f"{arm} {_number(g.share)} ({g.met}/{g.of})" for arm, g in outcome.goodput.items()))
    if outcome.changed:
        lines.append("  gates differ from the run's own: " + "; ".join(outcome.changed))
    if outcome.unaccepted_promote:
        lines.append("  PROMOTE under gates the run did not use: not the run's verdict, exit 4 "
                     "(--accept-changed-gates accepts it)")
    lines += [f"  note: {note}" for note in outcome.notes]
    return "\n".join(lines)


def exit_code(decisions: Sequence[Decision]) -> int:
    """As `run`: 0 when every input promotes, 3 when any rolls back, else 4 (pass an unaccepted PROMOTE under
    changed gates as INCONCLUSIVE)."""
    from rollout.judge.verdicts import Decision
    from rollout.record.result import EXIT_CODES

    if any(d is Decision.ROLLBACK for d in decisions):
        return EXIT_CODES[Decision.ROLLBACK]
    if decisions and all(d is Decision.PROMOTE for d in decisions):
        return EXIT_CODES[Decision.PROMOTE]
    return EXIT_CODES[Decision.INCONCLUSIVE]


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser("judge", help="re-judge runs' request records (records.jsonl or run dirs) with the "
                            "controller's look logic", description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", metavar="RECORDS.jsonl|RUN_DIR")
    parser.add_argument("--config", help="a run config whose gates and look plan to judge with "
                        "(default: the run directory's decision.json gates_config, else the defaults)")
    parser.add_argument("--json", action="store_true", help="one JSON object per input, one per line")
    parser.add_argument("--accept-changed-gates", action="store_true",
                        help="exit 0 on a PROMOTE under gates, thresholds, alpha or plan other than the run's own "
                             "(they are listed either way)")
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Every input judged, a table (or JSON lines) each; exit as `run` would have."""
    from rollout.analysis.replay import BadInput, judge_input, load_input, one_line
    from rollout.judge.verdicts import Decision

    try:
        run_config = None
        if args.config is not None:
            from rollout.config import ConfigError, load_config

            try:
                run_config = load_config(args.config)
            except ConfigError as exc:
                raise BadInput(one_line(str(exc))) from None
        outcomes = [judge_input(load_input(arg, run_config)) for arg in args.inputs]
    except BadInput as exc:
        print(f"mtp-canary judge: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for outcome in outcomes:
        outcome.accept_changed = args.accept_changed_gates
        print(json.dumps(outcome.document()) if args.json else table(outcome))
    return exit_code([Decision.INCONCLUSIVE if o.unaccepted_promote else o.decision for o in outcomes])


def main(argv: Sequence[str] | None = None) -> int:
    """`mtp-canary judge ...` parsed alone (`python -m rollout.commands.judge`, tests)."""
    return run(parse_alone(register, argv))


if __name__ == "__main__":
    sys.exit(main())
