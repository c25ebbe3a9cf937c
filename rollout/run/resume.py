"""Where a run stands, read from what the store already holds: the one resume point.

A controller that dies (kill -9) leaves its run's rows behind; `mtp-canary resume RUN_ID`
continues from here. Nothing is stored for resuming alone: the point is derived from the
events, the phase results and the runs row every controller writes anyway, so a run started
by an older version resumes too. The phase results and event names the point is read from
are defined here, once; the phases that write them import them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout.judge.verdicts import Decision, GateResult
from rollout.record.result import (
    AccuracySummary,
    ExperimentSummary,
    PreflightSummary,
    ProgressiveSummary,
    SpecDecodeSummary,
)
from rollout.run.store import RunStore

JUDGED = "judged"  # phase_results look 1: the run once accuracy + experiment were judged
PROGRESSIVE_OUTCOME = "progressive_outcome"  # phase_results look 1: the progressive phase's verdict
PRE_JUDGEMENT_PHASES = ("preflight", "accuracy", "experiment")  # rerun (superseded) when no judgement was committed
CONTROLLER_RESUME = "controller_resume"  # event of every resumed attempt
STEP_DONE = "step_done"  # progressive event committed before the next step begins
PROGRESSIVE = "progressive"  # phase name of the progressive events, window results and request samples
STEP_PHASE = "progressive_step"  # phase_results of each step's pooled verdicts (look = step number, 1-based)
ROUTER_LEDGER = "progressive_router"  # phase_results look 1: the router's counts when the phase first began


@dataclass(frozen=True)
class Judgement:
    """The judgement committed before the controller acted on it."""

    decision: Decision | None
    reason: str
    gates: list[GateResult]
    preflight: PreflightSummary | None
    accuracy: AccuracySummary | None
    experiment: ExperimentSummary | None
    spec_decode: dict[str, SpecDecodeSummary]
    engine_warnings: dict[str, list[str]]

    def stored(self) -> dict[str, Any]:
        """The phase result written under JUDGED (its shape is the storage format: keep it)."""
        return {
            "decision": self.decision.value if self.decision else None,
            "reason": self.reason,
            "gates": [g.model_dump(mode="json") for g in self.gates],
            "preflight": self.preflight.document() if self.preflight else {},
            "accuracy": self.accuracy.document() if self.accuracy else {},
            "experiment": self.experiment.document() if self.experiment else {},
            "spec_decode": {arm: sd.model_dump(mode="json") for arm, sd in self.spec_decode.items()},
            "engine_warnings": self.engine_warnings,
        }

    @classmethod
    def from_stored(cls, stored: dict[str, Any]) -> "Judgement":
        return cls(
            decision=Decision(stored["decision"]) if stored["decision"] else None,
            reason=stored["reason"],
            gates=[GateResult.model_validate(g) for g in stored["gates"]],
            preflight=PreflightSummary.model_validate(stored["preflight"]) if stored.get("preflight") else None,
            accuracy=AccuracySummary.model_validate(stored["accuracy"]) if stored["accuracy"] else None,
            experiment=ExperimentSummary.model_validate(stored["experiment"]) if stored["experiment"] else None,
            spec_decode={arm: SpecDecodeSummary.model_validate(sd) for arm, sd in stored["spec_decode"].items()},
            engine_warnings=stored["engine_warnings"],
        )


@dataclass(frozen=True)
class ProgressiveVerdict:
    """The progressive phase's verdict, committed when the phase ended."""

    decision: Decision
    reason: str
    guards: list[GateResult]
    summary: ProgressiveSummary

    def stored(self) -> dict[str, Any]:
        return {
            "decision": self.decision.value,
            "reason": self.reason,
            "guards": [g.model_dump(mode="json") for g in self.guards],
            "summary": self.summary.document(),
        }

    @classmethod
    def from_stored(cls, stored: dict[str, Any]) -> "ProgressiveVerdict":
        return cls(
            decision=Decision(stored["decision"]),
            reason=stored["reason"],
            guards=[GateResult.model_validate(g) for g in stored["guards"]],
            summary=ProgressiveSummary.model_validate(stored["summary"]),
        )


@dataclass(frozen=True)
class ResumePoint:
    """Where a run stands. A fresh run's point is `ResumePoint.fresh()`."""

    attempt: int  # this controller's attempt: 1 for a fresh run, +1 for every resume
    last_phase: str  # the phase of the runs row when the last controller stopped
    canary_weight: float  # the weight the router was last set to
    started_at: float | None  # the run's creation time (None: a fresh run)
    timeline: list[dict]  # every event so far
    judgement: Judgement | None  # committed before the crash: accuracy and experiment are not rerun
    progressive: ProgressiveVerdict | None  # the progressive phase had ended: its verdict stands
    steps_done: int  # progressive steps whose step_done event was committed

    @property
    def resuming(self) -> bool:
        return self.attempt > 1

    @classmethod
    def fresh(cls) -> "ResumePoint":
        return cls(1, "prepare", 0.0, None, [], None, None, 0)


def load_resume_point(store: RunStore, run_id: str) -> ResumePoint:
    """The resume point of `run_id` from its rows; ValueError if the store has no such run."""
    row = store.run(run_id)
    if row is None:
        raise ValueError(f"no run {run_id!r} in {store.path}")
    events = store.events(run_id)
    judged = store.phase_results(run_id, JUDGED)
    progressive = store.phase_results(run_id, PROGRESSIVE_OUTCOME)
    return ResumePoint(
        # the first controller was attempt 1; every resume adds one
        attempt=2 + sum(1 for e in events if e["event"] == CONTROLLER_RESUME),
        last_phase=row["phase"] or "prepare",
        canary_weight=row["canary_weight"] or 0.0,
        started_at=row["created_at"],
        timeline=[dict(e) for e in events],
        judgement=Judgement.from_stored(judged[0]) if judged else None,
        progressive=ProgressiveVerdict.from_stored(progressive[0]) if progressive else None,
        steps_done=sum(1 for e in events if e["phase"] == PROGRESSIVE and e["event"] == STEP_DONE),
    )
