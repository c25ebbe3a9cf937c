"""A replica of tensor x pipeline parallel GPUs: its bundle, its CUDA_VISIBLE_DEVICES, its
command and the run's GPU-hours follow vLLM's world size; the flags that would change the
GPUs a server uses behind the reservation's back are refused naming the field. The GPU configs
say their hardware, and the memory check (cluster.gpu_memory) refuses a layout that cannot hold
the model, naming one that can. No Ray here."""

from __future__ import annotations

import pytest
import yaml

from cluster.engine_spec import EngineSpec
from cluster.gpu_memory import GpuType, fit_failures, gpu_types, model_need
from cluster.placement import default_cpus_per_replica, replica_bundle
from rollout.run import cluster_plan
from rollout.config import ConfigError, load_config
from tests.conftest import REPO

H100 = GpuType("H100", 81559 / 1024, 8)
H200 = GpuType("H200", 143771 / 1024, 8)


def test_a_replica_holds_tensor_times_pipeline_gpus():
    engine = EngineSpec(model="m", tensor_parallel_size=4, pipeline_parallel_size=2)
    assert engine.world_size == 8
    assert replica_bundle(engine, default_cpus_per_replica(engine)) == {"GPU": 8.0, "CPU": 10.0}
    cmd = engine.command(8000)
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "4"
    assert cmd[cmd.index("--pipeline-parallel-size") + 1] == "2"
    env = engine.environment(gpu_ids=[str(i) for i in range(8)])
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    with pytest.raises(ValueError, match="world size is 8"):
        engine.environment(gpu_ids=["0", "1", "2", "3"])


@pytest.mark.parametrize("flag", ["-pp", "--pipeline-parallel-size=2", "--pipeline_parallel_size"])
def test_pipeline_parallel_is_its_own_field(flag):
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineSpec(model="m", extra_args=[flag, "2"])


@pytest.mark.parametrize("flag,why", [
    ("-dp", "data parallel"), ("--data-parallel-size=2", "data parallel"), ("-dpl", "data parallel"),
    ("--distributed-executor-backend", "default executor"), ("-pcp", "context parallel"),
    ("--nnodes", "one node"),
])
def test_flags_that_change_the_gpus_a_server_uses_are_refused(flag, why):
    with pytest.raises(ValueError, match=why) as caught:
        EngineSpec(model="m", extra_args=[flag, "2"])
    assert flag.split("=")[0] in str(caught.value) and "\n" not in str(caught.value).split("\n", 1)[0]


def test_pipeline_parallel_on_cpu_is_refused():
    with pytest.raises(ValueError, match="pipeline_parallel_size must be 1"):
        EngineSpec(model="m", device="cpu", pipeline_parallel_size=2)


def test_gpu_hours_count_every_gpu_of_the_world_size(tmp_path):
    cfg = load_config(REPO / "configs" / "mimo-v2.5-mtp-h100.yaml")
    assert cfg.baseline.engine.world_size == 8 and not cfg.twin_baseline
    assert cluster_plan.gpu_hours(cfg)["gpus"] == 16  # baseline + canary x (TP 4 x PP 2)
    assert [r.bundle for r in cluster_plan.plan_replicas(cfg)] == [{"GPU": 8.0, "CPU": 10.0}] * 2


@pytest.mark.parametrize("name,hardware", [("mimo-v2.5-mtp.yaml", "H200"), ("mimo-v2.5-mtp-h100.yaml", "H100")])
def test_gpu_configs_follow_the_recipe(name, hardware):
    text = (REPO / "configs" / name).read_text()
    assert hardware in text.split("\n", 3)[0] + text.split("\n", 3)[1]  # the hardware named at the top
    cfg = load_config(REPO / "configs" / name)
    assert cfg.model_cache and cfg.accuracy.max_tokens >= 5120
    for arm in (cfg.baseline, cfg.canary):
        e = arm.engine
        assert e.max_model_len and e.max_model_len >= 5120 + 1024 and e.trust_remote_code
        assert "--language-model-only" in e.extra_args and "--no-enable-prefix-caching" in e.extra_args
        args = e.extra_args
        assert args[args.index("--gpu-memory-utilization") + 1] == "0.95"
        assert args[args.index("--generation-config") + 1] == "vllm"
        assert e.tensor_parallel_size == 4  # TP 8 breaks on this checkpoint (recipe)
        assert e.memory and e.memory.weights_gb == 295


def test_the_h200_layout_does_not_fit_h100_and_names_the_one_that_does():
    cfg = load_config(REPO / "configs" / "mimo-v2.5-mtp.yaml")
    engine = cfg.baseline.engine
    [line] = fit_failures([("baseline", engine)], [H100])
    assert line.startswith("baseline: tensor_parallel_size 4 x pipeline_parallel_size 1 does not fit H100")
    assert "68.7 GiB weights" in line and "374 GB" in line
    assert line.endswith("a layout that fits: tensor_parallel_size 4 x pipeline_parallel_size 2 (36.4 GiB per GPU)")
    assert fit_failures([("baseline", engine)], [H200]) == []
    h100 = load_config(REPO / "configs" / "mimo-v2.5-mtp-h100.yaml").baseline.engine
    assert fit_failures([("baseline", h100)], [H100]) == []


def test_a_layout_wider_than_a_node_does_not_fit():
    engine = EngineSpec(model="m", tensor_parallel_size=4, pipeline_parallel_size=4,
                        memory={"weights_gb": 10, "source": "test"})
    [line] = fit_failures([("canary", engine)], [H100])
    assert "a layout that fits: tensor_parallel_size 1 x pipeline_parallel_size 1" in line


def test_local_weights_and_config_are_read(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}')
    need = model_need(EngineSpec(model=str(tmp_path), max_model_len=100))
    assert need.weights == 4096 and need.kv == 2 * 2 * (64 + 64) * 2 * 100
    assert model_need(EngineSpec(model="org/hub-model")) is None  # nothing says: not checked


def test_gpu_types_come_from_rays_accelerator_type():
    nodes = [
        {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"GPU": 8.0, "accelerator_type:H100": 1.0}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"GPU": 4.0, "accelerator_type:H100": 1.0}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.3", "Resources": {"GPU": 8.0}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.4", "Resources": {"CPU": 8.0}},
    ]
    types, unknown = gpu_types(nodes)
    assert types == [GpuType("H100", 81559 / 1024, 8)]
    assert unknown == ["10.0.0.3 (no accelerator_type)"]


def test_memory_needs_the_weights(tmp_path):
    with pytest.raises(ValueError, match="weights_gb"):
        EngineSpec(model="m", memory={"kv_bytes_per_token": 1})
