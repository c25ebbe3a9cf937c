"""A fleet: every replica of every arm, started in parallel, torn down together.

Start-up is all or nothing. On a GPU cluster the fleet first reserves one
placement-group bundle of `tensor_parallel_size` GPUs per replica (a Ray actor's
resources always come from a single bundle, and vLLM needs all of a replica's
GPUs on one node), so a cluster that cannot hold every replica fails at once
with the missing resources named, instead of half-starting. Then every replica
launches at the same time; the fleet polls them, prints progress, and if any
fails it tears all of them down and raises with the failed replica's log tail.

With `model_cache`, between placement and launch each arm's hub model is staged once on every
node its replicas landed on (cluster.staging), and those replicas then serve the local copy
offline. At teardown each replica's server log is copied back through its actor (it runs on the
replica's node) into `logs_back_to`, capped and redacted, so it outlives a RayJob cluster.

An arm with `endpoints` is servers someone else runs: one `cluster.external_replica` actor per
URL, with nothing reserved, bound, staged, launched or stopped for it; its start is only the
wait for each server's /health.

Beyond loopback each launched server requires a key of its own (cluster.replica); the fleet asks
its actor for it once the server launched or was adopted, and keeps it in memory: upstream_keys()
is what the router and the preflight send.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import ray
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.engine_spec import EngineSpec
from cluster.external_replica import ExternalReplica
from cluster.gpu_memory import fit_failures, live_gpu_types
from cluster.placement import CPU_PLACEMENT_TIMEOUT_S, FLEET_START_SLACK_S, replica_bundle
from cluster.ray_cluster import find_actor, kill_quietly
from cluster.replica import ReplicaState, ReplicaStatus, VLLMReplica
from cluster.fleet_view import CONTROL_TIMEOUT_S, LOG_COPY_BYTES, FleetStartError, FleetView, ReplicaHandle, _get_or_fail
from cluster.staging import STAGING_TIMEOUT_S, Source, StagedWeights, StagingError, hub_source, is_local_model, stage_on_nodes

Progress = Callable[[str], None]


class ArmSpec(BaseModel):
    """One arm: `replicas` servers of the same engine config."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=r"^[a-z][a-z0-9_-]*$")
    engine: EngineSpec
    replicas: int = Field(1, ge=1)
    # reserved in each GPU replica's bundle and held by its actor (cluster.placement); the
    # run's config fills in tensor_parallel_size + 2 on GPU
    cpus_per_replica: float = Field(0.0, ge=0)
    # servers someone else runs (cluster.external_replica): one replica per URL, nothing launched,
    # reserved or bound here; `engine` then says what they serve (model name, speculative config)
    endpoints: list[str] = Field(default_factory=list)
    metrics_urls: list[str] | None = None  # one per endpoint; None: each endpoint's /metrics

    @model_validator(mode="after")
    def _one_replica_per_endpoint(self) -> "ArmSpec":
        if self.endpoints and self.replicas != len(self.endpoints):
            raise ValueError(f"arm {self.name}: {self.replicas} replicas for {len(self.endpoints)} endpoints")
        if self.metrics_urls is not None and len(self.metrics_urls) != len(self.endpoints):
            raise ValueError(f"arm {self.name}: {len(self.metrics_urls)} metrics_urls for {len(self.endpoints)} endpoints")
        return self

    @property
    def external(self) -> bool:
        return bool(self.endpoints)

    @property
    def launched_gpu(self) -> bool:
        """Replicas this fleet starts on GPUs (an external arm's GPUs are someone else's)."""
        return not self.external and self.engine.device == "gpu"

    @property
    def launched_cpu(self) -> bool:
        return not self.external and self.engine.device == "cpu"


@dataclass
class Fleet(FleetView):
    """Start, observe and stop all replicas of all arms.

    Use as a context manager so teardown also runs on error and Ctrl-C.
    """

    arms: list[ArmSpec]
    log_dir: str
    progress: Progress = print
    # (replicas ready, replicas in all) each time one more is ready: a progress bar's feed
    on_ready: Callable[[int, int], None] | None = None
    actor_name_prefix: str | None = None  # named actors let a later process reattach
    namespace: str | None = None
    # detached (needs a name prefix): the replicas outlive this driver (resume after a crash);
    # each holds a lease the owner must renew (cluster.lease), so an abandoned fleet stops itself
    detached: bool = False
    lease_s: float | None = None  # renewed once at creation; the owner keeps renewing (renew_lease)
    bind_host: str = "127.0.0.1"  # "0.0.0.0" when Locust or the router run on another node
    placement_timeout_s: float = CPU_PLACEMENT_TIMEOUT_S  # the run's config: 900 s when any arm is on GPU
    poll_s: float = 2.0
    # hub models staged into this cache on each replica's node before any server starts, then
    # served offline from there (cluster.staging); None: each server fetches its model itself
    model_cache: str | None = None
    weights_source: Source = hub_source
    staging_timeout_s: float = STAGING_TIMEOUT_S
    staged: list[StagedWeights] = field(default_factory=list)
    # where teardown writes each replica's server log (<replica>.log), read through its actor on its
    # node; redact_log: what of a log may be written (the run's secrets scrubbed)
    logs_back_to: str | None = None
    redact_log: Callable[[str], str] | None = None
    log_copy_bytes: int = LOG_COPY_BYTES
    replicas: list[ReplicaHandle] = field(default_factory=list)
    cpu_cores: dict[str, str | None] = field(default_factory=dict)  # replica -> bound cores (plan_cpu_cores)
    _placement_group: object | None = None

    # -- start -----------------------------------------------------------------
    def _reserve_gpus(self) -> list[PlacementGroupSchedulingStrategy | None]:
        specs = [(arm, i) for arm in self.arms for i in range(arm.replicas)]
        if not any(arm.launched_gpu for arm in self.arms):
            return [None] * len(specs)
        # every replica this fleet starts gets a bundle (CPU ones too, as before); external ones none
        reserved = [(arm, i) for arm, i in specs if not arm.external]
        # a layout whose GPUs cannot hold the model fails here in seconds, not at KV-cache
        # allocation after every replica loaded its weights (cluster.gpu_memory, as `plan` says)
        too_big = fit_failures([(arm.name, arm.engine) for arm in self.arms if arm.launched_gpu], live_gpu_types()[0])
        if too_big:
            raise FleetStartError("GPU memory: " + "; ".join(too_big))
        bundles = [replica_bundle(arm.engine, arm.cpus_per_replica) for arm, _ in reserved]
        pg_options = {"name": f"{self.actor_name_prefix}gpus", "lifetime": "detached"} if self.detached else {}
        pg = placement_group(bundles, strategy="PACK", **pg_options)
        # held before the (up to 900 s) wait: an interrupt there (Ctrl-C, SIGTERM) reaches teardown,
        # which removes the group; a detached group nobody holds stays reserved until a resume
        self._placement_group = pg
        if not _wait_placement(pg, self.placement_timeout_s, self.progress):
            self._placement_group = None
            remove_placement_group(pg)
            need = ", ".join(
                f"{arm.name}: {arm.replicas} x {replica_bundle(arm.engine, arm.cpus_per_replica)}"
                for arm in self.arms if not arm.external
            )
            raise FleetStartError(
                f"the cluster cannot place every replica ({need}) within {self.placement_timeout_s:g} s "
                f"(placement_timeout_s); available: {ray.available_resources()}"
            )
        strategies: list[PlacementGroupSchedulingStrategy | None] = []
        bundle = 0
        for arm, _ in specs:
            if arm.external:
                strategies.append(None)
                continue
            strategies.append(PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle))
            bundle += 1
        return strategies

    def plan_cpu_cores(self) -> dict[str, str | None]:
        """Replica name -> the cores it is bound to (None: unbound, shares cores).

        CPU replicas on one node fight for the cores (seen on 2 cores: per-look TPOT medians of
        the two arms swung 286-467 ms, anti-correlated). When every replica is a CPU one, the
        cluster is a single node and their threads fit into its cores, each replica gets
        disjoint cores; otherwise they stay unbound and `core_sharing` says so.
        """
        every = [(f"{arm.name}-{i}", arm) for arm in self.arms for i in range(arm.replicas)]
        names = [(name, arm) for name, arm in every if not arm.external]  # an external server's cores are not ours
        if not names or any(arm.launched_gpu for _, arm in names):
            return {name: None for name, _ in every}
        explicit = {name: arm.engine.cpu.cores for name, arm in names if arm.engine.cpu.cores}
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        cores = int(nodes[0].get("Resources", {}).get("CPU", 0)) if len(nodes) == 1 else 0
        wanted = sum(arm.engine.cpu.omp_threads for _, arm in names)
        if explicit or len(nodes) != 1 or wanted > cores:
            return {name: explicit.get(name) for name, _ in every}
        plan: dict[str, str | None] = {name: None for name, _ in every}
        next_core = 0
        for name, arm in names:
            n = arm.engine.cpu.omp_threads
            plan[name] = str(next_core) if n == 1 else f"{next_core}-{next_core + n - 1}"
            next_core += n
        return plan

    @property
    def core_sharing(self) -> str | None:
        """Why replicas share cores (the report says so), or None when each has its own."""
        launched = [arm for arm in self.arms if not arm.external]
        if not launched or not all(arm.launched_cpu for arm in launched):
            return None
        if all(self.cpu_cores.get(f"{arm.name}-{i}") for arm in launched for i in range(arm.replicas)):
            return None
        return "CPU replicas are not bound to cores of their own (more OMP threads than cores, or several nodes)"

    def create_actors(self) -> list[ReplicaHandle]:
        """Place one actor per replica (GPU reservations first); starts no server yet."""
        if self.detached and not self.actor_name_prefix:
            raise ValueError("a detached fleet needs actor_name_prefix (a later process finds it by name)")
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        strategies = self._reserve_gpus()
        self.cpu_cores = self.plan_cpu_cores()
        index = 0
        for arm in self.arms:
            for i in range(arm.replicas):
                name = f"{arm.name}-{i}"
                engine = arm.engine
                if self.cpu_cores.get(name) and engine.device == "cpu":
                    engine = engine.model_copy(update={"cpu": engine.cpu.model_copy(update={"cores": self.cpu_cores[name]})})
                options: dict = {"num_gpus": arm.engine.world_size if arm.launched_gpu else 0}
                if arm.launched_gpu and arm.cpus_per_replica > 0:
                    options["num_cpus"] = arm.cpus_per_replica  # the bundle's CPUs, held by the replica
                if strategies[index] is not None:
                    options["scheduling_strategy"] = strategies[index]
                if self.actor_name_prefix:
                    options["name"] = f"{self.actor_name_prefix}{name}"
                if self.namespace:
                    options["namespace"] = self.namespace
                if self.detached:
                    options["lifetime"] = "detached"
                if arm.external:
                    actor = ExternalReplica.options(**options).remote(
                        name, arm.name, arm.endpoints[i], arm.metrics_urls[i] if arm.metrics_urls else None,
                        arm.engine.startup_timeout_s,
                    )
                else:
                    pg_name = f"{self.actor_name_prefix}gpus" if self.detached and self._placement_group is not None else None
                    actor = VLLMReplica.options(**options).remote(
                        name, arm.name, engine.model_dump(), str(Path(self.log_dir).resolve()), self.bind_host, pg_name
                    )
                if self.lease_s:
                    # at once: an owner that dies before its first renewal must not leave an unleased replica
                    actor.renew_lease.remote(self.lease_s)
                self.replicas.append(ReplicaHandle(name=name, arm=arm.name, actor=actor))
                index += 1
        return self.replicas

    def start_timeout_s(self) -> float:
        """The default clock of start(): placement, then the slowest engine's own startup_timeout_s."""
        return self.placement_timeout_s + max(a.engine.startup_timeout_s for a in self.arms) + FLEET_START_SLACK_S

    def start(self, timeout_s: float | None = None) -> dict[str, list[str]]:
        """Start every replica in parallel; return arm -> replica URLs, or raise FleetStartError.

        timeout_s covers placement and every replica's start (None: start_timeout_s()); each
        replica also keeps its own engine.startup_timeout_s from its launch."""
        timeout_s = self.start_timeout_s() if timeout_s is None else timeout_s
        total = sum(arm.replicas for arm in self.arms)
        self.progress(f"fleet: starting {total} replica(s): " + ", ".join(f"{a.name} x{a.replicas}" for a in self.arms))
        started = time.monotonic()
        try:
            self.create_actors()
            # staging has its own clock (staging_timeout_s): the fleet's covers placement and the engines
            started += self.stage_weights()
            # launch only starts the server process; actors that cannot even be created count against timeout_s
            statuses = _get_or_fail(
                [r.actor.launch.remote() for r in self.replicas],
                max(CONTROL_TIMEOUT_S, timeout_s - (time.monotonic() - started)), "launch their servers")
            for handle, st in zip(self.replicas, statuses):
                handle.status = st
            self._take_keys(self.replicas)
            self._wait_all_ready(started, timeout_s)
        except BaseException:
            self.teardown()
            raise
        self.progress(f"fleet: all {total} replica(s) ready in {time.monotonic() - started:.0f} s")
        return self.urls()

    def stage_weights(self) -> float:
        """Stage every arm's hub model on the nodes its replicas landed on (one task per node), then
        point those replicas at the local copies, offline; the seconds it took (0: nothing to stage)."""
        models = {arm.name: arm.engine.model for arm in self.arms
                  if not arm.external and not is_local_model(arm.engine.model)}
        handles = [r for r in self.replicas if r.arm in models]
        if not self.model_cache or not handles:
            return 0.0
        t0 = time.monotonic()
        nodes = [node for node, _ in ray.get([r.actor.where.remote() for r in handles], timeout=120)]
        jobs: dict[str, list[str]] = {}
        for r, node in zip(handles, nodes):
            wanted = jobs.setdefault(node, [])
            if models[r.arm] not in wanted:
                wanted.append(models[r.arm])
        try:
            staged = stage_on_nodes(jobs, self.model_cache, self.weights_source, self.progress,
                                    timeout_s=self.staging_timeout_s)
        except StagingError as exc:
            raise FleetStartError(f"weights: {exc}") from None
        self.staged = list(staged.values())
        _get_or_fail([r.actor.use_staged_weights.remote(staged[(node, models[r.arm])].path)
                      for r, node in zip(handles, nodes)], CONTROL_TIMEOUT_S, "take the staged weights")
        return time.monotonic() - t0

    def _wait_all_ready(self, started: float, timeout_s: float | None) -> None:
        last_report = 0.0
        reported_ready: set[str] = set()
        while True:
            statuses: list[ReplicaStatus] = _get_or_fail([r.actor.status.remote() for r in self.replicas],
                                                         CONTROL_TIMEOUT_S, "answer their status")
            for handle, st in zip(self.replicas, statuses):
                handle.status = st
                if st.state == ReplicaState.READY and st.name not in reported_ready:
                    reported_ready.add(st.name)
                    self.progress(f"fleet: {st.name} ready at {st.url} after {st.elapsed_s:.0f} s")
                    if self.on_ready is not None:
                        self.on_ready(len(reported_ready), len(self.replicas))
            failed = [st for st in statuses if st.state == ReplicaState.FAILED]
            if failed:
                st = failed[0]
                tail = "\n".join(f"    {line}" for line in st.log_tail[-25:])
                cause = f"; cause: {st.cause}" if st.cause else ""
                raise FleetStartError(
                    f"replica {st.name} on node {st.node_ip or '?'} failed to start: {st.error}{cause} "
                    f"(log: {st.log_path} on that node)\n  last log lines:\n{tail}"
                )
            if all(st.state == ReplicaState.READY for st in statuses):
                return
            now = time.monotonic()
            if timeout_s is not None and now - started > timeout_s:
                waiting = [st.name for st in statuses if st.state != ReplicaState.READY]
                raise FleetStartError(f"replicas {waiting} not ready within {timeout_s:g} s (startup_timeout_s)")
            if now - last_report >= 15:
                last_report = now
                waiting = [st for st in statuses if st.state != ReplicaState.READY]
                for st in waiting:
                    last_line = st.log_tail[-1][:120] if st.log_tail else ""
                    self.progress(f"fleet: {st.name} starting ({st.elapsed_s:.0f} s) | {last_line}")
            time.sleep(self.poll_s)

    # -- reattach (resume) -----------------------------------------------------
    def planned_names(self) -> list[tuple[str, str]]:
        """(replica name, arm) of every replica this fleet has, in start order."""
        return [(f"{arm.name}-{i}", arm.name) for arm in self.arms for i in range(arm.replicas)]

    def _find(self, name: str):
        return find_actor(f"{self.actor_name_prefix or ''}{name}", namespace=self.namespace)

    def attach(self) -> bool:
        """Adopt the named replicas an earlier process started; True only if every one is there and ready.

        On False nothing is adopted: call `remove_leftovers()` and start anew.
        """
        handles = []
        for name, arm in self.planned_names():
            actor = self._find(name)
            if actor is None:
                return False
            handles.append(ReplicaHandle(name=name, arm=arm, actor=actor))
        try:
            statuses = ray.get([h.actor.status.remote() for h in handles], timeout=30)
        except ray.exceptions.RayError:
            return False
        if any(st.state != ReplicaState.READY for st in statuses):
            return False
        for handle, st in zip(handles, statuses):
            handle.status = st
        try:
            self._take_keys(handles)
        except (ray.exceptions.RayError, FleetStartError):
            return False
        self.replicas = handles
        self.cpu_cores = self.plan_cpu_cores()  # what the earlier process planned (same rule, same cluster)
        if self.detached:
            self._placement_group = _named_placement_group(f"{self.actor_name_prefix}gpus")
        self.progress(f"fleet: reattached {len(handles)} running replica(s)")
        return True

    def remove_leftovers(self) -> None:
        """Stop whatever an earlier process left of this fleet (some replicas, a GPU reservation)."""
        found = [(name, arm, self._find(name)) for name, arm in self.planned_names()]
        self.replicas = [ReplicaHandle(name=n, arm=a, actor=actor) for n, a, actor in found if actor is not None]
        if self.detached:
            self._placement_group = _named_placement_group(f"{self.actor_name_prefix}gpus")
        if self.replicas:
            self.progress(f"fleet: stopping {len(self.replicas)} replica(s) left from an earlier attempt")
        self.teardown()


    # -- stop ------------------------------------------------------------------
    def hand_over(self, arm: str, to: str) -> None:
        """Arm `arm`'s replicas serve as arm `to` from now on (several candidates: the winner takes
        the canary's place, so everything that asks for the canary's replicas finds them)."""
        if any(a.name == to for a in self.arms):
            raise ValueError(f"arm {to!r} already has replicas")
        self.arms = [a.model_copy(update={"name": to}) if a.name == arm else a for a in self.arms]
        for r in self.replicas:
            if r.arm == arm:
                r.arm = to

    def retire(self, arms: Collection[str]) -> None:
        """Stop the replicas of `arms` (their logs copied back first) while the others serve on. On GPU
        their bundles stay in the run's placement group until teardown (a group is removed whole)."""
        gone = [r for r in self.replicas if r.arm in arms]
        if not gone:
            return
        # the survivors first: the lease keeper renews self.replicas while the losers stop (up to ~90 s)
        self.replicas = [r for r in self.replicas if r.arm not in arms]
        self.arms = [a for a in self.arms if a.name not in arms]
        self._stop_replicas(gone)

    def teardown(self) -> None:
        """Stop every server (SIGTERM then SIGKILL), kill the actors, free the GPUs."""
        if not self.replicas and self._placement_group is None:
            return
        self._stop_replicas(self.replicas)
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
            self._placement_group = None
        self.replicas = []

    def _stop_replicas(self, replicas: list[ReplicaHandle]) -> None:
        pending = [(r, r.actor.stop.remote()) for r in replicas]
        # Wait for every stop before killing any actor: Ray kills a dead actor's
        # child processes, and a stop cut short would orphan the engine processes.
        deadline = time.monotonic() + 60
        for r, ref in pending:
            try:
                ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except Exception as exc:  # an actor already dead: its reaper stops the server
                self.progress(f"fleet: teardown: {r.name}: {type(exc).__name__}")
        self.copy_logs_back(replicas)
        for r in replicas:
            kill_quietly(r.actor)
        if replicas:
            self.progress(f"fleet: stopped {len(replicas)} replica(s)")


    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()


def _named_placement_group(name: str):
    try:
        return ray.util.get_placement_group(name)
    except ValueError:
        return None


def _wait_placement(pg, timeout_s: float, progress: Progress = print, every_s: float = 30.0) -> bool:
    """Wait for the group, saying every every_s that it still waits (an autoscaler may be adding nodes)."""
    ready = pg.ready()
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            ray.get(ready, timeout=max(0.1, min(every_s, left)))
            return True
        except ray.exceptions.GetTimeoutError:
            if time.monotonic() >= deadline:
                return False
            progress(f"fleet: waiting for the cluster to place every replica ({left:.0f} s left of placement_timeout_s)")
