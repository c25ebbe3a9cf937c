"""Connecting to Ray: the cluster a job was submitted to, or a local instance."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray


def connect(address: str | None = "auto", namespace: str | None = None, local_num_cpus: int | None = None) -> str:
    """Join the Ray cluster at `address` ("auto": the one this process runs in, as
    under `ray job submit`); with no cluster to find, start a local instance
    (the embedded default, tests, laptops). Returns a one-line description."""
    if ray.is_initialized():
        return "ray: already connected"
    quiet = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address not in (None, "", "local"):
        want_cluster = address != "auto" or os.environ.get("RAY_ADDRESS")
        try:
            ray.init(address=address, namespace=namespace, **quiet)
            return f"ray: joined cluster at {address} ({ray.cluster_resources()})"
        except ConnectionError:
            if want_cluster:
                raise
    ray.init(
        # "local", not None: ray.init() without an address joins a cluster it finds on the machine
        # (another session's `ray start`, a test's cluster_utils cluster); this must be our own
        address="local",
        namespace=namespace,
        num_cpus=local_num_cpus or os.cpu_count(),
        include_dashboard=False,
        **quiet,
    )
    return f"ray: started a local instance ({ray.cluster_resources()})"


def disconnect() -> None:
    if ray.is_initialized():
        ray.shutdown()


def find_actor(name: str, namespace: str | None = None) -> Any:
    """The live named actor, or None (never created, or dead: Ray frees a dead actor's name)."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def kill_quietly(actor: Any) -> None:
    """ray.kill an actor that may already be gone."""
    try:
        ray.kill(actor)
    except Exception:  # already gone
        pass
