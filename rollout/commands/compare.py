"""`mtp-canary compare`: two finished runs side by side, from their decision.json files.

    mtp-canary compare RUN_A RUN_B [--runs-dir DIR] [--json]

RUN_A / RUN_B are run directories (holding decision.json) or run ids under --runs-dir.
The use: one vLLM version (or engine config, or machine) against the next with the same
run config: did the gates move, did latency or acceptance move. The comparison is of
the two runs' own judgements (each run's gates, estimates and intervals as it judged
them); it is not a new statistical test between the runs: two runs' canaries measured
at different times on different fleets are not paired, and the tool does not pretend so.

Output: a table per section (decision, gates, latency per arm, acceptance per arm,
timings), or one JSON object with the same content. Exit 0; 2 when a run cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout.commands.arguments import parse_alone

if TYPE_CHECKING:  # the document model imports pydantic and the judge: read_run imports it when run
    from rollout.record.document import DecisionDocument, GateRecord

EXIT_USAGE = 2
DECISION = "decision.json"
LATENCY_KEYS = ("ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95", "e2e_p50", "e2e_p95")


class RunNotReadable(ValueError):
    """A run given to compare has no readable decision.json (the message names the path and cause)."""


def read_run(ref: str, runs_dir: Path) -> DecisionDocument:
    """The decision.json of a run directory, or of a run id under ``runs_dir``."""
    from rollout.record.document import BadDocument, DecisionDocument

    path = Path(ref)
    candidates = [path / DECISION, runs_dir / ref / DECISION] if path.is_dir() or not path.suffix else [path]
    for candidate in candidates:
        if candidate.is_file():
            try:
                doc = json.loads(candidate.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise RunNotReadable(f"{candidate}: not a decision.json ({type(exc).__name__}: {exc})") from None
            if not isinstance(doc, dict) or "decision" not in doc:
                raise RunNotReadable(f"{candidate}: not a decision.json (no 'decision' key)")
            try:
                return DecisionDocument.of(doc)
            except BadDocument as exc:
                raise RunNotReadable(f"{candidate}: {exc}") from None
    raise RunNotReadable(f"{ref}: no {DECISION} (neither a run directory nor a run id in {runs_dir})")


def _gates(doc: DecisionDocument) -> dict[str, GateRecord]:
    """The last judgement of each gate (decision.json lists the deciding ones)."""
    return {g.name: g for g in doc.gates if g.name is not None}


def _change(a: float | None, b: float | None) -> float | None:
    """B over A (None when either is missing or A is zero)."""
    if a is None or b is None or a == 0:
        return None
    return b / a


def _judged(gate: GateRecord | None) -> dict[str, Any]:
    return {"verdict": gate.verdict if gate else None, "estimate": gate.estimate if gate else None,
            "interval": gate.interval if gate else None}


def _run(doc: DecisionDocument) -> dict[str, Any]:
    return {"run_id": doc.run_id, "decision": doc.decision, "exit_code": doc.exit_code, "reason": doc.reason}


def comparison(a: DecisionDocument, b: DecisionDocument) -> dict[str, Any]:
    """Everything compare prints, as data (pure: two decision documents in)."""
    gates_a, gates_b = _gates(a), _gates(b)
    gates = []
    for name in sorted(set(gates_a) | set(gates_b)):
        ga, gb = gates_a.get(name), gates_b.get(name)
        gates.append({"gate": name, "a": _judged(ga), "b": _judged(gb),
                      "verdict_changed": (ga.verdict if ga else None) != (gb.verdict if gb else None)})
    latency = []
    lat_a = a.experiment.latency_ms if a.experiment else {}
    lat_b = b.experiment.latency_ms if b.experiment else {}
    for arm in sorted(set(lat_a) | set(lat_b)):
        for key in LATENCY_KEYS:
            va, vb = (lat_a.get(arm) or {}).get(key), (lat_b.get(arm) or {}).get(key)
            if va is None and vb is None:
                continue
            latency.append({"arm": arm, "metric": key, "a_ms": va, "b_ms": vb, "b_over_a": _change(va, vb)})
    acceptance = []
    for arm in sorted(set(a.spec_decode) | set(b.spec_decode)):
        sa, sb = a.spec_decode.get(arm), b.spec_decode.get(arm)
        acceptance.append({
            "arm": arm,
            "a_mean_acceptance_length": sa.mean_acceptance_length if sa else None,
            "b_mean_acceptance_length": sb.mean_acceptance_length if sb else None,
            "a_per_position": sa.per_position if sa else None,
            "b_per_position": sb.per_position if sb else None,
        })
    timings = {key: {"a_s": a.timings.get(key), "b_s": b.timings.get(key)}
               for key in sorted(set(a.timings) | set(b.timings))}
    return {
        "a": _run(a),
        "b": _run(b),
        "decision_changed": a.decision != b.decision,
        "gates": gates,
        "latency": latency,
        "acceptance": acceptance,
        "timings": timings,
    }


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    if isinstance(value, list):
        return "[" + ", ".join(_num(v, digits) for v in value) + "]"
    return str(value)


def format_comparison(c: dict[str, Any]) -> str:
    a, b = c["a"], c["b"]
    lines = [
        f"A {a['run_id']}: {a['decision'] or 'error'} (exit {a['exit_code']}) {a['reason'] or ''}".rstrip(),
        f"B {b['run_id']}: {b['decision'] or 'error'} (exit {b['exit_code']}) {b['reason'] or ''}".rstrip(),
        "",
        f"{'gate':<26} {'A':<13} {'A estimate':<11} {'B':<13} {'B estimate':<11}",
    ]
    for g in c["gates"]:
        mark = "  <- changed" if g["verdict_changed"] else ""
        lines.append(f"{g['gate']:<26} {_num(g['a']['verdict']):<13} {_num(g['a']['estimate']):<11} "
                     f"{_num(g['b']['verdict']):<13} {_num(g['b']['estimate']):<11}{mark}")
    if c["latency"]:
        lines += ["", f"{'arm':<9} {'latency (ms)':<12} {'A':>10} {'B':>10} {'B/A':>7}"]
        lines += [f"{r['arm']:<9} {r['metric']:<12} {_num(r['a_ms'], 1):>10} {_num(r['b_ms'], 1):>10} {_num(r['b_over_a']):>7}"
                  for r in c["latency"]]
    if c["acceptance"]:
        lines += ["", f"{'arm':<9} {'acceptance length A':>20} {'B':>8}  per position A -> B"]
        lines += [f"{r['arm']:<9} {_num(r['a_mean_acceptance_length'], 2):>20} {_num(r['b_mean_acceptance_length'], 2):>8}  "
                  f"{_num(r['a_per_position'], 2)} -> {_num(r['b_per_position'], 2)}" for r in c["acceptance"]]
    if c["timings"]:
        lines += ["", "timings (s): " + ", ".join(f"{k} {_num(v['a_s'], 1)} -> {_num(v['b_s'], 1)}" for k, v in c["timings"].items())]
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser("compare", help="two finished runs side by side: decision, gates, latency, acceptance",
                            description=__doc__.splitlines()[0])
    parser.add_argument("run_a", metavar="RUN_A", help="run directory or run id")
    parser.add_argument("run_b", metavar="RUN_B", help="run directory or run id")
    parser.add_argument("--runs-dir", default="runs", help="where run ids are looked up (default: runs)")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.set_defaults(handler=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`mtp-canary compare ...` parsed alone (`python -m rollout.commands.compare`, tests)."""
    return run(parse_alone(register, argv))


def run(args: argparse.Namespace) -> int:
    try:
        a, b = (read_run(ref, Path(args.runs_dir)) for ref in (args.run_a, args.run_b))
    except RunNotReadable as exc:
        print(f"mtp-canary compare: {exc}", file=sys.stderr)
        return EXIT_USAGE
    result = comparison(a, b)
    print(json.dumps(result, indent=2, default=str) if args.json else format_comparison(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
