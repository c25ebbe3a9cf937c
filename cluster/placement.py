"""Where things go on the cluster: each replica's bundle, the placement clock, the load's nodes.

Plain rules, no Ray calls except where a function says it reads the cluster: the fleet
reserves what `replica_bundle` says, `mtp-canary plan` prints the same bundles before
anything is reserved, and the config fills its defaults from here.

- A GPU replica's bundle reserves CPUs beside its GPUs (`cpus_per_replica`): vLLM's API
  server, its engine core and one worker per GPU are busy processes, and a bundle of GPUs
  only lets Ray put Locust workers on the same cores.
- The placement clock: on GPU an autoscaler (KubeRay) takes minutes to bring an H200 node
  up, and removing the placement group also withdraws its demand, so the default is long.
- Locust's `auto` placement: CPU-only nodes when the cluster has both kinds, so the load's
  own CPU use does not perturb one arm's TTFT/TPOT on a GPU node; else `spread`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from cluster.engine_spec import EngineSpec

GPU_PLACEMENT_TIMEOUT_S = 900.0  # an H200 node through an autoscaler: minutes, not seconds
CPU_PLACEMENT_TIMEOUT_S = 60.0  # what the fleet always waited on a CPU cluster
# between placement and a replica's own startup clock: actor creation and launch
FLEET_START_SLACK_S = 60.0
CPU_BUNDLE = 0.001  # a CPU replica's token bundle inside a mixed placement group
# busy processes of a vLLM server besides its GPU workers: the API server and the engine core
SERVER_PROCESSES = 2


def default_cpus_per_replica(engine: EngineSpec) -> float:
    """CPUs a replica's bundle reserves when the config does not say: one per GPU worker plus
    the API server and engine core on GPU; 0 on CPU (CpuLimits bounds those, as before)."""
    return float(engine.world_size + SERVER_PROCESSES) if engine.device == "gpu" else 0.0


def default_placement_timeout_s(engines: Iterable[EngineSpec]) -> float:
    return GPU_PLACEMENT_TIMEOUT_S if any(e.device == "gpu" for e in engines) else CPU_PLACEMENT_TIMEOUT_S


def replica_bundle(engine: EngineSpec, cpus: float) -> dict[str, float]:
    """The placement-group bundle of one replica (all its GPUs on one node, its CPUs beside them):
    the engine's world size (tensor x pipeline parallel), the GPUs its one server uses."""
    if engine.device != "gpu":
        return {"CPU": CPU_BUNDLE}
    bundle = {"GPU": float(engine.world_size)}
    if cpus > 0:
        bundle["CPU"] = float(cpus)
    return bundle


def alive_nodes(nodes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [n for n in nodes if n.get("Alive")]


def cpu_only_nodes(nodes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Live nodes (ray.nodes() entries) with CPUs to give and no GPU."""
    return [
        n for n in alive_nodes(nodes)
        if n.get("Resources", {}).get("CPU", 0) > 0 and not n.get("Resources", {}).get("GPU", 0)
    ]


def auto_worker_nodes(nodes: Sequence[dict[str, Any]]) -> list[str] | None:
    """Node ids Locust's `auto` placement keeps to, or None (spread over every node): the
    CPU-only nodes when the cluster also has GPU nodes."""
    live = alive_nodes(nodes)
    has_gpu = any(n.get("Resources", {}).get("GPU", 0) for n in live)
    cpu_only = cpu_only_nodes(live)
    if not has_gpu or not cpu_only:
        return None
    return [str(n["NodeID"]) for n in cpu_only]


def auto_worker_options(nodes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Ray actor options of `auto` (see auto_worker_nodes): spread, restricted by a label
    selector on the node id (Ray gives every node its `ray.io/node-id` label)."""
    chosen = auto_worker_nodes(nodes)
    if chosen is None:
        return {"scheduling_strategy": "SPREAD"}
    return {"scheduling_strategy": "SPREAD", "label_selector": {"ray.io/node-id": f"in({','.join(chosen)})"}}


def load_nodes(placement: str, workers: int, nodes: Sequence[dict[str, Any]], driver: str) -> list[str]:
    """Node ids the run's Locust workers may land on (`experiment.worker_placement`): the driver's
    for `local` or no workers; the CPU-only nodes for `auto` when there are some; else any live node."""
    if placement == "local" or workers == 0:
        return [driver]
    cpu_only = auto_worker_nodes(nodes)
    return cpu_only if placement == "auto" and cpu_only else [str(n["NodeID"]) for n in alive_nodes(nodes)]


def shared_load_notes(nodes: Sequence[dict[str, Any]], driver: str, locust: Sequence[str], workers: int) -> list[str]:
    """What the load shares with GPU replicas (call it for a run with GPU arms): the driver and router
    on a GPU node, Locust workers on GPU nodes (an all-GPU cluster has no CPU-only node to keep them
    to). Their CPU use is then in the arms' latency: `plan` says it, the run's report says it."""
    gpu_nodes = {str(n["NodeID"]): n.get("NodeManagerAddress", "?") for n in alive_nodes(nodes)
                 if n.get("Resources", {}).get("GPU", 0)}
    notes = []
    if driver in gpu_nodes:
        notes.append(f"load: the driver and the router run on GPU node {gpu_nodes[driver]} ({driver[:12]}) beside "
                     "replicas: submit to a cluster whose head has no GPU (KubeRay: num-gpus 0) to keep them apart")
    shared = sorted(gpu_nodes[n] for n in set(locust) if n in gpu_nodes)
    if shared and workers:
        why = ("experiment.worker_placement lets them there" if cpu_only_nodes(nodes)
               else "no CPU-only node to keep them to")
        notes.append(f"load: {workers} Locust worker(s) share GPU node(s) {', '.join(shared)} with the "
                     f"replicas ({why}): their CPU use is in the arms' latency")
    return notes


def load_placement_notes(gpu_arms: bool, placement: str, workers: int, nodes: Sequence[dict[str, Any]],
                         driver: str) -> list[str]:
    """shared_load_notes for a run (none without GPU arms): `plan` prints them before the run, the
    run's setup records them for its report (decision.json prepare.load_placement)."""
    if not gpu_arms:
        return []
    return shared_load_notes(nodes, driver, load_nodes(placement, workers, nodes, driver), workers)
