"""A streaming request to an OpenAI-compatible server (vLLM, the router) and its record.

The HTTP client is geventhttpclient: cooperative sockets without monkey patching and a C
response parser, the cheapest client a Locust process can run. Its `read(n)` waits for n
bytes, which would delay every chunk; `readline()` returns as soon as one SSE line has
arrived, so each line is stamped the moment it can be used.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from gevent import GreenletExit
from geventhttpclient import HTTPClient

from loadtests.records import Endpoint, RequestRecord
from loadtests.sse import TimedEvent, parse_events

ARM_HEADER = "x-mtp-canary-arm"
REPLICA_HEADER = "x-mtp-canary-replica"

ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}

# How much of an error body a record keeps: enough to read the cause, not a page of HTML.
ERROR_TEXT_LIMIT = 300


@dataclass(frozen=True)
class StreamRequest:
    """The body and headers of one streaming completion request."""

    endpoint: Endpoint
    model: str | None
    max_tokens: int
    prompt: str | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    pinned_arm: str | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint == "completions" and self.prompt is None:
            raise ValueError("a completions request needs a prompt")
        if self.endpoint == "chat" and self.messages is None and self.prompt is None:
            raise ValueError("a chat request needs messages or a prompt")

    @property
    def path(self) -> str:
        return ENDPOINT_PATHS[self.endpoint]

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            # the only place the real output token count comes from; chunks are not tokens
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM extension: exact output lengths
        if self.endpoint == "completions":
            body["prompt"] = self.prompt
        else:
            body["messages"] = (
                list(self.messages) if self.messages is not None else [{"role": "user", "content": self.prompt}]
            )
        body.update(self.extra_body)
        return body


@dataclass(frozen=True)
class RecordLabels:
    """What the sender knows about a request before sending it."""

    request_id: str
    tag: str
    worker: str
    dataset_index: int | None = None
    scheduled_at: float | None = None


@dataclass(frozen=True)
class StreamOutcome:
    """What the SSE events of one response say, timed from the send."""

    ttft_s: float | None
    chunks: int
    output_tokens: int | None
    prompt_tokens: int | None
    finish_reason: str | None
    saw_done: bool
    error: str | None


@dataclass(frozen=True)
class StreamResult:
    record: RequestRecord
    response_bytes: int


def _carries_output(choice: Mapping[str, Any], endpoint: Endpoint) -> bool:
    """Whether a choice chunk stands for generated tokens (one engine step).

    Empty text still counts: a step whose tokens decode to no text yet (half a UTF-8
    character, or the EOS token on the finish chunk) produced tokens all the same. The
    chat role announcement ({"role": "assistant", "content": ""}) produced none.
    """
    if endpoint == "completions":
        return "text" in choice
    delta = choice.get("delta") or {}
    has_text = any(delta.get(key) for key in ("content", "reasoning_content", "reasoning", "tool_calls"))
    if has_text:
        return True
    if "role" in delta:
        return False
    return "content" in delta or choice.get("finish_reason") is not None


def summarise_events(events: Sequence[TimedEvent], started_s: float, endpoint: Endpoint) -> StreamOutcome:
    """Interpret the events of an OpenAI completion stream (parsing happens here, after the reads)."""
    ttft_s: float | None = None
    chunks = 0
    usage: Mapping[str, Any] | None = None
    finish_reason: str | None = None
    saw_done = False
    error: str | None = None
    for event in events:
        if event.data.strip() == "[DONE]":
            saw_done = True
            continue
        try:
            payload = json.loads(event.data)
        except ValueError:
            error = error or f"unparseable SSE data: {event.data[:ERROR_TEXT_LIMIT]!r}"
            continue
        if not isinstance(payload, dict):
            error = error or f"unexpected SSE data: {event.data[:ERROR_TEXT_LIMIT]!r}"
            continue
        if payload.get("error"):
            # vLLM reports failures inside a 200 stream as a data event with an "error" object
            detail = payload["error"]
            message = detail.get("message", detail) if isinstance(detail, dict) else detail
            error = error or f"server error in stream: {str(message)[:ERROR_TEXT_LIMIT]}"
            continue
        if payload.get("usage"):
            usage = payload["usage"]
        choices = payload.get("choices") or []
        if not choices:
            continue
        choice = choices[0]
        if _carries_output(choice, endpoint):
            chunks += 1
            if ttft_s is None:
                ttft_s = event.received_s - started_s
        if choice.get("finish_reason") is not None:
            finish_reason = choice["finish_reason"]
    output_tokens = usage.get("completion_tokens") if usage else None
    prompt_tokens = usage.get("prompt_tokens") if usage else None
    if error is None and not saw_done:
        error = "stream ended before [DONE]" if events else "no SSE events in the response"
    return StreamOutcome(
        ttft_s=ttft_s,
        chunks=chunks,
        output_tokens=int(output_tokens) if output_tokens is not None else None,
        prompt_tokens=int(prompt_tokens) if prompt_tokens is not None else None,
        finish_reason=finish_reason,
        saw_done=saw_done,
        error=error,
    )


def _header(response: Any, name: str) -> str | None:
    value = response.get(name)
    if isinstance(value, list):  # a repeated header: the first is the one a proxy set
        value = value[0] if value else None
    return value or None


class OpenAIStreamClient:
    """One connection's worth of streaming client for one Locust user (or a test).

    `base_url` may carry a path prefix (http://host:8000/prefix). Requests on one client
    run one at a time, like the user they belong to.
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0, connect_timeout_s: float = 10.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) base URL: {base_url!r}")
        self.base_url = base_url
        self._path_prefix = parts.path.rstrip("/")
        self._http = HTTPClient.from_url(
            base_url,
            concurrency=1,
            network_timeout=timeout_s,
            connection_timeout=min(connect_timeout_s, timeout_s),
            insecure=True,
        )

    def close(self) -> None:
        self._http.close()

    def first_model(self) -> str:
        """The first model the server lists (what a request without a model name should use)."""
        response = self._http.get(self._path_prefix + "/v1/models")
        body = response.read()
        if response.status_code != 200:
            raise RuntimeError(f"GET /v1/models answered HTTP {response.status_code}: {body[:ERROR_TEXT_LIMIT]!r}")
        models = json.loads(body).get("data") or []
        if not models:
            raise RuntimeError(f"{self.base_url} serves no models")
        return str(models[0]["id"])

    def stream(
        self,
        request: StreamRequest,
        labels: RecordLabels,
        on_cancelled: Callable[[RequestRecord], None] | None = None,
    ) -> StreamResult:
        """Send one streaming request, read it to the end, and describe it as a record.

        Never raises for request failures (they become records with ok=False). If the
        greenlet is killed mid-request (the test stopping), the partial request is handed
        to `on_cancelled` as a cancelled record before the kill proceeds, so a request
        that was sent is never silently lost.
        """
        payload = json.dumps(request.body()).encode("utf-8")
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "X-Request-Id": labels.request_id,
        }
        if request.pinned_arm:
            headers[ARM_HEADER] = request.pinned_arm

        timed_lines: list[tuple[float, bytes]] = []
        status = 0
        arm: str | None = None
        replica: str | None = None
        transport_error: str | None = None
        response = None
        sent_at = time.time()
        started_s = time.perf_counter()
        ended_s = started_s
        try:
            response = self._http.request("POST", self._path_prefix + request.path, body=payload, headers=headers)
            status = response.status_code
            arm = _header(response, ARM_HEADER)
            replica = _header(response, REPLICA_HEADER)
            if status != 200:
                detail = response.read()
                ended_s = time.perf_counter()
                transport_error = f"HTTP {status}: {detail[:ERROR_TEXT_LIMIT].decode('utf-8', 'replace')}"
            else:
                # the timed loop: read, stamp, keep; nothing else happens between reads
                readline = response.readline
                append = timed_lines.append
                clock = time.perf_counter
                while True:
                    line = readline(b"\n")
                    now = clock()
                    if not line:
                        break
                    append((now, line))
                    ended_s = now
                if not timed_lines:
                    ended_s = time.perf_counter()
        except GreenletExit:
            cancelled = self._record(
                request, labels, sent_at, started_s, time.perf_counter(), timed_lines, status, arm, replica,
                transport_error="cancelled: the load test stopped during the request", cancelled=True,
            )
            if on_cancelled is not None:
                on_cancelled(cancelled)
            raise
        except Exception as exc:  # connection refused, timeouts, resets: a failed request, not a crash
            ended_s = time.perf_counter()
            transport_error = f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_LIMIT]
        finally:
            if response is not None:
                # returns a finished connection to the pool, closes a half-read one
                response.release()
        record = self._record(
            request, labels, sent_at, started_s, ended_s, timed_lines, status, arm, replica, transport_error
        )
        return StreamResult(record=record, response_bytes=sum(len(line) for _, line in timed_lines))

    @staticmethod
    def _record(
        request: StreamRequest,
        labels: RecordLabels,
        sent_at: float,
        started_s: float,
        ended_s: float,
        timed_lines: list[tuple[float, bytes]],
        status: int,
        arm: str | None,
        replica: str | None,
        transport_error: str | None,
        cancelled: bool = False,
    ) -> RequestRecord:
        outcome = summarise_events(parse_events(timed_lines), started_s, request.endpoint)
        error = transport_error or outcome.error
        return RequestRecord(
            request_id=labels.request_id,
            tag=labels.tag,
            worker=labels.worker,
            endpoint=request.endpoint,
            arm=arm,
            replica=replica,
            pinned_arm=request.pinned_arm,
            dataset_index=labels.dataset_index,
            scheduled_at=labels.scheduled_at,
            sent_at=sent_at,
            ttft_s=outcome.ttft_s,
            e2e_s=ended_s - started_s,
            output_tokens=outcome.output_tokens,
            prompt_tokens=outcome.prompt_tokens,
            requested_max_tokens=request.max_tokens,
            chunks=outcome.chunks,
            finish_reason=outcome.finish_reason,
            ok=status == 200 and error is None,
            status=status,
            error=error,
            cancelled=cancelled,
        )
