"""The decision webhook against a real HTTP server on 127.0.0.1: retries, gives up, never raises, stays bounded.

Time bounds are the call's own (its back-offs, timeouts and deadline), each far from what
the machine's speed adds: the tries against a local server take milliseconds."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollout.record.webhook import BACKOFF_S, post_decision

DOC = {"run_id": "r1", "decision": "promote", "gates": [{"name": "g", "verdict": "pass"}]}


class Receiver:
    """Answers each POST with the next status of `script` (the last one repeats)."""

    def __init__(self, script: list[int], delay_s: float = 0.0) -> None:
        self.script = list(script)
        self.delay_s = delay_s
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", 0))
                receiver.bodies.append(json.loads(self.rfile.read(length)))
                receiver.headers.append(dict(self.headers))
                status = receiver.script.pop(0) if len(receiver.script) > 1 else receiver.script[0]
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Receiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_posts_the_document_as_json():
    with Receiver([200]) as hook:
        result = post_decision(hook.url, DOC)
    assert result.ok and result.status == 200 and result.attempts == 1 and result.error is None
    assert hook.bodies == [DOC]
    assert hook.headers[0]["Content-Type"] == "application/json"


def test_retries_on_5xx_then_succeeds():
    with Receiver([503, 500, 200]) as hook:
        result = post_decision(hook.url, DOC, timeout_s=2, retries=3)
    assert result.ok and result.attempts == 3 and len(hook.bodies) == 3
    assert len(result.errors) == 2 and "HTTP 503" in result.errors[0]


def test_gives_up_after_the_retries_without_raising():
    with Receiver([502]) as hook:
        started = time.monotonic()
        result = post_decision(hook.url, DOC, timeout_s=1, retries=3)
        elapsed = time.monotonic() - started
    assert not result.ok and result.attempts == 3 and result.status == 502 and len(hook.bodies) == 3
    assert "HTTP 502" in result.error
    # it backed off between the tries (0.5 s, then 1 s), and stopped after the third: no
    # further back-off (2 s) and try
    backoffs = BACKOFF_S + 2 * BACKOFF_S
    assert backoffs <= elapsed < backoffs + 4 * BACKOFF_S, elapsed


def test_a_4xx_is_not_retried():
    with Receiver([400]) as hook:
        result = post_decision(hook.url, DOC, retries=3)
    assert not result.ok and result.attempts == 1 and result.status == 400 and len(hook.bodies) == 1


def test_nobody_listening_is_retried_and_returned():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = post_decision(f"http://127.0.0.1:{port}/hook", DOC, timeout_s=1, retries=2)
    assert not result.ok and result.attempts == 2 and result.status is None
    assert "ConnectionError" in result.error


def test_a_slow_receiver_cannot_hold_the_decision():
    with Receiver([200], delay_s=20.0) as hook:
        started = time.monotonic()
        result = post_decision(hook.url, DOC, timeout_s=0.5, retries=2)
        elapsed = time.monotonic() - started
    assert not result.ok and result.attempts == 2 and len(hook.bodies) == 2
    # two tries of 0.5 s and a back-off: it waited out its own timeouts, not the receiver's
    # 20 s (a single answer would have taken that long)
    assert 2 * 0.5 + BACKOFF_S <= elapsed < hook.delay_s / 2, elapsed


def test_the_total_deadline_bounds_everything():
    with Receiver([503]) as hook:
        started = time.monotonic()
        result = post_decision(hook.url, DOC, timeout_s=5, retries=10, deadline_s=1.5)
        elapsed = time.monotonic() - started
    # 10 tries would back off 0.5 + 1 + 2 + 4 + ... s; the deadline ends it at 1.5 s, in the
    # middle of the second back-off (1 s, after 0.5 s): before the third try's back-off
    # (2 s) could even start, and long before the 27.5 s the back-offs of 10 tries add up to
    assert not result.ok and 2 <= result.attempts <= 3 and len(hook.bodies) == result.attempts
    assert 1.5 <= elapsed < 1.5 + 4 * BACKOFF_S, elapsed


def test_the_deadline_cuts_a_try_short():
    with Receiver([200], delay_s=20.0) as hook:
        started = time.monotonic()
        result = post_decision(hook.url, DOC, timeout_s=10, retries=3, deadline_s=1.0)
        elapsed = time.monotonic() - started
    # the one try got what was left of the deadline, not its own 10 s timeout
    assert not result.ok and result.attempts == 1
    assert 1.0 <= elapsed < 10 / 2, elapsed


@pytest.mark.parametrize("url", ["not a url", "ftp://127.0.0.1/x", ""])
def test_a_bad_url_is_an_error_result_not_an_exception(url):
    result = post_decision(url, DOC, timeout_s=1, retries=2)
    assert not result.ok and result.error


def test_a_document_with_odd_values_is_still_sent():
    with Receiver([200]) as hook:
        result = post_decision(hook.url, {"when": time, "n": float("inf")})
    assert result.ok and hook.bodies[0]["when"].startswith("<module")


class Redirector:
    """Answers every POST with a 307 to `location` (a receiver must never follow it there)."""

    def __init__(self, location: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(307)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook-s3cret-path?token=t0ken"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Redirector":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_redirect_is_not_followed_and_is_a_failed_delivery(caplog):
    caplog.set_level("WARNING", logger="mtp_canary.webhook")
    with Receiver([200]) as admin, Redirector(admin.url.replace("/hook", "/internal/admin")) as hook:
        result = post_decision(hook.url, DOC, timeout_s=2, retries=3)
    assert admin.bodies == []  # the decision never reached where the redirect pointed
    assert not result.ok and result.status == 307 and result.attempts == 1  # a 3xx is not retried
    assert "307" in result.error and "redirect" in result.error
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "307" in logged
    # the receiver is named by scheme and host only: its path and query may be its credential
    assert "127.0.0.1" in logged and "s3cret" not in logged and "t0ken" not in logged
    assert "s3cret" not in result.url and "t0ken" not in str(result.to_dict())


@pytest.mark.parametrize("url", ["http://hooks.example.com/s3cret?token=t0ken", "http://10.0.0.7:8080/s3cret"])
def test_plain_http_beyond_loopback_is_refused_without_sending(url, caplog):
    caplog.set_level("WARNING", logger="mtp_canary.webhook")
    result = post_decision(url, DOC, timeout_s=1, retries=3)
    assert not result.ok and result.attempts == 0 and result.status is None
    assert "https://" in result.error and "allow_http" in result.error
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "https://" in logged and "s3cret" not in logged and "t0ken" not in logged


def test_allow_http_lets_a_plain_http_receiver_be_tried():
    # 192.0.2.1 is TEST-NET-1: nothing answers; what matters is that it was tried
    result = post_decision("http://192.0.2.1/hook", DOC, timeout_s=0.5, retries=1, allow_http=True)
    assert not result.ok and result.attempts == 1 and "https" not in (result.error or "")
