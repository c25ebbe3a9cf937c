"""Speedup vs load: what the canary's speculation buys at each load level (pure).

Speculative decoding trades spare compute for fewer forward passes, so its TPOT gain
shrinks as the batch grows and the GPU (here: the CPU) becomes compute-bound. One
judged ratio at one load hides that; a sweep over levels (closed-loop streams per
replica, both arms at once, the same prompts to each) shows where the gain ends.
Informational: no gate reads it.

Records carry the level their request was sent at (the stepped load profile). A
level's throughput counts the output tokens of requests *sent* in the level over the
level's length, so requests that straddle a boundary are not split. Each user sends
every prompt to both arms in turn, so the arms' request counts (and tokens/s) are
equal by construction: the table shows the load achieved for both arms together.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loadtests.health import format_or_na, median_ms
from loadtests.records import RequestRecord

__all__ = ["summarize_sweep", "sweep_table"]


def summarize_sweep(records: Sequence[RequestRecord], arms: Sequence[str], step_s: float) -> list[dict]:
    """Per level (ascending): per arm requests, errors, TPOT/TTFT p50 ms, output tokens/s, client
    tokens per chunk; and the canary/baseline TPOT p50 ratio (arms[0] is the baseline)."""
    levels = sorted({r.level for r in records if r.level is not None})
    out = []
    for level in levels:
        at = [r for r in records if r.level == level and not r.cancelled]
        row: dict = {"level": level, "arms": {}}
        for arm in arms:
            mine = [r for r in at if r.arm == arm or (r.arm is None and r.pinned_arm == arm)]
            ok = [r for r in mine if r.ok]
            per_chunk = [r.decode_tokens_per_chunk for r in ok if r.decode_tokens_per_chunk is not None]
            row["arms"][arm] = {
                "requests": len(mine),
                "errors": sum(1 for r in mine if not r.ok),
                "tpot_p50_ms": median_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
                "ttft_p50_ms": median_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
                "output_tokens_per_s": round(sum(r.output_tokens or 0 for r in ok) / step_s, 2),
                "tokens_per_chunk": round(float(np.mean(per_chunk)), 3) if per_chunk else None,
            }
        base, canary = (row["arms"][a]["tpot_p50_ms"] for a in arms[:2])
        row["tpot_ratio"] = round(canary / base, 4) if base and canary is not None else None
        out.append(row)
    return out


def sweep_table(rows: Sequence[dict], arms: Sequence[str]) -> list[str]:
    """Markdown lines of the sweep."""
    base, canary = arms[0], arms[1]
    lines = [
        f"| streams per replica | TPOT p50 {base} ms | TPOT p50 {canary} ms | {canary}/{base} | "
        f"TTFT p50 {base} ms | TTFT p50 {canary} ms | tokens/chunk {canary} | requests per arm | tokens/s (both arms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        b, c = row["arms"][base], row["arms"][canary]
        ratio = "n/a" if row["tpot_ratio"] is None else f"{row['tpot_ratio']:.2f}"
        lines.append(
            f"| {row['level']:g} | {format_or_na(b['tpot_p50_ms'])} | {format_or_na(c['tpot_p50_ms'])} | {ratio} | "
            f"{format_or_na(b['ttft_p50_ms'])} | {format_or_na(c['ttft_p50_ms'])} | {format_or_na(c['tokens_per_chunk'])} | "
            f"{b['requests']}/{c['requests']} | {b['output_tokens_per_s'] + c['output_tokens_per_s']:.1f} |"
        )
    return lines
