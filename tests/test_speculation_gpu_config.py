"""The GPU example of "which speculative config" (configs/examples/mimo-v2.6-dflash-vs-no-speculation.yaml):
it loads, names each arm's speculation, follows vLLM's recipe for MiMo-V2.6-Flash-RL, and `mtp-canary plan`
passes on a fake cluster of H200 nodes (ray.cluster_utils.Cluster, as tests/test_plan_fit.py) with the
checkpoint staged in model_cache."""

from __future__ import annotations

import json

import pytest
import ray
import yaml
from ray.cluster_utils import Cluster

from cluster.staging import MARKER, model_dir
from rollout.commands import plan as plan_command
from rollout.config import load_config
from tests.conftest import REPO

CONFIG = REPO / "configs" / "examples" / "mimo-v2.6-dflash-vs-no-speculation.yaml"
MODEL = "XiaomiMiMo/MiMo-V2.6-Flash-RL"


def test_the_example_names_each_arms_speculation_and_follows_the_recipe():
    cfg = load_config(CONFIG)
    assert cfg.baseline.engine.speculation == "no speculation"
    assert [(c.name, c.engine.speculation) for c in cfg.candidates] == [
        ("dflash7", "dflash k=7 (XiaomiMiMo--MiMo-V2.6-Flash-RL/dflash)"),
        ("dflash3", "dflash k=3 (XiaomiMiMo--MiMo-V2.6-Flash-RL/dflash)"),
    ]
    for arm in (cfg.baseline, *cfg.candidates):
        e = arm.engine
        assert e.model == MODEL and e.tensor_parallel_size == 4 and e.trust_remote_code
        args = e.extra_args
        assert json.loads(args[args.index("--compilation-config") + 1]) == {"cudagraph_mode": "FULL_DECODE_ONLY"}
        assert args[args.index("--gpu-memory-utilization") + 1] == "0.95"
        assert e.memory and e.memory.weights_gb == 173 and e.memory.min_total_gb == 208
    for c in cfg.candidates:  # the drafter is the staged snapshot's dflash/ (vLLM wants a local path)
        assert c.engine.speculative_config["model"] == str(model_dir(cfg.model_cache, MODEL) / "dflash")


@pytest.fixture(scope="module")
def h200_cluster():
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    # baseline and two candidates at TP 4, each with 6 CPUs beside them
    cluster.add_node(num_cpus=18, num_gpus=12, resources={"accelerator_type:H200": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield
    ray.shutdown()
    cluster.shutdown()


def test_plan_passes_on_h200_nodes_with_the_checkpoint_staged(h200_cluster, tmp_path, capsys):
    cfg = yaml.safe_load(CONFIG.read_text())
    cache = tmp_path / "model-cache"
    cfg["model_cache"] = str(cache)
    target = model_dir(str(cache), MODEL)
    (target / "dflash").mkdir(parents=True)
    with open(target / "model.safetensors", "wb") as f:
        f.truncate(173 * 10**9)  # sparse: the recipe's size, no disk used
    (target / MARKER).write_text(json.dumps({"model": MODEL, "files": {"model.safetensors": 173 * 10**9}}))
    path = tmp_path / "dflash.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code = plan_command.main([str(path), "--placement-wait-s", "5"], modules=("ray",))
    out, err = capsys.readouterr()
    assert err.strip() == "" and code == 0, err
    assert "baseline-0" in out and "dflash7-0" in out and "dflash3-0" in out and "cached at" in out
