"""A streaming request to an OpenAI-compatible server (vLLM, the router) and its record.

The HTTP client is geventhttpclient: cooperative sockets without monkey patching and a C
response parser (HTTP framing, chunked encoding). Its `read(n)` waits for n bytes, which
would delay every chunk, and `readline()` runs a Python loop per line; the stream is
instead read one socket read at a time (`_read_body`) and each read's bytes go to an
incremental `StreamReader` as they arrive.

Times are when the bytes reached this host: the kernel stamps every arriving segment
(SO_TIMESTAMPNS) and a read's time is taken from that stamp, so neither the gevent loop
(other streams' chunks handled first) nor a CPU shared with other processes bends TTFT
or E2E (see `_read_body` for the limits).

CPU is what limits how much load one worker core offers, so the read path is lean:
one read per arriving chunk until the first output chunk, then one read per few chunks
(the socket's receive low-water mark: `_read_body`), no per-read timer (a timer per socket
read cost more than the rest of the read), one watchdog greenlet per process that cuts a
stream off when it waited longer than its timeout for its next bytes, and no JSON parse
for ordinary mid-stream chunks (`StreamReader.feed`).
"""

from __future__ import annotations

import json
import os
import platform
import socket as _socket
import struct
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import gevent
from gevent import GreenletExit
from gevent.socket import socket as _GeventSocket
from gevent.socket import wait as wait_on_watcher
from geventhttpclient import HTTPClient

from loadtests.options import BEARER_TOKEN_ENV
from loadtests.records import Endpoint, RequestRecord
from loadtests.sse import SseDecoder, TimedEvent

ARM_HEADER = "x-mtp-canary-arm"
REPLICA_HEADER = "x-mtp-canary-replica"
ARM_NAME_LIMIT = 64  # an arm's name is a config key; a longer header is not the router's

ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}

# How much of an error body a record keeps: enough to read the cause, not a page of HTML.
ERROR_TEXT_LIMIT = 300
SERVER_ID_LIMIT = 200  # a server-chosen string kept in every record: bounded
MAX_HISTOGRAM_BINS = 65  # an acceptance histogram has k + 1 bins; no MTP or EAGLE config drafts 64 tokens
# the most bytes one socket read takes
_READ_SIZE = 65536
# kernel receive stamps: a struct timespec per read in the read's ancillary data. Python
# names neither constant; Linux's generic value (x86, ARM, RISC-V, POWER, s390) is 35
_SO_TIMESTAMPNS = getattr(_socket, "SO_TIMESTAMPNS", None) or (
    35 if sys.platform == "linux" and platform.machine() in
    ("x86_64", "aarch64", "arm64", "armv7l", "riscv64", "ppc64le", "s390x") else None
)
_SCM_TIMESTAMPNS = getattr(_socket, "SCM_TIMESTAMPNS", None) or _SO_TIMESTAMPNS
_TIMESPEC = struct.Struct("@qq")
# the receive low-water mark: the socket reads as readable once this many bytes wait (Linux: 18)
_SO_RCVLOWAT = getattr(_socket, "SO_RCVLOWAT", None)
# after the first output chunk a stream is read once per this many ordinary chunks' bytes: the
# stream's tail (finish chunk, usage chunk, [DONE]) is about two chunks, so its end is never held
BATCHED_CHUNKS = 2
# a batched stream that brought no read for this long is read chunk by chunk again (a slow
# stream, a tail shorter than the mark); the watchdog checks this often while any is batched
BATCH_FLUSH_AFTER_S = 0.25
BATCH_CHECK_S = 0.05
_ANCILLARY_SIZE = _socket.CMSG_SPACE(_TIMESPEC.size) if hasattr(_socket, "CMSG_SPACE") else 0
_wall_clock = time.time


class StreamTimeout(Exception):
    """A request waited longer than its timeout for its next bytes."""


class ResponseTooLarge(ValueError):
    """A response carried more bytes than its request could need."""


# a response's bytes may reach this many per requested token (a chunk is a few hundred bytes),
# and at least RESPONSE_FLOOR_BYTES: an endless body fails its request instead of running on
RESPONSE_BYTES_PER_TOKEN = 8192
RESPONSE_FLOOR_BYTES = 1 << 20


class _Watch:
    __slots__ = ("socket", "timeout_s", "last_read_s", "expired", "batched", "unbatched")

    def __init__(self, socket: Any, timeout_s: float, now: float) -> None:
        self.socket = socket
        self.timeout_s = timeout_s
        self.last_read_s = now
        self.expired = False
        self.batched = False  # its socket's low-water mark is above one byte
        self.unbatched = False  # the watchdog took the mark down: chunk by chunk to its end


def _set_low_water(socket: Any, n_bytes: int) -> bool:
    """Set a gevent socket's receive low-water mark (its real socket's); False if it is closed."""
    try:
        socket._sock.setsockopt(_socket.SOL_SOCKET, _SO_RCVLOWAT, n_bytes)
    except OSError:
        return False
    return True


class _IdleWatchdog:
    """One greenlet per process that closes the socket of a stream that waited longer than
    its timeout for bytes (the reader then fails with a read timeout). Streams register
    while their body is read and stamp `last_read_s` at every read.

    It also takes down the low-water mark of a batched stream that brought no read for
    BATCH_FLUSH_AFTER_S (or a quarter of its timeout): bytes below the mark wait unread, so
    a slow stream or a short tail is read chunk by chunk from then on, and a trickle below
    the mark is still bytes arriving, never a read timeout."""

    def __init__(self) -> None:
        self._watches: set[_Watch] = set()
        self._greenlet: gevent.Greenlet | None = None

    def watch(self, socket: Any, timeout_s: float, now: float) -> _Watch:
        watch = _Watch(socket, timeout_s, now)
        self._watches.add(watch)
        if self._greenlet is None or self._greenlet.dead:
            self._greenlet = gevent.spawn(self._run)
        return watch

    def unwatch(self, watch: _Watch) -> None:
        self._watches.discard(watch)

    def _run(self) -> None:
        while self._watches:
            period = min(1.0, min(w.timeout_s for w in self._watches) / 4)
            if any(w.batched for w in self._watches):
                period = min(period, BATCH_CHECK_S)
            gevent.sleep(period)
            now = time.perf_counter()
            for watch in list(self._watches):
                idle_s = now - watch.last_read_s
                if idle_s > watch.timeout_s:
                    watch.expired = True
                    self._watches.discard(watch)
                    try:
                        watch.socket.close()  # gevent wakes the reader with an error
                    except OSError:
                        pass
                elif watch.batched and idle_s > min(BATCH_FLUSH_AFTER_S, watch.timeout_s / 4):
                    watch.batched, watch.unbatched = False, True
                    _set_low_water(watch.socket, 1)  # the kernel signals readable if a byte waits


_watchdog = _IdleWatchdog()


def _enable_receive_stamps(raw: Any) -> bool:
    """Ask the kernel to stamp the bytes it receives on this socket (SO_TIMESTAMPNS)."""
    if _SO_TIMESTAMPNS is None or not _ANCILLARY_SIZE:
        return False
    try:
        raw.setsockopt(_socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def _kernel_stamp(ancillary: list[tuple[int, int, bytes]], floor: float, clock: Callable[[], float]) -> float | None:
    """The `clock` (perf_counter) time at which the kernel received the bytes of a read,
    from the read's SCM_TIMESTAMPNS (a wall-clock time): `clock()` now less how long ago
    that was on the wall clock, read right after it. Never before `floor` (the previous
    stamp, or the send) nor after now; None when the read brought no stamp."""
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == _SCM_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
            seconds, nanoseconds = _TIMESPEC.unpack_from(data)
            now = clock()
            ago = _wall_clock() - (seconds + nanoseconds * 1e-9)
            if ago <= 0.0:
                return now
            stamp = now - ago
            return stamp if stamp > floor else floor
    return None


# A read's time is when its bytes reached this host. On a plain TCP socket the kernel stamps each
# arriving segment (SO_TIMESTAMPNS), and the stamp of the read is `clock()` right after it less how
# long its bytes sat in the socket: a busy generator (other streams' chunks handled first, a gevent
# loop iteration, a CPU shared with other processes) does not bend TTFT or E2E. Without kernel
# stamps (TLS, other platforms) it is `clock()` right after the read.
#
# The kernel's stamp of a TCP read is that of its last segment: right for the end of a stream, but
# a read that came late (the generator stalled longer than a token's time) holds several chunks.
# So while the reader has not seen its first output chunk, a read is also stamped with its first
# segment's arrival, which a one-byte MSG_PEEK reports: one more syscall for the first read or two.
# (Small segments that wait in a socket may be merged by the kernel, which keeps the newest stamp:
# after a stall longer than the gap between two chunks, TTFT can get the later chunk's time, never
# the read's.) Only the stamps that are used become times: the reads until the first output chunk
# (TTFT) and the one that ends the response (E2E); the others get `clock()`.
def _read_stamps(first_ancillary: list | None, last_ancillary: list | None, now: float, floor: float,
                 clock: Callable[[], float]) -> tuple[float, float, float]:
    """(start, end, new floor) of one read from the kernel's stamps of its first segment (a peek,
    when asked) and of its last (the read that ends the response); `now` where a stamp is missing."""
    start_s = end_s = now
    first_stamp = _kernel_stamp(first_ancillary, floor, clock) if first_ancillary is not None else None
    if first_stamp is not None:
        start_s = floor = first_stamp
    last_stamp = _kernel_stamp(last_ancillary, floor, clock) if last_ancillary is not None else None
    if last_stamp is not None:
        end_s = last_stamp
        if first_stamp is None:
            start_s = last_stamp
    return start_s, end_s, floor


def _read_mode(socket: Any) -> tuple[Any, bool]:
    """How a body is read from this socket: (the watcher to wait on for readability or None,
    whether the real socket is read directly with the kernel's receive stamps)."""
    # wait for readability before reading: a stream's next chunk is rarely there yet, and
    # gevent's recv would first try the read and fail with EAGAIN (a syscall and an exception)
    plain = type(socket) is _GeventSocket
    # TLS: no wait on the raw socket (decrypted bytes may already sit in the TLS layer); its recv
    # blocks this greenlet only (gevent), and the watchdog's close ends it
    readable = socket._read_event if plain else None
    # a plain gevent TCP socket: read its real socket directly (after the wait, the read
    # does not block), with the kernel's receive stamps; anything else (TLS) through gevent
    return readable, plain and _enable_receive_stamps(socket._sock)


# Reads after the first output chunk: `batch_bytes()`, asked after each read, is how many bytes
# should wait before the next (the socket's low-water mark, on a stamped socket only): one while
# the first output chunk is awaited (TTFT is its first segment's stamp) and once the stream's end
# is in sight; a few chunks' worth in between, where no read's time is used, so a stream wakes its
# greenlet once per few chunks instead of once per chunk. The read that ends the response still
# carries its last segment's stamp (E2E), however many chunks it holds. The mark is back to one
# byte when the body ends: the connection serves the next request.
def _read_body(response: Any, on_read: Callable[[float, bytes, float], None], timeout_s: float,
               clock: Callable[[], float], sent_s: float | None = None,
               stamp_first_bytes: Callable[[], bool] | None = None,
               batch_bytes: Callable[[], int] | None = None) -> None:
    """Read a response body to its end, one socket read at a time, handing each read's
    body bytes and when they arrived (start, end: perf_counter) to `on_read`. Uses the response's
    parser state (geventhttpclient HTTPSocketResponse: `_body_buffer`, `_sock`, `feed`).

    A read's time is when its bytes reached this host, not when this greenlet got round to
    reading them (the kernel's receive stamps: the comment above `_read_stamps`), so a busy
    generator does not bend TTFT or E2E. Body bytes that came with the headers are stamped
    when the headers were parsed. `batch_bytes`: the comment above."""
    buffer = response._body_buffer
    if buffer:  # body bytes that came with the headers
        now = clock()
        data = bytes(buffer)
        del buffer[:]
        on_read(now, data, now)
    if response.message_complete:
        return
    socket = response._sock
    if socket is None:
        raise ConnectionError("the connection closed before the end of the response")
    feed = response.feed
    readable, stamped = _read_mode(socket)
    recv = socket.recv
    floor = sent_s if sent_s is not None else clock()  # no byte of the answer arrived before
    watch = _watchdog.watch(socket, timeout_s, clock())
    ancillary: list[tuple[int, int, bytes]] = []
    first_ancillary: list[tuple[int, int, bytes]] = []
    if not stamped or _SO_RCVLOWAT is None:
        batch_bytes = None
    low_water = 1
    try:
        while True:
            first = stamp_first_bytes is not None and stamp_first_bytes()
            try:
                if readable is not None:
                    wait_on_watcher(readable)
                if stamped:
                    # gevent swaps in a closed stand-in when the watchdog closes it: read it anew
                    raw = socket._sock
                    if first:  # the stamp of the oldest segment waiting, then the read
                        _data, first_ancillary, _flags, _address = raw.recvmsg(1, _ANCILLARY_SIZE, _socket.MSG_PEEK)
                    data, ancillary, _flags, _address = raw.recvmsg(_READ_SIZE, _ANCILLARY_SIZE)
                else:
                    data = recv(_READ_SIZE)
            except BlockingIOError:
                continue  # woken without bytes after all: wait again
            except OSError:
                if watch.expired:
                    raise StreamTimeout(f"no bytes for {timeout_s:g}s (read timeout)") from None
                raise
            now = clock()
            watch.last_read_s = now
            feed(data)  # parses the framing; the body lands in the buffer
            complete = response.message_complete
            start_s = end_s = now  # when the read's first and last bytes arrived
            if stamped and (first or complete):
                start_s, end_s, floor = _read_stamps(first_ancillary if first else None,
                                                     ancillary if complete else None, now, floor, clock)
            if buffer or complete:  # (the end alone, chunked encoding's last chunk, is the stream's end too)
                body = bytes(buffer)
                del buffer[:]
                on_read(start_s, body, end_s)
            if complete:
                return
            if not data:
                raise ConnectionError("the connection closed before the end of the response")
            if batch_bytes is not None and not watch.unbatched:
                wanted = batch_bytes()
                if wanted != low_water and _set_low_water(socket, wanted):
                    low_water = wanted
                    watch.batched = wanted > 1
    finally:
        _watchdog.unwatch(watch)
        if watch.batched:
            watch.batched = False
            _set_low_water(socket, 1)


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
    level: float | None = None
    session: int | None = None
    turn: int | None = None


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
    server_request_id: str | None = None
    acceptance_histogram: tuple[int, ...] | None = None
    draft_tokens: int | None = None


def _spec_decode_of(metrics: Any) -> tuple[tuple[int, ...], int] | None:
    """(acceptance histogram, draft tokens) of a final chunk's `metrics.speculative_decoding` (vLLM's
    per-request spec-decode metrics), or None where it is absent or not that shape (never trusted half)."""
    spec = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if not isinstance(spec, dict):
        return None
    histogram, drafted = spec.get("acceptance_histogram"), spec.get("num_draft_tokens")
    if not isinstance(histogram, list) or not histogram or len(histogram) > MAX_HISTOGRAM_BINS:
        return None
    if not all(type(n) is int and n >= 0 for n in histogram) or type(drafted) is not int or drafted < 0:
        return None
    return tuple(histogram), drafted


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


# where the generated text sits in an output chunk, as vLLM and OpenAI write it
_TEXT_SLOTS: dict[str, bytes] = {"completions": b'"text":"', "chat": b'"content":"'}


def _chunk_template(data: str, slot: bytes) -> tuple[bytes, bytes, int] | None:
    """An output chunk's bytes as one read brings them (`data: {...}` and a blank line),
    cut around its text: (before the text, after it, their length together). None when
    the text slot is not one plain string value."""
    raw = f"data: {data}\n\n".encode("utf-8")
    if raw.count(slot) != 1:
        return None
    start = raw.index(slot) + len(slot)
    end = raw.find(b'"', start)
    if end < 0 or any(c in raw[start:end] for c in (b"\\", b"\n", b"\r")):
        return None
    return raw[:start], raw[end:], start + len(raw) - end


def _ordinary_chunks(data: bytes, template: tuple[bytes, bytes, int]) -> tuple[int, bytes]:
    """How many whole ordinary output chunks (see `StreamReader.feed`) a read that starts at an
    event's start begins with, and the bytes from the first other event on (b"" when none).
    An ordinary chunk holds no blank line (its JSON escapes line ends), so the events of a
    read are its pieces between blank lines."""
    before, after, least = template
    closing = after[:-2]  # the template's end without its blank line
    pieces = data.split(b"\n\n")
    tail = pieces.pop()  # after the last blank line: b"" or the start of the next event
    count = 0
    for piece in pieces:
        if len(piece) + 2 < least or not piece.startswith(before) or not piece.endswith(closing):
            break
        text = piece[len(before):len(piece) - len(closing)]
        if b'"' in text or b"\n" in text or b"\r" in text or text.endswith(b"\\"):
            break
        count += 1
    if count == len(pieces) and not tail:
        return count, b""
    return count, b"\n\n".join(pieces[count:] + [tail])


class StreamReader:
    """Reads an OpenAI completion stream as it arrives: `feed(read time, bytes)` per socket
    read (right after its stamp), `outcome()` at the end. Counts the chunks that carry
    output, times the first, and keeps usage, finish reason and errors. `batch_bytes()` says
    how many bytes the next read may wait for (see `_read_body`)."""

    __slots__ = ("_started_s", "_endpoint", "_decoder", "_template", "ttft_s", "chunks", "usage", "finish_reason",
                 "saw_done", "error", "events", "bytes", "last_read_s", "server_request_id", "spec_decode",
                 "_max_bytes", "_low_water")

    def __init__(self, started_s: float, endpoint: Endpoint, max_bytes: int | None = None) -> None:
        self._max_bytes = max_bytes
        self._started_s = started_s
        self._endpoint = endpoint
        self._decoder = SseDecoder()
        # an ordinary output chunk of this stream, cut around its text (see `feed`)
        self._template: tuple[bytes, bytes, int] | None = None
        self.ttft_s: float | None = None
        self.chunks = 0
        self.usage: Mapping[str, Any] | None = None
        self.finish_reason: str | None = None
        self.saw_done = False
        self.error: str | None = None
        self.events = 0
        self.bytes = 0
        self.last_read_s: float | None = None
        # the id the server gave the request (vLLM: "cmpl-" + the X-Request-Id it was sent),
        # from the first chunk, which is always parsed: the key to join with server traces
        self.server_request_id: str | None = None
        # (acceptance histogram, draft tokens) from the final usage chunk, where the server sends them
        self.spec_decode: tuple[tuple[int, ...], int] | None = None
        # bytes the next read may wait for: 1 until the first ordinary output chunk, and again once
        # an event other than an ordinary chunk (the finish, usage, [DONE], an error) came
        self._low_water = 1

    def feed(self, read_s: float, data: bytes, end_s: float | None = None) -> None:
        """One read's bytes: `read_s` when they (the first of them) arrived, `end_s` when
        the last did (the same when not given)."""
        self.bytes += len(data)
        if self._max_bytes is not None and self.bytes > self._max_bytes:
            raise ResponseTooLarge(f"the response ran past {self._max_bytes} bytes (more than its max_tokens could need)")
        self.last_read_s = read_s if end_s is None else end_s
        # The usual read mid-stream is whole events: output chunks like the stream's first
        # ordinary one (one choice, output, no finish reason, no usage, no error), byte for
        # byte but for their text. Such chunks are counted without a JSON parse: the text
        # between the template's two parts holds no quote, no line end and ends in no
        # backslash, so it is all one JSON string and the chunk parses like the template.
        # The rest of the read (from the first other event on) goes through the SSE decoder
        # and the parser. (Their read times matter no more: TTFT is already taken.)
        template = self._template
        if template is not None and len(data) >= template[2] and self._decoder.idle:
            counted, data = _ordinary_chunks(data, template)
            self.events += counted
            self.chunks += counted
            if not data:
                return
        for event in self._decoder.feed(read_s, data):
            self.add(event)

    def batch_bytes(self) -> int:
        """How many bytes the next read may wait for: a few ordinary chunks' worth between the
        first output chunk and the first sign of the stream's end, else one."""
        return self._low_water

    def awaits_output(self) -> bool:
        """No output chunk yet: the next read may carry the first (the one TTFT is timed by)."""
        return self.ttft_s is None

    def add(self, event: TimedEvent) -> None:
        self.events += 1
        data = event.data
        if data == "[DONE]" or data.strip() == "[DONE]":
            self.saw_done = True
            self._low_water = 1
            return
        try:
            payload = json.loads(data)
        except ValueError:
            self.error = self.error or f"unparseable SSE data: {data[:ERROR_TEXT_LIMIT]!r}"
            self._low_water = 1
            return
        if not isinstance(payload, dict):
            self.error = self.error or f"unexpected SSE data: {data[:ERROR_TEXT_LIMIT]!r}"
            self._low_water = 1
            return
        if payload.get("error") or payload.get("usage") or not payload.get("choices"):
            self._low_water = 1  # the end is in sight: read every byte as it comes
        if self.server_request_id is None and isinstance(payload.get("id"), str):
            self.server_request_id = payload["id"][:SERVER_ID_LIMIT]
        if payload.get("error"):
            # vLLM reports failures inside a 200 stream as a data event with an "error" object
            detail = payload["error"]
            message = detail.get("message", detail) if isinstance(detail, dict) else detail
            self.error = self.error or f"server error in stream: {str(message)[:ERROR_TEXT_LIMIT]}"
            return
        usage = payload.get("usage")
        if usage:
            self.usage = usage
            if "metrics" in payload:
                self.spec_decode = _spec_decode_of(payload["metrics"]) or self.spec_decode
        choices = payload.get("choices")
        if not choices:
            return
        choice = choices[0]
        carries_output = _carries_output(choice, self._endpoint)
        if carries_output:
            self.chunks += 1
            if self.ttft_s is None:
                self.ttft_s = event.received_s - self._started_s
        finish_reason = choice.get("finish_reason")
        if finish_reason is not None:
            self.finish_reason = finish_reason
            self._low_water = 1
        elif self._template is None and carries_output and not usage and len(choices) == 1:
            if self._endpoint == "completions":
                plain = isinstance(choice.get("text"), str)
            else:  # (a chat delta with a role is output only when its text is not empty)
                delta = choice.get("delta") or {}
                plain = isinstance(delta.get("content"), str) and "role" not in delta
            if plain:
                self._template = _chunk_template(data, _TEXT_SLOTS[self._endpoint])
                if self._template is not None and not self.saw_done and self.error is None:
                    # the event's bytes on the wire: its SSE line and blank line, its HTTP chunk header
                    self._low_water = BATCHED_CHUNKS * (len(data) + 16)

    def outcome(self) -> StreamOutcome:
        """What the stream said (call once, at its end: a last event without its blank line counts)."""
        for event in self._decoder.close():
            self.add(event)
        usage = self.usage
        output_tokens = usage.get("completion_tokens") if usage else None
        prompt_tokens = usage.get("prompt_tokens") if usage else None
        error = self.error
        if error is None and not self.saw_done:
            error = "stream ended before [DONE]" if self.events else "no SSE events in the response"
        return StreamOutcome(
            ttft_s=self.ttft_s,
            chunks=self.chunks,
            output_tokens=int(output_tokens) if output_tokens is not None else None,
            prompt_tokens=int(prompt_tokens) if prompt_tokens is not None else None,
            finish_reason=self.finish_reason,
            saw_done=self.saw_done,
            error=error,
            server_request_id=self.server_request_id,
            acceptance_histogram=self.spec_decode[0] if self.spec_decode else None,
            draft_tokens=self.spec_decode[1] if self.spec_decode else None,
        )


def summarise_events(events: Sequence[TimedEvent], started_s: float, endpoint: Endpoint) -> StreamOutcome:
    """Interpret the events of an OpenAI completion stream."""
    reader = StreamReader(started_s, endpoint)
    for event in events:
        reader.add(event)
    return reader.outcome()


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

    def __init__(self, base_url: str, timeout_s: float = 600.0, connect_timeout_s: float = 10.0,
                 deadline_s: float | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) base URL: {base_url!r}")
        self.base_url = base_url
        self._path_prefix = parts.path.rstrip("/")
        self._timeout_s = timeout_s
        # the whole request's limit: the per-read timeout alone lets a trickle run forever
        self._deadline_s = deadline_s
        token = os.environ.get(BEARER_TOKEN_ENV)
        self._bearer = f"Bearer {token}" if token else None
        self._http = HTTPClient.from_url(
            base_url,
            concurrency=1,
            # no per-read timer: the headers wait under one gevent.Timeout, the body under the watchdog
            network_timeout=None,
            connection_timeout=min(connect_timeout_s, timeout_s),
            # TLS is verified (certificate and host name): the router token travels in these requests;
            # a private CA is given as SSL_CERT_FILE, as for Python's own clients
            insecure=False,
            **({"ssl_options": {"ca_certs": os.environ["SSL_CERT_FILE"]}}
               if parts.scheme == "https" and os.environ.get("SSL_CERT_FILE") else {}),
        )

    def close(self) -> None:
        self._http.close()

    def first_model(self) -> str:
        """The first model the server lists (what a request without a model name should use)."""
        with gevent.Timeout(self._timeout_s, StreamTimeout(f"GET /v1/models: no answer in {self._timeout_s:g}s")):
            response = self._http.get(self._path_prefix + "/v1/models")
            body = response.read(RESPONSE_FLOOR_BYTES)
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
        if self._bearer:
            headers["Authorization"] = self._bearer

        status = 0
        arm: str | None = None
        replica: str | None = None
        transport_error: str | None = None
        response = None
        sent_at = time.time()
        started_s = time.perf_counter()
        ended_s = started_s
        reader = StreamReader(started_s, request.endpoint,
                              max_bytes=max(RESPONSE_FLOOR_BYTES, request.max_tokens * RESPONSE_BYTES_PER_TOKEN))
        timeout_s = self._timeout_s
        deadline = gevent.Timeout(self._deadline_s, StreamTimeout(f"the request ran past its {self._deadline_s:g}s "
                                                                  "deadline")) if self._deadline_s else None
        try:
            if deadline is not None:
                deadline.start()
            with gevent.Timeout(timeout_s, StreamTimeout(f"no response headers in {timeout_s:g}s")):
                response = self._http.request("POST", self._path_prefix + request.path, body=payload, headers=headers)
            status = response.status_code
            arm = _header(response, ARM_HEADER)
            replica = _header(response, REPLICA_HEADER)
            if status != 200:
                with gevent.Timeout(timeout_s, StreamTimeout(f"no error body in {timeout_s:g}s")):
                    detail = response.read(ERROR_TEXT_LIMIT)  # the rest is never read: the connection closes
                ended_s = time.perf_counter()
                transport_error = f"HTTP {status}: {detail[:ERROR_TEXT_LIMIT].decode('utf-8', 'replace')}"
            else:
                # the timed loop: read, stamp, then parse what the read brought
                _read_body(response, reader.feed, timeout_s, time.perf_counter, started_s, reader.awaits_output,
                           reader.batch_bytes)
                ended_s = reader.last_read_s if reader.last_read_s is not None else time.perf_counter()
        except GreenletExit:
            cancelled = self._record(
                request, labels, sent_at, started_s, time.perf_counter(), reader, status, arm, replica,
                transport_error="cancelled: the load test stopped during the request", cancelled=True,
            )
            if on_cancelled is not None:
                on_cancelled(cancelled)
            raise
        except Exception as exc:  # connection refused, timeouts, resets: a failed request, not a crash
            # (gevent.Timeout is not an Exception: the ones raised here carry a StreamTimeout)
            ended_s = time.perf_counter()
            transport_error = f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_LIMIT]
        finally:
            if deadline is not None:
                deadline.close()
            if response is not None:
                # returns a finished connection to the pool, closes a half-read one
                response.release()
        record = self._record(request, labels, sent_at, started_s, ended_s, reader, status, arm, replica, transport_error)
        return StreamResult(record=record, response_bytes=reader.bytes)

    @staticmethod
    def _record(
        request: StreamRequest,
        labels: RecordLabels,
        sent_at: float,
        started_s: float,
        ended_s: float,
        reader: StreamReader,
        status: int,
        arm: str | None,
        replica: str | None,
        transport_error: str | None,
        cancelled: bool = False,
    ) -> RequestRecord:
        outcome = reader.outcome()
        error = transport_error or outcome.error
        if arm is not None and len(arm) > ARM_NAME_LIMIT:
            error, arm = error or f"the response's {ARM_HEADER} header is {len(arm)} characters long", None
        if request.pinned_arm and arm is not None and arm != request.pinned_arm:
            # the router serves a pinned request from that arm only: a response that names another
            # came from something else (a forged server), and its timings belong to no arm
            error = error or f"the response names arm {arm!r}, the request was pinned to {request.pinned_arm!r}"
            arm = request.pinned_arm
        return RequestRecord(
            request_id=labels.request_id,
            server_request_id=outcome.server_request_id,
            tag=labels.tag,
            worker=labels.worker,
            endpoint=request.endpoint,
            arm=arm,
            replica=replica,
            pinned_arm=request.pinned_arm,
            dataset_index=labels.dataset_index,
            session=labels.session,
            turn=labels.turn,
            level=labels.level,
            scheduled_at=labels.scheduled_at,
            sent_at=sent_at,
            ttft_s=outcome.ttft_s,
            e2e_s=ended_s - started_s,
            output_tokens=outcome.output_tokens,
            prompt_tokens=outcome.prompt_tokens,
            requested_max_tokens=request.max_tokens,
            chunks=outcome.chunks,
            finish_reason=outcome.finish_reason,
            acceptance_histogram=list(outcome.acceptance_histogram) if outcome.acceptance_histogram else None,
            draft_tokens=outcome.draft_tokens,
            ok=status == 200 and error is None,
            status=status,
            error=error,
            cancelled=cancelled,
        )
