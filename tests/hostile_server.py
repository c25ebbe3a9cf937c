"""A named fault target: an HTTP server that answers as a broken or hostile replica would.

Each path is one fault (stdlib only, a thread of the test's process):
  /metrics/huge-position   a vLLM page whose per-position counter has position="999999999"
  /metrics/endless         a page that never ends (64 KiB pieces as fast as they are read)
  /health, /version        200 with a body that never ends
  /v1/no-newline           a 200 SSE stream of one line that never ends
  /v1/endless              a 200 SSE stream of valid chunks that never reaches [DONE]
  /v1/trickle              a 200 SSE stream of a byte every 0.2 s, forever
  /v1/forged-arm           a good stream whose x-mtp-canary-arm says "canary", whatever was asked
  /v1/error-endless        an HTTP 500 whose body never ends

Served as an `endpoints:` server of a whole run, a fault is a base URL (`s.url + "/trickle"`):
  <fault>/health           200 at once (the fleet takes it as ready)
  <fault>/metrics          a small good vLLM page
  /trickle/v1/completions  (as above) every request, the preflight's smoke request too
  /evals-trickle/v1/completions  a good JSON completion, except an accuracy eval's request
                           (return_token_ids) which trickles a byte every 0.2 s, forever
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHUNK = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
DONE = (b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"","finish_reason":"length"}],'
        b'"usage":{"prompt_tokens":4,"completion_tokens":2,"total_tokens":6}}\n\ndata: [DONE]\n\n')
GOOD_PAGE = "# TYPE vllm:request_success_total counter\nvllm:request_success_total{finished_reason=\"length\"} 0.0\n"
GOOD_COMPLETION = (b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" 2","token_ids":[7],'
                   b'"finish_reason":"length"}],"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}')
HUGE_POSITION_PAGE = (
    "# TYPE vllm:spec_decode_num_drafts_total counter\n"
    "vllm:spec_decode_num_drafts_total 10.0\n"
    "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter\n"
    'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="999999999"} 1.0\n'
)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *_args) -> None:
        pass

    def _stream_head(self, status: int = 200, arm: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")  # the body ends when the socket does
        if arm:
            self.send_header("x-mtp-canary-arm", arm)
        self.end_headers()

    def _forever(self, piece: bytes, every_s: float = 0.0) -> None:
        deadline = time.monotonic() + 120  # a test's client gives up long before
        try:
            while time.monotonic() < deadline and not self.server.closing:
                self.wfile.write(piece)
                self.wfile.flush()
                if every_s:
                    time.sleep(every_s)
        except OSError:  # the client hung up: what a cap does
            pass

    def _whole(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.count("/") == 2 and self.path.endswith("/health"):  # a fault's base URL, as a server's
            self._whole(b"", "text/plain")
        elif self.path.count("/") == 2 and self.path.endswith("/metrics"):
            self._whole(GOOD_PAGE.encode(), "text/plain")
        elif self.path == "/metrics/huge-position":
            body = HUGE_POSITION_PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/metrics/endless":
            self._stream_head()
            self._forever(b"# " + b"x" * 65534 + b"\n")
        elif self.path in ("/health", "/version"):
            self._stream_head()
            self._forever(b"{" + b" " * 65535)
        else:
            self.send_error(404)

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        if self.path.endswith("/evals-trickle/v1/completions"):
            if b"return_token_ids" in body:
                self._stream_head()
                self._forever(b" ", every_s=0.2)
            else:
                self._whole(GOOD_COMPLETION, "application/json")
        elif self.path.endswith("/no-newline/v1/completions"):
            self._stream_head()
            self._forever(b"data: " + b"x" * 65536)
        elif self.path.endswith("/endless/v1/completions"):
            self._stream_head()
            self._forever(CHUNK * 64)
        elif self.path.endswith("/trickle/v1/completions"):
            self._stream_head()
            self._forever(b":", every_s=0.2)
        elif self.path.endswith("/forged-arm/v1/completions"):
            self._stream_head(arm="canary")
            self.wfile.write(CHUNK + DONE)
        elif self.path.endswith("/error-endless/v1/completions"):
            self._stream_head(status=500)
            self._forever(b"e" * 65536)
        else:
            self.send_error(404)


class HostileServer:
    """`with HostileServer() as s: s.url + "/metrics/endless"`."""

    def __enter__(self) -> HostileServer:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.closing = False
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self

    def __exit__(self, *_exc) -> None:
        self._server.closing = True
        self._server.shutdown()
        self._server.server_close()
