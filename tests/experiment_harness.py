"""The experiment phase over stand-in replicas (benchmarks/stream_target.py) behind a real Router
actor, with every seam of its context open (what the controller wires from its fleet: scrape,
replica arms, liveness): for tests/test_experiment.py and the fault corpus (tests/faults/)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray

from cluster.router import Router, RouterClient
from loadtests.options import TrafficOptions
from loadtests.swarm import SwarmSpec
from rollout.config import ExperimentConfig
from rollout.judge.config import GatesConfig
from rollout.run.phases.experiment_loop import LOAD_STOP_TIMEOUT_S, ExperimentContext, ExperimentPhase
from rollout.run.store import RunStore


@contextmanager
def routed(baseline_url: str, canary_url: str, **more_arms: str):
    """A real Router actor over the targets (`more_arms`: arm name -> URL, e.g. candidates):
    (actor, url), stopped and killed at the end."""
    router = Router.remote(initial_weights={"baseline": 100.0, "canary": 0.0}, seed=0)
    try:
        url = ray.get(router.start.remote())
        arms = {"baseline": [baseline_url], "canary": [canary_url]} if canary_url else {"baseline": [baseline_url]}
        ray.get(router.set_arms.remote({**arms, **{arm: [u] for arm, u in more_arms.items()}}))
        yield router, url
    finally:
        ray.get(router.stop.remote())
        ray.kill(router)


@contextmanager
def once_the_load_flows(records: Path, act: Callable[[], bool | None], min_records: int = 20) -> Iterator[list[float]]:
    """Call `act` once `records` holds `min_records` records (mid-load on a machine of any speed), again
    at each poll while it returns False; yields the list that gets the monotonic time it acted at."""
    acted: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if records.exists() and records.read_text().count("\n") >= min_records and act() is not False:
                acted.append(time.monotonic())
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield acted
    finally:
        stop.set()
        watcher.join(5)


# These tests are about when the phase looks and stops, so only the objective and a lenient error
# guard judge: acceptance has no /metrics here, and the TTFT p95 guard would judge the CPU
# contention of a slow machine (router, Locust and pytest on the same cores), not the targets.
GATES = GatesConfig(min_acceptance_length=None, error_rate_max_increase=0.5, min_requests_per_arm=20,
                    enabled=["tpot_p50_improvement", "error_rate_guard"])


def run_experiment(
    tmp_path, router: Any, router_url: str, exp: ExperimentConfig, gates: GatesConfig, *,
    web_port: int | None = None,
    scrape: Callable[[], dict] = lambda: {},
    replica_arms: dict[str, str] | None = None,
    speculative_canary: bool = False,
    replicas_alive: Callable[[], dict[str, bool | None]] = lambda: {},
    ticks: list[tuple[str, int, int]] | None = None,
    candidates: tuple[str, ...] = (),
):
    """(outcome, store, progress lines) of one experiment phase through `router_url`; `ticks`
    gets the progress bar's feed."""
    store = RunStore(tmp_path / "history.db")
    store.create_run("exp", "test", "target", {})
    out = tmp_path / "experiment"
    arms = ("baseline", *candidates) if candidates else ("baseline", "canary")
    traffic = TrafficOptions(
        dataset="synthetic", input_tokens="8", max_tokens=exp.max_tokens, model="target",
        records=str(out / "records.jsonl"), ignore_eos=True, tag="experiment", arm_pin=",".join(arms), seed=1,
    )
    spec = SwarmSpec(
        host=router_url, traffic=traffic, users=exp.users_per_replica * len(arms), run_time_s=int(exp.max_duration_s + 120),
        n_workers=1, stop_timeout_s=LOAD_STOP_TIMEOUT_S, log_dir=out / "locust",
        web_ui=web_port is not None, web_port=web_port or 8089,
    )
    lines: list[str] = []
    phase = ExperimentPhase(
        ExperimentContext(
            run_id="exp", config=exp, gates=gates, store=store, swarm_spec=spec, placement="local",
            scrape=scrape, replica_arms=replica_arms or {}, router=RouterClient(router, router_url),
            speculative_canary=speculative_canary, say=lines.append, event=lambda event, reason: None,
            aborted=lambda: False, replicas_alive=replicas_alive,
            candidates=candidates, speculative=dict.fromkeys(candidates, speculative_canary),
            tick=(lambda *tick: ticks.append(tick)) if ticks is not None else (lambda task, done, total: None),
        )
    )
    return phase.run(), store, lines
