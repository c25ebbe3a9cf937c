"""Locust load distributed by Ray: the master here, each worker under a Ray actor on a node.

`run_distributed_swarm(spec)` runs a `loadtests.swarm.SwarmSpec` like `Swarm(spec).run()`
does, with the same checks and the same `SwarmResult`, except that each of the
spec.n_workers Locust workers is started and supervised by one `cluster.process`
actor (a generic "supervised process") placed by Ray: spread over the nodes, or pinned
to a node, a node label or a custom resource. The master stays a child process of this
one and is the only place records are written.

Gevent stays out of Ray: a worker is a `locust --worker` child process of its actor,
and this module imports only `loadtests.swarm` (which imports no Locust) and Ray.

Addresses: workers connect to the master at `spec.master_advertise_host`, by default
the bind host; a master bound to 0.0.0.0 is advertised at this node's Ray IP. A master
bound to 127.0.0.1 (the default, one machine) cannot be reached from other nodes: a
worker placed on another node stops the run before it starts, with a message that says
to bind 0.0.0.0.

Fail closed: a worker process that exits non-zero, or whose actor dies, fails the run
with `SwarmError` at once (the master and every other worker are killed); the run never
returns partial numbers as complete.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from cluster.process import NodeInfo, ProcessStatus, supervised_process_actor
from loadtests.swarm import (
    LOCUST_ENV_PREFIX,
    PARENT_PID_ENV,
    Swarm,
    SwarmError,
    SwarmProgress,
    SwarmResult,
    SwarmSpec,
    worker_command,
)

_PACKAGE_PARENT = Path(__file__).resolve().parent.parent
# an actor that does not answer a status poll for this long counts as dead
_UNRESPONSIVE_S = 30.0
# exit code reported for a worker whose actor died (the process is gone with it: the reaper kills it)
ACTOR_DIED = -1000


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class RayWorkers:
    """Locust workers, each started and watched by one SupervisedProcess actor (a
    `loadtests.swarm.WorkerGroup`)."""

    def __init__(
        self,
        placement: str = "spread",
        *,
        num_cpus_per_worker: float = 1.0,
        placement_timeout_s: float = 60.0,
        poll_interval_s: float = 0.5,
    ) -> None:
        self.placement = placement
        self.num_cpus_per_worker = num_cpus_per_worker
        self.placement_timeout_s = placement_timeout_s
        self.poll_interval_s = poll_interval_s
        self._actors: list[Any] = []
        self._nodes: list[NodeInfo] = []
        self._commands: list[tuple[str, str]] = []  # (python, locustfile) per worker, as paths on its node
        self._advertise_host = ""
        self._pids: list[int] = []
        self._codes: list[int | None] = []
        self._why_dead: dict[int, str] = {}
        self._last_answer: list[float] = []
        self._polled_at = 0.0
        self._log_dir = ""
        self._started = False
        self._descriptions: dict[int, str] = {}  # kept for after the actors are released

    # -- WorkerGroup -----------------------------------------------------------------
    def prepare(self, spec: SwarmSpec) -> None:
        """Place one actor per worker and check that each can run its worker (before any load)."""
        if not ray.is_initialized():
            raise SwarmError("distributed load needs a Ray connection (cluster.ray_cluster.connect) first")
        self._log_dir = str(spec.logs)
        try:
            self._actors = [
                supervised_process_actor(f"worker-{index}", num_cpus=self.num_cpus_per_worker,
                                         placement=self.placement, log_dir=self._log_dir)
                for index in range(spec.n_workers)
            ]
        except ValueError as exc:
            raise SwarmError(f"bad placement for the locust workers: {exc}") from exc
        locustfile = Path(spec.locustfile).resolve()
        try:
            relative = str(locustfile.relative_to(_PACKAGE_PARENT))
        except ValueError:
            relative = str(locustfile)
        probes = [str(locustfile), relative, spec.python]
        try:
            self._nodes = ray.get([actor.node_info.remote(probes) for actor in self._actors],
                                  timeout=self.placement_timeout_s)
        except GetTimeoutError:
            self._release()
            raise SwarmError(
                f"Ray could not place {spec.n_workers} locust worker(s) ({self.num_cpus_per_worker:g} CPU each, "
                f"placement {self.placement!r}) within {self.placement_timeout_s:g} s; "
                f"available: {ray.available_resources()}"
            ) from None
        except RayError as exc:
            self._release()
            raise SwarmError(f"a locust worker's actor failed to start: {exc}") from exc
        here = ray.util.get_node_ip_address()
        bind = spec.master_bind_host
        self._advertise_host = spec.master_advertise_host or (here if bind in ("0.0.0.0", "*", "") else bind)
        if _is_loopback(self._advertise_host):
            remote = [f"worker {i} on {node.node_ip}" for i, node in enumerate(self._nodes) if node.node_ip != here]
            if remote:
                raise SwarmError(
                    f"{', '.join(remote)} cannot reach a master at {self._advertise_host} (this node is {here}): "
                    "set SwarmSpec.master_bind_host='0.0.0.0' (or master_advertise_host) for a multi-node swarm"
                )
        for index, node in enumerate(self._nodes):
            present = node.paths_present
            if present[str(locustfile)]:
                path = str(locustfile)
            elif present[relative]:  # the job's working directory on that node holds the checkout
                path = str(Path(node.cwd) / relative)
            else:
                raise SwarmError(
                    f"worker {index}'s node {node.node_ip} has no {locustfile} (nor {relative} under {node.cwd}): "
                    "ship the code with the Ray job (working_dir) or install it on every node"
                )
            python = spec.python if present[spec.python] else node.python
            self._commands.append((python, path))

    def start(self, spec: SwarmSpec, master_port: int) -> None:
        env = {**spec.env, "PYTHONUNBUFFERED": "1"}
        refs = []
        self._started = True
        for actor, (python, locustfile) in zip(self._actors, self._commands):
            command = worker_command(self._advertise_host, master_port, locustfile=Path(locustfile), python=python)
            refs.append(actor.start.remote(command, env, unset_env_prefixes=(LOCUST_ENV_PREFIX,),
                                           parent_pid_env=PARENT_PID_ENV, reaper_grace_s=2.0))
        try:
            statuses: list[ProcessStatus] = ray.get(refs, timeout=60)
        except RayError as exc:  # an actor died, or hangs, before its worker started
            raise SwarmError(f"the locust workers could not be started: {type(exc).__name__}: {exc}") from exc
        for index, status in enumerate(statuses):
            if status.error:
                raise SwarmError(f"locust worker {index} could not start on {status.node_ip}: {status.error}")
        self._pids = [status.pid or 0 for status in statuses]
        self._codes = [None] * len(statuses)
        self._last_answer = [time.monotonic()] * len(statuses)

    def poll(self) -> list[int | None]:
        now = time.monotonic()
        if now - self._polled_at < self.poll_interval_s:
            return list(self._codes)
        self._polled_at = now
        refs = [(index, actor.status.remote(0)) for index, actor in enumerate(self._actors)
                if self._codes[index] is None]
        for index, ref in refs:
            try:
                status: ProcessStatus = ray.get(ref, timeout=10)
            except GetTimeoutError:
                if now - self._last_answer[index] > _UNRESPONSIVE_S:
                    self._dead(index, f"its actor has not answered for {_UNRESPONSIVE_S:g} s")
                continue
            except RayError as exc:
                self._dead(index, f"its Ray actor died ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
                continue
            self._last_answer[index] = now
            self._codes[index] = status.exit_code
        return list(self._codes)

    def describe(self, index: int) -> str:
        where = self._nodes[index].node_ip if index < len(self._nodes) else "?"
        if index in self._descriptions:
            return self._descriptions[index]
        if index in self._why_dead:
            return f"{self._why_dead[index]}; node {where}, log {self._log_dir}/worker-{index}.log there"
        if index >= len(self._actors):
            return f"node {where}, log {self._log_dir}/worker-{index}.log there"
        try:
            status: ProcessStatus = ray.get(self._actors[index].status.remote(20), timeout=10)
        except RayError as exc:
            return f"its Ray actor is gone ({type(exc).__name__}); node {where}"
        return f"node {status.node_ip}, log {status.log_path}:\n" + "\n".join(status.log_tail)

    @property
    def pids(self) -> list[int]:
        """The worker processes' pids (on their own nodes)."""
        return list(self._pids)

    @property
    def nodes(self) -> list[NodeInfo]:
        return list(self._nodes)

    def finish(self, grace_s: float) -> list[int]:
        """After the master exited: wait for the workers to quit, SIGTERM (then SIGKILL) any
        that did not, and release the actors."""
        try:
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(code is None for code in self._codes):
                self._polled_at = 0.0
                self.poll()
                time.sleep(0.1)
            pending = [i for i, code in enumerate(self._codes) if code is None]
            if pending:
                stopped = self._get_each([(i, self._actors[i].stop.remote(10.0)) for i in pending], timeout_s=30)
                for index in pending:
                    status = stopped.get(index)
                    if status is None or status.alive:
                        raise SwarmError(f"locust worker {index} did not quit after the master ended; "
                                         f"{self.describe(index)}")
                    self._codes[index] = status.exit_code
            codes = [code if code is not None else ACTOR_DIED for code in self._codes]
            for index, code in enumerate(codes):
                if code != 0:  # the Swarm will say why; the actors are about to go
                    self._descriptions[index] = self.describe(index)
            return codes
        finally:
            self._release()

    def kill(self) -> None:
        """Stop every worker at once (SIGTERM, SIGKILL right after) and release the actors; an
        actor that cannot be reached leaves its process group to its reaper."""
        if not self._started:  # nothing runs yet (or the actors were never placed)
            self._release()
            return
        try:
            refs = [(index, actor.stop.remote(0.5)) for index, actor in enumerate(self._actors)]
            stopped = self._get_each(refs, timeout_s=30)
            alive = [index for index, status in stopped.items() if status.alive]
            if alive:
                raise SwarmError(f"locust worker(s) {alive} survived SIGKILL")
        finally:
            self._release()

    # -- internals -------------------------------------------------------------------
    def _dead(self, index: int, why: str) -> None:
        self._why_dead[index] = why
        self._codes[index] = ACTOR_DIED

    def _get_each(self, refs: Sequence[tuple[int, Any]], timeout_s: float) -> dict[int, ProcessStatus]:
        answers: dict[int, ProcessStatus] = {}
        deadline = time.monotonic() + timeout_s
        for index, ref in refs:
            try:
                answers[index] = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except (RayActorError, GetTimeoutError, RayError):
                continue
        return answers

    def _release(self) -> None:
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self._actors = []


class DistributedSwarm:
    """`Swarm` with its workers placed by Ray: `DistributedSwarm(spec, "spread").run()`."""

    def __init__(
        self,
        spec: SwarmSpec,
        placement: str = "spread",
        on_progress: Callable[[SwarmProgress], None] | None = None,
        *,
        num_cpus_per_worker: float = 1.0,
        placement_timeout_s: float = 60.0,
        progress_interval_s: float = 1.0,
    ) -> None:
        if spec.n_workers < 1:
            raise ValueError("a distributed swarm needs n_workers >= 1 (n_workers=0 is a single local process)")
        self.workers = RayWorkers(placement, num_cpus_per_worker=num_cpus_per_worker,
                                  placement_timeout_s=placement_timeout_s)
        self.swarm = Swarm(spec, on_progress=on_progress, progress_interval_s=progress_interval_s,
                           workers=self.workers)

    @property
    def pids(self) -> list[int]:
        return self.swarm.pids

    @property
    def worker_pids(self) -> list[int]:
        return self.swarm.worker_pids

    def run(self, timeout_s: float | None = None) -> SwarmResult:
        return self.swarm.run(timeout_s=timeout_s)


def run_distributed_swarm(
    spec: SwarmSpec,
    placement: str = "spread",
    on_progress: Callable[[SwarmProgress], None] | None = None,
    *,
    num_cpus_per_worker: float = 1.0,
    placement_timeout_s: float = 60.0,
    progress_interval_s: float = 1.0,
    timeout_s: float | None = None,
) -> SwarmResult:
    """Run `spec` with its Locust workers under Ray actors; the complete, checked result or
    SwarmError. Needs a Ray connection. placement: see `cluster.process.placement_options`."""
    return DistributedSwarm(
        spec,
        placement,
        on_progress,
        num_cpus_per_worker=num_cpus_per_worker,
        placement_timeout_s=placement_timeout_s,
        progress_interval_s=progress_interval_s,
    ).run(timeout_s=timeout_s)
