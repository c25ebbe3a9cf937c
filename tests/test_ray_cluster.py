"""`ray.address: local` is a Ray instance of the run's own, whatever else runs on the machine."""

from __future__ import annotations

import subprocess
import sys

import ray
from ray.cluster_utils import Cluster

from tests.conftest import REPO

PROBE = """
import ray
from cluster.ray_cluster import connect
print(connect("local", local_num_cpus=1))
print("marker" in ray.cluster_resources())
ray.shutdown()
"""


def test_local_never_joins_a_cluster_already_running_on_the_machine():
    if ray.is_initialized():
        ray.shutdown()
    other = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"marker": 1}})
    try:
        # a plain ray.init() here would join it (seen: a CI run's CLI test joined a test's cluster
        # and failed on "num_cpus must not be provided")
        proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines = proc.stdout.strip().splitlines()
        assert lines[0].startswith("ray: started a local instance") and lines[-1] == "False", proc.stdout
    finally:
        other.shutdown()
