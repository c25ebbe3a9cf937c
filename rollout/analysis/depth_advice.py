"""Which MTP depth to run: the decode TPOT predicted for every depth k up to the deepest arm's,
from that arm's per-position acceptance and the decode-step cost the arms measured.

Why it can be predicted. One decode step of an MTP engine drafts k tokens and verifies them
with the target model; it emits 1 + (accepted drafts) tokens. Position i is accepted only when
every earlier one was, so the deepest arm's per-position rates p_1..p_K (vLLM's
`spec_decode_num_accepted_tokens_per_pos` over its drafts) give the acceptance length any
shallower depth would have had: E(k) = 1 + p_1 + ... + p_k (`SpecDecodeStats.expected_length_for_k`).
The cost of a step grows with k (k draft forward passes, a verify of k + 1 tokens); the arms
measure it: an arm's step time is its TPOT x its own acceptance length. A line through the
arms' step times by k, s(k) = fixed + per_draft x k, and TPOT(k) = s(k) / E(k).

What it assumes, and where it breaks: the drafts of positions <= k do not depend on how many
follow (true of MTP's sequential drafting); the step cost is linear in k at the measured load
(on a GPU the verify is memory-bound and nearly flat in k, the drafts add a pass each; on CPU
it is compute-bound); and every depth runs at the same streams per replica as the arms did.
With two arms the line passes through both, so their depths are reproduced by construction and
only the depths between (or below) them are predictions; with three or more, each arm that ran
is also a check of the model (`measured_tpot_ms` beside the prediction). Depths beyond the
deepest arm's are not predicted: no acceptance was measured past its last position.

The interval: the prediction is computed per look (each look's TPOT p50 per arm, the same
profile) and the looks' spread gives a t interval on looks - 1 degrees of freedom around the
whole run's prediction: looks are the blocks the latency judge treats as independent, and the
acceptance counters, with thousands of drafts, are far less noisy than the TPOT.

The layer-reuse signature: vLLM runs MiMo-V2's MTP layer 0 for every draft step (it logs "will
run multiple times of forward on same MTP layer"); its acceptance then falls fast with the
position (published: 0.77 / 0.47 / 0.36 against a healthy 0.82 / 0.75 / 0.78). Flagged when a
position >= 2 keeps less than `REUSE_KEEP_RATIO` of the rate before it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field
from scipy import stats as scipy_stats

__all__ = ["DepthArm", "DepthPrediction", "LayerReuse", "DepthAdvice", "advise_depth", "layer_reuse"]

# a position that keeps less of the one before it than this looks like a reused draft layer
# (the published reuse profile keeps 0.61 at position 2; the healthy one 0.91)
REUSE_KEEP_RATIO = 0.75
CONFIDENCE = 0.95


@dataclass(frozen=True)
class DepthArm:
    """What one arm measured: its depth, its own mean acceptance length (1 without speculation),
    its TPOT p50 over the experiment and per look (ms)."""

    name: str
    k: int
    acceptance_length: float
    tpot_ms: float
    tpot_ms_by_look: Sequence[float] = ()


class DepthPrediction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    k: int
    acceptance_length: float = Field(description="1 + the deepest arm's first k per-position rates")
    tpot_ms: float = Field(description="predicted decode TPOT p50 at the arms' load")
    interval_ms: tuple[float, float] | None = Field(
        None, description=f"{CONFIDENCE:.0%} interval over the looks (null with fewer than 3 looks)"
    )
    measured_tpot_ms: float | None = Field(None, description="the TPOT p50 of the arm that ran this depth, if one did")
    vs_best: float = Field(description="predicted TPOT / the best depth's (1.0 for the best)")


class LayerReuse(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    signature: bool = Field(description=f"a position >= 2 keeps < {REUSE_KEEP_RATIO:g} of the rate before it")
    logged: bool = Field(description="vLLM warned that it runs the same MTP layer for every draft step")
    kept: list[float] = Field(description="per position >= 2: its rate / the rate of the position before")


class DepthAdvice(BaseModel):
    """decision.json experiment.depth_advice."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profile_arm: str = Field(description="the deepest arm, whose per-position acceptance the predictions use")
    per_position: list[float]
    streams_per_replica: float | None
    fixed_step_ms: float = Field(description="the step-cost line: s(k) = fixed_step_ms + per_draft_ms x k")
    per_draft_ms: float
    predictions: list[DepthPrediction]
    best_k: int
    layer_reuse: LayerReuse
    text: str


def layer_reuse(per_position: Sequence[float], logged: bool) -> LayerReuse:
    kept = [per_position[i] / per_position[i - 1] if per_position[i - 1] > 0 else 0.0
            for i in range(1, len(per_position))]
    return LayerReuse(signature=any(k < REUSE_KEEP_RATIO for k in kept), logged=logged,
                      kept=[round(k, 4) for k in kept])


def _line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(fixed, per_draft) of the least-squares line through (k, step time) points of two or more depths."""
    ks = [k for k, _ in points]
    mean_k = statistics.fmean(ks)
    mean_s = statistics.fmean(s for _, s in points)
    spread = sum((k - mean_k) ** 2 for k in ks)
    slope = sum((k - mean_k) * (s - mean_s) for k, s in points) / spread
    return mean_s - slope * mean_k, slope


def _predict(arms: Sequence[DepthArm], tpots: Sequence[float], lengths: Sequence[float]) -> tuple[float, float, list[float]]:
    fixed, per_draft = _line([(arm.k, tpot * arm.acceptance_length) for arm, tpot in zip(arms, tpots)])
    return fixed, per_draft, [(fixed + per_draft * k) / length for k, length in enumerate(lengths, start=1)]


def advise_depth(
    arms: Sequence[DepthArm],
    per_position: Sequence[float],
    *,
    profile_arm: str,
    streams_per_replica: float | None,
    reuse_logged: bool = False,
) -> DepthAdvice | None:
    """The advice, or None when it cannot be given: fewer than two depths among the arms, a
    profile with no position, or a TPOT or acceptance length that is not a positive number."""
    depths = {arm.k for arm in arms}
    usable = all(arm.tpot_ms > 0 and arm.acceptance_length >= 1 and math.isfinite(arm.tpot_ms) for arm in arms)
    if len(depths) < 2 or not per_position or not usable:
        return None
    lengths = [1.0 + sum(per_position[:k]) for k in range(1, len(per_position) + 1)]
    fixed, per_draft, point = _predict(arms, [arm.tpot_ms for arm in arms], lengths)
    looks = min((len(arm.tpot_ms_by_look) for arm in arms), default=0)
    intervals: list[tuple[float, float] | None] = [None] * len(lengths)
    if looks >= 3:
        by_look = [_predict(arms, [arm.tpot_ms_by_look[i] for arm in arms], lengths)[2] for i in range(looks)]
        t = float(scipy_stats.t.ppf(0.5 + CONFIDENCE / 2, looks - 1))
        for k in range(len(lengths)):
            se = statistics.stdev(row[k] for row in by_look) / math.sqrt(looks)
            intervals[k] = (round(point[k] - t * se, 3), round(point[k] + t * se, 3))
    best = min(range(len(point)), key=lambda i: (point[i], i))  # ties: the shallower (fewer draft tokens)
    measured = {arm.k: arm.tpot_ms for arm in arms}
    predictions = [
        DepthPrediction(k=k, acceptance_length=round(lengths[k - 1], 4), tpot_ms=round(point[k - 1], 3),
                        interval_ms=intervals[k - 1], measured_tpot_ms=measured.get(k),
                        vs_best=round(point[k - 1] / point[best], 4))
        for k in range(1, len(lengths) + 1)
    ]
    reuse = layer_reuse(per_position, reuse_logged)
    return DepthAdvice(
        profile_arm=profile_arm, per_position=[round(p, 4) for p in per_position],
        streams_per_replica=streams_per_replica, fixed_step_ms=round(fixed, 3), per_draft_ms=round(per_draft, 3),
        predictions=predictions, best_k=best + 1, layer_reuse=reuse,
        text=_text(predictions, best + 1, streams_per_replica, reuse, len(per_position)),
    )


def _text(predictions: Sequence[DepthPrediction], best_k: int, streams: float | None, reuse: LayerReuse,
          deepest: int) -> str:
    load = f" at {streams:g} streams per replica" if streams is not None else ""
    parts = [f"k={best_k} is predicted fastest{load} (TPOT p50 {predictions[best_k - 1].tpot_ms:.1f} ms)"]
    for p in predictions:
        if p.k != best_k:
            parts.append(f"k={p.k} {100 * (p.vs_best - 1):+.0f}%")
    text = "; ".join(parts) + f"; depths past k={deepest} not predicted (no acceptance measured past position {deepest})"
    if reuse.signature:
        kept = ", ".join(f"{k:.2f}" for k in reuse.kept)
        text += (f". Layer-reuse signature: positions >= 2 keep {kept} of the rate before them"
                 + (" and vLLM logged that it runs the same MTP layer for every draft step" if reuse.logged else ""))
    return text
