"""One run's shared state, handed to every phase: config, store, event log, fleet and router,
the traffic plan, the attempt, and the leases that keep the run's actors alive.

A phase (rollout/run/phases/) reads what it needs from the context and writes what it finds into
`ctx.result`, all but the decision; the controller owns the order of the phases, error handling,
teardown, and the run's decision (rollout.run.decision).

The decision has one writer, `record_decision`, and only the controller calls it, with what each
phase returned. An abort command is taken in the middle of a phase (between accuracy batches, at
an experiment tick), which then ends early and still summarises what it measured: `aborted` keeps
the abort as a pending `Decided` (`abort`) and returns True, and `record_decision` turns it into the
decision when that phase returns, over whatever the phase handed back (or raised). Until then
`decided` and `standing` already count it, so the rest of that phase (a failed gate, the
candidates' choice) sees a decided run, as every later phase does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from cluster.arms import BASELINE, CANARY
from cluster.engine_spec import EngineSpec
from cluster.fleet import Fleet
from cluster.router import ROUTER_WATCH_NAME, RouterClient
from loadtests.options import TrafficOptions
from loadtests.swarm import SwarmSpec
from rollout.config import ArmConfig, RolloutConfig
from rollout.judge.verdicts import GateResult
from rollout.record.result import RunResult
from rollout.run.decision import Decided, aborted_by_command
from rollout.run.resume import ResumePoint
from rollout.run.store import HEARTBEAT_S, RunStore
from rollout.run.weight_hook import WeightHookError, call_weight_hook

Progress = Callable[[str], None]


class InfrastructureError(RuntimeError):
    """The run could not measure (a replica, the router or Locust failed): exit 1, no verdict."""


def run_namespace(run_id: str) -> str:
    """The Ray namespace of one run's named actors."""
    return f"mtp-canary-{run_id}"


class LeaseKeeper:
    """Renews the lease of every actor of the run a few times per lease while the controller lives.

    Each actor ends itself (and its processes) when its lease lapses: a dead controller's fleet,
    router and load do not outlive it by more than one lease unless a resumed controller adopts them.
    """

    def __init__(self, lease_s: float, actors: Callable[[], list[Any]],
                 heartbeat: Callable[[], None] | None = None) -> None:
        self.lease_s = lease_s
        self._actors = actors
        self._heartbeat = heartbeat  # the controller's sign of life in the store (resume from another host)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def renew(self) -> None:
        # nothing here may end the keeper's thread: a keeper that stops renewing ends the run's
        # actors one lease later, under a controller that still lives
        try:
            actors = self._actors()
        except Exception:
            actors = []
        for actor in actors:
            try:
                actor.renew_lease.remote(self.lease_s)
            except Exception:  # a dead actor: the health checks say so
                pass
        if self._heartbeat is not None:
            try:
                self._heartbeat()
            except Exception:  # a locked or vanished store: the next beat tries again
                pass

    def start(self) -> None:
        self.renew()
        interval = max(1.0, self.lease_s / 6)
        beat_s = min(interval, HEARTBEAT_S)  # a reader on another host watches the beats for two of these

        def keep() -> None:
            renewed = time.monotonic()
            while not self._stop.wait(beat_s):
                if time.monotonic() - renewed >= interval - 0.01:
                    renewed = time.monotonic()
                    self.renew()
                elif self._heartbeat is not None:
                    try:
                        self._heartbeat()
                    except Exception:  # a locked or vanished store: the next beat tries again
                        pass

        self._thread = threading.Thread(target=keep, name="lease-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def release(self) -> None:
        """Leave every actor running without a lease (keep_fleet)."""
        for actor in self._actors():
            try:
                ray.get(actor.release_lease.remote(), timeout=10)
            except Exception:
                pass


@dataclass
class TrafficPlan:
    """The load every phase sends: the experiment's prompts and lengths, and how Locust is placed."""

    cfg: RolloutConfig
    model: str  # served model name

    @property
    def master_bind_host(self) -> str:
        # workers on other nodes reach the master on the cluster's interface
        return self.cfg.ray.bind_host if self.cfg.experiment.worker_placement != "local" else "127.0.0.1"

    def fields(self) -> dict[str, Any]:
        """The experiment's prompt source and lengths (TrafficOptions fields)."""
        exp = self.cfg.experiment
        return {
            "dataset": exp.dataset,
            "dataset_path": exp.dataset_path,
            "input_tokens": exp.input_tokens,
            "prefix_groups": exp.prefix_groups,
            "prefix_tokens": exp.prefix_tokens,
            "turns": exp.turns,
            "trace_format": exp.trace_format,
            "trace_speedup": exp.trace_speedup,
            "max_tokens": exp.max_tokens,
            "temperature": exp.temperature,
            "endpoint": exp.endpoint,
        }

    def pinned(self, records: Path, **options: Any) -> TrafficOptions:
        """The experiment's prompts and lengths (exact output lengths: ignore_eos) plus `options`."""
        return TrafficOptions(**self.fields(), model=self.model, records=str(records), ignore_eos=True, **options)

    def swarm_spec(self, host: str, traffic: TrafficOptions, users: int, run_time_s: int | None, log_dir: Path,
                   **extra: Any) -> SwarmSpec:
        exp = self.cfg.experiment
        return SwarmSpec(
            host=host,
            traffic=traffic,
            users=max(users, exp.workers, 1),
            run_time_s=run_time_s,
            n_workers=exp.workers,
            web_ui=exp.web_ui,
            web_port=exp.web_port,
            log_dir=log_dir,
            master_bind_host=self.master_bind_host,
            **extra,
        )


@dataclass
class RunContext:
    """What every phase shares. Built by the controller; phases fill `result`, all but its decision."""

    cfg: RolloutConfig
    run_id: str
    run_dir: Path
    store: RunStore
    result: RunResult
    progress: Progress
    cache_dir: Path
    point: ResumePoint
    namespace: str
    engines: dict[str, EngineSpec] = field(default_factory=dict)
    fleet: Fleet | None = None
    router: RouterClient | None = None
    canary_weight: float = 0.0
    judged: bool = False  # the judgement is made (or restored): accuracy and experiment do not run again
    experiment_capped: str | None = None  # the experiment hit max_duration_s before its plan
    leased: dict[str, Any] = field(default_factory=dict)  # extra leased actors (the progressive load), by name
    leases: LeaseKeeper | None = None
    fleet_since: float | None = None  # wall clock when this controller started (or reattached) the fleet
    # several candidates: each one's gates against the baseline at alpha / K, by phase order (accuracy, experiment)
    candidate_gates: dict[str, list[GateResult]] = field(default_factory=dict)
    abort: Decided | None = None  # an abort command taken during the running phase; recorded when it returns

    # -- the decision ------------------------------------------------------------
    @property
    def standing(self) -> Decided | None:
        """The decision that stands so far: the recorded one, else an abort taken during the running phase."""
        if self.result.decision is not None:
            return Decided(self.result.decision, self.result.reason)
        return self.abort

    @property
    def decided(self) -> bool:
        """Something decided the run already: later phases that judge do not run, and none decides again
        (the progressive steps alone revise a decision: rollout.run.decision.after_steps)."""
        return self.standing is not None

    def record_decision(self, outcome: Decided | None) -> None:
        """The run's decision and reason: the one write of them, by the controller after each phase with
        what the phase returned. An abort taken during the phase, not yet recorded, stands over it."""
        if self.abort is not None and self.result.decision is None:
            outcome = self.abort
        if outcome is not None:
            self.result.decision, self.result.reason = outcome.decision, outcome.reason

    # -- facts -------------------------------------------------------------------
    @property
    def attempt(self) -> int:
        return self.point.attempt

    @property
    def resuming(self) -> bool:
        return self.point.resuming

    @property
    def served_model(self) -> str:
        return self.engines[BASELINE].served_model_name

    @property
    def canary_arm(self) -> ArmConfig:
        """The arm in the canary's seat: the config's canary, or, once a candidate won, that candidate's arm
        (the config itself never changes during a run: which candidate sits there is `result.winner`)."""
        if self.result.winner:
            return next(c for c in self.cfg.candidates if c.name == self.result.winner).arm()
        return self.cfg.canary

    @property
    def speculative_canary(self) -> bool:
        return self.engines[CANARY].num_speculative_tokens > 0

    @property
    def traffic(self) -> TrafficPlan:
        return TrafficPlan(self.cfg, self.served_model)

    def replica_arms(self) -> dict[str, str]:
        return {h.name: h.arm for h in self.fleet.replicas}

    def leased_actors(self) -> list[Any]:
        actors = [h.actor for h in self.fleet.replicas] if self.fleet is not None else []
        if self.router is not None:
            actors.append(self.router.actor)
        return actors + list(self.leased.values())

    # -- the run's log -----------------------------------------------------------
    def say(self, message: str) -> None:
        self.progress(f"[{time.strftime('%H:%M:%S')}] {message}")

    def tick(self, task: str, done: int, total: int) -> None:
        """Where a sized task stands (a bar on a terminal: rollout.run.progress_display); a progress
        callable without `advance` (a plain function, a test's list.append) only gets lines."""
        advance = getattr(self.progress, "advance", None)
        if advance is not None:
            advance(task, done, total)

    def event(self, phase: str, event: str, reason: str = "") -> None:
        entry = self.store.add_event(self.run_id, phase, event, reason, canary_weight=self.canary_weight)
        self.result.timeline.append(entry)
        self.store.update_run(self.run_id, phase=phase)

    def set_canary_weight(self, weight: float, phase: str, reason: str) -> None:
        """The canary's share of the router's traffic, then of the real traffic (cfg.weight_hook):
        a hook that does not confirm the weight is an InfrastructureError (where the traffic is,
        is then unknown: no verdict)."""
        self.router.set_canary_weight(weight)
        self.canary_weight = weight
        # the phase with it, in one write: a reader of the row (status, the live /metrics) never sees
        # the new weight under the phase before it (the finish's 100% while the row still said experiment)
        self.store.update_run(self.run_id, canary_weight=weight, phase=phase)
        hooked = ""
        if self.cfg.weight_hook is not None:
            try:
                call = call_weight_hook(self.cfg.weight_hook, weight, self.run_id, phase, reason)
            except WeightHookError as exc:
                self.event(phase, "weights", f"canary {weight:g}% on the router; {exc}")
                raise InfrastructureError(str(exc)) from None
            hooked = f" (weight_hook: {call.seconds:.1f} s)"
        self.event(phase, "weights", f"canary {weight:g}%: {reason}{hooked}")

    def aborted(self, phase: str) -> bool:
        """`mtp-canary abort RUN_ID` arrived: the phase stops early, and the decision is ROLLBACK (the canary
        never got traffic weight), kept in `abort` until the controller records it when the phase returns."""
        if self.store.take_command(self.run_id, accept=("abort",)) is None:
            return False
        self.abort = aborted_by_command(phase)
        self.say(f"{phase}: abort command received: rolling back")
        self.event(phase, "abort", "abort command")
        return True

    def replica_node(self, name: str) -> str | None:
        """Where a replica ran, for a cause line: 'on node IP', and 'lost: Ray lists it dead' when its
        node is gone (a raylet or host that died takes every replica on it); None when unknown."""
        handle = next((h for h in (self.fleet.replicas if self.fleet is not None else []) if h.name == name), None)
        node_ip = handle.status.node_ip if handle is not None and handle.status is not None else None
        if not node_ip:
            return None
        try:
            nodes = [n for n in ray.nodes() if n.get("NodeManagerAddress") == node_ip]
        except Exception:  # Ray cannot say: the IP alone
            nodes = []
        lost = bool(nodes) and not any(n.get("Alive") for n in nodes)
        return f"on node {node_ip}" + (" (lost: Ray lists the node dead)" if lost else "")

    def replicas_alive(self) -> dict[str, bool | None]:
        """Replica name (and ROUTER) -> alive (True), down (False) or no answer in time (None: the
        server, or its actor, is silent; ReplicaWatch calls a long silence a stall)."""
        alive: dict[str, bool | None] = {}
        if self.router is not None:
            alive[ROUTER_WATCH_NAME] = self.router.alive()
        if self.fleet is None:
            return alive
        for handle in self.fleet.replicas:
            try:
                answer = ray.get(handle.actor.liveness.remote(), timeout=10)
            except ray.exceptions.GetTimeoutError:
                answer = None
            except ray.exceptions.RayError:
                answer = False  # the actor itself is gone
            alive[handle.name] = None if answer is None else bool(answer)
        return alive
