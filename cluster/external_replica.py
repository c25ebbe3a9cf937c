"""An external replica: one Ray actor standing for a vLLM server someone else started and runs
(Kubernetes, KServe, llm-d, a colleague's box), given by its URL (`baseline.endpoints`).

It answers the fleet as `cluster.replica.VLLMReplicaServer` does (status polls, /metrics
scrapes, liveness, a lease) so that the router, the preflight, the replica watch, the
progressive steps and a resumed run treat both kinds alike; what it cannot have it says
it has not (no server log: no engine warnings, no args line), and it never starts, stops
or signals the server: `stop()` only forgets it. A server that does not answer /health
with 200 within the engine's `startup_timeout_s` fails the fleet's start, named by its URL.

Why an actor and not a plain object: the fleet's handles are actors everywhere (a resumed
controller finds them by name; the lease ends an abandoned one), and this one costs no CPU.
"""

from __future__ import annotations

import json
import time
from urllib.parse import urlsplit

import ray
import requests

from cluster.lease import Lease
from cluster.metrics import MetricsSnapshot, fetch_metrics_text, parse_metrics
from cluster.replica import ReplicaState, ReplicaStatus
from cluster.replica_environment import PACKAGES, ReplicaEnvironment

HEALTH_TIMEOUT_S = 5.0
METRICS_TIMEOUT_S = 10.0
VERSION_MAX_BYTES = 64 * 1024  # vLLM's /version is a few dozen bytes: a server's longer answer is cut


def metrics_url_of(url: str) -> str:
    """Where a vLLM server at `url` serves Prometheus metrics (vLLM: GET /metrics, no auth)."""
    return url.rstrip("/") + "/metrics"


class ExternalReplicaServer:
    """The replica's logic; `ExternalReplica` is the Ray actor class built from it."""

    def __init__(self, name: str, arm: str, url: str, metrics_url: str | None = None,
                 startup_timeout_s: float = 300.0) -> None:
        self.name = name
        self.arm = arm
        self._url = url.rstrip("/")
        self.metrics_url = metrics_url or metrics_url_of(self._url)
        self.startup_timeout_s = startup_timeout_s
        self._state = ReplicaState.PENDING
        self._error: str | None = None
        self._started_at: float | None = None
        self._launched_at: float | None = None
        self._ready_after_s: float | None = None
        self._last_refusal = ""
        # nothing to stop on a lapse: the server is someone else's; the actor just ends
        self._lease = Lease(f"external replica {name}")

    # -- start -----------------------------------------------------------------
    def planned_launch(self, port: int = 0) -> tuple[list[str], dict[str, str]]:
        return [], {}  # nothing is launched

    def where(self) -> tuple[str, str]:
        """('external', the server's host): it runs on no node of this cluster."""
        return "external", urlsplit(self._url).hostname or "?"

    def use_staged_weights(self, path: str) -> None:
        raise RuntimeError(f"replica {self.name} is an external endpoint ({self._url}): its weights are not staged here")

    def launch(self) -> ReplicaStatus:
        """Start waiting for the server's /health (it may still be rolling out)."""
        if self._started_at is None:
            self._started_at = time.monotonic()
            self._launched_at = time.time()
            self._state = ReplicaState.STARTING
        return self.status()

    def _health(self, timeout_s: float) -> bool | None:
        """/health answered 200 (True), refused or not 200 (False), or not within timeout_s (None)."""
        try:
            # the status line is the answer: a body is never read (an endless one would hold the poll)
            with requests.get(f"{self._url}/health", timeout=timeout_s, stream=True) as response:
                pass
        except requests.Timeout:
            self._last_refusal = f"no answer within {timeout_s:g} s"
            return None
        except requests.RequestException as exc:
            self._last_refusal = type(exc).__name__
            return False
        if response.status_code != 200:
            self._last_refusal = f"HTTP {response.status_code}"
        return response.status_code == 200

    def status(self) -> ReplicaStatus:
        elapsed = time.monotonic() - self._started_at if self._started_at else 0.0
        if self._state == ReplicaState.STARTING:
            if self._health(HEALTH_TIMEOUT_S) is True:
                self._state = ReplicaState.READY
                self._ready_after_s = elapsed
            elif elapsed > self.startup_timeout_s:
                self._state = ReplicaState.FAILED
                self._error = (f"external endpoint {self._url}: /health did not answer 200 within "
                               f"{self.startup_timeout_s:g} s (last: {self._last_refusal or 'no answer'})")
        return ReplicaStatus(
            name=self.name,
            arm=self.arm,
            state=self._state,
            url=self._url if self._state == ReplicaState.READY else None,
            node_ip=None,
            log_path=None,
            elapsed_s=self._ready_after_s if self._ready_after_s is not None else elapsed,
            launched_at=self._launched_at,
            error=self._error,
            log_tail=[f"external endpoint {self._url}: /health {self._last_refusal or 'not asked yet'}"]
            if self._state != ReplicaState.READY else [],
        )

    def wait_ready(self, poll_s: float = 1.0) -> ReplicaStatus:
        while True:
            st = self.status()
            if st.state != ReplicaState.STARTING:
                return st
            time.sleep(poll_s)

    # -- observe ---------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._url

    def metrics_text(self) -> str:
        return fetch_metrics_text(self.metrics_url, timeout_s=METRICS_TIMEOUT_S)

    def metrics(self) -> MetricsSnapshot:
        return parse_metrics(self.metrics_text())

    def alive(self) -> bool:
        return self._state == ReplicaState.READY and self._health(2.0) is True

    def liveness(self, timeout_s: float = 5.0) -> bool | None:
        """True: serving; False: /health refused or not 200; None: no answer within timeout_s."""
        if self._state not in (ReplicaState.READY, ReplicaState.STARTING):
            return False
        return self._health(timeout_s)

    def engine_warnings(self) -> list[str]:
        return []  # its log is not ours to read

    def log_tail(self, lines: int = 40) -> list[str]:
        return []

    def log_copy(self, max_bytes: int) -> tuple[bytes, int]:
        return b"", 0

    def log_lines_with(self, needles: tuple[str, ...], max_chars: int = 20_000) -> list[str]:
        return []

    def environment(self) -> dict:
        """What can be known from outside: the server's vLLM version (GET /version); the rest None."""
        packages: dict[str, str | None] = {name: None for name in PACKAGES}
        try:
            with requests.get(f"{self._url}/version", timeout=HEALTH_TIMEOUT_S, stream=True) as response:
                if response.status_code == 200:
                    packages["vllm"] = str(json.loads(response.raw.read(VERSION_MAX_BYTES)).get("version"))[:64]
        except (requests.RequestException, ValueError, AttributeError):
            pass
        return ReplicaEnvironment(node_ip=urlsplit(self._url).hostname, packages=packages).model_dump(mode="json")

    # -- lease and stop --------------------------------------------------------
    def release_lease(self) -> None:
        self._lease.release()

    def renew_lease(self, seconds: float) -> float:
        return self._lease.renew(seconds)

    def stop(self, grace_s: float = 15.0) -> ReplicaStatus:
        """Forget the server (it keeps running: it is not this run's to stop)."""
        if self._state != ReplicaState.FAILED:
            self._state = ReplicaState.STOPPED
        return ReplicaStatus(name=self.name, arm=self.arm, state=self._state, error=self._error)


ExternalReplica = ray.remote(num_cpus=0, max_restarts=0)(ExternalReplicaServer)
