import json

import pytest
from pydantic import ValidationError

from cluster.engine_spec import CpuLimits, EngineSpec


def spec(**kw) -> EngineSpec:
    return EngineSpec(model="/models/tiny", served_model_name="tiny", **kw)


def test_command_carries_model_port_and_speculative_config():
    cmd = spec(
        device="cpu",
        dtype="bfloat16",
        max_model_len=1024,
        enforce_eager=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": 3},
        extra_args=["--seed", "7"],
    ).command(8123, python="/py")
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(zip(cmd[3::1], cmd[4::1]))
    assert pairs["--model"] == "/models/tiny"
    assert pairs["--port"] == "8123"
    assert pairs["--host"] == "127.0.0.1"
    assert pairs["--max-model-len"] == "1024"
    assert json.loads(pairs["--speculative-config"]) == {"method": "mtp", "num_speculative_tokens": 3}
    assert "--enforce-eager" in cmd
    assert cmd[-2:] == ["--seed", "7"]
    assert "--tensor-parallel-size" not in cmd


def test_gpu_command_has_tensor_parallel_and_trust_remote_code():
    cmd = spec(tensor_parallel_size=4, trust_remote_code=True).command(9000, host="0.0.0.0")
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "4"
    assert "--trust-remote-code" in cmd
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert "--speculative-config" not in cmd


def test_cpu_environment_limits_threads_and_kv_cache():
    env = spec(device="cpu", cpu=CpuLimits(omp_threads=1, kv_cache_gb=2)).environment(iomp_path="/lib/libiomp5.so")
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["LD_PRELOAD"] == "/lib/libiomp5.so"


def test_gpu_environment_uses_ray_gpu_ids_and_checks_their_count():
    assert spec(tensor_parallel_size=2).environment(gpu_ids=["3", "5"])["CUDA_VISIBLE_DEVICES"] == "3,5"
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        spec(tensor_parallel_size=4).environment(gpu_ids=["0"])


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"extra_args": ["--port", "1"]}, "--port is set by its own field"),
        ({"extra_args": ["--speculative-config={}"]}, "--speculative-config"),
        ({"speculative_config": {"num_speculative_tokens": 3}}, "method"),
        ({"speculative_config": {"method": "mtp", "num_speculative_tokens": 0}}, "num_speculative_tokens"),
        ({"device": "cpu", "tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_bad_specs_are_rejected_naming_the_field(bad, field):
    with pytest.raises(ValidationError, match=field):
        spec(**bad)


def test_num_speculative_tokens():
    assert spec().num_speculative_tokens == 0
    assert spec(speculative_config={"method": "mtp", "num_speculative_tokens": 3}).num_speculative_tokens == 3
