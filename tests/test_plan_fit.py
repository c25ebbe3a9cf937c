"""`mtp-canary plan configs/mimo-v2.5-mtp.yaml` against fake GPU clusters
(ray.cluster_utils.Cluster, fake GPUs named by Ray's `accelerator_type:<type>` resource, as a
real node reports it): on 80 GB H100 nodes the 4 x H200 layout does not fit and the plan names
the one that does (TP 4 x PP 2); on 141 GB H200 nodes it fits. And `run`'s fleet refuses the
layout the same way before it reserves a GPU."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from rollout import plan_command
from tests.conftest import REPO

CONFIG = str(REPO / "configs" / "mimo-v2.5-mtp.yaml")


@pytest.fixture(params=["H100", "H200"])
def gpu_cluster(request):
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    # 12 GPUs: baseline, canary and twin at TP 4, each with 6 CPUs beside them
    cluster.add_node(num_cpus=18, num_gpus=12, resources={f"accelerator_type:{request.param}": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield request.param
    ray.shutdown()
    cluster.shutdown()


def test_plan_refuses_the_h200_layout_on_80_gb_gpus_and_passes_on_141(gpu_cluster, capsys):
    code = plan_command.main([CONFIG, "--placement-wait-s", "5"], modules=("ray",))
    out, err = capsys.readouterr()
    memory = [line for line in err.splitlines() if "memory:" in line]
    if gpu_cluster == "H100":
        assert code == 1
        assert len(memory) == 2, err  # baseline and canary (the twin runs the baseline's engine)
        assert memory[0].startswith("mtp-canary plan: memory: baseline: tensor_parallel_size 4 x "
                                    "pipeline_parallel_size 1 does not fit H100")
        assert "68.7 GiB weights" in memory[0]
        assert memory[0].endswith("a layout that fits: tensor_parallel_size 4 x pipeline_parallel_size 2 "
                                  "(36.4 GiB per GPU)")
    else:
        assert memory == [], err
        assert code == 0, err


@pytest.mark.parametrize("gpu_cluster", ["H100"], indirect=True)
def test_run_refuses_the_layout_before_it_reserves_a_gpu(gpu_cluster, tmp_path):
    from cluster.fleet import ArmSpec, Fleet, FleetStartError
    from rollout.config import load_config

    cfg = load_config(CONFIG)
    arms = [ArmSpec(name=name, engine=arm.engine, replicas=arm.replicas, cpus_per_replica=arm.cpus_per_replica)
            for name, arm in plan_command._launched_arms(cfg)]
    fleet = Fleet(arms=arms, log_dir=str(tmp_path / "logs"), placement_timeout_s=5)
    with pytest.raises(FleetStartError, match="GPU memory: baseline: tensor_parallel_size 4"):
        fleet.create_actors()
    assert ray.available_resources().get("GPU") == 12  # nothing reserved
