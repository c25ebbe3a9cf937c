"""After its first output chunk a stream is read once per few chunks (the socket's receive
low-water mark), and its timings stay those of the bytes' arrival: TTFT the first output
chunk's, E2E the last segment's, whether several events share a read, an event is split
across reads, the tail is shorter than the mark, or the connection serves another request.
The server is a thread of this process writing scripted bytes at known perf_counter times."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtests import openai_stream  # noqa: E402
from loadtests.openai_stream import OpenAIStreamClient, RecordLabels, StreamReader, StreamRequest  # noqa: E402

pytestmark = pytest.mark.skipif(openai_stream._SO_TIMESTAMPNS is None or openai_stream._SO_RCVLOWAT is None,
                                reason="no kernel receive stamps or low-water mark on this platform")

HEADERS = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
TOLERANCE_S = 0.004  # loopback, kernel stamps: the client's error is well under a millisecond when quiet
# the request's own trip (client send -> this server's thread reading it): milliseconds on a busy
# box; far below the 100 ms a first chunk held back by a raised mark would be late
TRIP_S = 0.030


def sse(payload) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def http_chunk(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(body), body)


def completion(text: str, finish: str | None = None) -> bytes:
    return sse({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": None})


def usage(tokens: int) -> bytes:
    return sse({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [],
                "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}})


TERMINATOR = b"0\r\n\r\n"


@dataclass
class Script:
    """One answer: (seconds after the request arrived, bytes) writes; the send time of each is kept."""

    writes: list[tuple[float, bytes]]
    sent: list[float] = field(default_factory=list)
    arrived: float = 0.0


class ScriptedServer:
    """Serves one scripted answer per request, in order, on keep-alive connections."""

    def __init__(self, scripts: list[Script]) -> None:
        self.scripts = list(scripts)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        pending = list(self.scripts)
        try:
            while pending:
                connection, _ = self._listener.accept()
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # every write its own segment
                with connection:
                    while pending and self._answer(connection, pending[0]):
                        pending.pop(0)
        except OSError:
            return  # the test closed the listener or the client its connection

    @staticmethod
    def _answer(connection: socket.socket, script: Script) -> bool:
        request = b""
        while b"\r\n\r\n" not in request:
            piece = connection.recv(65536)
            if not piece:
                return False
            request += piece
        head, body = request.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += connection.recv(65536)
        script.arrived = time.perf_counter()
        for offset, data in script.writes:
            delay = script.arrived + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            script.sent.append(time.perf_counter())  # before the write: the bytes arrive after this
            connection.sendall(data)
        return True

    def close(self) -> None:
        self._listener.close()


def ordinary_answer(tokens_per_chunk: int = 4, n_chunks: int = 24, first_gap_s: float = 0.010,
                    tail: bytes | None = None, tail_in_one_write: bool = False) -> tuple[Script, int]:
    """Headers, the first chunk (one token) at 40 ms, then 4-token chunks every 10 ms (first_gap_s
    after the first one): two events in one write at chunk 6, one event split across two writes
    2 ms apart at chunk 12; the finish chunk, the usage chunk + [DONE], the terminator 1 ms apart
    (or in one write). Returns the script and the output tokens."""
    text = " tok" * tokens_per_chunk
    writes: list[tuple[float, bytes]] = [(0.0, HEADERS), (0.040, http_chunk(completion(" tok")))]
    at = 0.040 + first_gap_s
    chunk = 1
    while chunk < n_chunks:
        if chunk == 6:  # two events, one HTTP chunk, one write
            writes.append((at, http_chunk(completion(text) + completion(text))))
            chunk += 2
        elif chunk == 12:  # one event in two writes
            whole = http_chunk(completion(text))
            writes += [(at - 0.002, whole[:40]), (at, whole[40:])]
            chunk += 1
        else:
            writes.append((at, http_chunk(completion(text))))
            chunk += 1
        at += 0.010
    tokens = 1 + (n_chunks - 1) * tokens_per_chunk
    if tail is None:
        writes += [(at, http_chunk(completion(text, "length"))), (at + 0.001, http_chunk(usage(tokens + 4)) +
                   http_chunk(sse("[DONE]"))), (at + 0.002, TERMINATOR)]
        if tail_in_one_write:  # the read that ends the response holds ordinary chunks' worth and more
            writes[-3:] = [(at, b"".join(data for _, data in writes[-3:]))]
        tokens += 4
    else:
        writes += [(at, tail)]
    return Script(writes), tokens


def request(max_tokens: int = 256) -> StreamRequest:
    return StreamRequest(endpoint="completions", model="m", max_tokens=max_tokens, prompt="x")


def labels(number: int) -> RecordLabels:
    return RecordLabels(request_id=f"batched-{number}", tag="test", worker="pytest")


@pytest.fixture
def reads(monkeypatch):
    """How many times each stream's reader was fed (one feed per socket read that brought body bytes)."""
    counted: list[int] = []
    feed = StreamReader.feed

    def counting_feed(self, *args, **kwargs):
        counted.append(id(self))
        return feed(self, *args, **kwargs)

    monkeypatch.setattr(StreamReader, "feed", counting_feed)
    return counted


def assert_timed_right(record, script: Script) -> None:
    """TTFT at the first output chunk's send, E2E at the terminator's (the last write's), from the
    request's arrival: the client's stamps are later by the request's own trip, the same for both."""
    assert record.ok, record.error
    first_sent = next(sent for sent, (_, data) in zip(script.sent, script.writes) if b'"text"' in data)
    server_ttft = first_sent - script.arrived
    server_e2e = script.sent[-1] - script.arrived
    trip_s = record.ttft_s - server_ttft
    assert 0.0 <= trip_s < TRIP_S, (record.ttft_s, server_ttft)
    assert record.e2e_s - server_e2e == pytest.approx(trip_s, abs=TOLERANCE_S), (record.e2e_s, server_e2e, trip_s)
    # hence TPOT = (E2E - TTFT) / (tokens - 1) is the send-side span's, within the tolerance
    assert (record.e2e_s - record.ttft_s) == pytest.approx(server_e2e - server_ttft, abs=TOLERANCE_S)


def stream_one(script: Script, timeout_s: float):
    """One request against a server that plays `script`: its record and the wall time the client took."""
    server = ScriptedServer([script])
    client = OpenAIStreamClient(server.url, timeout_s=timeout_s)
    try:
        started = time.perf_counter()
        record = client.stream(request(), labels(0)).record
        return record, time.perf_counter() - started
    finally:
        client.close()
        server.close()


def test_a_stream_is_read_once_per_few_chunks_and_timed_as_it_arrived(reads):
    """Two requests on one connection: the low-water mark is raised after the first output chunk
    (fewer reads than chunks) and back to one byte at the end (the first answer ends in a read
    made under the raised mark), so the second answer's headers and first chunk, 100 ms before
    its next, are read (and stamped) when they come."""
    first, tokens = ordinary_answer(tail_in_one_write=True)
    second, _ = ordinary_answer(first_gap_s=0.100)
    server = ScriptedServer([first, second])
    client = OpenAIStreamClient(server.url, timeout_s=5.0)
    try:
        records = [client.stream(request(), labels(n)).record for n in range(2)]
    finally:
        client.close()
        server.close()
    for record, script in zip(records, (first, second)):
        assert_timed_right(record, script)
        assert (record.chunks, record.output_tokens, record.finish_reason) == (25, tokens, "length")
    # 25 output chunks + the tail per answer; one read per chunk would be ~26 each
    assert len(reads) <= 2 * 18, f"{len(reads)} reads for 2 x 25 chunks: not batched"


def test_a_tail_shorter_than_the_mark_is_read_when_the_watchdog_lowers_it(reads):
    """An answer that ends with [DONE] alone (no finish chunk, no usage): the tail is below the
    mark, so it waits in the socket until the watchdog takes the mark down; E2E is still its
    arrival (the last segment's stamp), and the wait is bounded."""
    tail = http_chunk(sse("[DONE]")) + TERMINATOR
    script, _ = ordinary_answer(tail=tail)
    record, took_s = stream_one(script, timeout_s=5.0)
    assert_timed_right(record, script)
    assert record.output_tokens is None and record.chunks == 24
    assert took_s < record.e2e_s + openai_stream.BATCH_FLUSH_AFTER_S + 2 * openai_stream.BATCH_CHECK_S + 0.1


def test_a_trickle_below_the_mark_is_bytes_arriving_not_a_read_timeout():
    """Mid-stream, one byte every 100 ms for 1.5 s against a 0.6 s read timeout: bytes keep
    arriving, so the request must not time out, though each byte is far below the mark."""
    script, tokens = ordinary_answer(n_chunks=8)
    *body, tail_finish, tail_usage, terminator = script.writes
    last_at = body[-1][0]
    partial = http_chunk(completion(" tok tok tok tok"))
    trickle = [(last_at + 0.1 * (i + 1), partial[i:i + 1]) for i in range(15)]
    rest_at = trickle[-1][0] + 0.01
    script.writes = body + trickle + [(rest_at + 0.005, partial[15:]), (rest_at + 0.010, tail_finish[1]),
                                      (rest_at + 0.011, tail_usage[1]), (rest_at + 0.012, terminator[1])]
    record, _ = stream_one(script, timeout_s=0.6)
    assert_timed_right(record, script)
    assert (record.chunks, record.output_tokens) == (10, tokens)  # 8, the trickled one, the finish; usage's count


def test_a_stream_that_goes_quiet_below_the_mark_still_times_out():
    """Mid-stream, half a chunk and then nothing: the read timeout ends the request, about on time."""
    script, _ = ordinary_answer(n_chunks=8)
    body = [write for write in script.writes if b'"finish_reason":"length"' not in write[1]][:8]
    half = http_chunk(completion(" tok tok tok tok"))[:30]
    script.writes = body + [(body[-1][0] + 0.010, half), (body[-1][0] + 5.0, b"")]
    record, took_s = stream_one(script, timeout_s=0.6)
    assert not record.ok and "read timeout" in (record.error or ""), record.error
    assert took_s < 0.2 + 0.6 + 0.6  # the last bytes, the timeout, the watchdog's period (a quarter of it) and slack
