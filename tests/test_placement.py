"""GPU placement logic on a fake multi-node GPU cluster (ray.cluster_utils.Cluster)."""

import time

import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.engine_spec import EngineSpec
from cluster.fleet import ArmSpec, Fleet, FleetStartError


@pytest.fixture(scope="module")
def fake_gpu_cluster():
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1, num_gpus=4)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def tp4(k: int) -> EngineSpec:
    return EngineSpec(
        model="XiaomiMiMo/MiMo-V2.5",
        served_model_name="mimo",
        tensor_parallel_size=4,
        trust_remote_code=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
    )


def test_each_tp4_replica_gets_four_gpus_of_one_node(fake_gpu_cluster, tmp_path):
    fleet = Fleet(
        [ArmSpec(name="baseline", engine=tp4(1)), ArmSpec(name="canary", engine=tp4(3))],
        log_dir=str(tmp_path),
        progress=lambda m: None,
        bind_host="0.0.0.0",
    )
    try:
        handles = fleet.create_actors()
        planned = ray.get([h.actor.planned_launch.remote(8000) for h in handles])
        for cmd, env in planned:
            gpus = env["CUDA_VISIBLE_DEVICES"].split(",")
            assert len(gpus) == 4 and len(set(gpus)) == 4
            assert cmd[cmd.index("--tensor-parallel-size") + 1] == "4"
            assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
        # 2 replicas x 4 GPUs on 2 nodes of 4 GPUs: one whole node per replica.
        table = ray.util.placement_group_table(fleet._placement_group)
        assert len(set(table["bundles_to_node_id"].values())) == 2
        assert ray.available_resources().get("GPU", 0) == 0
    finally:
        fleet.teardown()
    assert gpus_free_within(8, 20)


def gpus_free_within(expected: float, timeout_s: float) -> bool:
    """Ray returns a removed placement group's resources asynchronously."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0) != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_fleet_the_cluster_cannot_hold_fails_at_once_naming_the_shortfall(fake_gpu_cluster, tmp_path):
    fleet = Fleet(
        [ArmSpec(name="baseline", engine=tp4(1), replicas=2), ArmSpec(name="canary", engine=tp4(3), replicas=2)],
        log_dir=str(tmp_path),
        progress=lambda m: None,
        placement_timeout_s=3,
    )
    with pytest.raises(FleetStartError, match="cannot place every replica"):
        fleet.start()
    assert gpus_free_within(8, 20)


def test_an_abandoned_detached_fleet_frees_its_gpus_when_its_leases_lapse(fake_gpu_cluster, tmp_path):
    # what a controller killed right after placing its fleet leaves: detached replicas in a
    # detached placement group, each leased once at creation and never renewed
    fleet = Fleet(
        [ArmSpec(name="baseline", engine=tp4(1)), ArmSpec(name="canary", engine=tp4(3))],
        log_dir=str(tmp_path),
        progress=lambda m: None,
        actor_name_prefix="abandoned-",
        namespace="test-abandoned",
        detached=True,
        lease_s=3,
    )
    fleet.create_actors()
    assert ray.available_resources().get("GPU", 0) == 0
    # the reservation is the fleet's own: nothing frees it but the lapsed leases
    assert gpus_free_within(8, 60), ray.util.placement_group_table()
