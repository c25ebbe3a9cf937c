"""Server-sent events: splitting timestamped bytes from the socket into timed events.

The transport only reads and timestamps (perf_counter at the read); this module parses
afterwards, so parsing cost never sits between a byte's arrival and its timestamp.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TimedEvent:
    """One SSE event and the perf_counter time of the read that completed its data."""

    received_s: float
    data: str


def parse_events(pieces: Iterable[tuple[float, bytes]]) -> list[TimedEvent]:
    """Split (read time, bytes) pieces, cut anywhere, into SSE events.

    Follows the SSE format: lines end in LF, CRLF or CR; a blank line ends an event;
    `data:` lines join with newlines; comments (`:`) and other fields are skipped. An
    event is stamped with the time its last data line was complete, i.e. when a client
    could first have used it. A last event without its blank line is kept, since some
    servers close the stream right after it.
    """
    events: list[TimedEvent] = []
    pending = b""
    data_lines: list[bytes] = []
    data_time = 0.0
    read_time = 0.0
    for read_time, piece in pieces:
        pending += piece
        lines = pending.splitlines(keepends=True)
        # a trailing line without its terminator (or a lone CR that may be half of a CRLF)
        # waits for the next piece
        if lines and (not lines[-1].endswith((b"\n", b"\r")) or lines[-1].endswith(b"\r")):
            pending = lines.pop()
        else:
            pending = b""
        for raw in lines:
            line = raw.rstrip(b"\r\n")
            if not line:
                if data_lines:
                    events.append(TimedEvent(data_time, b"\n".join(data_lines).decode("utf-8", "replace")))
                    data_lines = []
                continue
            if line.startswith(b"data:"):
                value = line[5:]
                data_lines.append(value[1:] if value.startswith(b" ") else value)
                data_time = read_time
            # comments (":") and the event/id/retry fields carry nothing an OpenAI stream needs
    if pending.rstrip(b"\r\n").startswith(b"data:"):
        value = pending.rstrip(b"\r\n")[5:]
        data_lines.append(value[1:] if value.startswith(b" ") else value)
        data_time = read_time
    if data_lines:
        events.append(TimedEvent(data_time, b"\n".join(data_lines).decode("utf-8", "replace")))
    return events
