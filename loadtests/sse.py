"""Server-sent events: splitting timestamped bytes from the socket into timed events.

The transport reads and stamps (when the read's bytes arrived: loadtests/openai_stream.py);
the bytes are parsed after their stamp, never between a read and its stamp. The decoder is incremental: a
streaming client feeds each read as it arrives, so the parsing cost is spread over the
stream instead of landing at its end (where the ends of many streams at once would
stall the reads of the others and bend their timestamps). Its buffers are bounded
(MAX_LINE_BYTES, MAX_EVENT_BYTES): a hostile stream fails the request, never the process.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


# A line or an event beyond these is not an OpenAI stream's (a chunk is a few hundred bytes):
# a server that never sends a line end must not grow the buffer without bound
MAX_LINE_BYTES = 1 << 20
MAX_EVENT_BYTES = 4 << 20


class SseTooLarge(ValueError):
    """A line or an event of the stream is longer than an OpenAI stream's ever is."""


class TimedEvent(NamedTuple):
    """One SSE event and the perf_counter time of the read that completed its data."""

    received_s: float
    data: str


class SseDecoder:
    """Incremental SSE decoding: `feed(read time, bytes)` pieces cut anywhere, `close()` at the end.

    Follows the SSE format: lines end in LF, CRLF or CR; a blank line ends an event;
    `data:` lines join with newlines; comments (`:`) and other fields are skipped. An
    event is stamped with the time its last data line was complete, i.e. when a client
    could first have used it. A last event without its blank line is kept by `close()`,
    since some servers close the stream right after it.
    """

    __slots__ = ("_pending", "_data_lines", "_data_time", "_last_time")

    def __init__(self) -> None:
        self._pending = b""
        self._data_lines: list[bytes] = []
        self._data_time = 0.0
        self._last_time = 0.0

    @property
    def idle(self) -> bool:
        """Between events: no partial line or event waits for more bytes."""
        return not self._pending and not self._data_lines

    def feed(self, read_time: float, piece: bytes) -> list[TimedEvent]:
        self._last_time = read_time
        if (
            not self._pending
            and not self._data_lines
            and piece.startswith(b"data: ")
            and piece.endswith(b"\n\n")
            and piece.count(b"\n") == 2
            and b"\r" not in piece
        ):  # the usual read: exactly one whole one-line event
            return [TimedEvent(read_time, piece[6:-2].decode("utf-8", "replace"))]
        pending = self._pending + piece if self._pending else piece
        if b"\r" in pending:
            lines = pending.splitlines(keepends=True)
            # a trailing line without its terminator (or a lone CR that may be half of a
            # CRLF) waits for the next piece
            if lines and (not lines[-1].endswith((b"\n", b"\r")) or lines[-1].endswith(b"\r")):
                self._pending = lines.pop()
            else:
                self._pending = b""
            lines = [line.rstrip(b"\r\n") for line in lines]
        else:  # LF only, as vLLM and OpenAI send: one split
            lines = pending.split(b"\n")
            self._pending = lines.pop()  # b"" when the piece ended with its LF
        if len(self._pending) > MAX_LINE_BYTES:
            raise SseTooLarge(f"an SSE line ran past {MAX_LINE_BYTES} bytes without a line end")
        events: list[TimedEvent] = []
        data_lines = self._data_lines
        for line in lines:
            if not line:
                if data_lines:
                    events.append(TimedEvent(self._data_time, b"\n".join(data_lines).decode("utf-8", "replace")))
                    data_lines = self._data_lines = []
            elif line.startswith(b"data:"):
                data_lines.append(line[6:] if line.startswith(b"data: ") else line[5:])
                self._data_time = read_time
                if len(data_lines) > 1 and sum(map(len, data_lines)) > MAX_EVENT_BYTES:
                    raise SseTooLarge(f"an SSE event ran past {MAX_EVENT_BYTES} bytes without its blank line")
            # comments (":") and the event/id/retry fields carry nothing an OpenAI stream needs
        return events

    def close(self) -> list[TimedEvent]:
        """The end of the stream: a last event that lacked its blank line (or its line end)."""
        last = self._pending.rstrip(b"\r\n")
        self._pending = b""
        if last.startswith(b"data:"):
            self._data_lines.append(last[6:] if last.startswith(b"data: ") else last[5:])
            self._data_time = self._last_time
        events = []
        if self._data_lines:
            events.append(TimedEvent(self._data_time, b"\n".join(self._data_lines).decode("utf-8", "replace")))
            self._data_lines = []
        return events


def parse_events(pieces: Iterable[tuple[float, bytes]]) -> list[TimedEvent]:
    """Split (read time, bytes) pieces, cut anywhere, into SSE events (see `SseDecoder`)."""
    decoder = SseDecoder()
    events: list[TimedEvent] = []
    for read_time, piece in pieces:
        events += decoder.feed(read_time, piece)
    return events + decoder.close()
