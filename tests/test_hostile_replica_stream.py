"""Fault corpus, the client's side: a replica (or an `endpoints:` server) whose stream is hostile.

Each fault fails its request as a record (ok=False, the cause named), within a bound, and
never grows the client's memory or time without limit: a line with no newline, a body that
never ends, a trickle that never finishes, an endless error body, a response that names an
arm the request was not pinned to, and TLS that does not verify. The target is the named fault
server (tests/hostile_server.py); Locust-side only (gevent, no Ray).
"""

from __future__ import annotations

import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loadtests.openai_stream import OpenAIStreamClient, RecordLabels, StreamRequest
from loadtests.sse import MAX_LINE_BYTES, SseDecoder, SseTooLarge
from tests.conftest import REPO

sys.path.insert(0, str(REPO))
from tests.hostile_server import CHUNK, DONE, HostileServer  # noqa: E402

LABELS = RecordLabels(request_id="r", tag="test", worker="pytest")


def _request(pinned: str | None = None, max_tokens: int = 8) -> StreamRequest:
    return StreamRequest(endpoint="completions", model="m", max_tokens=max_tokens, prompt="p", pinned_arm=pinned)


def _send(base: str, request: StreamRequest | None = None, **client):
    c = OpenAIStreamClient(base, **{"timeout_s": 10, **client})
    try:
        return c.stream(request or _request(), LABELS).record
    finally:
        c.close()


def test_the_decoder_refuses_a_line_that_never_ends():
    decoder = SseDecoder()
    with pytest.raises(SseTooLarge):
        for _ in range(MAX_LINE_BYTES // 65536 + 2):
            decoder.feed(0.0, b"x" * 65536)


@pytest.mark.parametrize("fault, cause", [
    ("no-newline", "SseTooLarge"),  # (a 1024-token request may take 8 MiB: the line's cap is the one met)
    ("endless", "ResponseTooLarge"),
    ("error-endless", "HTTP 500"),
])
def test_a_hostile_stream_fails_its_request_within_a_bound(fault, cause):
    with HostileServer() as server:
        started = time.monotonic()
        record = _send(f"{server.url}/{fault}", _request(max_tokens=1024 if fault == "no-newline" else 8))
    assert not record.ok and cause in (record.error or ""), record.error
    assert time.monotonic() - started < 60


def test_a_trickle_that_never_ends_meets_the_requests_deadline():
    with HostileServer() as server:
        record = _send(f"{server.url}/trickle", deadline_s=2.0)
    assert not record.ok and "deadline" in (record.error or ""), record.error


def test_a_response_naming_another_arm_than_the_pinned_one_is_no_record_of_either():
    with HostileServer() as server:
        record = _send(f"{server.url}/forged-arm", _request(pinned="baseline"))
        unpinned = _send(f"{server.url}/forged-arm")
    assert not record.ok and "pinned to 'baseline'" in record.error, record
    assert record.served_arm == "baseline"  # counted as a failure of the arm that was asked
    assert unpinned.ok and unpinned.arm == "canary"  # only the router (token-guarded) splits unpinned


class _Hello(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(CHUNK + DONE)

    def log_message(self, *_args) -> None:
        pass


def test_tls_is_verified_host_name_included(tmp_path, monkeypatch):
    """A certificate the client trusts (given as SSL_CERT_FILE) but issued for another name than
    the one connected to is refused: the router token must not reach a server that merely holds
    some trusted certificate."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                           "/CN=localhost", "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key),
                           "-out", str(cert)], capture_output=True)
    if made.returncode != 0:
        pytest.skip("no openssl to make a certificate")
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    # (the trust as the client had it before: geventhttpclient's default bundle, here this certificate)
    from geventhttpclient.connectionpool import SSLConnectionPool

    monkeypatch.setitem(SSLConnectionPool.default_options, "ca_certs", str(cert))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        wrong_name = _send(f"https://127.0.0.1:{port}")  # the certificate names localhost only
        right_name = _send(f"https://localhost:{port}")
    finally:
        server.shutdown()
        server.server_close()
    assert not wrong_name.ok and wrong_name.status == 0 and "CERTIFICATE_VERIFY_FAILED" in (wrong_name.error or ""), \
        wrong_name.error
    # the right name gets through, and its stream is read over TLS
    assert right_name.ok and right_name.output_tokens == 2, right_name.error
