"""Whether a replica's layout can hold its model: weights plus one sequence's KV cache against
the GPUs' memory, before anything is reserved (`mtp-canary plan`, and the fleet before it places).

Plain arithmetic over plain inputs: an EngineSpec and the GPU node types of the cluster (read
from `ray.nodes()` by the caller, where Ray names each node's `accelerator_type:<type>`).

- Weights: the checkpoint's files when `engine.model` is a local directory (bytes on disk: FP8
  weights count one byte a parameter, as loaded), else the engine's `memory` block (the model
  card's or vLLM recipe's numbers). The KV cache per token: the local config.json (full-attention
  layers x KV heads x (K + V head dims) x 2 bytes; sliding-window layers a fixed window), else
  `memory`. Both are split over the world size (tensor x pipeline parallel).
- Budget per GPU: its memory x `--gpu-memory-utilization` (vLLM 0.32 CacheConfig default 0.92),
  less a runtime reserve (activations of vLLM's profile run, NCCL buffers, CUDA graphs).
- A model's recipe may name the GPU memory it needs in all (`memory.min_total_gb`): a floor for
  the replica's GPUs x memory x utilization.

A layout that does not fit is one line naming the replica, the numbers and the smallest layout
(tensor x pipeline parallel on one node) that would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.engine_spec import EngineSpec

GIB = 1024**3
# vLLM 0.32 vllm/config/cache.py: gpu_memory_utilization default
VLLM_DEFAULT_UTILIZATION = 0.92
# Per GPU, beside weights and KV cache: the profile run's activation peak (max_num_batched_tokens
# through a MoE layer), NCCL buffers, CUDA graphs. An estimate: vLLM measures it at start only.
RUNTIME_RESERVE_GIB = 2.0
# Total memory per GPU as the driver reports it (nvidia-smi's MiB; vLLM's utilization is a
# fraction of this), by Ray's accelerator type (ray/util/accelerators/accelerators.py names).
GPU_MEMORY_MIB: dict[str, int] = {
    "H100": 81559,  # H100 SXM 80GB
    "H200": 143771,  # H200 SXM 141GB
    "A100-80G": 81920,
    "A100-40G": 40960,
    "L40S": 46068,
    "L4": 23034,
    "A10G": 23028,
}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
TENSOR_SIZES = (1, 2, 4, 8, 16)
PIPELINE_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class GpuType:
    """One kind of GPU node: Ray's accelerator type, memory per GPU, the most GPUs one node has."""

    name: str
    memory_gib: float
    gpus_per_node: int


@dataclass(frozen=True)
class Need:
    """What a model takes in all (bytes), and where the numbers come from."""

    weights: float
    kv: float
    min_total: float | None
    source: str
    max_tp: int | None = None


def gpu_types(nodes: list[dict[str, Any]]) -> tuple[list[GpuType], list[str]]:
    """The GPU node types of live `ray.nodes()` entries, and the GPU nodes whose memory is unknown
    (no accelerator type, or one not in GPU_MEMORY_MIB): those are not checked."""
    types: dict[str, GpuType] = {}
    unknown: list[str] = []
    for node in nodes:
        resources = node.get("Resources", {})
        gpus = int(resources.get("GPU", 0))
        if not node.get("Alive") or not gpus:
            continue
        kinds = [k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")]
        kind = next((k for k in kinds if k in GPU_MEMORY_MIB), None)
        if kind is None:
            unknown.append(f"{node.get('NodeManagerAddress', '?')} ({', '.join(kinds) or 'no accelerator_type'})")
            continue
        seen = types.get(kind)
        types[kind] = GpuType(kind, GPU_MEMORY_MIB[kind] / 1024, max(gpus, seen.gpus_per_node if seen else 0))
    return sorted(types.values(), key=lambda t: t.name), unknown


def utilization(engine: EngineSpec) -> float:
    """--gpu-memory-utilization from extra_args (either spelling), else vLLM's default."""
    args = engine.extra_args
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag.replace("_", "-") == "--gpu-memory-utilization":
            try:
                return float(value if eq else args[i + 1])
            except (IndexError, ValueError):
                return VLLM_DEFAULT_UTILIZATION
    return VLLM_DEFAULT_UTILIZATION


def _kv_dtype_bytes(engine: EngineSpec) -> int:
    # --kv-cache-dtype fp8*: one byte; auto: the model's dtype (BF16 for these checkpoints)
    for i, arg in enumerate(engine.extra_args):
        flag, eq, value = arg.partition("=")
        if flag.replace("_", "-") == "--kv-cache-dtype":
            value = value if eq else (engine.extra_args[i + 1] if i + 1 < len(engine.extra_args) else "")
            return 1 if value.startswith("fp8") else 2
    return 2


def kv_from_config(config: dict[str, Any], bytes_per_value: int) -> tuple[float, float]:
    """(KV bytes per token over the full-attention layers, KV bytes per sequence of the
    sliding-window layers) from a config.json (MiMo's field names: hybrid_layer_pattern 1 =
    sliding window, swa_* heads and dims; else every layer full attention)."""
    config = config.get("text_config", config)
    layers = int(config.get("num_hidden_layers", 0))
    heads = int(config.get("num_attention_heads", 1))
    head_dim = int(config.get("head_dim") or config.get("hidden_size", 0) // max(heads, 1))
    v_dim = int(config.get("v_head_dim") or head_dim)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    pattern = config.get("hybrid_layer_pattern") or [0] * layers
    full = sum(1 for p in pattern if not p)
    swa = len(pattern) - full
    per_token = full * kv_heads * (head_dim + v_dim) * bytes_per_value
    window = int(config.get("sliding_window") or config.get("sliding_window_size") or 0)
    swa_heads = int(config.get("swa_num_key_value_heads") or kv_heads)
    swa_dims = int(config.get("swa_head_dim") or head_dim) + int(config.get("swa_v_head_dim") or v_dim)
    return float(per_token), float(swa * swa_heads * swa_dims * bytes_per_value * window)


def model_need(engine: EngineSpec) -> Need | None:
    """What `engine`'s model takes for one sequence of max_model_len, or None when nothing says
    (a hub id without a `memory` block)."""
    path = Path(engine.model)
    local = path.is_dir()
    config: dict[str, Any] = {}
    if local and (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
    memory = engine.memory
    length = engine.max_model_len or int(config.get("max_position_embeddings") or 0)
    if local:
        weights = float(sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES)))
        source = f"the files in {path}"
    elif memory is not None:
        weights = memory.weights_bytes
        source = memory.source or "engine.memory"
    else:
        return None
    if config and not (memory and memory.kv_bytes_per_token):
        per_token, fixed = kv_from_config(config, _kv_dtype_bytes(engine))
    elif memory is not None:
        per_token, fixed = memory.kv_bytes_per_token, memory.kv_fixed_gb * 1e9
    else:
        per_token, fixed = 0.0, 0.0
    return Need(weights=weights, kv=per_token * length + fixed,
                min_total=memory.min_total_gb * 1e9 if memory and memory.min_total_gb else None,
                source=source, max_tp=memory.max_tensor_parallel_size if memory else None)


def per_gpu_gib(need: Need, world: int) -> float:
    """GiB each GPU of a `world`-GPU replica holds: its share of weights and KV, plus the reserve."""
    return (need.weights + need.kv) / world / GIB + RUNTIME_RESERVE_GIB


def fits(need: Need, world: int, gpu: GpuType, util: float) -> bool:
    budget = gpu.memory_gib * util
    if per_gpu_gib(need, world) > budget:
        return False
    return need.min_total is None or world * budget * GIB >= need.min_total


def layout_that_fits(need: Need, gpu: GpuType, util: float) -> tuple[int, int] | None:
    """The smallest (tensor, pipeline) parallel layout on one node of `gpu` that holds the model
    (more tensor parallel first, within the checkpoint's known limit), or None."""
    options = sorted(
        ((tp, pp) for tp in TENSOR_SIZES for pp in PIPELINE_SIZES
         if tp * pp <= gpu.gpus_per_node and (need.max_tp is None or tp <= need.max_tp)),
        key=lambda layout: (layout[0] * layout[1], -layout[0]),
    )
    return next((layout for layout in options if fits(need, layout[0] * layout[1], gpu, util)), None)


def fit_failures(arms: list[tuple[str, EngineSpec]], types: list[GpuType]) -> list[str]:
    """One line per (GPU arm, GPU node type) whose layout cannot hold the model there."""
    failures: list[str] = []
    for name, engine in arms:
        if engine.device != "gpu":
            continue
        need = model_need(engine)
        if need is None:
            continue
        world, util = engine.world_size, utilization(engine)
        for gpu in types:
            if fits(need, world, gpu, util) and world <= gpu.gpus_per_node:
                continue
            layout = layout_that_fits(need, gpu, util)
            would = (f"tensor_parallel_size {layout[0]} x pipeline_parallel_size {layout[1]} "
                     f"({per_gpu_gib(need, layout[0] * layout[1]):.1f} GiB per GPU)" if layout else
                     f"none on one node of {gpu.gpus_per_node} {gpu.name}")
            floor = (f"; the recipe asks {need.min_total / 1e9:g} GB in all, {world} GPUs give "
                     f"{world * gpu.memory_gib * util * GIB / 1e9:.0f} GB" if need.min_total else "")
            failures.append(
                f"{name}: tensor_parallel_size {engine.tensor_parallel_size} x pipeline_parallel_size "
                f"{engine.pipeline_parallel_size} does not fit {gpu.name} ({gpu.memory_gib:.1f} GiB x "
                f"{util:g} utilization = {gpu.memory_gib * util:.1f} GiB per GPU, {gpu.gpus_per_node} per node): "
                f"{need.weights / world / GIB:.1f} GiB weights + {need.kv / world / GIB:.2f} GiB KV for one "
                f"{engine.max_model_len or '?'}-token sequence + {RUNTIME_RESERVE_GIB:g} GiB runtime = "
                f"{per_gpu_gib(need, world):.1f} GiB per GPU{floor} ({need.source}); a layout that fits: {would}"
            )
    return failures


def live_gpu_types() -> tuple[list[GpuType], list[str]]:
    """gpu_types of the connected Ray cluster."""
    import ray

    return gpu_types(ray.nodes())
