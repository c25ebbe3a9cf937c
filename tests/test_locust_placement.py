"""Locust workers' default placement (`auto`) on a fake cluster with a GPU node and two CPU
nodes (ray.cluster_utils.Cluster): the workers keep off the GPU node, whose CPUs belong to
its engines, and spread over the CPU nodes; on a cluster of one kind they spread as before."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.process import supervised_process_actor


@pytest.fixture(scope="module")
def gpu_and_cpu_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1})  # the GPU node
    cpu_nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield {node.node_id for node in cpu_nodes}
    ray.shutdown()
    cluster.shutdown()


def test_auto_keeps_locust_workers_off_the_gpu_node_and_spreads_them(gpu_and_cpu_nodes, tmp_path):
    actors = [supervised_process_actor(f"worker-{i}", num_cpus=0.5, placement="auto", log_dir=str(tmp_path))
              for i in range(4)]
    try:
        nodes = [info.node_id for info in ray.get([a.node_info.remote([]) for a in actors], timeout=60)]
    finally:
        for actor in actors:
            ray.kill(actor)
    assert set(nodes) == gpu_and_cpu_nodes  # both CPU nodes, never the GPU node

