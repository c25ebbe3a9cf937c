"""The progressive phase's load, owned by a Ray actor rather than by the controller.

Production-like traffic must not stop because the controller died: with the
swarm (Locust master and its workers) owned by a detached `LoadRunner` actor of
the run, a controller killed with kill -9 leaves the load running through the
router at the current weights, and every request's record still reaches the
records file. `mtp-canary resume` then stops that load gracefully (so every
request it sent has its record), stores what nobody committed, and starts a
fresh load for the remaining steps. Unresumed, the actor's lease lapses and it
stops the swarm the same graceful way.

The actor runs `loadtests.swarm.Swarm` in a thread; Locust itself stays in its own
processes (no gevent in Ray). It must run on the node whose disk holds the
records file: the controller pins it to its own node.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.lease import Lease
from cluster.ray_cluster import kill_quietly
from loadtests.swarm import Swarm, SwarmError, SwarmSpec

__all__ = ["LoadRunner", "LoadRunnerHandle", "LoadRunnerServer", "start_load_runner"]


class LoadRunnerServer:
    """The actor's logic; `LoadRunner` is the Ray actor class built from it."""

    def __init__(self, spec: dict[str, Any], placement: str = "local") -> None:
        self.spec = SwarmSpec.model_validate(spec)
        workers = None
        if placement != "local" and self.spec.n_workers:
            # each Locust worker under an actor of its own, placed on the cluster (cluster.distributed_load)
            from cluster.distributed_load import RayWorkers

            workers = RayWorkers(placement)
        self._swarm = Swarm(self.spec, workers=workers)
        self._error: str | None = None
        self._n_records: int | None = None
        self._generator: dict | None = None
        self._thread = threading.Thread(target=self._run, name="load-runner", daemon=True)
        self._lease = Lease("load runner", on_lapse=lambda: self.finish(self.spec.stop_timeout_s + 60))
        self._thread.start()

    def _run(self) -> None:
        try:
            result = self._swarm.run()
            self._n_records = result.n_records
            self._generator = result.generator.model_dump(mode="json")
        except BaseException as exc:
            self._error = f"{type(exc).__name__}: {exc}"

    def state(self) -> dict[str, Any]:
        """running, error (the swarm's complaint once ended), records written, generator health."""
        return {
            "running": self._thread.is_alive(),
            "error": self._error,
            "n_records": self._n_records,
            "generator": self._generator,
            "records_path": str(self.spec.records_path),
        }

    def stop(self) -> None:
        """Graceful end: in-flight requests get stop_timeout_s, every record is collected."""
        self._swarm.stop()

    def finish(self, timeout_s: float) -> dict[str, Any]:
        """stop() and wait up to timeout_s; kills the swarm if it does not end in time."""
        self._swarm.stop()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.kill()
            self._error = self._error or "the load did not stop in time and was killed"
        return self.state()

    def kill(self) -> None:
        try:
            self._swarm.kill()
        except Exception:  # already gone
            pass
        self._thread.join(15)

    def release_lease(self) -> None:
        """No deadline: the actor stays until stopped (keep_fleet)."""
        self._lease.release()

    def renew_lease(self, seconds: float) -> float:
        return self._lease.renew(seconds)


# num_cpus=0: the Locust processes it starts are what uses CPU, not the actor.
LoadRunner = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(LoadRunnerServer)


def start_load_runner(
    spec: SwarmSpec, name: str | None = None, namespace: str | None = None, placement: str = "local",
    lease_s: float | None = None,
) -> Any:
    """A LoadRunner running `spec` on this node (named and detached when `name` is given); its
    workers are local processes, or Ray actors placed by `placement` (see cluster.process).

    With `lease_s` the lease is taken before anything is waited on: a caller that dies while
    the constructor runs leaves a detached actor that still ends itself one lease later."""
    options: dict[str, Any] = {
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    }
    if name:
        options.update(name=name, lifetime="detached")
        if namespace:
            options["namespace"] = namespace
    actor = LoadRunner.options(**options).remote(spec.model_dump(mode="json"), placement)
    if lease_s:
        actor.renew_lease.remote(lease_s)  # queued before the state call below: runs first
    # wait for the constructor: a spec the actor cannot run fails here, not at the first poll
    try:
        ray.get(actor.state.remote(), timeout=60)
    except BaseException:
        ray.kill(actor)  # never a detached load nobody holds
        raise
    return actor



class LoadRunnerHandle:
    """The driver's side of a LoadRunner: is the load still running, stop it gracefully, or kill it."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._next_check = 0.0

    def check(self) -> None:
        """Raise if the load ended before the phase asked it to (polled at most once a second)."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + 1.0
        try:
            state = ray.get(self.actor.state.remote(), timeout=10)
        except ray.exceptions.GetTimeoutError:
            return  # a busy actor is no evidence of a dead load
        except ray.exceptions.RayError as exc:
            raise SwarmError(f"the progressive load's actor died: {type(exc).__name__}") from None
        if not state["running"]:
            raise SwarmError(f"the progressive load stopped early: {state['error'] or 'the swarm ended'}")

    def kill(self) -> None:
        try:
            ray.get(self.actor.kill.remote(), timeout=30)
        except ray.exceptions.RayError:
            pass
        kill_quietly(self.actor)

    def finish(self, timeout_s: float) -> str | None:
        """Stop gracefully; the swarm's complaint (or None). Killed if it does not end in time."""
        try:
            state = ray.get(self.actor.finish.remote(timeout_s), timeout=timeout_s + 30)
        except ray.exceptions.RayError as exc:
            kill_quietly(self.actor)
            return f"the load's actor did not answer: {type(exc).__name__}"
        kill_quietly(self.actor)
        return state["error"]
