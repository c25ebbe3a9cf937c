"""The console's status costs one sleeping process while a Rollout tab is shown, and none otherwise.

Every open Locust page polls `/stats/requests` every 2 s, whatever its tab: those polls read the
cached document and start nothing. A shown tab (its panel polls `/mtp-console/status`) keeps one
`status --watch --json` process, which reads the store in-process every 2 s; with no tab polling
for `idle_s` it is stopped (loadtests.console.StatusSource). The process here is a stand-in that
prints what `status --watch --json` prints.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from loadtests.console import ConsoleSettings, StatusSource

DOC = {"run_id": "r1", "status": "running", "phase": "experiment", "latest_gates": []}
WATCH = ("import json, sys, time\n"
         "for i in range(600):\n"
         "    print('--- 12:00:00'); print(json.dumps({**%r, 'step': i}, indent=2)); sys.stdout.flush(); time.sleep(0.2)\n"
         % DOC)


def _source(started: list, idle_s: float = 60.0) -> StatusSource:
    def popen(command, **kwargs):
        started.append(command)
        return subprocess.Popen([sys.executable, "-c", WATCH], **kwargs)

    return StatusSource(ConsoleSettings(run_id="r1", runs_dir="/nowhere"), idle_s=idle_s, popen=popen)


def _wait(check, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def test_page_polls_start_nothing_and_a_shown_tab_keeps_one_watching_process():
    started: list = []
    source = _source(started)
    try:
        for _ in range(5):
            assert source.cached() == (None, None)
        assert started == [] and source.fetches == 0
        status, problem = source.current()
        assert problem is None and status.run_id == "r1"
        for _ in range(10):
            source.current()
        assert len(started) == 1 and source.fetches == 1
        assert "--watch" in started[0] and "--json" in started[0]
        # the document follows the process's later prints without another process
        first = source.status.step
        assert _wait(lambda: source.status.step > first)
        assert source.cached()[0].step >= source.status.step - 1
    finally:
        source.stop()


def test_with_no_tab_polling_the_watching_process_stops():
    started: list = []
    source = _source(started, idle_s=1.0)
    source.current()
    proc = source._proc
    assert proc is not None and proc.poll() is None
    assert _wait(lambda: proc.poll() is not None, 30), "the idle watch was not stopped"


def test_a_failing_status_says_why():
    def popen(command, **kwargs):
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.stderr.write('no run r1\\n'); sys.exit(2)"],
                                **kwargs)

    source = StatusSource(ConsoleSettings(run_id="r1", runs_dir="/nowhere"), popen=popen)
    status, problem = source.current()
    assert status is None and problem == "mtp-canary status failed: no run r1"
    json.dumps(problem)
