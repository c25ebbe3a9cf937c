"""A replica whose port is taken between free_port() and the server's bind relaunches on another.

The server here is a stand-in (a few lines of http.server that bind like vLLM's API server and
fail the same way, errno 98); the replica logic around it is the real one, without Ray.
"""

from __future__ import annotations

import socket
import sys
import time

import pytest

from cluster import replica as replica_module
from cluster.engine_spec import EngineSpec
from cluster.replica import PORT_RETRIES, ReplicaState, VLLMReplicaServer

SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), Health).serve_forever()
"""


@pytest.fixture
def stand_in_server(monkeypatch):
    monkeypatch.setattr(EngineSpec, "command", lambda self, port, host="127.0.0.1", python=None:
                        [sys.executable, "-c", SERVER, host, str(port)])


def taken_port() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def wait_state(replica: VLLMReplicaServer, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = replica.status()
        if st.state != ReplicaState.STARTING:
            return st
        time.sleep(0.2)
    raise AssertionError("the stand-in never started")


def test_a_port_taken_before_the_bind_is_retried_on_a_new_port(stand_in_server, monkeypatch, tmp_path):
    holder = taken_port()
    ports = iter([holder.getsockname()[1]])
    real = replica_module.free_port
    monkeypatch.setattr(replica_module, "free_port", lambda host="127.0.0.1": next(ports, None) or real(host))
    replica = VLLMReplicaServer("baseline-0", "baseline", EngineSpec(model="m", device="cpu"), str(tmp_path))
    try:
        replica.launch()
        st = wait_state(replica)
        assert st.state == ReplicaState.READY, st
        assert st.url != f"http://127.0.0.1:{holder.getsockname()[1]}"
        assert "Address already in use" in (tmp_path / "baseline-0.log").read_text()  # the first try's exit
    finally:
        replica.stop(grace_s=2)
        holder.close()


def test_a_port_that_stays_taken_fails_after_the_retries(stand_in_server, monkeypatch, tmp_path):
    holder = taken_port()
    monkeypatch.setattr(replica_module, "free_port", lambda host="127.0.0.1": holder.getsockname()[1])
    replica = VLLMReplicaServer("canary-0", "canary", EngineSpec(model="m", device="cpu"), str(tmp_path))
    try:
        replica.launch()
        st = wait_state(replica)
        assert st.state == ReplicaState.FAILED and "exited" in st.error
        log = (tmp_path / "canary-0.log").read_text()
        assert log.count("# mtp-canary replica canary-0") == PORT_RETRIES + 1
    finally:
        replica.stop(grace_s=2)
        holder.close()


def test_ports_handed_to_servers_come_from_below_the_ephemeral_range():
    """free_port's pick is bound seconds later by Locust's master or vLLM: from the ephemeral range,
    any outgoing connection (thousands per run) could take it first."""
    import socket

    from loadtests.swarm import _ephemeral_range, free_port

    low, high = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert all(p < low for p in ports) and len(ports) > 10, (sorted(ports), low)
    with socket.socket() as s:  # and free: a server can bind it
        s.bind(("127.0.0.1", ports.pop()))
