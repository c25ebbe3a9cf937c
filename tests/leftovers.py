"""The test session's marker on every process it starts, and stopping what dead sessions left behind.

conftest calls `ensure_session()` at import: it sets MTP_CANARY_TEST_SESSION (unless a live
session already did, e.g. for a pytest started by a test), and every process the tests start
inherits it: a local Ray's GCS, raylets, agents and workers, `ray start`ed clusters, the vLLM
servers and their engine processes, Locust masters and workers, the reapers, CLI runs. (Only
children see it: /proc/PID/environ of pytest itself is the one it was started with.)

The value names the session's owner, the pytest process (pid and start time), so that
- `session_processes()` finds this session's processes only, never another's (a colleague's
  tests on the same machine, a manual `ray start`, `make demo`);
- `leftover_processes()` finds the processes of sessions whose owner is gone (a CI job killed
  at its time limit, pytest-timeout ending a hung session, a crash). `stop_leftovers()` stops
  them; every session does so at its start (conftest), and `.ci/run` before `make test`.
  A session whose owner still runs is never touched, in this checkout or another.

The owner is in the value rather than in a file under .cache/: a fresh CI checkout has no
.cache/ but may run where an earlier job's processes still are, and two sessions may run at
once in one checkout (the later one must not take the earlier one's processes for leftovers).

    python tests/leftovers.py     # stop the processes of dead test sessions; says which
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from collections.abc import Callable

import psutil

SESSION_ENV = "MTP_CANARY_TEST_SESSION"


def start_ticks(pid: int) -> int:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat field 22).

    Not psutil's create_time(): that is boot time + ticks, and the boot time it derives
    from the wall clock moves when the clock is stepped (a VM's time sync moved it by 4 s
    here mid-session), which made a live session's owner look dead and the next session
    stop its processes. Ticks since boot do not move."""
    stat = open(f"/proc/{pid}/stat", "rb").read()  # noqa: SIM115 - one read of a tiny file
    fields = stat[stat.rindex(b")") + 2:].split()  # after the command name, which may hold spaces
    return int(fields[19])  # field 22 of stat; fields[0] is field 3


def new_session_id(pid: int | None = None) -> str:
    """`PID-STARTTICKS-RANDOM` of the owner process `pid` (default: this one)."""
    owner = pid if pid is not None else os.getpid()
    return f"{owner}-{start_ticks(owner)}-{uuid.uuid4().hex[:12]}"


def parse_session_id(value: str) -> tuple[int, int] | None:
    """(owner pid, owner start in ticks since boot) of a session id; None if `value` is not one."""
    try:
        pid, started, rest = value.split("-", 2)
        return (int(pid), int(started)) if rest else None
    except ValueError:  # not ours, or an id of the older PID-EPOCH.xx form (its owner is long gone)
        return None


def owner_alive(value: str) -> bool:
    """Whether the session's owner still runs (a pid reused by another process does not count).

    Not a session id at all: True, so that a value nobody of ours wrote is never taken
    for a leftover."""
    owner = parse_session_id(value)
    if owner is None:
        return True
    pid, started = owner
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and start_ticks(pid) == started
    except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
        return False
    except (psutil.AccessDenied, PermissionError):
        return True


def ensure_session() -> str:
    """This session's id, set in os.environ for every process started from here on."""
    current = os.environ.get(SESSION_ENV)
    if current and parse_session_id(current) is not None and owner_alive(current):
        return current  # inside a live session (a pytest started by a test): its processes are that session's
    os.environ[SESSION_ENV] = value = new_session_id()
    return value


def marked_processes(match: Callable[[str], bool]) -> list[psutil.Process]:
    """Live processes (no zombies, never this one) whose MTP_CANARY_TEST_SESSION satisfies `match`.

    Each has `info` with pid, name, cmdline (from psutil.process_iter); processes whose
    environment cannot be read (another user's) are skipped."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            value = proc.environ().get(SESSION_ENV)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if value and match(value):
            found.append(proc)
    return found


def session_processes(session_id: str | None = None) -> list[psutil.Process]:
    """The processes of session `session_id` (default: the one in os.environ)."""
    wanted = session_id if session_id is not None else os.environ.get(SESSION_ENV)
    if not wanted:
        return []
    return marked_processes(lambda value: value == wanted)


def leftover_processes() -> list[psutil.Process]:
    """Processes of test sessions whose owner is gone (never this process or its ancestors)."""
    current = os.environ.get(SESSION_ENV)
    verdicts: dict[str, bool] = {}

    def dead_session(value: str) -> bool:
        if value == current or parse_session_id(value) is None:
            return False
        if value not in verdicts:
            verdicts[value] = not owner_alive(value)
        return verdicts[value]

    try:
        ancestors = {p.pid for p in psutil.Process().parents()}
    except psutil.Error:
        ancestors = set()
    # e.g. a shell that inherited a dead session's marker and started this one
    return [p for p in marked_processes(dead_session) if p.pid not in ancestors]


def stop_processes(procs: list[psutil.Process], grace_s: float = 5.0, kill_wait_s: float = 5.0) -> list[psutil.Process]:
    """SIGTERM (none when grace_s is 0), then SIGKILL what is still there after grace_s;
    returns what is still alive kill_wait_s after the SIGKILL."""
    steps = ((signal.SIGTERM, grace_s),) if grace_s > 0 else ()
    for sig, wait_s in steps + ((signal.SIGKILL, kill_wait_s),):
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        _, procs = psutil.wait_procs(procs, timeout=wait_s)
        procs = [proc for proc in procs if not _ended(proc)]  # a zombie waits for its parent only
        if not procs:
            break
    return procs


def _ended(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def describe(proc: psutil.Process) -> str:
    cmd = " ".join(proc.info.get("cmdline") or []) if hasattr(proc, "info") else ""
    return f"pid {proc.pid} ({(cmd or proc.info.get('name') or '?')[:120]})"


def stop_leftovers(say: Callable[[str], None] = print) -> int:
    """Stop the processes of dead test sessions; returns how many there were."""
    found = leftover_processes()
    if not found:
        return 0
    say(f"stopping {len(found)} process(es) left by earlier test sessions:")
    for proc in found:
        say(f"  {describe(proc)}")
    for proc in stop_processes(found):
        say(f"  still alive after SIGKILL: {describe(proc)}")
    return len(found)


def main() -> int:
    count = stop_leftovers()
    print(f"leftovers: {count} process(es) of earlier test sessions stopped" if count else
          "leftovers: no process of an earlier test session is running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
