import json

import pytest
from pydantic import ValidationError

from cluster.engine_spec import CpuLimits, EngineSpec, printable_args


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
    # each response carries its own acceptance (the acceptance gate counts the experiment's requests)
    assert pairs["--per-request-spec-decode-metrics"] == "summary"
    off = EngineSpec(model="/m", device="cpu", per_request_spec_decode_metrics=False).command(1)
    assert "--per-request-spec-decode-metrics" not in off
    # an engine without speculation (a k=0 baseline) must start: vLLM 0.32 exits 1 on the flag without it
    plain = EngineSpec(model="/m", device="cpu").command(1)
    assert "--per-request-spec-decode-metrics" not in plain and "--speculative-config" not in plain


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


def test_cpu_model_runs_in_the_engine_core_process_bound_by_affinity_by_default():
    one_process = spec(device="cpu", cpu=CpuLimits(cores="0,2-3"))
    env = one_process.environment()
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # vLLM binds nothing in this mode
    assert one_process.cpu_affinity() == {0, 2, 3}
    assert spec(device="cpu").cpu_affinity() is None  # no cores: unbound


def test_cpu_worker_process_is_vllms_default_and_binds_by_vllm():
    with_worker = spec(device="cpu", cpu=CpuLimits(cores="1", worker_process=True))
    env = with_worker.environment()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert with_worker.cpu_affinity() is None
    assert spec(cpu=CpuLimits(cores="1")).cpu_affinity() is None  # GPU replicas: never


def test_the_engine_process_mode_is_set_by_its_field_not_by_env():
    with pytest.raises(ValidationError, match="VLLM_ENABLE_V1_MULTIPROCESSING"):
        spec(device="cpu", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})


def test_gpu_environment_uses_ray_gpu_ids_and_checks_their_count():
    assert spec(tensor_parallel_size=2).environment(gpu_ids=["3", "5"])["CUDA_VISIBLE_DEVICES"] == "3,5"
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        spec(tensor_parallel_size=4).environment(gpu_ids=["0"])


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"extra_args": ["--port", "1"]}, "--port is set by its own field"),
        ({"tensor_parallel_size": 65}, "tensor_parallel_size"),
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


# vLLM's FlexibleArgumentParser reads '_' as '-', has argparse's allow_abbrev on (an unambiguous
# prefix is the option), takes `--flag.key value` as one key of --flag, and `--config FILE` as a
# YAML of flags: each of these set a reserved flag behind the config's back (checked against
# vLLM 0.32's own parser when this was written).
@pytest.mark.parametrize(
    "args, named",
    [
        (["--hos", "0.0.0.0"], "--hos"),
        (["--hos=0.0.0.0"], "--hos"),
        (["--HOST", "0.0.0.0"], "--HOST"),
        (["--speculative_config", '{"method": "mtp", "num_speculative_tokens": 5}'], "--speculative_config"),
        (["--speculative-config.num_speculative_tokens", "5"], "--speculative-config.num_speculative_tokens"),
        (["--spec", "{}"], "--spec"),
        (["-sc", "{}"], "-sc"),
        (["-s", "{}"], "-s"),
        (["-tp", "2"], "-tp"),
        (["-tp=2"], "-tp"),
        (["-t", "2"], "-t"),
        (["--tensor_parallel_size", "2"], "--tensor_parallel_size"),
        (["--trust_remote_code"], "--trust_remote_code"),
        (["--no-trust-remote-code"], "--no-trust-remote-code"),
        (["--no-enforce-eager"], "--no-enforce-eager"),
        (["--no-enf"], "--no-enf"),
        (["--served", "other"], "--served"),
        (["--max-model", "4096"], "--max-model"),
        (["--max_model_len=4096"], "--max_model_len"),
        (["--mod", "/other"], "--mod"),
        (["--seed", "1", "--port", "1"], "--port"),
        (["--config", "engine.yaml"], "--config"),
        (["--config=engine.yaml"], "--config"),
        (["--conf", "engine.yaml"], "--conf"),
        (["--", "positional"], "'--'"),
    ],
)
def test_reserved_flags_are_refused_however_vllm_would_spell_them(args, named):
    with pytest.raises(ValidationError) as err:
        spec(extra_args=args)
    message = str(err.value.errors()[0]["msg"])
    assert "extra_args" in message and named in message
    assert "\n" not in message
    assert "0.0.0.0" not in message and "engine.yaml" not in message  # the flag, never its value


@pytest.mark.parametrize(
    "args",
    [
        ["--seed", "7"],
        ["--no-async-scheduling", "--gpu-memory-utilization", "0.90"],
        ["--max_num_seqs", "4"],
        ["--max-num-batched-tokens=4096"],
        ["--model-impl", "vllm"],  # longer than --model: its own flag
        ["--kv-cache-dtype", "fp8"],
        ["--compilation-config", '{"mode": 0}'],
        ["-O3"],
        ["-q", "fp8"],
        ["--seed", "-1"],  # (--api-key goes by the environment: test_router_token)
    ],
)
def test_other_engine_flags_still_pass_verbatim(args):
    assert spec(extra_args=args).command(8000)[-len(args):] == args


@pytest.mark.parametrize(
    "args, shown",
    [
        (["--api-key", "sk-1"], ["--api-key", "<redacted>"]),
        (["--api-key=sk-1", "--seed", "7"], ["--api-key=<redacted>", "--seed", "7"]),
        (["--api_key", "a", "b", "--seed", "7"], ["--api_key", "<redacted>", "<redacted>", "--seed", "7"]),
        (["--hf-token", "-starts-with-a-dash"], ["--hf-token", "<redacted>"]),
        (["--db-password", "p", "--x-secret=s", "--aws-credentials", "c"],
         ["--db-password", "<redacted>", "--x-secret=<redacted>", "--aws-credentials", "<redacted>"]),
        (["--max-num-batched-tokens", "4096", "--tokenizer", "/t", "--ssl-keyfile", "/k"],
         ["--max-num-batched-tokens", "4096", "--tokenizer", "/t", "--ssl-keyfile", "/k"]),
    ],
)
def test_printable_args_redact_secret_flag_values(args, shown):
    assert printable_args(args) == shown
    assert printable_args(shown) == shown  # idempotent
