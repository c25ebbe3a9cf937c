"""`mtp-canary plan` on an all-GPU cluster (every node, the head too, has GPUs: no CPU-only node
to keep the load to): the plan says that the driver and router, and the Locust workers, share
GPU nodes with the replicas."""

from __future__ import annotations

import pytest
import ray
import yaml
from ray.cluster_utils import Cluster

from rollout.commands import plan as plan_command


@pytest.fixture(scope="module")
def all_gpu():
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 2})
    cluster.add_node(num_cpus=8, num_gpus=4)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_plan_says_what_the_load_shares_on_an_all_gpu_cluster(all_gpu, tmp_path, capsys):
    engine = {"model": "org/model", "served_model_name": "m", "device": "gpu", "tensor_parallel_size": 2}
    cfg = {"name": "all-gpu", "ray": {"address": "auto"}, "model_cache": str(tmp_path / "cache"),
           "baseline": {"replicas": 1, "engine": {**engine, "speculative_config": {"method": "mtp",
                                                                                   "num_speculative_tokens": 1}}},
           "canary": {"replicas": 1, "engine": {**engine, "speculative_config": {"method": "mtp",
                                                                                 "num_speculative_tokens": 3}}},
           "accuracy": {"enabled": False}, "experiment": {"workers": 2}}
    path = tmp_path / "all-gpu.yaml"
    path.write_text(yaml.safe_dump(cfg))
    plan_command.main([str(path), "--placement-wait-s", "5"], modules=("ray",))
    out = capsys.readouterr().out
    assert "note: load: the driver and the router run on GPU node" in out
    assert "note: load: 2 Locust worker(s) share GPU node(s)" in out
