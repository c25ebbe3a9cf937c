"""Locust workers on several Ray nodes: a fake 3-node cluster (ray.cluster_utils.Cluster).

The nodes share this machine, so they share its IP, but Ray schedules them as separate
nodes: a head with no CPU for workers and two worker nodes with one CPU each. Two
workers of one CPU must then land on the two different nodes, reach the master over the
cluster's interface, and deliver every record.
"""

from __future__ import annotations

import sys

import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.distributed_load import DistributedSwarm
from loadtests.options import TrafficOptions
from loadtests.records import read_records
from loadtests.swarm import SwarmSpec
from tests.conftest import REPO, wait_until_gone

sys.path.insert(0, str(REPO))
from benchmarks.stream_target import TargetProcess  # noqa: E402


@pytest.fixture(scope="module")
def three_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield {node.node_id for node in nodes}
    ray.shutdown()
    cluster.shutdown()


def test_workers_spread_over_two_nodes_deliver_every_record(three_nodes, tmp_path):
    with TargetProcess(ttft_ms=10, tpot_ms=4, replica="t") as target:
        spec = SwarmSpec(host=target.url, users=4, run_time_s=4, n_workers=2, stop_timeout_s=10,
                         master_bind_host="0.0.0.0",  # workers on other nodes reach the master by the node's IP
                         traffic=TrafficOptions(records=str(tmp_path / "records.jsonl"), max_tokens=17, tag="multi"))
        swarm = DistributedSwarm(spec, "spread")
        result = swarm.run(timeout_s=120)
        served = target.stats()
        nodes = {node.node_id for node in swarm.workers._nodes}
    assert nodes == three_nodes  # one worker on each worker node, none on the CPU-less head
    records = read_records(result.records_path)
    assert len(records) == result.n_records == served["started"] > 0
    assert len({r.worker for r in records}) == 2 and result.worker_exit_codes == [0, 0]
    assert wait_until_gone(swarm.pids, 10.0) == []

