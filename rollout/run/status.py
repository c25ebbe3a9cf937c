"""A run's status (what `mtp-canary status [--json]` prints), read from the store, typed: `RunStatus`.

The phase results hold gates in two shapes (the storage format, kept so that old runs read
the same): accuracy and experiment looks store the list of gates itself; the judgement, the
progressive windows and steps store a document whose "gates" is that list (with the "step"
of a progressive window or step); a run with candidates stores each look's gates per
candidate. Which phase stores which is said once, here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rollout.judge.verdicts import GateResult
from rollout.run.resume import JUDGED, PROGRESSIVE, STEP_PHASE
from rollout.run.store import RunStore, run_controller_alive

GATE_LIST_PHASES = ("accuracy", "experiment")  # phase_results: the list of gates of one look
GATE_DOCUMENT_PHASES = (JUDGED, PROGRESSIVE, STEP_PHASE)  # phase_results: {"gates": [...], "step"?: n, ...}
# a run with candidates: each look's gates per candidate, {"k2": [...], "k3": [...]}, shown as "k2/<gate>"
CANDIDATE_PHASES = ("accuracy_candidates", "experiment_candidates")


def committed_gates(phase: str, result: Any) -> tuple[list[GateResult], int | None]:
    """The gates a stored phase result holds, and its progressive step (None: not a step)."""
    name = phase.split("@")[0]  # a superseded attempt's rows: "accuracy@attempt-1"
    if name in GATE_LIST_PHASES:
        return [GateResult.model_validate(g) for g in result], None
    if name in GATE_DOCUMENT_PHASES:
        return [GateResult.model_validate(g) for g in result["gates"]], result.get("step")
    if name in CANDIDATE_PHASES:
        return [GateResult.model_validate({**g, "name": f"{candidate}/{g['name']}"})
                for candidate, gates in result.items() for g in gates], None
    return [], None


@dataclass(frozen=True)
class StatusGate:
    """One committed gate of a run: which phase and look judged it, with its numbers."""

    phase: str  # the stored phase ("experiment", "progressive", "accuracy@attempt-1", ...)
    look: int
    name: str  # "k2/<gate>" for a candidate's gate
    verdict: str
    canary: float | None
    threshold: float | None
    estimate: float | None
    interval: list[float] | None
    detail: str
    step: int | None = None  # a progressive window's or step's step; None (and absent in --json) otherwise

    def document(self) -> dict[str, Any]:
        row = asdict(self)
        if self.step is None:
            del row["step"]
        return row


@dataclass(frozen=True)
class StatusEvent:
    """A run's event as the store keeps it."""

    time: float
    phase: str
    canary_weight: float | None
    event: str
    reason: str | None


@dataclass(frozen=True)
class RunStatus:
    """A run's status: the store's row, its committed gates (each look's, and the latest of each gate),
    whether the progressive phase is paused, commands not yet taken, and whether its controller is alive."""

    run_id: str
    name: str
    model: str
    status: str  # running | done | failed | ...
    phase: str | None
    step: int | None
    canary_weight: float | None
    paused: bool
    pending_commands: list[str]
    decision: str | None  # None while running
    exit_code: int | None
    reason: str | None
    created_at: float
    updated_at: float
    gates: list[StatusGate]
    latest_gates: list[StatusGate]
    last_event: StatusEvent | None
    controller: str | None
    controller_alive: bool | None  # None: not running (or not known)

    def document(self) -> dict[str, Any]:
        """What `status --json` prints."""
        doc = asdict(self)
        doc["gates"] = [g.document() for g in self.gates]
        doc["latest_gates"] = [g.document() for g in self.latest_gates]
        return doc


def _gate_rows(store: RunStore, run_id: str) -> list[StatusGate]:
    rows = []
    for entry in store.all_phase_results(run_id):
        found, step = committed_gates(entry["phase"], entry["result"])
        rows += [StatusGate(phase=entry["phase"], look=entry["look"], name=gate.name, verdict=gate.verdict.value,
                            canary=gate.canary, threshold=gate.threshold, estimate=gate.estimate,
                            interval=list(gate.interval) if gate.interval is not None else None, detail=gate.detail,
                            step=step) for gate in found]
    return rows


def run_status(store: RunStore, run_id: str, watch_beats: bool = False) -> RunStatus | None:
    """The status of a run (what `status --json` prints: `.document()`), or None if unknown."""
    run = store.run(run_id)
    if run is None:
        return None
    gates = _gate_rows(store, run_id)
    latest = {f"{gate.phase}:{gate.name}": gate for gate in gates}
    events = store.events(run_id)
    progressive = [e for e in events if e["phase"] == "progressive" and e["event"] in ("pause", "resume", "pause_timeout", "abort", "done")]
    paused = bool(progressive) and progressive[-1]["event"] == "pause" and run["status"] == "running"
    pending = [c["command"] for c in store.commands(run_id) if c["consumed"] is None]
    return RunStatus(
        run_id=run["run_id"],
        name=run["name"],
        model=run["model"],
        status=run["status"],
        phase=run["phase"],
        step=run.get("step"),
        canary_weight=run.get("canary_weight"),
        paused=paused,
        pending_commands=pending,
        decision=run["decision"] if run["status"] != "running" else None,
        exit_code=run["exit_code"],
        reason=run["reason"],
        created_at=run["created_at"],
        updated_at=run["updated_at"],
        gates=gates,
        latest_gates=list(latest.values()),
        last_event=StatusEvent(**events[-1]) if events else None,
        controller=run.get("controller"),
        # watch_beats: a controller on another host whose heartbeat looks stale by the wall clocks is
        # watched for two beats on this process's monotonic clock before it is called gone (one-shot
        # status; --watch confirms a stale one the same way before it exits)
        controller_alive=run_controller_alive(run, store if watch_beats else None) if run["status"] == "running" else None,
    )
