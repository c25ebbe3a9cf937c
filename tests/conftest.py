"""Shared fixtures: the tiny checkpoint cache, local Ray, and a check for leftover processes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
# Tests and the CLI runs they start share one cache of tiny checkpoints.
os.environ.setdefault("MTP_CANARY_CACHE", str(REPO / ".cache" / "tiny-models"))


def server_processes() -> list[psutil.Process]:
    """vLLM servers and engine processes, and Locust processes, still alive on this machine."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(proc.info["cmdline"] or [])
            name = proc.info["name"] or ""
            if (
                "vllm.entrypoints.openai.api_server" in cmd
                or name.startswith("VLLM::")
                or "locust" in cmd and "loadtests" in cmd
            ):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_gone(check, timeout_s: float = 30.0) -> list:
    """What `check()` still finds after up to timeout_s (it is polled until it finds nothing)."""
    deadline = time.monotonic() + timeout_s
    left = check()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = check()
    return left


def wait_no_server_processes(timeout_s: float = 30.0) -> list[psutil.Process]:
    return wait_gone(server_processes, timeout_s)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until_gone(pids, timeout_s: float) -> list[int]:
    """The pids of `pids` still alive (not zombies) after up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from rollout.tiny_checkpoint import TinyCheckpointSpec, ensure_checkpoint

    return ensure_checkpoint(Path(os.environ["MTP_CANARY_CACHE"]) / "tests-default", TinyCheckpointSpec())
