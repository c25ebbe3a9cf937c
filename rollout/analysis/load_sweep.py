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

`level_results` turns a level's records into the numbers rollout.analysis.crossover judges: each
prompt's TPOT on each arm (paired by the prompt's dataset index, in send order), and the
output tokens/s per replica; `crossover_line` is the report's line under the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loadtests.health import format_or_na, median_ms
from loadtests.records import RequestRecord
from rollout.analysis.crossover import LevelResult, ratio_interval
from rollout.judge.config import SloConfig
from rollout.judge.goodput import arm_goodput
from rollout.judge.load_curve import PromoteUpTo

__all__ = ["crossover_line", "level_results", "summarize_sweep", "sweep_table"]


def _of_arm(record: RequestRecord, arm: str) -> bool:
    return record.arm == arm or (record.arm is None and record.pinned_arm == arm)


def summarize_sweep(records: Sequence[RequestRecord], arms: Sequence[str], step_s: float,
                    slo: SloConfig | None = None) -> list[dict]:
    """Per level (ascending): per arm requests, errors, TPOT/TTFT p50 ms, output tokens/s, client
    tokens per chunk, goodput (the share of its requests meeting `slo`; null without one: goodput
    vs load); and the canary/baseline TPOT p50 ratio (arms[0] is the baseline)."""
    levels = sorted({r.level for r in records if r.level is not None})
    out = []
    for level in levels:
        at = [r for r in records if r.level == level and not r.cancelled]
        row: dict = {"level": level, "arms": {}}
        for arm in arms:
            mine = [r for r in at if _of_arm(r, arm)]
            ok = [r for r in mine if r.ok]
            per_chunk = [r.decode_tokens_per_chunk for r in ok if r.decode_tokens_per_chunk is not None]
            row["arms"][arm] = {
                "requests": len(mine),
                "errors": sum(1 for r in mine if not r.ok),
                "tpot_p50_ms": median_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
                "ttft_p50_ms": median_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
                "output_tokens_per_s": round(sum(r.output_tokens or 0 for r in ok) / step_s, 2),
                "tokens_per_chunk": round(float(np.mean(per_chunk)), 3) if per_chunk else None,
                "goodput": arm_goodput(mine, slo, arm).share if slo is not None else None,
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
    if rows and any(row["arms"][a].get("goodput") is not None for row in rows for a in (base, canary)):
        lines += ["", "Goodput vs load (share of requests meeting gates.slo): " + "; ".join(
            f"{row['level']:g} streams {format_or_na(row['arms'][base].get('goodput'))} / "
            f"{format_or_na(row['arms'][canary].get('goodput'))}" for row in rows) + f" ({base} / {canary})"]
    return lines


def level_results(records: Sequence[RequestRecord], arms: Sequence[str], step_s: float, replicas: int,
                  seed: int = 0) -> list[LevelResult]:
    """Per level (ascending): the canary/baseline TPOT p50 ratio and its interval (rollout.analysis.crossover).

    The same samples as `summarize_sweep` (successful, not cancelled, with a TPOT). The unit is
    the prompt: the sweep sends each prompt to every arm in turn, so a prompt's baseline and
    canary TPOT are paired by its dataset index; a prompt with one arm only (the other failed,
    or the level ended between the two) keeps that arm's sample. Units in order of their first send."""
    base, canary = arms[0], arms[1]
    out = []
    for level in sorted({r.level for r in records if r.level is not None}):
        at = [r for r in records if r.level == level and not r.cancelled and r.ok]
        units: dict[object, dict[str, tuple[float, float]]] = {}
        for r in at:
            arm = base if _of_arm(r, base) else canary if _of_arm(r, canary) else None
            if arm is None or r.tpot_s is None:
                continue
            key: object = r.dataset_index if r.dataset_index is not None else r.request_id
            if arm in units.get(key, {}):
                key = r.request_id  # the same prompt twice on one arm (should not happen): its own unit
            units.setdefault(key, {})[arm] = (r.sent_at, r.tpot_s)
        ordered = sorted(units.values(), key=lambda unit: min(sent for sent, _ in unit.values()))
        b = np.array([u[base][1] if base in u else np.nan for u in ordered], dtype=float)
        c = np.array([u[canary][1] if canary in u else np.nan for u in ordered], dtype=float)
        got = ratio_interval(b, c, seed=seed + round(level * 1000))
        per_arm = [sum(r.output_tokens or 0 for r in at if _of_arm(r, arm)) / step_s / replicas for arm in (base, canary)]
        out.append(LevelResult(
            level=level,
            ratio=None if got.ratio is None else round(got.ratio, 4),
            ratio_low=None if got.low is None else round(got.low, 4),
            ratio_high=None if got.high is None else round(got.high, 4),
            pairs=sum(1 for u in ordered if len(u) == 2),
            block=got.block,
            log_sd=None if got.log_sd is None else round(got.log_sd, 6),
            dof=got.dof,
            tokens_per_s=round(float(np.mean(per_arm)), 2),
        ))
    return out


def crossover_line(crossover: dict) -> str:
    """One line for the report: where the ratio crosses the objective's bar and 1.0, with intervals."""
    levels = [row["level"] for row in crossover.get("levels") or []]
    lowest, top = (min(levels), max(levels)) if levels else (None, None)

    def one(c: dict) -> str:
        low = f"below {lowest:g}" if c["level_low"] is None else f"{c['level_low']:g}"
        high = f"above {top:g}" if c["level_high"] is None else f"{c['level_high']:g}"
        interval = f"95% interval {low} to {high}" if levels else "no interval"
        if c["level"] is None:
            return f"none in range, {c['reason']} ({interval})"
        tokens = "" if c["offered_tokens_per_s"] is None else f", {c['offered_tokens_per_s']:g} output tokens/s per replica"
        return f"{c['level']:g} streams per replica{tokens} ({interval})"

    bar = crossover["objective_bar"]
    how = "adaptive levels" if crossover.get("adaptive") else "the levels above"
    line = f"\nCrossover load ({how}): the TPOT ratio reaches the objective's bar {bar['bar']:g} at {one(bar)}"
    if crossover["ratio_1"]["bar"] != bar["bar"]:
        line += f"; reaches 1.0 at {one(crossover['ratio_1'])}"
    return line + "."


def promote_up_to_line(claim: PromoteUpTo) -> str:
    """One line for the reports: up to which load the candidate is shown to pay (rollout.judge.load_curve)."""
    where = ("at no swept level" if claim.streams_per_replica is None
             else f"at every swept load up to {claim.streams_per_replica:g} streams per replica")
    return f"Promote up to (judged): the candidate beats the objective's bar {claim.bar:g} {where}; {claim.reason}."
