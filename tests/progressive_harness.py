"""What the progressive-phase tests share: a controller stand-in (the callables
`run_progressive` gets, recording what happened) and checks of what a phase left behind.

Used by tests/test_progressive.py (stream-target upstreams) and tests/test_fleet.py (real
vLLM replicas)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import ray

from cluster.metrics import MetricsSnapshot
from cluster.router import RouterClient
from loadtests.records import read_records
from rollout.config import ProgressiveConfig
from rollout.run.phases.progressive_context import ProgressiveContext, ProgressiveOutcome
from rollout.run.phases.progressive_steps import PHASE
from rollout.run.store import RunStore


def locust_processes(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


class Harness:
    """A controller stand-in: the callables run_progressive gets, recording what happened."""

    def __init__(self, tmp_path: Path, run_id: str, router, router_url: str, replicas: dict[str, Any],
                 scrape: Callable[[], dict[str, MetricsSnapshot]], alive: Callable[[], dict[str, bool]]):
        self.run_id = run_id
        self.runs_dir = tmp_path / "runs"
        self.store = RunStore(self.runs_dir / "history.db")
        self.store.create_run(run_id, "test", "m", {"baseline": {}, "canary": {}})
        self.router = router
        self.router_url = router_url
        self.replicas = replicas
        self._scrape = scrape
        self._alive = alive
        self.weight_log: list[tuple[float, float, str]] = []  # (time, weight, reason)
        self.lines: list[str] = []

    def set_canary_weight(self, weight: float, reason: str) -> None:
        ray.get(self.router.set_weights.remote({"baseline": 100.0 - weight, "canary": weight}))
        self.weight_log.append((time.time(), weight, reason))
        self.store.add_event(self.run_id, PHASE, "weights", f"canary {weight:g}%: {reason}", canary_weight=weight)

    def event(self, event: str, reason: str) -> None:
        weight = self.weight_log[-1][1] if self.weight_log else 0.0
        self.store.add_event(self.run_id, PHASE, event, reason, canary_weight=weight)

    def say(self, line: str) -> None:
        self.lines.append(line)
        print(f"progressive: {line}", flush=True)

    def context(self, config: ProgressiveConfig, model: str, speculative: bool, traffic: dict | None = None,
                n_workers: int = 0) -> ProgressiveContext:
        return ProgressiveContext(
            run_id=self.run_id,
            run_dir=self.runs_dir / self.run_id,
            config=config,
            router=RouterClient(self.router, self.router_url),
            model=model,
            traffic=traffic or {"dataset": "synthetic", "input_tokens": "8", "max_tokens": 16, "endpoint": "completions", "seed": 1},
            set_canary_weight=self.set_canary_weight,
            event=self.event,
            say=self.say,
            scrape=self._scrape,
            replica_arms={name: arm for name, (arm, _) in self.replicas.items()},
            replicas_alive=self._alive,
            store=self.store,
            speculative_canary=speculative,
            n_workers=n_workers,
        )

    def events(self) -> list[tuple[str, str]]:
        return [(e["event"], e["reason"]) for e in self.store.events(self.run_id)]

    def window_results(self) -> list[dict]:
        return self.store.phase_results(self.run_id, PHASE)

    def check_records(self) -> None:
        """Every record the master wrote is in the store once, and nothing else."""
        records = read_records(self.runs_dir / self.run_id / PHASE / "records.jsonl")
        stored = self.store.request_samples(self.run_id, PHASE)
        assert len(stored) == len(records) == self.store.count_request_samples(self.run_id, PHASE)
        windows = [w for w, _ in stored]
        assert windows == sorted(windows)


def assert_split_within_a_block(outcome: ProgressiveOutcome, block: int = 10) -> None:
    """The router's real guarantee: in every step the canary's routed count is within one shuffled
    block (10 requests) of its weight's share, however few requests the step had."""
    for step in outcome.observed_split:
        routed = step["routed"]
        total = sum(routed.values())
        assert total > 0, step
        assert abs(routed["canary"] - total * step["canary_weight"] / 100) <= block + 1, step


def assert_split_follows(outcome: ProgressiveOutcome, tolerance: float) -> None:
    for step in outcome.observed_split:
        share = step["observed_canary_share"]
        assert share is not None, step
        assert abs(share * 100 - step["canary_weight"]) <= tolerance, step
