"""Tests of the router under faults and hostile input: outlier ejection (cluster/outlier.py) and
the limits (cluster/router_limits.py), over real sockets, without Ray.

The router runs as a plain `RouterServer` in a background event loop; its upstreams run in
the same loop: a live one (a short SSE stream), one that answers 500, one that accepts and
never answers, one that sends headers and a first chunk and then goes silent. Time bounds
are the limits set here (a fraction of a second to 1 s) against what a limitless router
would do (wait 30 s or forever), so a machine 4x slower passes too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
import requests
from aiohttp import web
from pydantic import ValidationError

from cluster.arms import ARM_HEADER
from cluster.outlier import EjectionPolicy, ReplicaHealth
from cluster.router import REPLICA_HEADER, RouterServer
from cluster.router_limits import RouterLimits, is_loopback, limits_error

T = TypeVar("T")


# --------------------------------------------------------------------------
# Pure: the ejection rule
# --------------------------------------------------------------------------


def test_consecutive_failures_eject_with_a_doubling_capped_backoff() -> None:
    policy = EjectionPolicy(threshold=3, base_s=10.0, max_s=25.0)
    health = ReplicaHealth()
    assert health.failed(0.0, policy) is None and health.failed(0.0, policy) is None
    assert health.failed(0.0, policy) == 10.0  # the third in a row
    assert health.ejected(5.0) and not health.ejected(10.0)
    # in flight when ejected: the same outage, not a longer ejection
    assert health.failed(5.0, policy) is None and health.ejected_until == 10.0
    # back on probation: its first failure ejects again, for twice as long, then the cap
    assert health.failed(11.0, policy) == 20.0
    assert health.failed(32.0, policy) == 25.0
    assert health.ejections == 3
    # one success ends the streak and the doubling
    health.succeeded()
    assert [health.failed(100.0, policy) for _ in range(3)] == [None, None, 10.0]


def test_a_success_between_failures_keeps_the_replica_in() -> None:
    policy = EjectionPolicy(threshold=3)
    health = ReplicaHealth()
    for _ in range(10):
        assert health.failed(0.0, policy) is None
        assert health.failed(0.0, policy) is None
        health.succeeded()
    assert health.ejections == 0 and not health.ejected(0.0)


def test_limits_validate_and_explain_in_one_line() -> None:
    with pytest.raises(ValidationError) as bad:
        RouterLimits(max_body_bytes=0)
    assert limits_error(bad.value).startswith("max_body_bytes: ")
    with pytest.raises(ValidationError) as crossed:
        RouterLimits(ejection_base_s=60, ejection_max_s=10)
    assert "ejection_max_s" in limits_error(crossed.value) and "\n" not in limits_error(crossed.value)
    with pytest.raises(ValidationError):
        RouterLimits(no_such_limit=1)  # type: ignore[call-arg]
    assert RouterLimits().max_body_bytes == 16 * 1024 * 1024
    assert RouterLimits().header_timeout_s <= 30 and RouterLimits().body_timeout_s <= 30
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2", "0.0.0.0", "10.0.0.1")] == [
        True, True, True, True, True, False, False
    ]


# --------------------------------------------------------------------------
# Harness: the router and its upstreams in one background event loop
# --------------------------------------------------------------------------


class Upstreams:
    """Upstream servers of every kind a test needs, on 127.0.0.1, in the harness's loop."""

    def __init__(self) -> None:
        self.live = ""
        self.failing = ""
        self.silent = ""
        self.stalling = ""
        self.received: list[dict[str, str]] = []  # headers the live upstream got
        self._runners: list[web.AppRunner] = []
        self._silent_server: asyncio.Server | None = None
        self._held: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self.live = await self.serve(self._live)
        self.failing = await self.serve(self._failing)
        self.stalling = await self.serve(self._stalling)
        self._silent_server = await asyncio.start_server(self._never_answer, "127.0.0.1", 0)
        self.silent = f"http://127.0.0.1:{self._silent_server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        for writer in self._held:
            writer.close()
        if self._silent_server is not None:
            self._silent_server.close()
        for runner in self._runners:
            await runner.cleanup()

    async def serve(self, handler: Any, keepalive_timeout: float = 3630.0) -> str:
        """`handler` on /v1/... at a new 127.0.0.1 port (aiohttp's own keep-alive unless given); its URL."""
        app = web.Application()
        app.router.add_route("*", "/v1/{tail:.*}", handler)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1, keepalive_timeout=keepalive_timeout)
        await runner.setup()
        listening = socket.create_server(("127.0.0.1", 0))
        await web.SockSite(runner, listening).start()
        self._runners.append(runner)
        return f"http://127.0.0.1:{listening.getsockname()[1]}"

    async def _live(self, request: web.Request) -> web.StreamResponse:
        self.received.append(dict(request.headers))
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"upstream": "live"}\n\n')
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _failing(self, request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "failing upstream"}}, status=500)

    async def _stalling(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"upstream": "stalling"}\n\n')
        await asyncio.sleep(3600)
        return response

    async def _never_answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._held.append(writer)  # accepted, read, never answered, never closed


class Harness:
    """`RouterServer`s and `Upstreams` in one event loop in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router-harness", daemon=True)
        self._thread.start()
        self.upstreams = Upstreams()
        self.run(self.upstreams.start())
        self._routers: list[RouterServer] = []

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def router(self, arms: dict[str, list[str]], limits: RouterLimits | None = None, **kwargs: Any) -> tuple[RouterServer, str]:
        async def make() -> tuple[RouterServer, str]:
            server = RouterServer(limits=limits, **kwargs)
            url = await server.start()
            await server.set_arms(arms)
            return server, url

        server, url = self.run(make())
        self._routers.append(server)
        return server, url

    def state(self, server: RouterServer) -> dict[str, Any]:
        return self.run(server.get_state())  # type: ignore[return-value]

    def close(self) -> None:
        for server in self._routers:
            self.run(server.stop())
        self.run(self.upstreams.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    made = Harness()
    yield made
    made.close()


def _free_port_with_nothing_listening() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _complete(url: str, http: requests.Session, **headers: str) -> requests.Response:
    return http.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers=headers, timeout=30)


def _raw_exchange(url: str, request: bytes, read_timeout_s: float = 10) -> bytes:
    """Send raw bytes, read until the server closes (or read_timeout_s of silence)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=read_timeout_s) as conn:
        conn.sendall(request)
        received = b""
        try:
            while chunk := conn.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return received


def _status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


# --------------------------------------------------------------------------
# Outlier ejection over HTTP
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dead_kind", ["nobody_listening", "answers_500"])
def test_a_dead_replica_next_to_a_live_one_gets_only_a_handful(
    harness: Harness, dead_kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    live = harness.upstreams.live
    dead = f"http://127.0.0.1:{_free_port_with_nothing_listening()}" if dead_kind == "nobody_listening" else harness.upstreams.failing
    server, url = harness.router({"baseline": [live, dead]}, limits=RouterLimits(eject_after_failures=3, ejection_base_s=60))
    caplog.set_level(logging.WARNING, logger="mtp_canary.router")

    def user(n: int) -> list[int]:
        with requests.Session() as http:
            return [_complete(url, http).status_code for _ in range(n)]

    with ThreadPoolExecutor(max_workers=8) as pool:  # 8 users, 200 requests
        statuses = [status for batch in pool.map(user, [25] * 8) for status in batch]

    state = harness.state(server)
    dead_counts, live_counts = state["replica_counts"][dead], state["replica_counts"][live]
    # Without ejection the dead replica, always idle, would take most of the 200. With it: the 3
    # failures that eject it, and what the other 7 users had sent it meanwhile, at most.
    assert dead_counts["routed"] <= 3 + 7, dead_counts
    assert live_counts["routed"] == 200 - dead_counts["routed"]
    assert dead_counts["ejections"] == 1 and dead_counts["ejected_until"] > time.time()
    assert live_counts["ejected_until"] is None and live_counts["ejections"] == 0
    # the failed requests are still the arm's errors (the guards must see them)
    assert state["arm_counts"]["baseline"]["errors"] == dead_counts["errors"] == dead_counts["routed"]
    assert statuses.count(200) == live_counts["routed"]
    ejection_logs = [r for r in caplog.records if "ejected replica" in r.getMessage()]
    assert len(ejection_logs) == 1 and dead in ejection_logs[0].getMessage()
    # over HTTP the same report
    assert requests.get(f"{url}/router/state", timeout=10).json()["replica_counts"][dead]["ejections"] == 1


def test_every_replica_ejected_answers_503_naming_the_arm_counted_as_its_error(harness: Harness) -> None:
    dead = f"http://127.0.0.1:{_free_port_with_nothing_listening()}"
    server, url = harness.router(
        {"baseline": [harness.upstreams.live], "canary": [dead]}, limits=RouterLimits(eject_after_failures=2)
    )
    with requests.Session() as http:
        answers = [_complete(url, http, **{ARM_HEADER: "canary"}) for _ in range(6)]
        baseline = _complete(url, http, **{ARM_HEADER: "baseline"})
    assert [a.status_code for a in answers] == [502, 502, 503, 503, 503, 503]
    assert "'canary'" in answers[-1].json()["error"]["message"] and "ejected" in answers[-1].json()["error"]["message"]
    assert answers[-1].headers[ARM_HEADER] == "canary"
    assert baseline.status_code == 200
    counts = harness.state(server)["arm_counts"]["canary"]
    assert counts["errors"] == 6 and counts["routed"] == 2 and counts["rejected"] == 4
    # the arm was wholly out: said apart from "no replicas", and kept past a reset of the counts (a run's record)
    harness.run(server.reset_counts())
    assert harness.state(server)["wholly_ejected"] == {"canary": 4}


# --------------------------------------------------------------------------
# Upstream timeouts
# --------------------------------------------------------------------------


def test_an_upstream_that_never_answers_gets_504_after_the_first_byte_timeout(harness: Harness) -> None:
    server, url = harness.router(
        {"baseline": [harness.upstreams.silent]}, limits=RouterLimits(upstream_first_byte_timeout_s=0.5)
    )
    started = time.monotonic()
    response = requests.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=60)
    elapsed = time.monotonic() - started
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == 504 and "upstream_first_byte_timeout_s" in error["message"]
    assert response.headers[REPLICA_HEADER] == harness.upstreams.silent
    assert 0.5 <= elapsed < 30  # it waited its own timeout, not forever
    assert harness.state(server)["arm_counts"]["baseline"]["errors"] == 1


def _listener_that_accepts_no_connection() -> tuple[socket.socket, list[socket.socket], str]:
    """A port whose accept queue is full: Linux drops further SYNs, so a connect hangs (a replica
    whose server stopped accepting, or a host behind a black-holing firewall)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers: list[socket.socket] = []
    for _ in range(8):  # never accepted: they fill the queue
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    time.sleep(0.2)
    probe = socket.socket()
    probe.settimeout(1.0)
    try:
        probe.connect(("127.0.0.1", port))
        hangs = False
    except (TimeoutError, socket.timeout):
        hangs = True
    finally:
        probe.close()
    assert hangs, "this kernel accepted a connection beyond a full accept queue: no stand-in for a hung connect"
    return listener, fillers, f"http://127.0.0.1:{port}"


def test_an_upstream_that_accepts_no_connection_gets_504_after_the_connect_timeout(harness: Harness) -> None:
    listener, fillers, hung = _listener_that_accepts_no_connection()
    try:
        server, url = harness.router({"baseline": [hung]}, limits=RouterLimits(upstream_connect_timeout_s=0.5))
        started = time.monotonic()
        response = requests.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=60)
        elapsed = time.monotonic() - started
        assert response.status_code == 504, response.text
        error = response.json()["error"]
        assert "upstream_connect_timeout_s" in error["message"] and "connection" in error["message"]
        assert 0.5 <= elapsed < 30  # its own timeout, not the client's
        assert harness.state(server)["arm_counts"]["baseline"]["errors"] == 1  # an error of its arm
    finally:
        for sock in [listener, *fillers]:
            sock.close()


def test_an_idle_pooled_connection_is_closed_before_the_replica_closes_it(harness: Harness) -> None:
    """vLLM's server closes an idle keep-alive connection after 5 s, aiohttp's pool keeps one 15 s: a request
    sent on it as the replica closes it failed unanswered ("Server disconnected"), and three in a row ejected
    a replica in CI. Here the replica's keep-alive is 0.3 s and requests come ~0.3 s apart, right at the
    moment it closes (with a pool keep-alive of 15 s, 4 of 40 such requests failed); the router's pool
    drops a connection after upstream_keepalive_s, so every request goes out on a fresh one and succeeds."""
    peer_ports: list[int] = []

    async def answer(request: web.Request) -> web.Response:
        peer_ports.append(request.transport.get_extra_info("peername")[1])
        await request.read()
        return web.json_response({"choices": []})

    upstream = harness.run(harness.upstreams.serve(answer, keepalive_timeout=0.3))
    server, url = harness.router({"baseline": [upstream]}, limits=RouterLimits(upstream_keepalive_s=0.1))
    with requests.Session() as http:
        statuses = []
        for i in range(24):
            statuses.append(_complete(url, http).status_code)
            time.sleep(0.3 + (i % 8) * 0.002 - 0.006)
    assert statuses == [200] * 24
    assert harness.state(server)["arm_counts"]["baseline"]["errors"] == 0
    assert len(set(peer_ports)) == 24  # none reused past the router's keep-alive


def test_an_upstream_silent_mid_stream_has_the_client_stream_cut(harness: Harness) -> None:
    server, url = harness.router(
        {"baseline": [harness.upstreams.stalling]}, limits=RouterLimits(upstream_idle_timeout_s=0.5)
    )
    received = b""
    with requests.post(f"{url}/v1/completions", json={"prompt": "hi"}, stream=True, timeout=60) as response:
        assert response.status_code == 200
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            for data in response.iter_content(chunk_size=None):
                received += data
    assert b"stalling" in received  # what came was relayed; then the stream was cut, not ended
    assert harness.state(server)["arm_counts"]["baseline"]["errors"] == 1


# --------------------------------------------------------------------------
# Client-side limits
# --------------------------------------------------------------------------


def test_a_declared_body_over_the_cap_is_refused_413_before_it_is_sent(harness: Harness) -> None:
    server, url = harness.router({"baseline": [harness.upstreams.live]}, limits=RouterLimits(max_body_bytes=1024))
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000000\r\n\r\n"
    )
    raw = _raw_exchange(url, head)  # not one byte of the body is sent
    assert _status_of(raw) == 413
    assert b"1000000000 bytes exceeds" in raw
    state = harness.state(server)
    assert state["refused"]["body_too_large"] == 1 and state["arm_counts"]["baseline"]["routed"] == 0


def test_a_chunked_body_over_the_cap_is_refused_413_and_not_routed(harness: Harness) -> None:
    server, url = harness.router({"baseline": [harness.upstreams.live]}, limits=RouterLimits(max_body_bytes=64 * 1024))

    def body() -> Iterator[bytes]:  # no Content-Length: the cap holds on what is read
        for _ in range(64):
            yield b"x" * 16 * 1024

    try:
        response = requests.post(f"{url}/v1/completions", data=body(), timeout=30)
        assert response.status_code == 413
    except requests.exceptions.ConnectionError:
        pass  # the router may close while the client still sends: refused either way
    state = harness.state(server)
    assert state["refused"]["body_too_large"] == 1 and state["arm_counts"]["baseline"]["routed"] == 0
    # a body within the cap passes
    assert requests.post(f"{url}/v1/completions", data=b'{"prompt": "hi"}', timeout=30).status_code == 200


def test_a_client_trickling_headers_is_cut_off_at_the_header_deadline(harness: Harness) -> None:
    _, url = harness.router({"baseline": [harness.upstreams.live]}, limits=RouterLimits(header_timeout_s=1.0))
    host, port = url.removeprefix("http://").rsplit(":", 1)
    trickle = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 300  # 300 x 0.1 s: 30 s if never cut
    started = time.monotonic()
    cut = False
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        try:
            for byte in trickle:
                conn.sendall(bytes([byte]))
                time.sleep(0.1)
                conn.setblocking(False)
                try:
                    if conn.recv(1024) == b"":
                        cut = True
                        break
                except BlockingIOError:
                    pass
                finally:
                    conn.setblocking(True)
        except (BrokenPipeError, ConnectionResetError):
            cut = True
    elapsed = time.monotonic() - started
    assert cut, "the router waited for the whole trickle"
    assert 1.0 <= elapsed < 20, elapsed  # cut at its own deadline, long before the trickle's 30 s
    # a client that sends its headers at once is served under the same deadline
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def test_a_client_trickling_its_body_gets_408_at_the_body_deadline(harness: Harness) -> None:
    server, url = harness.router({"baseline": [harness.upstreams.live]}, limits=RouterLimits(body_timeout_s=1.0))
    host, port = url.removeprefix("http://").rsplit(":", 1)
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=20) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 300\r\n\r\n")
        conn.setblocking(False)
        answer = b""
        for _ in range(300):  # one byte each 0.1 s: 30 s for the whole body
            try:
                conn.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError, BlockingIOError):
                break
            time.sleep(0.1)
            try:
                answer += conn.recv(4096)
                if answer:
                    break
            except BlockingIOError:
                pass
    elapsed = time.monotonic() - started
    assert _status_of(answer) == 408, answer
    assert 1.0 <= elapsed < 20, elapsed
    assert harness.state(server)["refused"]["body_timeout"] == 1


def test_connections_beyond_the_cap_are_answered_503(harness: Harness) -> None:
    server, url = harness.router({"baseline": [harness.upstreams.live]}, limits=RouterLimits(max_connections=2))
    host, port = url.removeprefix("http://").rsplit(":", 1)
    held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(2)]
    try:
        time.sleep(0.2)  # let the router accept both
        raw = _raw_exchange(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _status_of(raw) == 503 and b"max_connections" in raw
        assert harness.state(server)["refused"]["connections"] == 1
    finally:
        for conn in held:
            conn.close()
    deadline = time.monotonic() + 20
    while True:  # once they are closed, there is room again
        raw = _raw_exchange(url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        if _status_of(raw) == 200:
            break
        assert time.monotonic() < deadline, raw
        time.sleep(0.1)


@pytest.mark.parametrize(
    "target",
    [b"http://evil.example/v1/models", b"//evil.example/v1/models", b"/v1/../admin", b"/v1/%2e%2e/admin", b"/admin",
     b"/metrics"],
)
def test_targets_that_are_not_origin_form_v1_paths_get_400_and_are_not_routed(harness: Harness, target: bytes) -> None:
    server, url = harness.router({"baseline": [harness.upstreams.live]})
    raw = _raw_exchange(url, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert _status_of(raw) == 400, raw
    body = json.loads(raw.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == 400 and body["error"]["type"] == "invalid_request_error"
    state = harness.state(server)
    assert state["arm_counts"]["baseline"]["routed"] == 0 and state["refused"]["bad_target"] == 1


def test_a_token_is_required_when_set_and_never_reported(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    token = "s3cret-router-token-for-tests"
    monkeypatch.setenv("MTP_CANARY_TEST_ROUTER_TOKEN", token)
    limits = RouterLimits(auth_token_env="MTP_CANARY_TEST_ROUTER_TOKEN")
    server, url = harness.router({"baseline": [harness.upstreams.live]}, limits=limits)
    with requests.Session() as http:
        assert _complete(url, http).status_code == 401
        assert _complete(url, http, Authorization="Bearer wrong").status_code == 401
        assert _complete(url, http, Authorization=token).status_code == 401  # no scheme
        assert http.get(f"{url}/health", timeout=10).status_code == 401
        assert http.get(f"{url}/router/state", timeout=10).status_code == 401
        good = _complete(url, http, Authorization=f"Bearer {token}")
        assert good.status_code == 200
        over_http = http.get(f"{url}/router/state", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    # the router's credential is not passed on to the replica
    assert "authorization" not in {name.lower() for name in harness.upstreams.received[-1]}
    state = harness.state(server)
    assert state["auth_required"] and state["refused"]["unauthorized"] == 5
    assert state["arm_counts"]["baseline"]["routed"] == 1
    assert token not in json.dumps(state) and token not in over_http.text


def test_binding_beyond_loopback_without_a_token_is_refused(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MTP_CANARY_TEST_UNSET_TOKEN", raising=False)
    server = RouterServer(limits=RouterLimits(auth_token_env="MTP_CANARY_TEST_UNSET_TOKEN"))
    with pytest.raises(RuntimeError) as refused:
        harness.run(server.start(host="0.0.0.0"))
    message = str(refused.value)
    assert "MTP_CANARY_TEST_UNSET_TOKEN" in message and "0.0.0.0" in message and "\n" not in message
    assert harness.run(server.get_state())["url"] is None  # nothing was bound
