"""The fleet's clocks and bundles on the GPU path: one startup_timeout_s per engine that the
fleet's own clock fits around, a placement timeout long enough for an autoscaler on GPU, and
bundles that reserve CPUs beside the GPUs (on a fake GPU cluster: ray.cluster_utils.Cluster)."""

from __future__ import annotations

import time

import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.engine_spec import EngineSpec
from cluster.fleet import ArmSpec, Fleet, FleetStartError
from cluster.placement import auto_worker_nodes, replica_bundle
from rollout.config import ConfigError, load_config, parse_config
from tests.conftest import REPO


def config(device: str = "gpu", engine_s: float = 1800, **top) -> dict:
    engine = {"model": "m", "served_model_name": "m", "device": device, "startup_timeout_s": engine_s,
              "tensor_parallel_size": 4 if device == "gpu" else 1}
    return {"name": "t", "baseline": {"engine": engine}, "canary": {"engine": engine},
            "accuracy": {"enabled": False}, **top}


def test_the_fleet_clock_defaults_to_placement_plus_the_slowest_engine():
    gpu = parse_config(config("gpu", 1800))
    assert gpu.placement_timeout_s == 900 and gpu.startup_timeout_s == 900 + 1800 + 60
    assert gpu.baseline.cpus_per_replica == 6  # tp 4 + API server + engine core
    cpu = parse_config(config("cpu", 300))
    assert cpu.placement_timeout_s == 60 and cpu.startup_timeout_s == 60 + 300 + 60
    assert cpu.baseline.cpus_per_replica == 0
    slower = config("gpu", 600)
    slower["canary"] = {"engine": {**slower["canary"]["engine"], "startup_timeout_s": 2400}}
    assert parse_config(slower).startup_timeout_s == 900 + 2400 + 60


def test_a_fleet_clock_shorter_than_placement_plus_engine_is_a_config_error():
    with pytest.raises(ConfigError, match=r"startup_timeout_s: 900 s is shorter than placement_timeout_s \(900 s\) "
                                          r"\+ the longest engine.startup_timeout_s \(1800 s\) = 2700 s"):
        parse_config(config("gpu", 1800, startup_timeout_s=900))
    assert parse_config(config("gpu", 1800, startup_timeout_s=2700)).startup_timeout_s == 2700
    # a short placement clock is allowed when the user says so (a fixed cluster)
    assert parse_config(config("gpu", 1800, placement_timeout_s=120)).startup_timeout_s == 120 + 1800 + 60


def test_a_dumped_config_reads_back_the_same_clocks():
    cfg = parse_config(config("gpu", 1800))
    again = parse_config(cfg.model_dump(mode="json"))
    assert (again.placement_timeout_s, again.startup_timeout_s) == (cfg.placement_timeout_s, cfg.startup_timeout_s)


def test_mimo_config_gives_its_engines_their_1800_s():
    cfg = load_config(REPO / "configs" / "mimo-v2.5-mtp.yaml")
    assert cfg.baseline.engine.startup_timeout_s == cfg.canary.engine.startup_timeout_s == 1800
    assert cfg.startup_timeout_s >= cfg.placement_timeout_s + 1800 and cfg.placement_timeout_s >= 900
    assert cfg.baseline.cpus_per_replica == cfg.canary.cpus_per_replica == 6


def test_fleet_start_clock_follows_its_engines():
    engine = EngineSpec(model="m", tensor_parallel_size=2, startup_timeout_s=1800)
    fleet = Fleet([ArmSpec(name="baseline", engine=engine)], log_dir="/tmp/unused", placement_timeout_s=900)
    assert fleet.start_timeout_s() == 900 + 1800 + 60


def test_bundles_reserve_cpus_beside_gpus_only_on_gpu():
    assert replica_bundle(EngineSpec(model="m", tensor_parallel_size=4), 6) == {"GPU": 4.0, "CPU": 6.0}
    assert replica_bundle(EngineSpec(model="m", tensor_parallel_size=4), 0) == {"GPU": 4.0}
    assert replica_bundle(EngineSpec(model="m", device="cpu"), 8) == {"CPU": 0.001}


def test_auto_worker_nodes_are_the_cpu_only_ones_when_both_kinds_exist():
    gpu = {"NodeID": "g", "Alive": True, "Resources": {"CPU": 64, "GPU": 8}}
    cpu = {"NodeID": "c", "Alive": True, "Resources": {"CPU": 16}}
    head0 = {"NodeID": "h", "Alive": True, "Resources": {"CPU": 0}}  # KubeRay head with num-cpus 0
    dead = {"NodeID": "d", "Alive": False, "Resources": {"CPU": 16}}
    assert auto_worker_nodes([gpu, cpu, head0, dead]) == ["c"]
    assert auto_worker_nodes([gpu, head0]) is None
    assert auto_worker_nodes([cpu]) is None


@pytest.fixture(scope="module")
def gpu_cluster():
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    cluster.add_node(num_cpus=4, num_gpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_a_gpu_replica_holds_its_cpus_and_the_fleet_waits_out_placement_saying_so(gpu_cluster, tmp_path):
    engine = EngineSpec(model="m", tensor_parallel_size=2)
    said: list[str] = []
    fleet = Fleet([ArmSpec(name="baseline", engine=engine, cpus_per_replica=3)], log_dir=str(tmp_path),
                  progress=said.append)
    try:
        fleet.create_actors()
        table = ray.util.placement_group_table(fleet._placement_group)
        assert table["bundles"][0] == {"GPU": 2.0, "CPU": 3.0}
        assert _free("CPU", 1 + 4 - 3)  # the GPU node's 4 CPUs less the replica's 3
    finally:
        fleet.teardown()
    assert _free("CPU", 5) and _free("GPU", 2)
    # 3 CPUs beside 2 GPUs twice: the node has 4; placement waits, says so, gives up naming the field
    big = Fleet([ArmSpec(name="baseline", engine=engine, cpus_per_replica=3, replicas=2)], log_dir=str(tmp_path),
                progress=said.append, placement_timeout_s=2.5)

    started = time.monotonic()
    with pytest.raises(FleetStartError, match=r"within 2.5 s \(placement_timeout_s\)"):
        big.create_actors()
    assert time.monotonic() - started >= 2.5
    assert _free("GPU", 2)


def test_wait_placement_reports_while_it_waits(gpu_cluster):
    from ray.util.placement_group import placement_group, remove_placement_group

    from cluster.fleet import _wait_placement

    said: list[str] = []
    pg = placement_group([{"GPU": 8.0}])
    try:
        assert not _wait_placement(pg, 2.0, said.append, every_s=0.5)
    finally:
        remove_placement_group(pg)
    assert said and all("placement_timeout_s" in line for line in said)


def _free(resource: str, expected: float, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get(resource, 0) != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
