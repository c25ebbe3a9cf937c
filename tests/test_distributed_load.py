"""Locust workers under Ray actors (local Ray, 2 CPUs), against the benchmark stream target:
the generic supervised-process actor, placement, a complete distributed run, and failing
closed when a worker or its actor dies, with no process left behind."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import ray  # noqa: E402

from benchmarks.stream_target import TargetProcess  # noqa: E402
from cluster.distributed_load import DistributedSwarm, run_distributed_swarm  # noqa: E402
from cluster.process import placement_options, supervised_process_actor  # noqa: E402
from loadtests.options import TrafficOptions  # noqa: E402
from loadtests.records import read_records  # noqa: E402
from loadtests.swarm import SwarmError, SwarmSpec  # noqa: E402
from tests.conftest import alive, wait_until_gone  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    os.environ["MTP_TEST_DROPPED"] = "inherited"  # the actors inherit it; a start may drop it
    # a new instance of its own: ray.init() would join a `ray start`ed cluster on this machine
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    yield
    ray.shutdown()
    os.environ.pop("MTP_TEST_DROPPED", None)


def test_ray_side_and_locust_side_import_nothing_of_each_other():
    ray_side = ("import sys, cluster.distributed_load, cluster.process; "
                "assert not {'gevent', 'locust', 'geventhttpclient'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", ray_side], cwd=REPO, check=True)
    locust_side = ("import sys, loadtests.locustfile, loadtests.swarm, loadtests.health, loadtests.profiles; "
                   "bad = {m for m in sys.modules if m == 'ray' or m.startswith(('ray.', 'cluster', 'rollout'))}; "
                   "assert not bad, bad")
    subprocess.run([sys.executable, "-c", locust_side], cwd=REPO, check=True, capture_output=True)


def test_placement_strings():
    assert placement_options("spread") == {"scheduling_strategy": "SPREAD"}
    assert placement_options("pack") == {"scheduling_strategy": "DEFAULT"}
    assert placement_options("label:role=loadgen, zone=a") == {"label_selector": {"role": "loadgen", "zone": "a"}}
    assert placement_options("resource:loadgen") == {"resources": {"loadgen": 1.0}}
    assert placement_options("resource:loadgen=0.5") == {"resources": {"loadgen": 0.5}}
    for bad in ("everywhere", "label:role", "resource:", "resource:x=-1", "spread:1"):
        with pytest.raises(ValueError):
            placement_options(bad)


def test_supervised_process_runs_reports_and_stops(local_ray, tmp_path):
    actor = supervised_process_actor("probe", num_cpus=0, placement="pack", log_dir=str(tmp_path))
    failing = supervised_process_actor("failing", num_cpus=0, log_dir=str(tmp_path))
    missing = supervised_process_actor("missing", num_cpus=0, log_dir=str(tmp_path))
    try:
        script = ('echo "hello $GREETING parent=$OWNER_PID dropped=${MTP_TEST_DROPPED:-yes}"; '
                  "sleep 60 & wait")
        status = ray.get(actor.start.remote(["sh", "-c", script], {"GREETING": "world"},
                                            unset_env_prefixes=("MTP_TEST_",), parent_pid_env="OWNER_PID"))
        info = ray.get(actor.node_info.remote([str(tmp_path), "/no/such/path"]))
        assert status.started and status.alive and status.exit_code is None and status.error is None
        assert info.paths_present == {str(tmp_path): True, "/no/such/path": False}
        assert psutil.Process(status.pid).ppid() == info.actor_pid  # a child of the actor, not of this driver
        children = []
        for _ in range(50):
            status = ray.get(actor.status.remote())
            children = psutil.Process(status.pid).children()
            if children and status.log_tail[1:]:
                break
            time.sleep(0.1)
        assert status.log_tail[1:] == [f"hello world parent={info.actor_pid} dropped=yes"]
        stopped = ray.get(actor.stop.remote(5.0))
        assert not stopped.alive and stopped.exit_code == -signal.SIGTERM
        assert wait_until_gone([status.pid] + [c.pid for c in children], 5.0) == []  # the whole group

        ray.get(failing.start.remote(["sh", "-c", "echo broken >&2; exit 3"]))
        done = ray.get(failing.wait.remote(10.0))
        assert (done.alive, done.exit_code, done.log_tail[-1]) == (False, 3, "broken")
        assert "could not start" in ray.get(missing.start.remote(["/no/such/binary"])).error
    finally:
        for each in (actor, failing, missing):
            ray.kill(each)


def test_a_killed_actor_takes_its_process_group_with_it(local_ray, tmp_path):
    actor = supervised_process_actor("orphan", num_cpus=0, log_dir=str(tmp_path))
    status = ray.get(actor.start.remote(["sh", "-c", "sleep 60 & sleep 60 & wait"], reaper_grace_s=1.0))
    deadline = time.monotonic() + 10
    while len(children := psutil.Process(status.pid).children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    group = [status.pid] + [c.pid for c in children]
    assert len(group) == 3
    ray.kill(actor)  # no stop(): the reaper must notice and end the group
    assert wait_until_gone(group, 10.0) == []


def test_workers_that_cannot_be_placed_fail_before_any_load(local_ray, tmp_path):
    spec = SwarmSpec(host="http://127.0.0.1:9", users=1, run_time_s=30, n_workers=1,
                     traffic=TrafficOptions(records=str(tmp_path / "r.jsonl")))
    swarm = DistributedSwarm(spec, placement="resource:no-such-node-resource", placement_timeout_s=2)
    with pytest.raises(SwarmError, match="could not place 1 locust worker"):
        swarm.run(timeout_s=60)
    assert swarm.pids == []  # the master never started
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2.0  # nothing holds the cluster's CPUs


def test_distributed_run_records_every_request_once(local_ray, tmp_path):
    # 8 s of load, not 3: at a quarter speed (benchmarks/slowed.sh 0.5) a 3 s run sent no request
    # at all (the workers' users start slowly on a CPU quota)
    with TargetProcess(ttft_ms=20, tpot_ms=5, tokens_per_chunk=4) as target:
        spec = SwarmSpec(host=target.url, users=4, run_time_s=8, n_workers=2, stop_timeout_s=10,
                         traffic=TrafficOptions(records=str(tmp_path / "records.jsonl"), max_tokens=33, rate=12.0,
                                                arrival="constant", tag="distributed"))
        parents = set()

        def note_worker_parents(progress):
            for pid in swarm.worker_pids:
                if alive(pid):
                    parents.add(psutil.Process(pid).ppid())

        swarm = DistributedSwarm(spec, "spread", on_progress=note_worker_parents, progress_interval_s=0.5)
        result = swarm.run(timeout_s=90)
        served = target.stats()
    records = read_records(result.records_path)
    assert result.n_records == len(records) == served["started"] == served["completed"] >= 25
    assert len({r.request_id for r in records}) == len(records)
    assert all(r.ok and r.tag == "distributed" and r.output_tokens == 33 for r in records)
    assert len({r.worker for r in records}) == 2 and result.worker_exit_codes == [0, 0]
    # the worker processes were children of their actors, never of this driver
    assert parents and os.getpid() not in parents
    # generator health: both workers' CPU, and the open-loop schedule kept
    generator = result.generator
    assert [w.cpu_s is not None and w.cpu_s > 0 for w in generator.workers] == [True, True]
    assert generator.scheduled_requests == len(records)
    assert (result.log_dir / "worker-0.log").exists() and (result.log_dir / "master.log").exists()
    assert wait_until_gone(swarm.pids, 5.0) == []


def test_a_worker_killed_mid_run_fails_the_run(local_ray, tmp_path):
    with TargetProcess(ttft_ms=10, tpot_ms=5) as target:
        spec = SwarmSpec(host=target.url, users=2, run_time_s=30, n_workers=2,
                         traffic=TrafficOptions(records=str(tmp_path / "r.jsonl"), max_tokens=10))
        killed = []

        def kill_a_worker_once_traffic_flows(progress):
            if progress.requests_done > 0 and not killed:
                killed.append(swarm.worker_pids[1])
                os.kill(killed[0], signal.SIGKILL)

        swarm = DistributedSwarm(spec, on_progress=kill_a_worker_once_traffic_flows, progress_interval_s=0.2)
        started = time.monotonic()
        with pytest.raises(SwarmError, match=r"locust worker 1 died with exit code -9"):
            swarm.run(timeout_s=90)
    assert time.monotonic() - started < 25  # at once, not at the end of the 30 s run
    assert wait_until_gone(swarm.pids, 5.0) == []


def test_a_dead_actor_fails_the_run_and_leaves_no_worker(local_ray, tmp_path):
    with TargetProcess(ttft_ms=10, tpot_ms=5) as target:
        spec = SwarmSpec(host=target.url, users=1, run_time_s=30, n_workers=1,
                         traffic=TrafficOptions(records=str(tmp_path / "r.jsonl"), max_tokens=10))
        state = {}

        def kill_the_actor_once_traffic_flows(progress):
            if progress.requests_done > 0 and not state:
                state["pids"] = list(swarm.pids)
                ray.kill(swarm.workers._actors[0])

        swarm = DistributedSwarm(spec, on_progress=kill_the_actor_once_traffic_flows, progress_interval_s=0.2)
        with pytest.raises(SwarmError, match=r"locust worker 0 died .*Ray actor died"):
            swarm.run(timeout_s=90)
    assert wait_until_gone(state["pids"], 10.0) == []  # the master killed, the worker reaped


def test_run_distributed_swarm_needs_workers(tmp_path):
    spec = SwarmSpec(host="http://127.0.0.1:9", users=1, run_time_s=1, n_workers=0,
                     traffic=TrafficOptions(records=str(tmp_path / "r.jsonl")))
    with pytest.raises(ValueError, match="n_workers"):
        run_distributed_swarm(spec)
