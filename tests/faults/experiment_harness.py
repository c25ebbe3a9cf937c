"""The experiment phase over stand-in replicas with every seam of its context open (what the
controller wires from its fleet: scrape, replica arms, liveness), for the fault corpus."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cluster.router import RouterClient
from loadtests.options import TrafficOptions
from loadtests.swarm import SwarmSpec
from rollout.config import ExperimentConfig
from rollout.judge.config import GatesConfig
from rollout.phases.experiment_loop import LOAD_STOP_TIMEOUT_S, ExperimentContext, ExperimentPhase
from rollout.store import RunStore


def run_experiment(
    tmp_path, router: Any, router_url: str, exp: ExperimentConfig, gates: GatesConfig, *,
    web_port: int | None = None,
    scrape: Callable[[], dict] = lambda: {},
    replica_arms: dict[str, str] | None = None,
    speculative_canary: bool = False,
    replicas_alive: Callable[[], dict[str, bool | None]] = lambda: {},
):
    """(outcome, store, progress lines) of one experiment phase through `router_url`."""
    store = RunStore(tmp_path / "history.db")
    store.create_run("exp", "test", "target", {})
    out = tmp_path / "experiment"
    traffic = TrafficOptions(
        dataset="synthetic", input_tokens="8", max_tokens=exp.max_tokens, model="target",
        records=str(out / "records.jsonl"), ignore_eos=True, tag="experiment", arm_pin="baseline,canary", seed=1,
    )
    spec = SwarmSpec(
        host=router_url, traffic=traffic, users=exp.users_per_replica * 2, run_time_s=int(exp.max_duration_s + 120),
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
        )
    )
    return phase.run(), store, lines
