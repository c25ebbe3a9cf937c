"""Fault corpus: the Locust master SIGKILLed mid-experiment.

The master holds the records file and the collection's tally: killed, the records stop and
what it had not written is lost. The phase must end as an error naming the master (the
controller's exit 1), never judge the records it left; its workers must not outlive it. Real
Router actor, real Locust (master and a worker under the Swarm), real SQLite; the replicas are
the named benchmark target.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from benchmarks.stream_target import TargetProcess
from loadtests.swarm import SwarmError
from rollout.config import ExperimentConfig
from tests.conftest import wait_until_gone
from tests.experiment_harness import GATES, once_the_load_flows, routed, run_experiment
from tests.faults.test_locust_worker_killed import locust_of


def test_the_locust_master_killed_mid_experiment_ends_it_as_an_error_naming_it(local_ray, tmp_path):
    exp = ExperimentConfig(requests_per_look=40, requests_per_arm=2000, window_s=1, users_per_replica=3, max_tokens=12,
                           max_duration_s=240, workers=1, worker_placement="local")
    with TargetProcess(ttft_ms=20, tpot_ms=20) as baseline, TargetProcess(ttft_ms=20, tpot_ms=10) as canary:
        records = tmp_path / "experiment" / "records.jsonl"
        seen: dict[str, list[int]] = {}
        with routed(baseline.url, canary.url) as (router, url):

            def kill_the_master() -> bool:
                master, workers = locust_of(url)
                if master is None or not workers:
                    return False  # not up yet: look again at the next poll
                seen["pids"] = [p.pid for p in [master, *workers]]
                os.kill(master.pid, signal.SIGKILL)
                return True

            with once_the_load_flows(records, kill_the_master) as killed:
                with pytest.raises(SwarmError, match=r"master"):
                    run_experiment(tmp_path, router, url, exp, GATES)
    assert killed, "the load never flowed"
    assert time.monotonic() - killed[0] < 90  # at once, not at max_duration_s
    assert wait_until_gone(seen["pids"], 15) == [], "Locust processes of this load outlived it"
