"""A CPU replica bound to cores (`cpu.cores`, the model inside the engine-core process) runs its
whole process tree on those cores: the server and the processes it starts later (vLLM's engine
core), since vLLM's uniproc executor binds nothing itself.

The server is a stand-in (http.server that starts a child the way vLLM's API server starts its
engine core, seconds after it begins); the replica logic around it is the real one, without Ray.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from cluster.engine_spec import CpuLimits, EngineSpec
from cluster.replica import ReplicaState, VLLMReplicaServer
from tests.test_replica_port import wait_state

SERVER = """
import http.server, subprocess, sys, time
time.sleep(0.5)  # the engine core starts after the API server's imports
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[3], "w").write(str(child.pid))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), Health).serve_forever()
"""


def allowed_cores(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


@pytest.fixture
def child_pid_file(monkeypatch, tmp_path) -> Path:
    path = tmp_path / "child.pid"
    monkeypatch.setattr(EngineSpec, "command", lambda self, port, host="127.0.0.1", python=None:
                        [sys.executable, "-c", SERVER, host, str(port), str(path)])
    return path


def test_a_bound_replica_and_the_processes_it_starts_run_on_its_cores(child_pid_file, tmp_path):
    core = max(os.sched_getaffinity(0))
    engine = EngineSpec(model="m", device="cpu", cpu=CpuLimits(cores=str(core)))
    replica = VLLMReplicaServer("canary-0", "canary", engine, str(tmp_path))
    try:
        replica.launch()
        st = wait_state(replica)
        assert st.state == ReplicaState.READY, st
        assert allowed_cores(replica._proc.pid) == {core}
        assert allowed_cores(int(child_pid_file.read_text())) == {core}
    finally:
        replica.stop(grace_s=2)


def test_an_unbound_replica_keeps_every_core(child_pid_file, tmp_path):
    replica = VLLMReplicaServer("baseline-0", "baseline", EngineSpec(model="m", device="cpu"), str(tmp_path))
    try:
        replica.launch()
        assert wait_state(replica).state == ReplicaState.READY
        assert allowed_cores(replica._proc.pid) == os.sched_getaffinity(0)
    finally:
        replica.stop(grace_s=2)


def test_cores_the_machine_does_not_have_fail_the_replica_with_the_cause(child_pid_file, tmp_path):
    engine = EngineSpec(model="m", device="cpu", cpu=CpuLimits(cores="4095"))
    replica = VLLMReplicaServer("canary-0", "canary", engine, str(tmp_path))
    try:
        st = replica.launch()
        assert st.state == ReplicaState.FAILED
        assert "could not bind the server to cores 4095" in st.error
        assert replica._proc.poll() is not None or wait_state(replica).state == ReplicaState.FAILED
    finally:
        replica.stop(grace_s=2)
