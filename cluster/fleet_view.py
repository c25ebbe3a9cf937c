"""What a running fleet tells and gives back: its URLs and the keys its replicas require, each
replica's /metrics, engine warnings, log lines and environment, and their logs copied back at teardown.

`FleetView` is the part of `cluster.fleet.Fleet` that only asks (Fleet starts, adopts, hands over
and stops); `ReplicaHandle` is one replica as the fleet holds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

import ray

from cluster.metrics import MetricsSnapshot
from cluster.replica import ReplicaStatus

Progress = Callable[[str], None]


class FleetStartError(RuntimeError):
    """A replica failed to start; the message names it and quotes its log."""


# a control call on a replica actor (status, launch, staged weights): an answer in seconds; longer is a hung actor
CONTROL_TIMEOUT_S = 120.0


# a replica's server log copied back into the run directory at teardown: its first quarter and
# its last bytes beyond this (a vLLM start logs ~100 KB; a server that logs every request, more)
LOG_COPY_BYTES = 4 * 1024 * 1024


@dataclass
class ReplicaHandle:
    name: str
    arm: str
    actor: "ray.actor.ActorHandle"
    status: ReplicaStatus | None = None
    api_key: str | None = field(default=None, repr=False)  # the key its server requires on /v1; never written

    @property
    def url(self) -> str | None:
        return self.status.url if self.status else None


def _get_or_fail(refs: list, timeout_s: float, what: str) -> list:
    """ray.get on the replicas' actors, bounded: a silent actor is a FleetStartError naming what it did not do."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise FleetStartError(f"the replicas' actors did not {what} within {timeout_s:g} s") from None


class FleetView:
    """The asking half of a Fleet: needs `arms`, `replicas`, `progress` and `run_dir`-like fields of it."""

    arms: list
    replicas: list[ReplicaHandle]

    # -- observe ---------------------------------------------------------------
    def urls(self, arm: str | None = None) -> dict[str, list[str]] | list[str]:
        by_arm: dict[str, list[str]] = {a.name: [] for a in self.arms}
        for r in self.replicas:
            if r.url:
                by_arm[r.arm].append(r.url)
        return by_arm if arm is None else by_arm[arm]

    def _take_keys(self, handles: list[ReplicaHandle]) -> None:
        """Each launched replica's key on /v1, asked of its actor (an actor of an earlier version has
        no api_key: its server was started without one)."""
        external = {arm.name for arm in self.arms if arm.external}
        asked = []
        for handle in handles:
            if handle.arm in external:
                continue
            try:
                asked.append((handle, handle.actor.api_key.remote()))
            except AttributeError:
                continue
        keys = _get_or_fail([ref for _, ref in asked], CONTROL_TIMEOUT_S, "say their keys")
        for (handle, _), key in zip(asked, keys):
            handle.api_key = key

    def upstream_keys(self) -> dict[str, str]:
        """replica URL -> the key its server requires on /v1 (its engine's --api-key, or the one it
        made for itself beyond loopback), for replicas that need one.

        In memory only: the router and the preflight send it; nothing writes it."""
        keys = {a.name: a.engine.api_key for a in self.arms}
        out = {r.url: r.api_key or keys.get(r.arm) for r in self.replicas if r.url}
        return {url: key for url, key in out.items() if key}

    def upstream_key(self, handle: ReplicaHandle) -> str | None:
        return self.upstream_keys().get(handle.url) if handle.url else None

    def handles(self, arm: str) -> list[ReplicaHandle]:
        return [r for r in self.replicas if r.arm == arm]

    def metrics(self) -> dict[str, MetricsSnapshot]:
        """replica name -> /metrics snapshot, scraped from every replica at (nearly) the same moment.

        A replica that cannot be scraped (server or actor gone) is left out; the
        caller treats missing data as missing, never as zero.
        """
        return self._ask_every_replica("metrics", (), "/metrics not scraped")

    def engine_warnings(self) -> dict[str, list[str]]:
        warnings = ray.get([r.actor.engine_warnings.remote() for r in self.replicas], timeout=CONTROL_TIMEOUT_S)
        return {r.name: w for r, w in zip(self.replicas, warnings)}

    def log_lines_with(self, needles: tuple[str, ...]) -> dict[str, list[str]]:
        """replica name -> its server log's lines holding any of `needles`; a replica whose actor
        cannot answer (gone, or an earlier version adopted by a resumed run) is left out."""
        return self._ask_every_replica("log_lines_with", (needles,), "server log not read")

    def environments(self) -> dict[str, dict]:
        """replica name -> its node, GPUs and package versions (cluster.replica_environment), read on its node."""
        return self._ask_every_replica("environment", (), "environment not read")

    def _ask_every_replica(self, method: str, args: tuple, failed: str) -> dict[str, Any]:
        """replica name -> the answer of its actor's `method(*args)`, all asked at once; a replica
        whose actor cannot answer (gone, or of an earlier version without `method`: the handle
        raises at once) is left out, with a progress line `failed`: why."""
        refs = []
        for r in self.replicas:
            try:
                refs.append((r, getattr(r.actor, method).remote(*args)))
            except AttributeError:
                self.progress(f"fleet: {r.name}: {failed}: its actor has no {method}")
        answers: dict[str, Any] = {}
        for r, ref in refs:
            try:
                answers[r.name] = ray.get(ref, timeout=30)
            except Exception as exc:
                self.progress(f"fleet: {r.name}: {failed}: {type(exc).__name__}")
        return answers

    def copy_logs_back(self, replicas: list[ReplicaHandle] | None = None) -> None:
        """Each replica's server log into logs_back_to/<replica>.log, read by its actor on its node (a
        RayJob cluster takes the GPU nodes' disks with it), cut to log_copy_bytes, redacted; a log that
        cannot be copied is named with its node and the cause, and the others are still copied.
        `replicas`: those (default: every replica of the fleet)."""
        replicas = self.replicas if replicas is None else replicas
        if not self.logs_back_to or not replicas:
            return
        target = Path(self.logs_back_to)
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self.progress(f"fleet: teardown: replica logs not copied back: {exc}")
            return
        external = {arm.name for arm in self.arms if arm.external}
        refs = []
        for r in replicas:
            if r.arm in external:
                continue  # its log is on someone else's machine
            try:
                refs.append((r, r.actor.log_copy.remote(self.log_copy_bytes)))
            except AttributeError:  # an actor of an earlier version (a resumed run)
                self.progress(f"fleet: teardown: replica {r.name}: log not copied back: its actor has no log_copy")
        for r, ref in refs:
            node = r.status.node_ip if r.status and r.status.node_ip else "?"
            try:
                data, _ = ray.get(ref, timeout=30)
            except Exception as exc:  # the actor died: its log stays on its node
                why = (str(exc).strip().splitlines() or [""])[-1][:200]
                self.progress(f"fleet: teardown: the log of replica {r.name} on node {node} was not copied back: "
                              f"{type(exc).__name__}: {why}")
                continue
            text = data.decode("utf-8", errors="replace")
            try:  # a full disk must not keep teardown from freeing the replicas and their GPUs
                (target / f"{r.name}.log").write_text(self.redact_log(text) if self.redact_log else text, encoding="utf-8")
            except Exception as exc:
                self.progress(f"fleet: teardown: the log of replica {r.name} was not written back: {type(exc).__name__}: {exc}")
