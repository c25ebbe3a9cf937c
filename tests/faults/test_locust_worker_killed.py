"""Fault corpus: a Locust worker SIGKILLed mid-experiment.

Its users' requests stop: the arms' counts and the records no longer mean the load the plan
asked for. The phase must end as an error naming the worker (the controller's exit 1), not
judge what the survivors sent; no Locust process may be left. Real Router actor, real Locust
(its worker under a Ray actor), real SQLite; the replicas are the named benchmark target.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from benchmarks.stream_target import TargetProcess
from loadtests.swarm import SwarmError
from rollout.config import ExperimentConfig
from tests.conftest import wait_until_gone
from tests.experiment_harness import GATES, once_the_load_flows, routed, run_experiment


def locust_of(router_url: str) -> tuple[psutil.Process | None, list[psutil.Process]]:
    """This load's master (its --host is this test's router) and the workers of its port: no other
    test's Locust on the machine is touched."""
    master, port = None, None
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "locust" in cmd and "--master" in cmd and router_url in cmd:
            master, port = proc, cmd[cmd.index("--master-bind-port") + 1]
    workers = []
    if port is not None:
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if "locust" in cmd and "--worker" in cmd and cmd[cmd.index("--master-port") + 1] == port:
                workers.append(proc)
    return master, workers


def test_a_locust_worker_killed_mid_experiment_ends_it_as_an_error_naming_it(local_ray, tmp_path):
    exp = ExperimentConfig(requests_per_look=40, requests_per_arm=2000, window_s=1, users_per_replica=3, max_tokens=12,
                           max_duration_s=240, workers=1, worker_placement="local")
    with TargetProcess(ttft_ms=20, tpot_ms=20) as baseline, TargetProcess(ttft_ms=20, tpot_ms=10) as canary:
        records = tmp_path / "experiment" / "records.jsonl"
        seen: dict[str, list[int]] = {}
        with routed(baseline.url, canary.url) as (router, url):

            def kill_the_worker() -> bool:
                master, workers = locust_of(url)
                if not workers:
                    return False  # not up yet: look again at the next poll
                seen["pids"] = [p.pid for p in [master, *workers] if p is not None]
                os.kill(workers[0].pid, signal.SIGKILL)
                return True

            with once_the_load_flows(records, kill_the_worker) as killed:
                with pytest.raises(SwarmError, match=r"locust worker 0 died"):
                    run_experiment(tmp_path, router, url, exp, GATES)
    assert killed, "the load never flowed"
    assert time.monotonic() - killed[0] < 60  # at once, not at max_duration_s
    assert wait_until_gone(seen["pids"], 15) == [], "Locust processes of this load outlived it"
