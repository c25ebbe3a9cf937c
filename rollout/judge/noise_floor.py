"""The twin baseline as the latency noise floor: the A/A TPOT p50 ratio twin / baseline, and its veto.

With ``twin_baseline: true`` a second baseline arm (the same config as the baseline) gets
the experiment's traffic like the other arms. At every look `judge_noise_floor` bounds the
TPOT p50 ratio twin / baseline with the objective's own interval
(``latency.tpot_p50_ratio_bounds``: block-robust order-statistic bands, both sides at
alpha, repeated over the looks). Identical configs should measure alike; an interval that
excludes 1 says they do not (a replica on a slower core, a noisy neighbour, placement), and
then the canary's ratio against the baseline measures the placement as much as the
canary. `apply_noise_floor` is the fail-closed rule: the objective cannot PASS while the
A/A interval excludes 1, nor before it has an interval at all; it becomes INCONCLUSIVE
with a reason naming the A/A ratio. A FAIL stays a FAIL (not promoting is the safe side).

An asymmetry too small for the A/A interval to exclude 1 at the look can still carry the
canary's ratio against the baseline below the bar (calibrate's ``aa_placement_0.95`` row: a
baseline on 5% slower cores, the canary at the bar, passed 0.30 of the time on that rule
alone). So the objective must also pass against the twin (an intersection of the two tests,
each at alpha): a canary at the bar against the twin, an identical config on its own
placement, passes at most at alpha whatever the baseline's placement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pydantic
from pydantic import Field

from rollout.judge.config import GatesConfig
from rollout.judge.latency import LatencySamples, tpot_p50_ratio_bounds
from rollout.judge.names import OBJECTIVE_NAME
from rollout.judge.verdicts import GateResult, Verdict

__all__ = ["NoiseFloor", "judge_noise_floor", "apply_noise_floor"]


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


class NoiseFloor(pydantic.BaseModel):
    """The A/A TPOT p50 ratio twin / baseline at one look, with its interval (decision.json's
    ``experiment.noise_floor``)."""

    look: int = Field(description="The look it was judged at.")
    ratio: float | None = Field(description="TPOT p50 twin / baseline (identical configs: 1 in truth).")
    lower: float | None = Field(description="Lower repeated confidence bound at alpha (None: no interval yet).")
    upper: float | None = Field(description="Upper repeated confidence bound at alpha (None: no interval yet).")
    excludes_one: bool = Field(description="The interval excludes 1: identical configs measured apart.")
    design_effect: dict[str, float | None] = Field(description="Block-robust over iid variance of each arm's p50.")
    n_baseline: int
    n_twin: int
    blocks_pass: bool = Field(description="Whether the objective may pass at this look (an interval, containing 1).")
    detail: str = ""


def judge_noise_floor(
    baseline: LatencySamples,
    twin: LatencySamples,
    cfg: GatesConfig,
    look: int = 1,
    max_looks: int | None = None,
    information: Sequence[float] | None = None,
) -> NoiseFloor:
    """The A/A ratio twin / baseline at ``look`` with the objective's interval, and whether it lets the objective pass."""
    bounds = tpot_p50_ratio_bounds(baseline, twin, cfg, look=look, max_looks=max_looks, information=information)
    excludes = bounds.usable and bounds.lower is not None and bounds.upper is not None and (
        bounds.lower > 1.0 or bounds.upper < 1.0
    )
    ratio = f"{bounds.estimate:.4f}" if bounds.estimate is not None else "n/a"
    if not bounds.usable:
        detail = f"A/A TPOT p50 ratio twin/baseline {ratio} has no interval yet ({bounds.why_not}): the objective cannot pass."
    else:
        detail = (
            f"A/A TPOT p50 ratio twin/baseline {ratio} [{bounds.lower:.4f}, {bounds.upper:.4f}]"
            + (": identical configs measured apart (placement or core asymmetry), the objective cannot pass."
               if excludes else ": contains 1.")
        )
    return NoiseFloor(
        look=look,
        ratio=bounds.estimate,
        lower=bounds.lower,
        upper=bounds.upper,
        excludes_one=bool(excludes),
        design_effect={"baseline": _finite(bounds.deff[0]), "twin": _finite(bounds.deff[1])},
        n_baseline=bounds.n_baseline,
        n_twin=bounds.n_other,
        blocks_pass=bool(excludes or not bounds.usable),
        detail=detail,
    )


def apply_noise_floor(
    gates: Sequence[GateResult], floor: NoiseFloor, against_twin: GateResult | None = None
) -> list[GateResult]:
    """The gates with the objective's detail naming the A/A floor, and its PASS made INCONCLUSIVE when
    the floor blocks it or when the objective judged canary against twin (``against_twin``) does not pass."""
    out = []
    for gate in gates:
        if gate.name == OBJECTIVE_NAME:
            if gate.verdict is Verdict.PASS and floor.blocks_pass:
                gate = gate.model_copy(update={
                    "verdict": Verdict.INCONCLUSIVE,
                    "detail": f"Noise floor: {floor.detail} (it would pass on its own: {gate.detail})",
                })
            elif gate.verdict is Verdict.PASS and (against_twin is None or against_twin.verdict is not Verdict.PASS):
                gate = gate.model_copy(update={
                    "verdict": Verdict.INCONCLUSIVE,
                    "detail": f"Noise floor: {floor.detail} Against the twin the objective is "
                    + (f"{against_twin.verdict.value} ({against_twin.detail})" if against_twin else "not judged")
                    + f"; against the baseline: {gate.detail}",
                })
            else:
                gate = gate.model_copy(update={"detail": f"{gate.detail} Noise floor: {floor.detail}"})
        out.append(gate)
    return out
