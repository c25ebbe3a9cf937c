"""One load for a whole phase: a Locust swarm (local processes, or workers placed on the
cluster by Ray) run in a thread from the phase's first look to its last, its records read as
they arrive. The experiment phase's load; the progressive phase's outlives the controller
instead (cluster.load_runner)."""

from __future__ import annotations

import threading
import time

from cluster.distributed_load import DistributedSwarm
from loadtests.records import RecordsTail
from loadtests.swarm import Swarm, SwarmError, SwarmResult, SwarmSpec

__all__ = ["ContinuousLoad"]


class ContinuousLoad:
    """One swarm run in a thread for the whole phase; its records are read as they arrive."""

    def __init__(self, spec: SwarmSpec, placement: str) -> None:
        self.spec = spec
        if placement == "local" or spec.n_workers == 0:
            self._swarm = Swarm(spec)
        else:
            self._swarm = DistributedSwarm(spec, placement).swarm
        self.tail = RecordsTail(spec.records_path)
        self._result: SwarmResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="experiment-load", daemon=True)
        self.started_at = 0.0
        self.stop_requested_at: float | None = None

    def _run(self) -> None:
        try:
            self._result = self._swarm.run()
        except BaseException as exc:  # reported by check() / finish()
            self._error = exc

    def start(self) -> None:
        self.started_at = time.time()
        self._thread.start()

    def check(self) -> None:
        """Raise if the load ended before the phase asked it to."""
        if self._thread.is_alive() or self.stop_requested_at is not None:
            return
        if self._error is not None:
            raise SwarmError(f"the experiment's load failed: {self._error}") from self._error
        raise SwarmError("the experiment's load ended before the phase did")

    def finish(self) -> SwarmResult:
        """Stop gracefully (in-flight requests get the stop timeout) and return the checked result."""
        if self.stop_requested_at is None:
            self.stop_requested_at = time.time()
        self._swarm.stop()
        self._thread.join(self.spec.startup_timeout_s + self.spec.stop_timeout_s + self.spec.traffic.flush_timeout_s + 90)
        if self._thread.is_alive():
            self.kill()
            raise SwarmError(f"the experiment's load did not stop; logs in {self.spec.logs}")
        if self._error is not None:
            raise SwarmError(f"the experiment's load failed: {self._error}") from self._error
        assert self._result is not None
        return self._result

    def kill(self) -> None:
        try:
            self._swarm.kill()
        except Exception:  # already gone
            pass
        self._thread.join(15)
