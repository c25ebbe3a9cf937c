"""Verdicts and the decision: one gate's `GateResult`, and how results combine.

`decide` and `is_final` turn the gates' verdicts into PROMOTE / ROLLBACK /
INCONCLUSIVE and say when the sequential procedure may stop; `is_enabled` says
which gates a `GatesConfig` asks for, `missing_gates` which of those no result covers.

Fail closed: with a config, PROMOTE needs every gate it enables to be present and
passed. A gate that was never judged (its phase disabled or skipped) is missing
evidence, never a pass; to promote without it, leave it out of ``gates.enabled``.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
import pydantic
from pydantic import Field

from rollout.judge.config import GatesConfig
from rollout.judge.names import ACCEPTANCE_NAME, GATE_NAMES, GOODPUT_NAME, PREFIX_CACHE_NAME, PROFILE_NAME

__all__ = [
    "Verdict",
    "Decision",
    "GateResult",
    "decide",
    "is_final",
    "is_enabled",
    "missing_gates",
    "counted_gates",
]



class Verdict(str, Enum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


class Decision(str, Enum):
    PROMOTE = "promote"
    ROLLBACK = "rollback"
    INCONCLUSIVE = "inconclusive"


class GateResult(pydantic.BaseModel):
    """One gate's verdict with the numbers behind it (goes into decision.json)."""

    name: str = Field(description="Gate name, one of GATE_NAMES.")
    metric: str = Field(description="What the estimate measures, e.g. 'tpot_p50_ratio' or 'accuracy_diff'.")
    baseline: float | None = Field(description="Baseline point value (latency in ms, rates as fractions).")
    canary: float | None = Field(description="Canary point value, same unit as baseline.")
    threshold: float | None = Field(description="The configured limit the estimate is judged against.")
    verdict: Verdict
    estimate: float | None = Field(None, description="Comparison estimate (ratio or difference).")
    interval: tuple[float, float] | None = Field(
        None, description="Repeated confidence bounds of the estimate used for the verdict (see detail for levels)."
    )
    n_baseline: int = Field(0, description="Baseline samples (requests or items) behind the numbers.")
    n_canary: int = Field(0, description="Canary samples behind the numbers.")
    look: int = Field(1, description="Look number k of the planned max_looks.")
    p_value: float | None = Field(None, description="Exact McNemar p-value (accuracy) where applicable.")
    detail: str = Field("", description="Human-readable account of the decision.")


def is_enabled(name: str, cfg: GatesConfig) -> bool:
    """Whether ``cfg`` asks for gate ``name`` (configured, not disabled and, if listed, enabled)."""
    if cfg.enabled is not None and name not in cfg.enabled:
        return False
    if name in cfg.disabled:
        return False
    if name == "e2e_p95_guard" and cfg.e2e_p95_max_ratio is None:
        return False
    if name == ACCEPTANCE_NAME and cfg.min_acceptance_length is None:
        return False
    if name == GOODPUT_NAME and cfg.goodput_slo is None:
        return False
    if name == PREFIX_CACHE_NAME and cfg.prefix_cache_max_drop is None:
        return False
    if name == PROFILE_NAME and cfg.acceptance_profile is None:
        return False
    return True


# ---------------------------------------------------------------------------
# Decision
# ---------------------------------------------------------------------------


def missing_gates(results: Sequence[GateResult], cfg: GatesConfig) -> list[str]:
    """The gates ``cfg`` enables that no result covers, in GATE_NAMES order."""
    present = {r.name for r in results}
    return [name for name in GATE_NAMES if is_enabled(name, cfg) and name not in present]


def counted_gates(results: Sequence[GateResult], cfg: GatesConfig | None) -> list[GateResult]:
    """The results that count: gates the config enables, and gates it cannot name (preflight checks)."""
    if cfg is None:
        return list(results)
    return [r for r in results if r.name not in GATE_NAMES or is_enabled(r.name, cfg)]


def decide(results: Sequence[GateResult], cfg: GatesConfig | None = None) -> Decision:
    """Any FAIL -> ROLLBACK; all PASS (at least one gate) -> PROMOTE; else INCONCLUSIVE.

    With ``cfg``, gates it does not enable are ignored, and a gate it enables that is
    missing from ``results`` makes PROMOTE impossible (INCONCLUSIVE unless a gate failed).
    """
    considered = counted_gates(results, cfg)
    if any(r.verdict is Verdict.FAIL for r in considered):
        return Decision.ROLLBACK
    if cfg is not None and missing_gates(results, cfg):
        return Decision.INCONCLUSIVE
    if considered and all(r.verdict is Verdict.PASS for r in considered):
        return Decision.PROMOTE
    return Decision.INCONCLUSIVE


def is_final(results: Sequence[GateResult], cfg: GatesConfig | None = None) -> bool:
    """True when the sequential procedure may stop: any FAIL, or every gate decided.

    Only the gates in ``results`` count here (a phase asks about its own gates; the
    gates of other phases are not missing from it).
    """
    considered = counted_gates(results, cfg)
    if any(r.verdict is Verdict.FAIL for r in considered):
        return True
    return bool(considered) and all(r.verdict is not Verdict.INCONCLUSIVE for r in considered)
