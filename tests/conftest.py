"""Shared fixtures and helpers: the tiny checkpoint cache, this session's processes (vLLM,
Locust, Ray: only the ones this test session started), and waiting for them to be gone."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.leftovers import ensure_session, session_processes, stop_leftovers, stop_processes  # noqa: E402

# Tests and the CLI runs they start share one cache of tiny checkpoints.
os.environ.setdefault("MTP_CANARY_CACHE", str(REPO / ".cache" / "tiny-models"))
# Every process the tests start inherits this marker: the checks below see this session's
# processes only, never another session's on the same machine (tests/leftovers.py).
SESSION_ID = ensure_session()


def pytest_sessionstart(session) -> None:
    # what a session killed at its time limit left behind holds ports and cores: stop it
    # (only processes of sessions whose pytest is gone; a live session is never touched)
    stop_leftovers(say=lambda line: print(f"conftest: {line}", file=sys.stderr))


def server_processes() -> list[psutil.Process]:
    """vLLM servers and engine processes, and Locust processes, that this test session started and that are still alive."""
    found = []
    for proc in session_processes(SESSION_ID):
        cmd = " ".join(proc.info["cmdline"] or [])
        name = proc.info["name"] or ""
        if (
            "vllm.entrypoints.openai.api_server" in cmd
            or name.startswith("VLLM::")
            or "locust" in cmd and "loadtests" in cmd
        ):
            found.append(proc)
    return found


def is_ray_process(proc: psutil.Process) -> bool:
    """GCS, raylet, Ray's agents and monitors, and workers (whose title reads `ray::...`)."""
    cmdline = proc.info["cmdline"] or []
    cmd = " ".join(cmdline)
    return (
        proc.info["name"] in ("raylet", "gcs_server")
        or bool(cmdline) and cmdline[0].startswith("ray::")
        or "ray/_private/workers/default_worker.py" in cmd
        or "site-packages/ray/" in cmd
        or " -m ray." in cmd
    )


def ray_processes() -> list[psutil.Process]:
    """Ray processes that this test session started (its local instances, `ray start`ed clusters)."""
    return [proc for proc in session_processes(SESSION_ID) if is_ray_process(proc)]


def stop_ray_cluster(temp_dir: str | os.PathLike, timeout_s: float = 30.0) -> list[psutil.Process]:
    """Stop the Ray cluster this session started with `ray start --temp-dir=temp_dir`, and only it.

    `ray stop` would stop every Ray cluster on the machine (other sessions', a colleague's).
    The cluster's GCS, raylet and agents name temp_dir on their command line; its workers
    (titled `ray::...`) and what they started (vLLM servers) are their descendants, and the
    client server names the GCS port. All are SIGKILLed, as `ray stop --force` does; returns
    what is still alive after timeout_s."""
    temp = str(temp_dir)
    mine = session_processes(SESSION_ID)
    roots = [p for p in mine if temp in " ".join(p.info["cmdline"] or [])]
    ports = {arg.split("=", 1)[1].rsplit(":", 1)[-1] for p in roots for arg in (p.info["cmdline"] or [])
             if arg.startswith("--gcs-address=") or arg.startswith("--gcs_server_port=")}
    client_servers = [p for p in mine if "ray.util.client.server" in " ".join(p.info["cmdline"] or [])
                      and any(arg.endswith(f":{port}") for arg in p.info["cmdline"] or [] for port in ports)]
    cluster: dict[int, psutil.Process] = {}
    for root in roots + client_servers:
        cluster[root.pid] = root
        try:
            cluster.update({child.pid: child for child in root.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    return stop_processes(list(cluster.values()), grace_s=0.0, kill_wait_s=timeout_s) if cluster else []


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
def tiny_sizing():
    """The tiny model's size and dtype for this machine, as the demo picks them (probed once, cached)."""
    from tinymodel.sizing import size_tiny_model

    return size_tiny_model(Path(os.environ["MTP_CANARY_CACHE"]), print)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_sizing) -> Path:
    """The sized tiny checkpoint (perfect drafts): a vLLM test takes as long on a slow machine as on a fast one."""
    from rollout.config import TinyModelOptions
    from tinymodel.checkpoint import checkpoint_dir, ensure_checkpoint
    from tinymodel.sizing import tiny_spec_for

    spec = tiny_spec_for(TinyModelOptions(), tiny_sizing)
    return ensure_checkpoint(checkpoint_dir(Path(os.environ["MTP_CANARY_CACHE"]), spec), spec)


@pytest.fixture(scope="session")
def tiny_dtype(tiny_sizing) -> str:
    """The engine dtype for the sized checkpoint (float32 on CPUs without native bf16)."""
    return tiny_sizing.dtype


def tmpfs_mount(tmp_path: Path, size: str):
    """A small tmpfs at tmp_path/runs for a test that fills a disk (skipped where mounting is not allowed),
    unmounted afterwards: a generator for a fixture to `yield from`."""
    import subprocess

    mount = tmp_path / "runs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()[:200]}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
