"""The cluster plan of a run: what it would reserve and whether its nodes can run it, before any
engine starts (`mtp-canary plan` prints it; `run` shares its checks).

On the connected cluster (the config's ray.address) it reserves the run's placement group
for a moment (every replica's bundle: GPUs and CPUs), reads which node holds each bundle and
which GPU ids a task in it gets, and removes it at once. Then one tiny task pinned to each
target node (NodeAffinitySchedulingStrategy, soft=False) imports the modules a run needs
there and reports their versions; a node missing one, or with another Ray than the driver,
fails the plan naming node and cause. With `model_cache`, it says per replica node whether each
hub model is cached there already (else the run's staging downloads it while the GPUs are
held), and fails naming a node that cannot read, write or make the cache. It says the timeouts
the fleet will use and the GPU-hours the run may hold.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rollout.run.node_check import RUN_MODULES, NodeCheck, check_nodes, launched_arms, model_cache_failures, run_arms
from rollout.run.plan_defaults import PLACEMENT_PROBE_S

# the fleet's teardown waits up to 60 s for every replica's stop; `ray job stop` must wait longer
TEARDOWN_GRACE_S = 90


@dataclass
class ReplicaPlan:
    name: str
    arm: str
    bundle: dict[str, float]
    node_id: str | None = None
    node_ip: str | None = None
    gpu_ids: list[str] = field(default_factory=list)


@dataclass
class Plan:
    replicas: list[ReplicaPlan]
    nodes: list[NodeCheck]
    timeouts: dict[str, Any]
    gpu_hours: dict[str, Any]
    failures: list[str]
    notes: list[str]

    @property
    def ok(self) -> bool:
        return not self.failures

    def document(self) -> dict[str, Any]:
        return {"ok": self.ok, **asdict(self)}


def gpu_hours(cfg) -> dict[str, Any]:
    """GPU-hours the run may hold: GPUs (replicas x world size, tensor x pipeline parallel, over GPU arms) x the
    planned duration, each phase at its bound: the fleet start at startup_timeout_s, the
    experiment at max_duration_s, the sweep's levels x step_s, the progressive steps' bake_s
    (and pause_timeout_s where a step pauses). The accuracy phase has no time bound and is
    left out (so is the gap between phases)."""
    gpus = sum(arm.replicas * arm.engine.world_size for _, arm in launched_arms(cfg) if arm.engine.device == "gpu")
    phases = {"fleet_start_s": cfg.startup_timeout_s}
    if cfg.experiment.enabled:
        phases["experiment_s"] = cfg.experiment.max_duration_s
        phases["sweep_s"] = cfg.experiment.sweep.planned_s
    if cfg.progressive.enabled:
        phases["progressive_s"] = sum(
            s.bake_s + (cfg.progressive.pause_timeout_s if s.pause else 0) for s in cfg.progressive.steps
        )
    seconds = sum(phases.values())
    return {
        "gpus": gpus,
        "planned_s": seconds,
        "phases": phases,
        "gpu_hours": round(gpus * seconds / 3600, 2),
        "estimate": "GPUs (replicas x tensor_parallel_size x pipeline_parallel_size) x (startup_timeout_s + experiment.max_duration_s + "
        "sweep + progressive bake), each at its bound; the accuracy phase (unbounded) is not included",
    }


def timeouts(cfg) -> dict[str, Any]:
    engine = {arm: a.engine.startup_timeout_s for arm, a in run_arms(cfg)}
    return {
        "placement_timeout_s": cfg.placement_timeout_s,
        "engine_startup_timeout_s": engine,
        "startup_timeout_s": cfg.startup_timeout_s,
        "fits": cfg.startup_timeout_s >= cfg.placement_timeout_s + max(engine.values()),
        "job_stop_wait_s": os.environ.get("RAY_JOB_STOP_WAIT_TIME_S"),
    }


def plan_replicas(cfg) -> list[ReplicaPlan]:
    from cluster.placement import replica_bundle

    return [
        ReplicaPlan(name=f"{arm}-{i}", arm=arm, bundle=replica_bundle(a.engine, a.cpus_per_replica))
        for arm, a in launched_arms(cfg) for i in range(a.replicas)
    ]


def place(replicas: list[ReplicaPlan], wait_s: float) -> str | None:
    """Reserve every bundle (PACK, as the fleet), fill in node and GPU ids, remove the group;
    the reason it could not, or None."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0)
    def where() -> tuple[str, str, list[str]]:
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]

    if not replicas:
        return None  # every arm runs elsewhere (endpoints): nothing to place
    pg = placement_group([r.bundle for r in replicas], strategy="PACK")
    try:
        try:
            ray.get(pg.ready(), timeout=wait_s)
        except ray.exceptions.GetTimeoutError:
            need = ", ".join(f"{r.name}: {r.bundle}" for r in replicas)
            return (f"the cluster cannot hold every replica now ({need}); available: {ray.available_resources()} "
                    "(an autoscaler may still add nodes within placement_timeout_s)")
        refs = []
        for i, r in enumerate(replicas):
            gpus = r.bundle.get("GPU", 0)
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
            refs.append(where.options(num_gpus=gpus, scheduling_strategy=strategy).remote())
        for r, (node_id, ip, gpu_ids) in zip(replicas, ray.get(refs, timeout=60)):
            r.node_id, r.node_ip, r.gpu_ids = node_id, ip, gpu_ids
        bundles = placement_group_table(pg).get("bundles_to_node_id", {})
        for i, r in enumerate(replicas):
            r.node_id = bundles.get(i, r.node_id)
        return None
    finally:
        remove_placement_group(pg)


def target_nodes(cfg, replicas: list[ReplicaPlan]) -> tuple[dict[str, list[str]], list[str]]:
    """node id -> roles (replica names, 'driver', 'locust'), and notes on where Locust goes."""
    import ray

    from cluster.placement import auto_worker_nodes, load_nodes

    nodes = ray.nodes()
    driver = ray.get_runtime_context().get_node_id()
    targets: dict[str, list[str]] = {driver: ["driver"]}
    for r in replicas:
        if r.node_id:
            targets.setdefault(r.node_id, []).append(r.name)
    notes = []
    placement = cfg.experiment.worker_placement
    locust = load_nodes(placement, cfg.experiment.workers, nodes, driver)
    cpu_only = auto_worker_nodes(nodes)
    if placement == "spread" and cfg.experiment.workers and cpu_only:
        notes.append(f"Locust workers ('spread') may land on GPU nodes beside vLLM; CPU-only nodes: "
                     f"{', '.join(cpu_only)} (experiment.worker_placement: auto, the default, keeps them there)")
    for node in locust:
        targets.setdefault(node, []).append("locust")
    notes += load_placement_notes(cfg, nodes, driver)
    return targets, notes


def load_placement_notes(cfg, nodes: list[dict[str, Any]], driver: str) -> list[str]:
    """What the load shares with GPU replicas (cluster.placement.load_placement_notes); the run's
    setup records the same for its report."""
    from cluster.placement import load_placement_notes as notes_for

    exp = cfg.experiment
    gpu_arms = any(arm.engine.device == "gpu" for _, arm in launched_arms(cfg))
    return notes_for(gpu_arms, exp.worker_placement, exp.workers if exp.enabled else 0, nodes, driver)


def weights_cached(cfg, nodes: list[NodeCheck]) -> tuple[list[str], list[str]]:
    """Fill in each replica node's `weights` (model_cache); (failures, notes): a failure per node
    whose disk cannot take the models it would download (their size from engine.memory or the
    local files: cluster.gpu_memory), a note per node that would download."""
    from cluster.gpu_memory import model_need
    from cluster.staging import hub_models, probe_cached, probe_free

    engines = [arm.engine for _, arm in launched_arms(cfg)]
    models = hub_models(e.model for e in engines)
    replica_nodes = [n for n in nodes if any(role not in ("driver", "locust") for role in n.roles) and not n.problems]
    if not cfg.model_cache or not models or not replica_nodes:
        return [], []
    try:
        found = probe_cached([n.node_id for n in replica_nodes], models, cfg.model_cache)
        free = probe_free([n.node_id for n in replica_nodes], cfg.model_cache)
    except Exception as exc:  # a node that cannot run the probe: the import check names it already
        return [], [f"weights: not checked ({type(exc).__name__}: {exc})"[:300]]
    sizes: dict[str, float] = {}
    for engine in engines:
        need = model_need(engine)
        if need is not None and engine.model in models:
            sizes[engine.model] = max(sizes.get(engine.model, 0.0), need.weights)
    failures, notes = [], []
    for node in replica_nodes:
        node.weights = found.get(node.node_id, {})
        missing = [m for m, copy in node.weights.items() if copy is None]
        if missing:
            notes.append(f"weights: {', '.join(missing)} not cached on node {node.node_ip} ({node.node_id[:12]}): the run "
                         f"downloads it into {cfg.model_cache} while its GPUs are held (staging_timeout_s "
                         f"{cfg.staging_timeout_s:g} s)")
        where, available = free.get(node.node_id, ("?", 0))
        wanted = sum(sizes.get(m, 0.0) for m in missing)
        if wanted > available:
            failures.append(f"disk: node {node.node_ip} ({node.node_id[:12]}) has {available / 1e9:.1f} GB free at "
                            f"{where}; staging {', '.join(m for m in missing if m in sizes)} into {cfg.model_cache} "
                            f"needs {wanted / 1e9:.1f} GB")
        elif missing and any(m not in sizes for m in missing):
            notes.append(f"disk: node {node.node_ip} has {available / 1e9:.1f} GB free at {where}; the size of "
                         f"{', '.join(m for m in missing if m not in sizes)} is unknown (engine.memory)")
    return failures, notes


def staging_failures(cfg) -> list[str]:
    """A GPU arm serving a hub id without model_cache: each server would download the weights
    itself inside its own startup clock, into its node's default cache, progress unseen."""
    from cluster.staging import hub_models

    gpu_hub = hub_models(arm.engine.model for _, arm in launched_arms(cfg) if arm.engine.device == "gpu")
    if not gpu_hub or cfg.model_cache:
        return []
    return [f"model_cache: unset, so every GPU server downloads {', '.join(gpu_hub)} itself within its "
            "engine.startup_timeout_s into its node's default cache; set model_cache (a path on every GPU node, "
            "e.g. a volume at /mnt/model-cache) to stage it once per node before the engines start"]


def memory_failures(cfg) -> list[str]:
    """Each GPU arm's layout against each GPU node type of the cluster (cluster.gpu_memory): one
    line per arm and type that cannot hold the model, naming a layout that could."""
    from cluster.gpu_memory import fit_failures, live_gpu_types

    types, _ = live_gpu_types()
    seen: list[Any] = []
    arms = []
    for name, arm in launched_arms(cfg):
        if arm.engine not in seen:  # the twin runs the baseline's engine: one line, not two
            seen.append(arm.engine)
            arms.append((name, arm.engine))
    return [f"memory: {line}" for line in fit_failures(arms, types)]


def memory_notes(cfg) -> list[str]:
    """GPU nodes whose memory the check could not know (no accelerator type it has a size for)."""
    from cluster.gpu_memory import live_gpu_types

    _, unknown = live_gpu_types()
    if not unknown or not any(arm.engine.device == "gpu" for _, arm in launched_arms(cfg)):
        return []
    return [f"memory: not checked on GPU nodes of unknown memory per GPU: {', '.join(unknown)}"]


def make_plan(cfg, modules: Sequence[str] = RUN_MODULES, placement_wait_s: float = PLACEMENT_PROBE_S) -> Plan:
    replicas = plan_replicas(cfg)
    failures: list[str] = []
    why = place(replicas, placement_wait_s)
    if why:
        failures.append(f"placement: {why}")
    failures += memory_failures(cfg)
    targets, notes = target_nodes(cfg, replicas)
    notes += memory_notes(cfg)
    nodes = check_nodes(targets, modules)
    for check in nodes:
        for problem in check.problems:
            failures.append(f"node {check.node_ip} ({check.node_id[:12]}, {', '.join(check.roles)}): {problem}")
    failures += staging_failures(cfg)
    failures += model_cache_failures(cfg)
    staged_failures, staged_notes = weights_cached(cfg, nodes)
    failures += staged_failures
    notes += staged_notes
    times = timeouts(cfg)
    if os.environ.get("RAY_JOB_ID"):
        grace = times["job_stop_wait_s"]
        if grace is None or not grace.isdigit() or int(grace) < TEARDOWN_GRACE_S:
            failures.append(
                f"driver: RAY_JOB_STOP_WAIT_TIME_S is {grace or 'unset (3 s)'}: `ray job stop` would SIGKILL the "
                f"teardown; submit with --runtime-env-json '{{\"env_vars\": {{\"RAY_JOB_STOP_WAIT_TIME_S\": "
                f"\"{TEARDOWN_GRACE_S}\"}}}}'"
            )
    return Plan(replicas=replicas, nodes=nodes, timeouts=times, gpu_hours=gpu_hours(cfg), failures=failures,
                notes=notes)


def render(plan: Plan) -> str:
    lines = ["placement:"]
    for r in plan.replicas:
        gpus = f" GPUs {','.join(r.gpu_ids)}" if r.gpu_ids else ""
        lines.append(f"  {r.name}: {r.bundle} on {r.node_ip or '?'} ({(r.node_id or '?')[:12]}){gpus}")
    lines.append("nodes:")
    for n in plan.nodes:
        state = "ok" if not n.problems else "FAILED: " + "; ".join(n.problems)
        versions = ", ".join(f"{m} {v}" for m, v in sorted(n.versions.items()))
        lines.append(f"  {n.node_ip} ({n.node_id[:12]}, {', '.join(n.roles)}): {state} [{versions}]")
        for model, copy in n.weights.items():
            lines.append(f"    weights {model}: " + ("not cached (staging downloads it)" if copy is None else
                         f"cached at {copy['path']} ({copy['files']} files, {copy['bytes'] / 1e9:.2f} GB)"))
    t = plan.timeouts
    lines.append(f"timeouts: placement {t['placement_timeout_s']:g} s + engine "
                 + ", ".join(f"{a} {s:g} s" for a, s in t["engine_startup_timeout_s"].items())
                 + f" <= fleet {t['startup_timeout_s']:g} s: {'ok' if t['fits'] else 'NO'}")
    g = plan.gpu_hours
    lines.append(f"GPU-hours: {g['gpu_hours']} ({g['gpus']} GPUs x {g['planned_s'] / 3600:.2f} h; {g['estimate']})")
    lines += [f"note: {n}" for n in plan.notes]
    lines.append("plan: every check passed" if plan.ok else f"plan: {len(plan.failures)} check(s) failed")
    return "\n".join(lines)
