"""A run's status document (what `mtp-canary status [--json]` prints), read from the store.

The phase results hold gates in two shapes (the storage format, kept so that old runs read
the same): accuracy and experiment looks store the list of gates itself; the judgement, the
progressive windows and steps store a document whose "gates" is that list (with the "step"
of a progressive window or step); a run with candidates stores each look's gates per
candidate. Which phase stores which is said once, here.
"""

from __future__ import annotations

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


def run_status(store: RunStore, run_id: str, watch_beats: bool = False) -> dict | None:
    """The status document of a run (what `status --json` prints), or None if unknown."""
    run = store.run(run_id)
    if run is None:
        return None
    gates = []
    latest: dict[str, dict] = {}
    for entry in store.all_phase_results(run_id):
        found, step = committed_gates(entry["phase"], entry["result"])
        for gate in found:
            item = {
                "phase": entry["phase"],
                "look": entry["look"],
                "name": gate.name,
                "verdict": gate.verdict.value,
                "canary": gate.canary,
                "threshold": gate.threshold,
                "estimate": gate.estimate,
                "interval": list(gate.interval) if gate.interval is not None else None,
                "detail": gate.detail,
            }
            if step is not None:
                item["step"] = step
            gates.append(item)
            latest[f"{entry['phase']}:{gate.name}"] = item
    events = store.events(run_id)
    progressive = [e for e in events if e["phase"] == "progressive" and e["event"] in ("pause", "resume", "pause_timeout", "abort", "done")]
    paused = bool(progressive) and progressive[-1]["event"] == "pause" and run["status"] == "running"
    pending = [c["command"] for c in store.commands(run_id) if c["consumed"] is None]
    return {
        "run_id": run["run_id"],
        "name": run["name"],
        "model": run["model"],
        "status": run["status"],
        "phase": run["phase"],
        "step": run.get("step"),
        "canary_weight": run.get("canary_weight"),
        "paused": paused,
        "pending_commands": pending,
        "decision": run["decision"] if run["status"] != "running" else None,
        "exit_code": run["exit_code"],
        "reason": run["reason"],
        "created_at": run["created_at"],
        "updated_at": run["updated_at"],
        "gates": gates,
        "latest_gates": list(latest.values()),
        "last_event": events[-1] if events else None,
        "controller": run.get("controller"),
        # watch_beats: a controller on another host whose heartbeat looks stale by the wall clocks is
        # watched for two beats on this process's monotonic clock before it is called gone (one-shot
        # status; --watch confirms a stale one the same way before it exits)
        "controller_alive": run_controller_alive(run, store if watch_beats else None) if run["status"] == "running" else None,
    }
