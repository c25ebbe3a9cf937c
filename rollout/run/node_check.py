"""Every node imports what a run needs: the modules a run loads on its nodes, probed on each node,
and the model cache staging writes there.

`run`'s setup (before the fleet starts, `ray.check_nodes`) and `mtp-canary plan` share it. Each probe is a
child of the node's Python: locust's gevent patching never shares a process with Ray.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


# what a run imports on its nodes: the engine, Ray, the load generator, the project itself
RUN_MODULES = ("vllm", "ray", "locust", "scipy", "aiohttp", "rollout", "cluster", "loadtests")


@dataclass
class NodeCheck:
    node_id: str
    node_ip: str
    roles: list[str]
    versions: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)  # module -> why it did not import
    problems: list[str] = field(default_factory=list)
    # model_cache: hub model -> {"path", "files", "bytes"} when a complete copy is cached on this node,
    # None when staging would download it (only replica nodes, only with model_cache)
    weights: dict[str, dict | None] = field(default_factory=dict)


_PROBE = """
import importlib, importlib.metadata, json, sys
name = sys.argv[1]
module = importlib.import_module(name)
version = getattr(module, "__version__", None)
if version is None:
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
print(json.dumps(str(version or "present")))
"""


def module_versions(modules: Sequence[str], timeout_s: float = 240) -> dict[str, dict[str, str]]:
    """Import each module in a child of this node's Python, one child per module;
    {"versions": {module: version}, "missing": {module: the import's last error line}}.
    Children, not this process: locust's gevent patching hangs a Ray worker, and after ray or
    ssl is imported it fails (RecursionError), so locust never shares a process with them."""
    import subprocess

    versions: dict[str, str] = {}
    missing: dict[str, str] = {}
    for name in modules:
        try:
            done = subprocess.run([sys.executable, "-c", _PROBE, name], capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            missing[name] = f"import did not finish within {timeout_s:g} s"
            continue
        if done.returncode == 0:
            versions[name] = json.loads(done.stdout.strip().splitlines()[-1])
        else:
            lines = (done.stderr or "").strip().splitlines() or [f"exit {done.returncode}"]
            missing[name] = lines[-1][:200]
    return {"versions": versions, "missing": missing}


def run_arms(cfg) -> list[tuple[str, Any]]:
    from cluster.arms import BASELINE, CANARY
    from rollout.config import TWIN

    if cfg.candidates:
        return [(BASELINE, cfg.baseline)] + [(c.name, c) for c in cfg.candidates]
    arms = [(BASELINE, cfg.baseline), (CANARY, cfg.canary)]
    return arms + [(TWIN, cfg.baseline)] if cfg.twin_baseline else arms


def launched_arms(cfg) -> list[tuple[str, Any]]:
    """The arms whose replicas the run starts (an arm with endpoints runs elsewhere: nothing placed)."""
    return [(name, arm) for name, arm in run_arms(cfg) if arm.launched]


def check_nodes(targets: dict[str, list[str]], modules: Sequence[str]) -> list[NodeCheck]:
    """One task per target node (node id -> roles), pinned there, importing `modules`."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0)(module_versions)
    ips = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    refs = {
        node: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(
            list(modules))
        for node in targets
    }
    here = ray.__version__
    checks = []
    for node, ref in refs.items():
        check = NodeCheck(node_id=node, node_ip=ips.get(node, "?"), roles=sorted(set(targets[node])))
        try:
            answer = ray.get(ref, timeout=300)
        except Exception as exc:
            check.problems.append(f"the check task did not run: {type(exc).__name__}: {exc}"[:300])
            checks.append(check)
            continue
        check.versions, check.missing = answer["versions"], answer["missing"]
        for module, why in check.missing.items():
            check.problems.append(f"cannot import {module} ({why})")
        theirs = check.versions.get("ray")
        if theirs and theirs != here:
            check.problems.append(f"ray {theirs}, the driver runs ray {here} (Ray needs one version cluster-wide)")
        checks.append(check)
    return checks


def wants_node_check(cfg) -> bool:
    """Whether `run` checks every node's environment before its fleet starts (ray.check_nodes;
    auto: on a multi-node cluster or with GPU engines, where a missing module would otherwise
    surface only after GPUs were held for the fleet start, the accuracy phase and preflight)."""
    if cfg.ray.check_nodes != "auto":
        return cfg.ray.check_nodes == "always"
    import ray

    from cluster.placement import alive_nodes

    gpu_engines = any(arm.engine.device == "gpu" for _, arm in launched_arms(cfg))
    return gpu_engines or len(alive_nodes(ray.nodes())) > 1


def node_environment_failures(modules: Sequence[str] | None = None) -> list[str]:
    """`run`'s check before its fleet starts: every live node that can run a task (resources, or
    the driver's) imports `modules`; one line per problem, naming the node's IP, id and kind."""
    import ray

    from cluster.placement import alive_nodes

    driver = ray.get_runtime_context().get_node_id()
    targets: dict[str, list[str]] = {}
    for node in alive_nodes(ray.nodes()):
        resources, roles = node.get("Resources", {}), []
        if node["NodeID"] == driver:
            roles.append("driver")
        if resources.get("GPU", 0):
            roles.append("GPU node")
        elif resources.get("CPU", 0):
            roles.append("CPU node")
        if roles:
            targets[str(node["NodeID"])] = roles
    return [f"node {c.node_ip} ({c.node_id[:12]}, {', '.join(c.roles)}): {problem}"
            for c in check_nodes(targets, modules or RUN_MODULES) for problem in c.problems]


def cache_problem(cache: str) -> str | None:
    """What keeps staging from using `cache` on this node (run it there), or None: the directory
    must be readable and writable, or, not there yet, creatable (its nearest existing parent a
    writable directory: staging makes it)."""
    from cluster.staging import expand_cache

    path = expand_cache(cache)
    if path.exists():
        if not path.is_dir():
            return f"{path} is not a directory"
        if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
            return f"{path} cannot be read and written by uid {os.getuid()}"
        return None
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} does not exist and cannot be made under {parent} (not a writable directory)"
    return None


def model_cache_failures(cfg) -> list[str]:
    """model_cache on every node a staged replica may land on (the GPU nodes for GPU arms, else
    every node with CPUs): one line per node where staging could not use it, naming the field. None
    without model_cache or a hub model to stage."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cluster.placement import alive_nodes
    from cluster.staging import hub_models

    engines = [arm.engine for _, arm in launched_arms(cfg)]
    if not cfg.model_cache or not hub_models(e.model for e in engines):
        return []
    kind = "GPU" if any(e.device == "gpu" for e in engines) else "CPU"
    nodes = [n for n in alive_nodes(ray.nodes()) if n.get("Resources", {}).get(kind, 0)]
    probe = ray.remote(num_cpus=0)(cache_problem)
    refs = [(n, probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False))
             .remote(cfg.model_cache)) for n in nodes]
    failures = []
    for node, ref in refs:
        try:
            problem = ray.get(ref, timeout=120)
        except Exception as exc:  # noqa: BLE001 - a node that cannot answer cannot stage either
            problem = f"not checked ({type(exc).__name__}: {exc})"[:300]
        if problem:
            failures.append(f"model_cache: {cfg.model_cache} on node {node.get('NodeManagerAddress', '?')} "
                            f"({str(node['NodeID'])[:12]}, {kind} node): {problem}")
    return failures
