"""`mtp-canary plan configs/mimo-v2.5-mtp.yaml` against fake GPU clusters
(ray.cluster_utils.Cluster, fake GPUs named by Ray's `accelerator_type:<type>` resource, as a
real node reports it): on 80 GB H100 nodes the 4 x H200 layout does not fit and the plan names
the one that does (TP 4 x PP 2); on 141 GB H200 nodes it fits. `run`'s fleet refuses the layout
the same way before it reserves a GPU. Staging: a GPU arm serving a hub id without model_cache
fails the plan naming model_cache, and a node whose disk cannot take the download is named; a
model_cache no GPU node can make fails the plan and `run` (before anything is reserved), and `run`
refuses a GPU hub model without model_cache before anything starts, as `plan` does.

The config's model_cache is pointed at a temporary directory holding a staged copy of the
weights (a sparse 295 GB file and the staging marker): the plan then finds them cached."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import ray
import yaml
from ray.cluster_utils import Cluster

from cluster.staging import MARKER, model_dir
from rollout.run import node_check
from rollout.commands import plan as plan_command
from tests.conftest import REPO

CONFIG = REPO / "configs" / "mimo-v2.5-mtp.yaml"
MODEL = "XiaomiMiMo/MiMo-V2.5"


@pytest.fixture(scope="module", params=["H100", "H200"])
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


def config_with_cache(tmp_path, staged: bool, **changes) -> str:
    cfg = yaml.safe_load(CONFIG.read_text())
    cache = tmp_path / "model-cache"
    cfg["model_cache"] = str(cache)
    cfg.update(changes)
    if staged:
        target = model_dir(str(cache), MODEL)
        target.mkdir(parents=True)
        with open(target / "model.safetensors", "wb") as f:
            f.truncate(295 * 10**9)  # sparse: the size the recipe gives, no disk used
        (target / MARKER).write_text(json.dumps({"model": MODEL, "files": {"model.safetensors": 295 * 10**9}}))
    path = tmp_path / "mimo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_plan_refuses_the_h200_layout_on_80_gb_gpus_and_passes_on_141(gpu_cluster, tmp_path, capsys):
    code = plan_command.main([config_with_cache(tmp_path, staged=True), "--placement-wait-s", "5"], modules=("ray",))
    out, err = capsys.readouterr()
    memory = [line for line in err.splitlines() if "memory:" in line]
    if gpu_cluster == "H100":
        assert code == 1
        assert len(memory) == 2, err  # baseline and canary (the twin runs the baseline's engine)
        assert memory[0].startswith("mtp-canary plan: memory: baseline: tensor_parallel_size 4 x "
                                    "pipeline_parallel_size 1 does not fit H100")
        assert "68.7 GiB weights" in memory[0] and "374 GB" in memory[0]
        assert memory[0].endswith("a layout that fits: tensor_parallel_size 4 x pipeline_parallel_size 2 "
                                  "(36.4 GiB per GPU)")
    else:
        assert err.strip() == "" and code == 0, err
        assert "cached at" in out and "295.00 GB" in out


def test_plan_refuses_a_gpu_hub_model_without_model_cache(gpu_cluster, tmp_path, capsys):
    if gpu_cluster != "H200":
        pytest.skip("one cluster is enough")
    cfg = yaml.safe_load(CONFIG.read_text())
    del cfg["model_cache"]
    path = tmp_path / "no-cache.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert plan_command.main([str(path), "--placement-wait-s", "5"], modules=("ray",)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mtp-canary plan: model_cache: unset") and MODEL in err[0]


def test_plan_names_a_node_whose_disk_cannot_take_the_download(gpu_cluster, tmp_path, capsys):
    if gpu_cluster != "H200":
        pytest.skip("one cluster is enough")
    cfg = yaml.safe_load(config_with_cache(tmp_path, staged=False) and (tmp_path / "mimo.yaml").read_text())
    for arm in ("baseline", "canary"):
        cfg[arm]["engine"]["memory"]["weights_gb"] = 10**7  # more than any test machine's disk
        cfg[arm]["engine"]["memory"]["min_total_gb"] = None
    # 10 PB of weights need a wider layout than 4 GPUs: the memory check says so too; the disk line is the subject
    (tmp_path / "mimo.yaml").write_text(yaml.safe_dump(cfg))
    assert plan_command.main([str(tmp_path / "mimo.yaml"), "--placement-wait-s", "5"], modules=("ray",)) == 1
    disk = [line for line in capsys.readouterr().err.splitlines() if " disk: " in line]
    assert len(disk) == 1 and "GB free at" in disk[0] and "needs 10000000.0 GB" in disk[0], disk


def test_run_refuses_the_layout_before_it_reserves_a_gpu(gpu_cluster, tmp_path):
    from cluster.fleet import ArmSpec, Fleet, FleetStartError
    from rollout.config import load_config

    if gpu_cluster != "H100":
        pytest.skip("the refusal is on 80 GB GPUs")
    cfg = load_config(CONFIG)
    arms = [ArmSpec(name=name, engine=arm.engine, replicas=arm.replicas, cpus_per_replica=arm.cpus_per_replica)
            for name, arm in node_check.launched_arms(cfg)]
    fleet = Fleet(arms=arms, log_dir=str(tmp_path / "logs"), placement_timeout_s=5)
    with pytest.raises(FleetStartError, match="GPU memory: baseline: tensor_parallel_size 4"):
        fleet.create_actors()
    assert ray.available_resources().get("GPU") == 12  # nothing reserved


def unusable_cache_config(tmp_path) -> str:
    """The H200 config with model_cache under a regular file: no node can make it (root or not)."""
    (tmp_path / "a-file").write_text("not a directory")
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["model_cache"] = str(tmp_path / "a-file" / "model-cache")
    cfg["ray"]["check_nodes"] = "never"  # the modules' import check is not the subject (and imports vLLM per node)
    path = tmp_path / "unusable-cache.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_plan_and_run_refuse_a_model_cache_the_gpu_nodes_cannot_use(gpu_cluster, tmp_path, capsys):
    if gpu_cluster != "H200":
        pytest.skip("one cluster is enough")
    path = unusable_cache_config(tmp_path)
    assert plan_command.main([path, "--placement-wait-s", "5"], modules=("ray",)) == 1
    cache = [line for line in capsys.readouterr().err.splitlines() if ": model_cache: " in line]
    assert len(cache) == 1 and cache[0].startswith(f"mtp-canary plan: model_cache: {tmp_path}/a-file/model-cache on node ")
    assert cache[0].endswith(f"GPU node): {tmp_path}/a-file/model-cache does not exist and cannot be made under "
                             f"{tmp_path}/a-file (not a writable directory)")
    # `run` (its own driver, joined to this cluster) stops before it reserves anything
    runs = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "rollout", "run", path, "--runs-dir", str(runs), "--run-id", "cache",
                           "--ray-address", ray.get_runtime_context().gcs_address],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    error = json.loads((runs / "cache" / "decision.json").read_text())["error"]
    assert error.startswith(f"model_cache: {tmp_path}/a-file/model-cache on node ") and "\n" not in error
    assert ray.available_resources().get("GPU") == 12  # nothing reserved


def test_run_refuses_a_gpu_hub_model_without_model_cache_before_anything_starts(tmp_path):
    cfg = yaml.safe_load(CONFIG.read_text())
    del cfg["model_cache"]
    path = tmp_path / "no-cache.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = subprocess.run([sys.executable, "-m", "rollout", "run", str(path), "--runs-dir", str(tmp_path / "runs")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [line for line in done.stderr.splitlines() if line.startswith("mtp-canary run: ")]
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("mtp-canary run: model_cache: unset")
    assert not (tmp_path / "runs").exists()  # no runs dir, no Ray
