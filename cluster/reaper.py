"""Kill a process group once its owner is gone: no orphaned vLLM server, ever.

A replica actor starts its vLLM server in a process group of its own (the API
server plus its EngineCore and worker processes). If the actor dies without
stopping it (kill -9, node agent restart, the driver interrupted), nothing would
stop those processes. The actor therefore also starts this small watchdog in a
session of its own: when the owner pid disappears it sends SIGTERM to the group,
then SIGKILL after a grace period. It exits as soon as the group is empty.

The watchdog detaches (forks, and the parent exits) so that it is not a child
of the owner: Ray kills a dead worker's direct children, which would take the
watchdog down with the actor and leave the engine processes orphaned (seen).
It exits by itself once the group is empty.

Usage: python -m cluster.reaper --owner-pid PID --pgid PGID [--grace-s 10]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_group(pgid: int, grace_s: float) -> None:
    """SIGTERM the group, then SIGKILL whatever is left after grace_s."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start_watchdog(owner_pid: int, pgid: int, grace_s: float = 10.0, timeout_s: float = 60.0) -> None:
    """Start the watchdog for `pgid`; returns once it has detached from the caller.

    Until it has, an owner that dies would take it down too (Ray kills a dead
    worker's direct children) and orphan the group, so this waits for the fork.
    """
    subprocess.run(
        [sys.executable, "-m", "cluster.reaper", "--owner-pid", str(owner_pid), "--pgid", str(pgid),
         "--grace-s", f"{grace_s:g}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        cwd=_PACKAGE_PARENT,
        check=True,
        timeout=timeout_s,
    )


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the group `proc` leads, SIGKILL whatever is left after grace_s, reap the leader.

    The leader may be gone while processes it started (vLLM's engine core and
    workers) linger in its group: the group, not the pid, is what is stopped.
    """
    pgid = proc.pid
    if proc.poll() is None or group_alive(pgid):
        deadline = time.monotonic() + grace_s
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        kill_group(pgid, grace_s=max(1.0, deadline - time.monotonic()))
    try:
        proc.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        pass


def watch(owner_pid: int, pgid: int, grace_s: float, poll_s: float = 0.5) -> None:
    while group_alive(pgid):
        if not _alive(owner_pid):
            kill_group(pgid, grace_s)
            return
        time.sleep(poll_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--owner-pid", type=int, required=True)
    parser.add_argument("--pgid", type=int, required=True)
    parser.add_argument("--grace-s", type=float, default=10.0)
    args = parser.parse_args()
    # The reaper must outlive its owner's Ctrl-C and SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.fork() != 0:
        os._exit(0)  # the owner's direct child ends here; the watchdog lives on, reparented
    watch(args.owner_pid, args.pgid, args.grace_s)


if __name__ == "__main__":
    main()
