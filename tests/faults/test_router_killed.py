"""Fault corpus: the router actor killed mid-experiment.

Every request then fails to connect, on both arms alike: no verdict may come out of that,
and nothing of the load may be left behind. Real Router actor, real Locust, real SQLite;
the replicas are the named benchmark target (benchmarks/stream_target.py).
"""

from __future__ import annotations

import time

import pytest
import ray

from benchmarks.stream_target import TargetProcess
from cluster.router import ROUTER_WATCH_NAME, Router, RouterClient
from rollout.config import ExperimentConfig
from rollout.run.context import InfrastructureError
from tests.experiment_harness import GATES, once_the_load_flows, run_experiment


def test_a_router_killed_mid_experiment_ends_it_as_an_error(local_ray, tmp_path):
    exp = ExperimentConfig(requests_per_look=40, requests_per_arm=2000, window_s=1, users_per_replica=3, max_tokens=12,
                           max_duration_s=240, workers=1, worker_placement="local")
    with TargetProcess(ttft_ms=20, tpot_ms=20) as baseline, TargetProcess(ttft_ms=20, tpot_ms=10) as canary:
        router = Router.remote(initial_weights={"baseline": 100.0, "canary": 0.0}, seed=0)
        url = ray.get(router.start.remote())
        ray.get(router.set_arms.remote({"baseline": [baseline.url], "canary": [canary.url]}))
        records = tmp_path / "experiment" / "records.jsonl"
        client = RouterClient(router, url)
        with once_the_load_flows(records, lambda: ray.kill(router)) as killed:
            with pytest.raises(InfrastructureError, match="experiment: router died") as error:
                # what RunContext.replicas_alive answers for the router (replicas: no evidence here)
                run_experiment(tmp_path, router, url, exp, GATES, replicas_alive=lambda: {ROUTER_WATCH_NAME: client.alive()})
    assert killed, "the load never flowed"
    assert time.monotonic() - killed[0] < 60, error.value  # seen within a few polls, not at the cap
