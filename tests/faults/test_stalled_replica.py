"""Fault corpus: a replica that stalls (SIGSTOP) mid-stream in the experiment.

A stalled server fails nothing fast: its requests wait for the router's timeouts, and a
stalled *baseline* makes the canary look better on every one-sided gate. The phase must end
as an infrastructure error naming the replica, never a verdict. Real Router actor, real
Locust, real SQLite; the replicas are the named fault target (benchmarks/stream_target.py),
whose /health stops answering when the process is stopped, as vLLM's does.
"""

from __future__ import annotations

import os
import signal

import pytest
import requests

from benchmarks.stream_target import TargetProcess
from rollout.config import ExperimentConfig
from rollout.run.phases import replica_watch
from rollout.run.context import InfrastructureError
from rollout.run.store import RunStore
from tests.experiment_harness import GATES, once_the_load_flows, routed, run_experiment


def health(url: str) -> bool | None:
    """What a replica actor's liveness() answers: True 200, False refused or not 200, None no answer in time."""
    try:
        return requests.get(f"{url}/health", timeout=1.0).status_code == 200
    except requests.Timeout:
        return None
    except requests.ConnectionError:
        return False


def test_a_baseline_stopped_mid_stream_ends_the_experiment_as_an_error_naming_it(local_ray, tmp_path, monkeypatch):
    monkeypatch.setattr(replica_watch, "STALL_AFTER_S", 8.0)  # 45 s in a run; the rule, not the wait, is tested
    exp = ExperimentConfig(requests_per_look=40, requests_per_arm=2000, window_s=1, users_per_replica=3, max_tokens=12,
                           max_duration_s=240, workers=1, worker_placement="local")
    # the canary is faster: a verdict built on a stalled baseline would lean its way
    with TargetProcess(ttft_ms=20, tpot_ms=20) as baseline, TargetProcess(ttft_ms=20, tpot_ms=10) as canary:
        urls = {"baseline-0": baseline.url, "canary-0": canary.url}
        records = tmp_path / "experiment" / "records.jsonl"
        try:
            # mid-stream on any machine: after records exist
            with once_the_load_flows(records, lambda: os.kill(baseline._process.pid, signal.SIGSTOP)) as stopped_at:
                with routed(baseline.url, canary.url) as (router, url):
                    with pytest.raises(InfrastructureError, match=r"replica baseline-0 stalled \(no answer to /health"):
                        run_experiment(tmp_path, router, url, exp, GATES,
                                       replicas_alive=lambda: {name: health(u) for name, u in urls.items()})
        finally:
            os.kill(baseline._process.pid, signal.SIGCONT)  # so that the target's own teardown can stop it
    assert stopped_at, "the load never flowed"
    store = RunStore(tmp_path / "history.db")
    # no look was judged on the stalled baseline: every stored verdict predates the stall
    assert store.count_request_samples("exp", "experiment") > 0
