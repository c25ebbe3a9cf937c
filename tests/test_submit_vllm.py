"""`mtp-canary submit` of a real run on a real `ray start --head`: vLLM CPU replicas, Locust, SQLite.

Two fleet starts in all (each ~1 min here, 2-4 min on a slow machine): one run to its decision,
whose exit code and fetched decision.json must agree with what the run itself wrote; and one run
stopped with `ray job stop` as soon as a vLLM server of its job exists, which must leave no vLLM
server, Locust process or run actor behind within the stop grace submit gives the job.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from rollout.commands.submit import JOB_STOP_WAIT_S, final_line
from tests.conftest import REPO, server_processes, session_processes, wait_gone
from tests.test_cli_run import assert_goodput_per_arm
from tests.test_submit import _head

pytestmark = pytest.mark.vllm

CONFIG = "deploy/smoke-cpu.yaml"  # inside the uploaded working dir (tmp files would not travel)
RUN_ACTORS = ("ray::VLLMReplicaServer", "ray::RouterServer", "ray::SupervisedProcessServer", "ray::LoadRunnerServer")
SUBMITTED = re.compile(r"mtp-canary submit: job (\S+) submitted")


@pytest.fixture(scope="module")
def head():
    with _head(RAY_AUTH_MODE="disabled") as address:
        yield address


def submit_command(head: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "rollout", "submit", CONFIG, "--address", head, *args]


def run_actor_processes() -> list:
    """Worker processes of this session that still host one of a run's actors (titled `ray::Class...`)."""
    return [p for p in session_processes() if (p.info["cmdline"] or [""])[0].startswith(RUN_ACTORS)]


def vllm_servers() -> list:
    return [p for p in server_processes() if "vllm.entrypoints.openai.api_server" in " ".join(p.info["cmdline"] or [])]


def test_submit_exits_with_the_runs_code_and_brings_its_decision_back(head, tmp_path):
    runs, fetched, ci = tmp_path / "runs", tmp_path / "fetched", tmp_path / "ci"
    ci.mkdir()
    proc = subprocess.run(
        submit_command(head, "--runs-dir", str(runs), "--fetch-dir", str(fetched), "--junit", str(ci / "junit.xml"),
                       "--decision-out", str(ci / "decision.json")),
        cwd=REPO, capture_output=True, text=True, timeout=1500, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    print(proc.stdout[-5000:], proc.stderr[-3000:])
    line = final_line(proc.stdout)  # the run's own last line, streamed from the job's log
    assert line is not None, proc.stderr[-2000:]
    code, decision, run_dir = line
    assert proc.returncode == code  # the run's code, not Ray's SUCCEEDED/FAILED
    doc = json.loads((fetched / "decision.json").read_text())
    # the head is this machine: what came back through the log is the file the run wrote
    assert doc == json.loads((Path(run_dir) / "decision.json").read_text())
    assert (doc["decision"], doc["exit_code"]) == (decision, code)
    assert (ci / "decision.json").read_text() == (fetched / "decision.json").read_text()
    cases = {case.get("name"): case for case in ET.parse(ci / "junit.xml").getroot().iter("testcase")}
    assert {g["name"] for g in doc["gates"]} <= set(cases) and "decision" in cases
    assert "mtp-canary: decision_json=" not in proc.stdout  # the base64 line is shown as a note
    assert code in (0, 3, 4), f"the run did not decide: {doc['error']}"  # a judged run, not a fleet that failed
    # a synthetic load with an SLO: each arm's goodput over the judged requests (a healthy smoke meets the SLO);
    # none is judged when accuracy rolled back or max_duration_s came before the first look (a slow machine)
    if doc["experiment"] and doc["experiment"]["looks"]:
        assert_goodput_per_arm(doc, at_least=20)
        assert "goodput_guard" not in {g["name"] for g in doc["gates"]}  # reported, not gated (gates.disabled)
    assert wait_gone(vllm_servers, 60) == [] and wait_gone(run_actor_processes, 60) == []


def test_ray_job_stop_while_replicas_start_leaves_nothing_behind(head, tmp_path):
    err_path = tmp_path / "submit.err"
    with open(tmp_path / "submit.out", "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(submit_command(head, "--runs-dir", str(tmp_path / "runs")), cwd=REPO, stdout=out,
                                stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 600
        job_id = None
        while time.monotonic() < deadline and proc.poll() is None:
            job_id = job_id or next(iter(SUBMITTED.findall(err_path.read_text())), None)
            if job_id and vllm_servers():
                break  # a vLLM server of this job exists (starting or serving): stop it now
            time.sleep(0.5)
        assert job_id and vllm_servers(), (err_path.read_text()[-2000:], (tmp_path / "submit.out").read_text()[-3000:])
        stopped = subprocess.run([str(Path(sys.executable).with_name("ray")), "job", "stop", "--address", head, job_id],
                                 capture_output=True, text=True, timeout=int(JOB_STOP_WAIT_S) + 60,
                                 env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        assert stopped.returncode == 0, stopped.stderr[-2000:]
        # within the grace submit gave the job (RAY_JOB_STOP_WAIT_TIME_S), the run tore its fleet down
        grace = int(JOB_STOP_WAIT_S) + 15
        assert wait_gone(server_processes, grace) == []  # no vLLM server or engine, no Locust
        assert wait_gone(run_actor_processes, 30) == []  # no replica, router or load actor
        assert proc.wait(timeout=120) == 1  # a stopped job is an infrastructure error, never a verdict
        assert "STOPPED" in err_path.read_text()
    finally:
        if proc.poll() is None:
            proc.terminate()  # ours: the submit client (it stops its job on SIGTERM)
            proc.wait(30)
