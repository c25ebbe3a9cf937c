"""What a run id may be: one path component and a Ray namespace suffix, checked before anything is written.

`--run-id ../../x` once wrote decision.json outside the runs directory and named a Ray
namespace `mtp-canary-../../x`. Light on purpose (no Ray): the CLI refuses a bad id in
milliseconds.
"""

from __future__ import annotations

import re

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def run_id_error(run_id: str, what: str) -> str | None:
    """One line saying why `run_id` is no run id (naming `what`: --run-id, RUN_ID), or None."""
    if RUN_ID_PATTERN.fullmatch(run_id) and ".." not in run_id:
        return None
    shown = repr(run_id) if len(run_id) <= 80 else repr(run_id[:80]) + "..."
    return (f"{what}: {shown} is not a run id (letters, digits, '.', '_', '-', at most 128, "
            "starting with a letter or digit, no '..')")
