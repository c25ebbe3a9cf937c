"""Compare two `mtp-canary calibrate --json` outputs: every rate, count and config field must be equal.

    python benchmarks/calibrate_compare.py [--new-rows-ok] REFERENCE.json NEW.json

Exit 0 when they are bit-identical apart from the run's own wall time and worker
count (``wall_s``, ``workers``); else one line per differing key path and exit 1.
A speed-up of the judging path must leave the same seed's numbers unchanged.
``--new-rows-ok``: keys only the new output has (rows added since the reference) are
listed but do not count as differences.
"""

from __future__ import annotations

import json
import sys
from typing import Any

IGNORED = {"wall_s", "workers"}


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Key paths where ``a`` and ``b`` differ (floats compared exactly, NaN equal to NaN)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            if key in IGNORED and not path:
                continue
            if key not in a or key not in b:
                out.append(f"{path}/{key}: only in {'new' if key not in a else 'reference'}")
            else:
                out += differences(a[key], b[key], f"{path}/{key}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} entries"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return []
    return [] if a == b and type(a) is type(b) else [f"{path}: {a!r} vs {b!r}"]


def main(argv: list[str]) -> int:
    new_rows_ok = "--new-rows-ok" in argv
    argv = [a for a in argv if a != "--new-rows-ok"]
    if len(argv) != 2:
        sys.stderr.write("usage: calibrate_compare.py [--new-rows-ok] REFERENCE.json NEW.json\n")
        return 2
    with open(argv[0], encoding="utf-8") as f:
        reference = json.load(f)
    with open(argv[1], encoding="utf-8") as f:
        new = json.load(f)
    diffs = differences(reference, new)
    if new_rows_ok:
        for line in [d for d in diffs if d.endswith("only in new")]:
            print(f"new row (not a difference): {line}")
        diffs = [d for d in diffs if not d.endswith("only in new")]
    for line in diffs:
        print(line)
    print("identical" if not diffs else f"{len(diffs)} difference(s)")
    return 0 if not diffs else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
