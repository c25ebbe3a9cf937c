"""Fault corpus through the whole controller: `mtp-canary run` (and `resume`) as a process, real Ray,
router, Locust, SQLite and weight hook; the arms are stream targets reached as `endpoints:` (no vLLM:
what is under test is the controller's exit, not a server).

Each scenario asserts the exit code (130 for a signal, 1 for an infrastructure error), the cause in
one line of the log and in decision.json and the store, the weight hook's last value 0, and nothing
left behind (Ray, Locust, temporary files).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from benchmarks.stream_target import TargetProcess
from rollout.config import load_config
from rollout.record.redact import redact_config
from rollout.run.store import RunStore
from tests.conftest import ray_processes, server_processes, session_processes, wait_gone
from tests.faults.endpoint_run import CliRun, hook_weights, run_config

# slow in CI's serial pass (Ray and Locust start per run); no vLLM server
pytestmark = pytest.mark.vllm

HOOK_AT_0_S = "MTP_CANARY_TEST_HOOK_SLEEP_AT_0"


def assert_ended(run: CliRun, code: int, cause: str, tmp_path, hook: list[str] | None = None) -> None:
    """The exit code and the cause agree in the final line, decision.json, the store; the hook ended at 0;
    nothing of the run is left."""
    assert run.wait(240) == code, run.text()[-4000:]
    assert run.final_line().startswith(f"mtp-canary: exit_code={code} decision=error "), run.text()[-2000:]
    assert f"mtp-canary: error: {cause}" in run.text()
    doc = run.decision()
    assert doc["exit_code"] == code and doc["decision"] is None and doc["error"].startswith(cause), doc["error"]
    row = run.row()
    assert (row["status"], row["exit_code"], row["canary_weight"]) == ("error", code, 0), row
    assert row["reason"] == doc["error"]
    weights = hook_weights(tmp_path)
    assert weights[-1:] == ["0"], weights
    if hook is not None:
        assert weights == hook
    assert run.temp_files() == []
    assert wait_gone(lambda: ray_processes() + server_processes(), 60) == []


def until(check, run: CliRun, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert run.proc.poll() is None, f"ended (exit {run.proc.returncode}):\n{run.text()[-4000:]}"
        assert time.monotonic() < deadline, run.text()[-4000:]
        time.sleep(0.3)


def test_sigterm_mid_experiment_ends_as_ctrl_c_and_a_second_one_does_not_cut_the_teardown(tmp_path):
    with TargetProcess(ttft_ms=20, tpot_ms=10) as base, TargetProcess(ttft_ms=20, tpot_ms=10) as cand:
        # the gateway takes 3 s to answer the way back to 0: the second SIGTERM lands inside the teardown
        run = CliRun(tmp_path, run_config(tmp_path, base.url, cand.url), env={HOOK_AT_0_S: "3"})
        try:
            run.wait_for("experiment: look 1/")  # the experiment's load flows
            run.signal(signal.SIGTERM)  # what `ray job stop`, a CI cancel and a pod deletion send
            until(lambda: hook_weights(tmp_path) == ["0"], run, 60)
            run.signal(signal.SIGTERM)
            assert_ended(run, 130, "interrupted by SIGTERM", tmp_path, hook=["0"])
        finally:
            run.kill()
    assert "SIGTERM received while the run ends: teardown goes on" in run.text()
    assert "*** SIGTERM received" not in run.text()  # Ray's own handler, which dies without teardown


def test_sigterm_during_a_progressive_step_puts_the_hook_back_to_0(tmp_path):
    with TargetProcess(ttft_ms=20, tpot_ms=10) as base, TargetProcess(ttft_ms=20, tpot_ms=10) as cand:
        config = run_config(tmp_path, base.url, cand.url, progressive=True, experiment={"enabled": False})
        run = CliRun(tmp_path, config)
        try:
            until(lambda: "10" in hook_weights(tmp_path), run)  # production at 10% on the canary
            run.wait_for("step 1/1: canary 10%")
            run.signal(signal.SIGTERM)
            assert_ended(run, 130, "interrupted by SIGTERM", tmp_path, hook=["10", "0"])
        finally:
            run.kill()


def router_worker() -> list[psutil.Process]:
    return [p for p in session_processes() if (p.info["cmdline"] or [""])[0].startswith("ray::Router")]


def test_a_router_killed_mid_progressive_is_an_error_with_the_hook_back_at_0(tmp_path):
    with TargetProcess(ttft_ms=20, tpot_ms=10) as base, TargetProcess(ttft_ms=20, tpot_ms=10) as cand:
        config = run_config(tmp_path, base.url, cand.url, progressive=True, experiment={"enabled": False})
        run = CliRun(tmp_path, config)
        try:
            run.wait_for("step 1/1: canary 10%")
            routers = router_worker()
            assert len(routers) == 1, [p.info["cmdline"] for p in session_processes()]
            routers[0].kill()
            assert run.wait(240) == 1, run.text()[-4000:]
        finally:
            run.kill()
    doc = run.decision()
    assert doc["exit_code"] == 1 and doc["decision"] is None and "router" in doc["error"].lower(), doc["error"]
    assert run.final_line().startswith("mtp-canary: exit_code=1 decision=error ")
    assert f"mtp-canary: error: {doc['error'].splitlines()[0][:80]}" in run.text()
    row = run.row()
    assert (row["status"], row["exit_code"], row["reason"]) == ("error", 1, doc["error"])
    assert hook_weights(tmp_path) == ["10", "0"]
    assert run.temp_files() == []
    assert wait_gone(lambda: ray_processes() + server_processes(), 60) == []


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_two_resumes_started_together_only_one_takes_the_run(tmp_path):
    # servers that are gone: the resume that takes the run fails its fleet start quickly (exit 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{s.getsockname()[1]}"
    path = run_config(tmp_path, gone, gone + "/v", engine_startup_s=5)
    config = load_config(path)
    runs = tmp_path / "runs"
    store = RunStore(runs / "history.db")
    store.create_run("f1", config.name, "stream-target", redact_config(config.model_dump(mode="json")))
    store.update_run("f1", controller=f"{socket.gethostname()}:{dead_pid()}", phase="experiment")
    (runs / "f1").mkdir()
    # the hook's argv is never stored (rollout.record.redact): the config file is given again
    resumes = [CliRun(tmp_path, config=None, run_id="f1", command="resume", runs_dir=runs, log_name=f"resume-{i}",
                      args=("--config", str(path)))
               for i in range(2)]
    try:
        codes = sorted(r.wait(240) for r in resumes)
    finally:
        for r in resumes:
            r.kill()
    logs = "\n---\n".join(r.text()[-3000:] for r in resumes)
    assert codes == [1, 2], logs
    refused = next(r for r in resumes if r.proc.returncode == 2)
    assert "mtp-canary resume: run f1 " in refused.text() and "exit_code=" not in refused.text(), logs
    taken = next(r for r in resumes if r.proc.returncode == 1)
    assert taken.final_line().startswith("mtp-canary: exit_code=1 decision=error "), logs
    assert "controller_resume" in [e["event"] for e in store.events("f1")]
    assert sum(e["event"] == "controller_resume" for e in store.events("f1")) == 1
    assert hook_weights(tmp_path)[-1:] == ["0"]
    assert wait_gone(lambda: ray_processes() + server_processes(), 60) == []


def test_sigterm_during_the_gpu_placement_wait_ends_the_run_before_any_replica(tmp_path):
    # GPU arms on a cluster without GPUs: the fleet waits for placement (up to placement_timeout_s). A local
    # model path: a hub id without model_cache is refused before anything starts (rollout.run.cluster_plan)
    (tmp_path / "weights").mkdir()
    gpu = {"model": str(tmp_path / "weights"), "device": "gpu"}
    config = run_config(tmp_path, "http://unused", "http://unused", progressive=True, experiment={"enabled": False},
                        baseline={"endpoints": [], "engine": gpu}, canary={"endpoints": [], "engine": gpu},
                        ray={"check_nodes": "never"})
    run = CliRun(tmp_path, config)
    try:
        run.wait_for("fleet: starting 2 replica(s)")
        time.sleep(1)  # inside the placement wait
        run.signal(signal.SIGTERM)
        assert_ended(run, 130, "interrupted by SIGTERM", tmp_path, hook=["0"])
    finally:
        run.kill()
    assert "ready at" not in run.text()
