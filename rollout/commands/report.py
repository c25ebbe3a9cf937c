"""`mtp-canary report RUN_ID|RUN_DIR`: write a run's report.md, report.html, junit.xml and metrics.prom again.

From its decision.json, left as it is (rollout.record.markdown.regenerate_reports): after an
upgrade of the renderers, or when a report was deleted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rollout.commands.arguments import EXIT_USAGE, parse_alone


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser("report", help="write a run's report.md and report.html again from its decision.json",
                            description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("run", metavar="RUN_ID|RUN_DIR")
    parser.add_argument("--runs-dir", default="runs")
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """The files written, one path a line; exit 2 when decision.json cannot be read."""
    from rollout.record.document import BadDocument
    from rollout.record.markdown import regenerate_reports

    run_dir = Path(args.run) if Path(args.run).is_dir() else Path(args.runs_dir) / args.run
    try:
        paths = regenerate_reports(run_dir)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, BadDocument) as exc:
        print(f"mtp-canary report: {run_dir / 'decision.json'}: cannot read it ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return EXIT_USAGE
    print("\n".join(str(path) for path in paths.values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`mtp-canary report ...` parsed alone (`python -m rollout.commands.report`, tests)."""
    return run(parse_alone(register, argv))


if __name__ == "__main__":
    sys.exit(main())
