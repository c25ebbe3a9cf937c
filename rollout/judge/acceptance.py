"""The speculative-decoding gate: a floor on the canary's mean acceptance length.

`judge_acceptance` judges the value measured from /metrics counter deltas as a
number (many drafts behind it), not as a test.
"""

from __future__ import annotations

import math

from rollout.judge.config import GatesConfig
from rollout.judge.looks import finite_or_none
from rollout.judge.names import ACCEPTANCE_NAME
from rollout.judge.verdicts import GateResult, Verdict

__all__ = ["judge_acceptance"]


# ---------------------------------------------------------------------------
# Speculative decoding health
# ---------------------------------------------------------------------------


def judge_acceptance(mean_acceptance_length: float | None, n_drafts: int, cfg: GatesConfig) -> GateResult:
    """Floor on the canary's mean acceptance length (gate ``acceptance_length_floor``).

    The value comes from /metrics counter deltas over many drafts (1 +
    accepted tokens / drafts), so it is judged as a number, not a test.
    ``None`` (not measured) is inconclusive. Whether zero drafts on a
    speculative canary is itself a failure is the controller's call (it knows
    the engine config); with a value given, the value is judged.
    """
    floor = cfg.min_acceptance_length
    common = dict(
        name=ACCEPTANCE_NAME,
        metric="mean_acceptance_length",
        baseline=None,
        canary=finite_or_none(mean_acceptance_length),
        threshold=floor,
        n_baseline=0,
        n_canary=int(n_drafts),
        estimate=finite_or_none(mean_acceptance_length),
    )
    if floor is None:
        return GateResult(**common, verdict=Verdict.PASS, detail="Acceptance-length floor disabled (min_acceptance_length is null).")
    if mean_acceptance_length is None or not math.isfinite(float(mean_acceptance_length)):
        return GateResult(**common, verdict=Verdict.INCONCLUSIVE, detail="Mean acceptance length not measured: cannot pass.")
    value = float(mean_acceptance_length)
    verdict = Verdict.PASS if value >= floor else Verdict.FAIL
    relation = ">=" if verdict is Verdict.PASS else "<"
    return GateResult(
        **common,
        verdict=verdict,
        detail=f"Mean acceptance length {value:.3f} {relation} floor {floor:g} over {int(n_drafts)} drafts.",
    )
