"""What the progressive phase needs from the run and what it returns: the phase's typed boundary
(callables keep it testable without a controller: tests/progressive_harness.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.load_runner import start_load_runner
from cluster.metrics import MetricsSnapshot
from cluster.router import RouterClient
from loadtests.swarm import SwarmSpec
from rollout.config import ProgressiveConfig
from rollout.judge.verdicts import Decision, GateResult
from rollout.run.store import RunStore


@dataclass
class ProgressiveContext:
    """What the progressive phase needs from the controller (callables keep it testable)."""

    run_id: str
    run_dir: Path
    config: ProgressiveConfig
    router: RouterClient
    model: str  # served model name
    traffic: dict[str, Any]  # TrafficOptions fields of the background load (dataset, input_tokens, ...)
    set_canary_weight: Callable[[float, str], None]  # applies at once on the router and records the event
    event: Callable[[str, str], None]  # timeline event (event, reason) in phase "progressive"
    say: Callable[[str], None]
    scrape: Callable[[], dict[str, MetricsSnapshot]]  # replica name -> /metrics snapshot
    replica_arms: dict[str, str]  # replica name -> arm
    replicas_alive: Callable[[], dict[str, bool]]  # replica name -> alive
    store: RunStore
    speculative_canary: bool
    first_step: int = 0  # resume: index of the first step to run (earlier ones are done)
    n_workers: int = 1  # Locust worker processes (0: one local process)
    # the LoadRunner actor for a swarm spec (the controller names it per run; detached)
    start_load: Callable[[SwarmSpec], Any] = start_load_runner  # default: an unnamed LoadRunner on this node
    # resume: an earlier attempt's LoadRunner still running (stopped gracefully, its records stored)
    previous_load: Any = None
    master_bind_host: str = "127.0.0.1"  # 0.0.0.0 when Locust workers run on other nodes
    tick: Callable[[str, int, int], None] = lambda task, done, total: None  # a progress bar's feed


@dataclass
class ProgressiveOutcome:
    decision: Decision  # PROMOTE, ROLLBACK, or INCONCLUSIVE (the last step never had enough canary data)
    reason: str
    guards: list[GateResult]  # the failing ones on abort; the last step's pooled verdicts otherwise
    steps_completed: int
    observed_split: list[dict]  # per step: asked weight, canary share from the router's counts
    windows: int = 0  # guard windows judged
    records: int = 0  # request records stored for this phase
    rolled_back_at: float | None = None  # wall time the canary weight went to 0 (abort only)
    load_error: str | None = None  # the swarm's complaint at the end (records incomplete), if any
    # requests the router received during the phase (all attempts; None if the router was replaced)
    requests_received: int | None = None
    records_stored: int | None = None  # request records of the phase in the store (all attempts)
