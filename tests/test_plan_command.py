"""`mtp-canary plan` on a fake 2-node cluster (ray.cluster_utils.Cluster, fake GPUs): where each
replica's bundle lands (GPUs and the CPUs beside them), and a node whose Python cannot import
locust named before any replica starts. The second node's raylet (and so its workers) gets a
PYTHONPATH with a `locust` package that fails to import: a real import check on a node whose
environment differs, as an image without locust would."""

from __future__ import annotations

import json

import pytest
import ray
import yaml
from ray.cluster_utils import Cluster

from rollout.run import node_check
from rollout.commands import plan as plan_command
from tests.conftest import REPO

MODULES = ("ray", "locust", "rollout", "cluster")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    stub = tmp_path_factory.mktemp("no-locust")
    (stub / "locust").mkdir()
    (stub / "locust" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'locust'\")\n")
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    gpu_node = cluster.add_node(num_cpus=8, num_gpus=4, env_vars={"PYTHONPATH": f"{stub}:{REPO}"})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster, gpu_node
    ray.shutdown()
    cluster.shutdown()


def gpu_config(tmp_path, **top) -> str:
    engine = {"model": "XiaomiMiMo/MiMo-V2.5", "served_model_name": "mimo", "device": "gpu",
              "tensor_parallel_size": 2, "startup_timeout_s": 1800,
              "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}
    cfg = {
        "name": "plan-test",
        "ray": {"address": "auto"},
        "baseline": {"replicas": 1, "engine": engine},
        "canary": {"replicas": 1, "engine": {**engine, "speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}},
        "accuracy": {"enabled": False},
        "experiment": {"max_duration_s": 3600, "workers": 2, "worker_placement": "spread"},
        # a GPU arm serving a hub id stages it first (plan refuses one without model_cache)
        "model_cache": str(tmp_path / "model-cache"),
        **top,
    }
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_plan_places_every_replica_and_names_the_node_without_locust(two_nodes, tmp_path, capsys):
    _, gpu_node = two_nodes
    code = plan_command.main([gpu_config(tmp_path), "--json"], modules=MODULES)
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert code == 1 and not doc["ok"]
    # both tp2 replicas on the one GPU node, each with 2 GPUs of its own and tp + 2 CPUs reserved
    assert {r["node_id"] for r in doc["replicas"]} == {gpu_node.node_id}
    assert [r["bundle"] for r in doc["replicas"]] == [{"GPU": 2.0, "CPU": 4.0}] * 2
    ids = [g for r in doc["replicas"] for g in r["gpu_ids"]]
    assert len(ids) == 4 and len(set(ids)) == 4
    # the trial group is gone: all 4 GPUs are free again
    assert ray.get_runtime_context() and _gpus_free(4)
    bad = [n for n in doc["nodes"] if n["problems"]]
    assert [n["node_id"] for n in bad] == [gpu_node.node_id], err
    assert "locust" in bad[0]["missing"] and "locust" not in [m for n in doc["nodes"] if n is not bad[0] for m in n["missing"]]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and gpu_node.node_id[:12] in lines[0] and "cannot import locust" in lines[0]
    # the timeouts the fleet will use: 900 s placement on GPU + the engines' 1800 s (+ 60 s slack)
    assert doc["timeouts"]["placement_timeout_s"] == 900 and doc["timeouts"]["startup_timeout_s"] == 2760
    # 2 replicas x 2 GPUs x (2760 s start + 3600 s experiment)
    assert doc["gpu_hours"]["gpus"] == 4 and doc["gpu_hours"]["gpu_hours"] == round(4 * 6360 / 3600, 2)


def test_plan_passes_when_every_node_imports_what_it_needs(two_nodes, tmp_path, capsys):
    code = plan_command.main([gpu_config(tmp_path)], modules=("ray", "rollout"))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "plan: every check passed" in out and "GPU-hours: " in out
    # spread with a CPU-only node present: the plan says where Locust could go instead
    assert "CPU-only nodes" in out


def test_plan_names_a_cluster_too_small_for_the_fleet(two_nodes, tmp_path, capsys):
    path = gpu_config(tmp_path, baseline={"replicas": 2, "engine": {"model": "m", "served_model_name": "mimo",
                                                                   "tensor_parallel_size": 2}},
                      canary={"replicas": 2, "engine": {"model": "m", "served_model_name": "mimo",
                                                        "tensor_parallel_size": 2}})
    code = plan_command.main([path, "--placement-wait-s", "2"], modules=("ray",))
    _, err = capsys.readouterr()
    assert code == 1 and "placement: the cluster cannot hold every replica now" in err
    assert _gpus_free(4)


def test_run_checks_the_nodes_first_and_fails_naming_the_one_without_locust(two_nodes, tmp_path, monkeypatch):
    """`run` on a multi-node cluster: the node environment check (ray.check_nodes: auto) fails the
    run in seconds, exit 1, naming the node, before any replica is placed."""
    from rollout.config import load_config
    from rollout.run.controller import Controller

    _, gpu_node = two_nodes
    monkeypatch.setattr(node_check, "RUN_MODULES", MODULES)  # vllm aside: every node here has the same one
    said: list[str] = []
    result = Controller(load_config(gpu_config(tmp_path)), runs_dir=tmp_path / "runs", run_id="nodes",
                        progress=said.append).run()
    assert result.exit_code == 1 and result.decision is None
    assert "node environment" in result.error and gpu_node.node_id[:12] in result.error
    assert "cannot import locust" in result.error
    assert not any("fleet: starting" in line for line in said)  # nothing placed, nothing started
    doc = json.loads((tmp_path / "runs" / "nodes" / "decision.json").read_text())
    assert doc["error"] == result.error and "usage" not in doc
    assert _gpus_free(4)


def test_a_bad_config_exits_2_with_one_line(tmp_path, capsys):
    path = gpu_config(tmp_path, startup_timeout_s=1000)
    assert plan_command.main([path]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "startup_timeout_s: 1000 s is shorter than placement_timeout_s (900 s)" in err


def _gpus_free(expected: float, timeout_s: float = 20) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0) != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_the_commands_placement_wait_default_is_the_plans():
    """`plan --help` builds its arguments without importing the plan: the default it shows is the plan's own
    (one definition, rollout.run.plan_defaults), and the command module loads neither the plan nor Ray."""
    import subprocess
    import sys

    from rollout.run import cluster_plan

    assert plan_command.PLACEMENT_PROBE_S is cluster_plan.PLACEMENT_PROBE_S
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, rollout.commands.plan; "
         "print(sorted(m for m in ('ray', 'rollout.run.cluster_plan') if m in sys.modules))"],
        cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
