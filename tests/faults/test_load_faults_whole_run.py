"""Fault corpus through the whole controller, the load's side: the Locust master SIGKILLed while the
experiment's load runs (`mtp-canary run` as a process; real Ray, router, Locust, SQLite and weight
hook; the arms are stream targets reached as `endpoints:`, tests/faults/endpoint_run.py).

The master holds the records file and the collection's tally: the run must end as an
infrastructure error (exit 1) naming the load, in its last line, decision.json and the store,
with the weight hook at 0 and nothing left behind; never a verdict on the records it left.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from benchmarks.stream_target import TargetProcess
from tests.faults.endpoint_run import CliRun, run_config
from tests.faults.test_controller_faults import assert_ended

# slow in CI's serial pass (Ray and Locust start per run); no vLLM server
pytestmark = pytest.mark.vllm


def _master_of(records_dir: str) -> psutil.Process | None:
    """This run's Locust master: its --mtp-records lies under this test's directory (no other test's)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "--master" in cmd and any(records_dir in arg for arg in cmd):
            return proc
    return None


def test_the_locust_master_killed_mid_experiment_ends_the_run_as_an_error(tmp_path):
    with TargetProcess(ttft_ms=20, tpot_ms=10) as base, TargetProcess(ttft_ms=20, tpot_ms=10) as cand:
        run = CliRun(tmp_path, run_config(tmp_path, base.url, cand.url))
        try:
            run.wait_for("completed requests baseline")  # the experiment's load flows
            master = _master_of(str(tmp_path))
            assert master is not None, "no Locust master of this run"
            os.kill(master.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            assert_ended(run, 1, "the experiment's load failed", tmp_path)
            assert time.monotonic() - killed_at < 180  # at once, not at max_duration_s (600)
        finally:
            run.kill()
    assert "master" in run.decision()["error"], run.decision()["error"]
