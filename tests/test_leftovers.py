"""tests/leftovers.py: the session marker picks out this session's processes, and only the
processes of sessions whose pytest is gone count as leftovers."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from tests.conftest import SESSION_ID, server_processes, wait_until_gone
from tests.leftovers import (
    SESSION_ENV,
    leftover_processes,
    new_session_id,
    owner_alive,
    parse_session_id,
    session_processes,
    start_ticks,
    stop_processes,
)

# a process that looks like a Locust worker of ours to server_processes(): it only sleeps
FAKE_LOCUST = [sys.executable, "-c", "import time; time.sleep(120)", "locust", "-f", "loadtests/locustfile.py"]


@pytest.fixture
def spawn():
    started: list[subprocess.Popen] = []

    def start(marker: str | None) -> int:
        env = {k: v for k, v in os.environ.items() if k != SESSION_ENV}
        if marker is not None:
            env[SESSION_ENV] = marker
        proc = subprocess.Popen(FAKE_LOCUST, env=env)
        started.append(proc)
        return proc.pid

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def dead_session_id() -> str:
    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    session = new_session_id(gone.pid)  # its pid and start time, while it runs
    gone.kill()
    gone.wait()
    return session


def test_a_session_id_names_its_owner():
    assert os.environ[SESSION_ENV] == SESSION_ID and owner_alive(SESSION_ID)
    pid, started = parse_session_id(SESSION_ID)
    # the pytest that began the session: this process, or under pytest-xdist the controller
    # that started this worker (its workers inherit the id, so the session is one run)
    owner = psutil.Process().parent() if os.environ.get("PYTEST_XDIST_WORKER") else psutil.Process()
    assert pid == owner.pid and started == start_ticks(owner.pid)
    assert not owner_alive(dead_session_id())
    # a pid reused by another process is not the owner: the start time differs
    assert not owner_alive(f"{os.getpid()}-{start_ticks(os.getpid()) - 100}-x")
    assert parse_session_id("not-a-session") is None and parse_session_id("") is None


def test_the_owner_stays_alive_whatever_the_wall_clock_does(monkeypatch):
    """The owner's start is in ticks since boot: a stepped wall clock (which moves psutil's
    boot time, hence create_time) must not make a live session look dead."""
    session = new_session_id()
    monkeypatch.setattr(psutil, "boot_time", lambda: 0.0)  # create_time() would now be ~1970
    assert owner_alive(session)


def test_only_this_sessions_processes_are_its_own(spawn):
    mine, other, unmarked = spawn(SESSION_ID), spawn(new_session_id()), spawn(None)
    assert mine in {p.pid for p in session_processes()}
    assert mine in {p.pid for p in server_processes()}
    assert not {other, unmarked} & {p.pid for p in session_processes() + server_processes()}


def test_leftovers_are_the_processes_of_sessions_whose_pytest_is_gone(spawn):
    dead = spawn(dead_session_id())
    live_other = spawn(new_session_id())  # another session whose pytest (this process) still runs
    current, unmarked, foreign = spawn(SESSION_ID), spawn(None), spawn("someone-elses-value")
    found = {p.pid for p in leftover_processes()}
    assert dead in found
    assert not {live_other, current, unmarked, foreign} & found
    # stopping them (the tests stop only their own: stop_leftovers() would take any on the machine)
    assert stop_processes([p for p in leftover_processes() if p.pid == dead], grace_s=5.0) == []
    assert wait_until_gone([dead], 10.0) == []
    assert all(psutil.pid_exists(pid) for pid in (live_other, current, unmarked, foreign))


def test_the_script_stops_nothing_of_a_live_session(spawn):
    current, live_other = spawn(SESSION_ID), spawn(new_session_id())
    done = subprocess.run([sys.executable, "tests/leftovers.py"], cwd=os.path.dirname(os.path.dirname(__file__)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "leftovers:" in done.stdout
    assert psutil.Process(current).status() != psutil.STATUS_ZOMBIE
    assert psutil.Process(live_other).status() != psutil.STATUS_ZOMBIE
