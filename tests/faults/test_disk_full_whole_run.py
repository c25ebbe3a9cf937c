"""A runs directory that fills up in the middle of a whole `mtp-canary run` (a real small tmpfs, the
real controller, Ray, router, Locust and SQLite; stream targets as `endpoints:`): the run ends as an
error (exit 1) with the cause in its final lines, never a verdict; whatever the store and
decision.json could still record agrees; production traffic goes back to the stable config (the
weight hook at 0); no temporary file or process is left.

The fill after the decision's commit is asserted where it can be timed to the line, around the
real controller (tests/test_disk_full.py): from outside the process the moment between the commit
and the reports is a race.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.stream_target import TargetProcess
from rollout.run.store import RunStore
from tests.conftest import ray_processes, server_processes, tmpfs_mount, wait_gone
from tests.faults.endpoint_run import CliRun, hook_weights, run_config
from tests.test_disk_full import fill

# slow in CI's serial pass (Ray and Locust start per run); no vLLM server
pytestmark = pytest.mark.vllm


@pytest.fixture
def runs_disk(tmp_path):
    yield from tmpfs_mount(tmp_path, "64m")


def test_a_runs_dir_that_fills_mid_experiment_ends_the_run_as_an_error_everywhere(tmp_path, runs_disk):
    with TargetProcess(ttft_ms=20, tpot_ms=10) as base, TargetProcess(ttft_ms=20, tpot_ms=10) as cand:
        run = CliRun(tmp_path, run_config(tmp_path, base.url, cand.url), runs_dir=runs_disk)
        try:
            run.wait_for("experiment: look 1/")  # the load flows, looks are being committed
            fill(runs_disk)
            assert run.wait(240) == 1, run.text()[-4000:]
        finally:
            run.kill()
    assert run.final_line() == f"mtp-canary: exit_code=1 decision=error run_dir={runs_disk / run.run_id}"
    errors = [line for line in run.text().splitlines() if line.startswith("mtp-canary: error: ")]
    assert errors and "No space left on device" in errors[-1], run.text()[-3000:]
    (runs_disk / "ballast").unlink()  # room to open the store and read what it holds
    row = RunStore(runs_disk / "history.db").run(run.run_id)
    assert row["decision"] is None and row["status"] != "done", row  # error, or running under a gone controller
    decision = runs_disk / run.run_id / "decision.json"
    assert not decision.exists() or json.loads(decision.read_text())["exit_code"] == 1
    assert hook_weights(tmp_path)[-1:] == ["0"]
    assert run.temp_files() == []
    assert wait_gone(lambda: ray_processes() + server_processes(), 60) == []
