"""decision.json read back, typed: the document every rendering and reader of a run's record takes.

`DecisionDocument.model_validate(json.loads(text))` (or `DecisionDocument.read(path)`) reads what
`decision_document` (rollout.record.result) writes; the phase sections are the writer's own summaries,
so each shape is said once. Leniency where a reader must not refuse a record: top-level keys this
version does not know (a newer or annotated document) are kept aside; an empty section ({}) is an
absent phase; a gate or candidate keeps a verdict or decision it does not know as text (junit.xml
counts it as an error, never as a pass), and its numbers may be missing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from cluster.metrics import KvCacheStats
from rollout.judge.load_curve import PromoteUpTo
from rollout.judge.power import DetectableEffect
from rollout.record.result import (AccuracySummary, ExperimentSummary, PreflightSummary, PrepareSummary,
                                   ProgressiveSummary, SpecDecodeSummary, UsageSummary)

DECISION_FILE = "decision.json"


class BadDocument(ValueError):
    """A mapping that is not a decision document; the message is one line naming the first bad field."""


class Record(BaseModel):
    """A part of decision.json as read back: unknown keys kept aside, not refused."""

    model_config = ConfigDict(extra="allow")


class GateRecord(Record):
    """One gate of decision.json `gates` (a GateResult as written), read leniently."""

    name: str | None = None
    metric: str | None = None
    baseline: float | None = None
    canary: float | None = None
    threshold: float | None = None
    verdict: str | None = None  # pass | fail | inconclusive; anything else is not a pass
    estimate: float | None = None
    interval: list[float | None] | None = None
    n_baseline: int | None = 0
    n_canary: int | None = 0
    look: int | None = 1
    p_value: float | None = None
    detail: str | None = ""


class CandidateRecord(Record):
    """One candidate of a several-candidates run (a CandidateSummary as written)."""

    name: str | None = None
    speculative_tokens: int | None = None
    speculation: str | None = None  # absent in documents written before candidates named their method
    alpha: float | None = None
    decision: str | None = None
    reason: str | None = None
    gates: list[GateRecord] = Field(default_factory=list)


def _kv_fields() -> dict[str, Any]:
    """What KvCacheStats.to_dict writes (its fields and its hit rate), each optional with KvCacheStats's own
    default: a document written before a field existed (the prefix-cache counters) still reads."""
    hints = get_type_hints(KvCacheStats)
    hints["prefix_cache_hit_rate"] = get_type_hints(KvCacheStats.prefix_cache_hit_rate.fget)["return"]
    return {name: (hints[name] | None, default) for name, default in KvCacheStats().to_dict().items()}


# one list of fields, KvCacheStats's: a field added there is read back here without a second edit
KvRecord = create_model(
    "KvRecord", __base__=Record, __module__=__name__,
    __doc__="An arm's KV cache during the experiment (decision.json arms.<arm>.kv: cluster.metrics.KvCacheStats).",
    **_kv_fields(),
)


class ArmRecord(Record):
    """decision.json arms.<arm>: replicas and engine as configured, the KV cache and the servers' own account."""

    replicas: int | None = None
    engine: dict[str, Any] = Field(default_factory=dict)  # the arm's engine config as dumped (rollout.config)
    kv: KvRecord | None = None
    servers: dict[str, dict[str, Any]] | None = None  # replica -> rollout.engine_parity.EngineRun as dumped


class TimelineEvent(Record):
    """One event of decision.json `timeline` (the store's events)."""

    time: float
    phase: str | None = None
    canary_weight: int | float | None = None
    event: str | None = None
    reason: str | None = None


class Attempts(Record):
    """decision.json `attempts`: earlier runs of the same comparison (rollout.run.phases.setup.attempts_note)."""

    comparison: str | None = None
    number: int | None = None
    alpha_spent_together: float | None = None
    judged_before: dict[str, str | None] = Field(default_factory=dict)
    inconclusive_before: list[str] = Field(default_factory=list)


class DecisionDocument(Record):
    """decision.json, typed: what every renderer (report.md, report.html, junit.xml, metrics.prom) and
    `mtp-canary compare` read."""

    run_id: str | None = None
    name: str | None = None
    decision: str | None = None  # promote | rollback | inconclusive; null: an error decided nothing
    exit_code: int | None = None
    reason: str | None = None
    error: str | None = None
    gates: list[GateRecord] = Field(default_factory=list)
    spec_decode: dict[str, SpecDecodeSummary] = Field(default_factory=dict)
    arms: dict[str, ArmRecord] = Field(default_factory=dict)
    prepare: PrepareSummary = Field(default_factory=PrepareSummary)
    preflight: PreflightSummary | None = None
    accuracy: AccuracySummary | None = None
    experiment: ExperimentSummary | None = None
    progressive: ProgressiveSummary | None = None
    engine_warnings: dict[str, list[str]] = Field(default_factory=dict)
    gates_config: dict[str, Any] = Field(default_factory=dict)  # the run's gates config as dumped (rollout.judge.config)
    timings: dict[str, int | float] = Field(default_factory=dict)
    timeline: list[TimelineEvent] = Field(default_factory=list)
    started_at: float | None = None
    # absent unless the run had them (rollout.record.result.decision_document)
    usage: UsageSummary | None = None
    detectable_effect: dict[str, DetectableEffect] | None = None
    attempts: Attempts | None = None
    winner_note: str | None = None
    candidates: list[CandidateRecord] | None = None
    winner: str | None = None
    wholly_ejected: dict[str, int] | None = None  # arm -> requests answered 503 with every replica out
    promote_up_to: PromoteUpTo | None = None  # up to which load the candidate pays (a run with a sweep)

    @field_validator("prepare", mode="before")
    @classmethod
    def _no_prepare(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("preflight", "accuracy", "experiment", "progressive", mode="before")
    @classmethod
    def _empty_is_absent(cls, value: Any) -> Any:
        return None if value == {} else value  # decision.json writes a phase that did not run as {}

    @classmethod
    def of(cls, doc: "DecisionDocument | Mapping[str, Any]") -> "DecisionDocument":
        """The typed document, from itself or from decision.json's mapping (BadDocument when it is not one)."""
        if isinstance(doc, cls):
            return doc
        try:
            return cls.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "the document"
            raise BadDocument(f"not a decision.json: {where}: {first['msg']}") from None

    @classmethod
    def read(cls, path: Path) -> "DecisionDocument":
        """A decision.json file, or a run directory holding one (OSError, ValueError when unreadable)."""
        path = Path(path)
        return cls.of(json.loads((path / DECISION_FILE if path.is_dir() else path).read_text()))

    def decided(self) -> str | None:
        """The run's decision, None when an error decided nothing (whatever `decision` says)."""
        return self.decision if not self.error else None
