"""A run's result, typed: what each phase found, the decision, and decision.json built from them.

Every phase writes its summary here (pydantic models, so the shapes are checked where they
are made); `decision_document` turns the whole into decision.json (secrets redacted), and `RunResult.from_document`
reads one back (a recorded run's document round-trips unchanged: tests/test_result.py).
The judgement checkpoint a resumed run restores (rollout.run.resume) holds the same summaries.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollout.analysis.acceptance_slices import AcceptanceSlice
from rollout.config import RolloutConfig
from rollout.analysis.crossover import Crossing, LevelResult
from rollout.analysis.depth_advice import DepthAdvice
from rollout.judge.goodput import ArmGoodput
from rollout.judge.latency import LookDependence
from rollout.judge.load_curve import PromoteUpTo
from rollout.judge.noise_floor import NoiseFloor
from rollout.judge.power import DetectableEffect
from rollout.judge.verdicts import Decision, GateResult
from rollout.record.redact import known_secrets, redact_document

EXIT_CODES = {Decision.PROMOTE: 0, Decision.ROLLBACK: 3, Decision.INCONCLUSIVE: 4}
EXIT_INFRASTRUCTURE = 1
EXIT_INTERRUPTED = 130  # a signal ended the run (rollout.run.interrupts)


class Summary(BaseModel):
    """A phase's summary: exactly the keys decision.json shows (unknown keys are refused)."""

    model_config = ConfigDict(extra="forbid")

    def document(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class PrepareSummary(Summary):
    """What the run chose before starting anything: the tiny model's size, cores per replica."""

    tiny_model: dict[str, Any] | None = None  # rollout's TinySizing, as decision.json shows it
    cpu_cores: dict[str, str | None] | None = None  # replica -> VLLM_CPU_OMP_THREADS_BIND
    core_sharing: str | None = None
    weights: list[dict[str, Any]] | None = None  # cluster.staging.StagedWeights per node and model (model_cache)
    # what the load shares with GPU replicas (cluster.placement.shared_load_notes), one line; set only then
    load_placement: str | None = None

    def document(self) -> dict[str, Any]:
        # keys appear as they are learnt (the sizing first, the cores once the fleet is up)
        return self.model_dump(mode="json", exclude_unset=True)


class PreflightSummary(Summary):
    smoke_completion_tokens: dict[str, int]
    canary_speculative_tokens: int
    canary_drafts: float
    notable_warnings: dict[str, list[str]]


class AccuracySummary(Summary):
    kind: str
    items: int
    planned_items: int
    accuracy: dict[str, float | None]
    divergence_vs_baseline: dict[str, float]
    request_errors: dict[str, int]
    duration_s: float


class LookSummary(Summary):
    look: int
    at: float
    information: float
    requests: dict[str, int]
    verdicts: dict[str, str]
    # each arm's prefix-cache counters (hits, queried prompt tokens) since the looks began, read at this
    # look (null: not read there): `mtp-canary judge` replays the prefix-cache gate
    # from them, as its records hold no server counters. Absent ({}) in runs written before them.
    prefix_cache: dict[str, tuple[float, float] | None] = Field(default_factory=dict)
    # each arm's share of this look's requests meeting gates.slo (an arm without requests in the look: null);
    # absent without an SLO
    goodput: dict[str, float | None] | None = None


class SweepArm(Summary):
    requests: int
    errors: int
    tpot_p50_ms: float | None
    ttft_p50_ms: float | None
    output_tokens_per_s: float
    tokens_per_chunk: float | None
    goodput: float | None = None  # share of the level's requests meeting gates.slo; null without an SLO


class SweepRow(Summary):
    level: float
    arms: dict[str, SweepArm]
    tpot_ratio: float | None


class SweepCrossover(Summary):
    """Where speculation stops paying (rollout.analysis.crossover): the load at which the sweep's TPOT ratio
    crosses 1.0 and the objective's bar, each with its interval, from the per-level intervals."""

    ratio_1: Crossing
    objective_bar: Crossing
    levels: list[LevelResult]
    adaptive: bool  # the levels were picked by the adaptive sweep (experiment.sweep.adaptive)


class JudgedLoad(Summary):
    """The load the latency verdict is about: what each replica of every arm was offered while it was judged."""

    kind: str  # closed_loop | open_loop | trace
    streams_per_replica: int | None  # closed loop: requests in flight per replica (a trace: at most)
    rate_per_replica: float | None  # open loop: requests/s offered to each replica
    arm_users: bool  # each stream kept one arm: both arms held the same streams (else each request took the next arm)
    text: str


class ExperimentSummary(Summary):
    looks: list[LookSummary]
    planned_looks: int
    requests_per_look: int
    requests_per_arm_planned: int
    arm_users: bool = False  # each Locust user kept one arm (experiment.arm_users)
    # experiment.warmup_requests_per_arm, and each arm's completed requests in the warm-up (stored, not judged)
    warmup_requests_per_arm: int = 0
    warmup_requests: dict[str, int] = {}  # pydantic copies a mutable default per instance
    information: float
    requests: dict[str, int]
    records_after_last_look: int
    requests_received: int | None
    records_stored: int
    duty_cycle: float | None
    load_start_s: float | None
    duration_s: float
    generator_warnings: list[str]
    generator_send_lag_p99_ms: float | None
    latency_ms: dict[str, dict[str, float | None]]
    client_tokens_per_chunk: dict[str, float | None]
    stopped_by: str  # evidence | max_duration_s | abort
    sweep: list[SweepRow] | None = None  # speedup vs load (no gate); absent when no sweep ran
    sweep_crossover: SweepCrossover | None = None  # beside the sweep's rows (a list): absent when no sweep ran
    # per arm, the judged requests meeting gates.slo (rollout.judge.goodput); absent when no SLO is set
    goodput: dict[str, ArmGoodput] | None = None
    # the last look's A/A TPOT p50 ratio twin / baseline (rollout.judge.noise_floor); absent without a twin baseline
    noise_floor: NoiseFloor | None = None
    # TPOT predicted for every MTP depth up to the deepest arm's (rollout.analysis.depth_advice); absent when the arms
    # do not run two depths or a profile is missing
    depth_advice: DepthAdvice | None = None
    # the load the verdict is about (rollout.run.phases.experiment_loop.judged_load) and how much the TPOT p50
    # persisted across looks (rollout.judge.latency.look_dependence); absent in runs written before them
    judged_load: JudgedLoad | None = None
    dependence: LookDependence | None = None

    def document(self) -> dict[str, Any]:
        absent: dict[str, Any] = {name: True for name in ("sweep", "sweep_crossover", "goodput", "noise_floor",
                                                          "depth_advice", "judged_load", "dependence")
                                  if getattr(self, name) is None}
        if all(look.goodput is None for look in self.looks):  # no SLO: no per-look goodput, as no goodput
            absent["looks"] = {"__all__": {"goodput"}}
        return self.model_dump(mode="json", exclude=absent or None)


class StepSplit(Summary):
    step: int
    canary_weight: float
    routed: dict[str, int]
    observed_canary_share: float | None
    records: dict[str, int]
    records_canary_share: float | None


class ProgressiveSummary(Summary):
    steps_completed: int
    observed_split: list[StepSplit]
    requests_received: int | None
    records_stored: int | None
    attempt: int
    duration_s: float
    # why the steps moved no real traffic (arms with endpoints and no weight_hook); absent otherwise
    advisory: str | None = None

    def document(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"advisory"} if self.advisory is None else None)


class SpecDecodeSummary(Summary):
    """An arm's speculative-decoding counters over the experiment (the /metrics deltas)."""

    model_config = ConfigDict(extra="ignore")  # a checkpoint may hold more counters than decision.json shows

    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    per_position: list[float] | None = None
    drafts: float | None = None
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    expected_length_by_k: dict[str, float] | None = None
    # whose counters the numbers above are: "requests" (the experiment's own, per request: vLLM's
    # --per-request-spec-decode-metrics) or "server" (its /metrics deltas, which count any traffic)
    counted_from: str | None = None
    server_drafts: float | None = None  # the servers' verify steps over the phase, every client's
    server_mean_acceptance_length: float | None = None
    other_traffic_steps: int | None = None  # server steps past the experiment's requests (None: not comparable)
    other_traffic: str | None = None  # the warning, when other traffic reached the arm
    # where acceptance changes (rollout.analysis.acceptance_slices; descriptive): by prompt length, by multi_turn turn;
    # empty where the requests carry no counters of their own
    by_prompt_length: list[AcceptanceSlice] = Field(default_factory=list)
    by_turn: list[AcceptanceSlice] = Field(default_factory=list)


class CandidateSummary(Summary):
    """One candidate of a several-candidates run: its own verdict against the baseline at its
    share of alpha, its gates, and why it won or lost (rollout.judge.candidates)."""

    name: str
    speculative_tokens: int
    speculation: str = ""  # its speculative config as the report names it: 'mtp k=3', 'ngram k=3', 'no speculation'
    alpha: float  # the level it was judged at: gates.alpha / K
    decision: Decision
    reason: str
    gates: list[GateResult]


class UsageSummary(Summary):
    """What the run held, measured: its replicas (and their GPUs) from the fleet's start (or a
    resumed controller's reattach) to the decision. `mtp-canary plan` gives the bound beforehand."""

    gpus: int  # replicas x tensor_parallel_size over GPU arms
    replicas: int
    held_s: float
    gpu_hours: float
    replica_hours: float

    @classmethod
    def held(cls, gpus: int, replicas: int, held_s: float) -> "UsageSummary":
        return cls(gpus=gpus, replicas=replicas, held_s=round(held_s, 3),
                   gpu_hours=round(gpus * held_s / 3600, 4), replica_hours=round(replicas * held_s / 3600, 4))


def _section(summary: Summary | None) -> dict[str, Any]:
    return summary.document() if summary is not None else {}


@dataclass
class RunResult:
    """Everything the report needs; built up phase by phase."""

    run_id: str
    run_dir: Path
    config: RolloutConfig
    started_at: float = field(default_factory=time.time)
    decision: Decision | None = None
    reason: str = ""
    gates: list[GateResult] = field(default_factory=list)
    prepare: PrepareSummary = field(default_factory=PrepareSummary)
    preflight: PreflightSummary | None = None
    accuracy: AccuracySummary | None = None
    experiment: ExperimentSummary | None = None
    progressive: ProgressiveSummary | None = None
    spec_decode: dict[str, SpecDecodeSummary] = field(default_factory=dict)
    engine_warnings: dict[str, list[str]] = field(default_factory=dict)
    # arm -> replicas, engine, tiny_model (as configured); servers: replica -> what its log says it ran
    # (vLLM version, non-default args: rollout.engine_parity.EngineRun), recorded by preflight
    arms: dict[str, dict] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    timeline: list[dict] = field(default_factory=list)
    error: str | None = None
    usage: UsageSummary | None = None  # None until a fleet started (decision.json leaves it out)
    # a several-candidates run (config candidates): each one's verdict and the winner (the canary's seat);
    # None otherwise, and decision.json then leaves both keys out
    candidates: list[CandidateSummary] | None = None
    winner: str | None = None
    # the signal that ended the run (SIGTERM, SIGINT, SIGHUP; rollout.run.interrupts): exit 130, with error set
    interrupted: str | None = None
    # gate -> what the plan could decide (rollout.judge.power), said before the run; None: not computed
    # (decision.json then leaves the key out)
    detectable_effect: dict[str, DetectableEffect] | None = None
    # earlier runs of the same comparison (rollout.run.phases.setup.attempts_note): number, alpha spent together,
    # the INCONCLUSIVE ones; None for a first attempt (decision.json then leaves the key out)
    attempts: dict[str, Any] | None = None
    # several candidates: how far choosing the lowest of K ratios may have flattered the winner's
    # (rollout.judge.selection); None otherwise (decision.json then leaves the key out)
    winner_note: str | None = None
    # arm -> requests the router answered 503 because every replica of the arm was ejected at once
    # (cluster.router wholly_ejected); None or empty: no arm was ever wholly out
    wholly_ejected: dict[str, int] | None = None
    # up to which load the candidate pays (rollout.judge.load_curve), from the sweep; None when no sweep ran
    # (decision.json then leaves the key out, as documents written before it lack it)
    promote_up_to: PromoteUpTo | None = None

    @property
    def exit_code(self) -> int:
        if self.interrupted is not None:
            return EXIT_INTERRUPTED
        if self.error is not None or self.decision is None:
            return EXIT_INFRASTRUCTURE
        return EXIT_CODES[self.decision]

    @classmethod
    def from_document(cls, doc: dict[str, Any], config: RolloutConfig, run_dir: Path) -> "RunResult":
        """A decision.json read back (the inverse of decision_document, timings as rounded there)."""
        error = doc["error"]
        return cls(
            run_id=doc["run_id"],
            run_dir=run_dir,
            config=config,
            started_at=doc["started_at"],
            decision=Decision(doc["decision"]) if doc["decision"] else None,
            reason="" if error else doc["reason"],
            gates=[GateResult.model_validate(g) for g in doc["gates"]],
            prepare=PrepareSummary.model_validate(doc["prepare"]),
            preflight=PreflightSummary.model_validate(doc["preflight"]) if doc["preflight"] else None,
            accuracy=AccuracySummary.model_validate(doc["accuracy"]) if doc["accuracy"] else None,
            experiment=ExperimentSummary.model_validate(doc["experiment"]) if doc["experiment"] else None,
            progressive=ProgressiveSummary.model_validate(doc["progressive"]) if doc["progressive"] else None,
            spec_decode={arm: SpecDecodeSummary.model_validate(sd) for arm, sd in doc["spec_decode"].items()},
            engine_warnings=doc["engine_warnings"],
            arms=doc["arms"],
            timings=doc["timings"],
            timeline=doc["timeline"],
            error=error,
            usage=UsageSummary.model_validate(doc["usage"]) if doc.get("usage") else None,
            candidates=[CandidateSummary.model_validate(c) for c in doc["candidates"]] if doc.get("candidates") else None,
            winner=doc.get("winner"),
            interrupted=_signal_named(error) if doc.get("exit_code") == EXIT_INTERRUPTED else None,
            detectable_effect=({g: DetectableEffect.model_validate(e) for g, e in doc["detectable_effect"].items()}
                               if doc.get("detectable_effect") is not None else None),
            attempts=doc.get("attempts"),
            winner_note=doc.get("winner_note"),
            wholly_ejected=doc.get("wholly_ejected"),
            promote_up_to=(PromoteUpTo.model_validate(doc["promote_up_to"])
                           if doc.get("promote_up_to") is not None else None),
        )


def _signal_named(error: str | None) -> str:
    """The signal an interrupted run's error names ("interrupted by SIGTERM"), else "signal"."""
    found = re.search(r"\bSIG[A-Z]+\b", error or "")
    return found.group(0) if found else "signal"


def decision_document(result: RunResult) -> dict[str, Any]:
    """decision.json: the verdict, every gate's numbers, and what was compared.

    Redacted (rollout.record.redact): the arms' engine env values and secret flags, and any secret of
    the config that reached free text (an error, an engine warning); a no-op without secrets.
    """
    doc = {
        "run_id": result.run_id,
        "name": result.config.name,
        "decision": result.decision.value if result.decision and result.error is None else None,
        "exit_code": result.exit_code,
        "reason": result.error or result.reason,
        "error": result.error,
        "gates": [g.model_dump(mode="json") for g in result.gates],
        "spec_decode": {arm: sd.document() for arm, sd in result.spec_decode.items()},
        "arms": result.arms,
        "prepare": result.prepare.document(),
        "preflight": _section(result.preflight),
        "accuracy": _section(result.accuracy),
        "experiment": _section(result.experiment),
        "progressive": _section(result.progressive),
        "engine_warnings": result.engine_warnings,
        "gates_config": result.config.gates.model_dump(mode="json"),
        "timings": {k: round(v, 3) for k, v in result.timings.items()},
        "timeline": result.timeline,
        "started_at": result.started_at,
    }
    if result.usage is not None:
        doc["usage"] = result.usage.document()
    if result.detectable_effect is not None:
        doc["detectable_effect"] = {g: e.model_dump(mode="json") for g, e in result.detectable_effect.items()}
    if result.attempts is not None:
        doc["attempts"] = result.attempts
    if result.winner_note is not None:
        doc["winner_note"] = result.winner_note
    if result.wholly_ejected:
        doc["wholly_ejected"] = result.wholly_ejected
    if result.promote_up_to is not None:
        doc["promote_up_to"] = result.promote_up_to.model_dump(mode="json")
    if result.candidates is not None:
        doc["candidates"] = [c.model_dump(mode="json") for c in result.candidates]
        doc["winner"] = result.winner
    return redact_document(doc, known_secrets(result.config.model_dump(mode="json")))


def wholly_ejected_line(doc: dict[str, Any]) -> str | None:
    """The report's line for an arm whose every replica the router ejected at once (None: none was)."""
    out = doc.get("wholly_ejected") or {}
    if not out:
        return None
    arms = ", ".join(f"{arm} ({n} request{'s' if n != 1 else ''} answered 503)" for arm, n in sorted(out.items()))
    return (f"Every replica of an arm was ejected at once: {arms}; those requests count as the arm's errors, "
            "and its latency figures hold only what it served")
