"""A bounded HTTP response body: read within a byte cap and a total deadline.

A replica (or an `endpoints:` server) may be broken or hostile: a body that never ends, or one
that trickles a byte at a time (each read within its timeout, the whole forever). Every client
of a replica that reads a body (the /metrics scrape, the preflight's smoke request, the accuracy
evals) reads it here, so none of them can hang the run or fill its memory.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class BodyLimitError(ValueError):
    """A body past its byte cap or its deadline (the message says which)."""


class BodyDeadlineError(BodyLimitError):
    """A body not whole by its deadline, or cancelled (its phase past its own)."""


def read_bounded(response: Any, max_bytes: int, deadline_s: float, started: float | None = None,
                 cancelled: threading.Event | None = None) -> bytes:
    """The body of a `requests` response opened with stream=True; BodyLimitError past `max_bytes`,
    `deadline_s` after `started` (a monotonic time; None: now), or once `cancelled` is set (a phase
    past its own deadline). Each read still waits at most the request's own timeout, so a server
    that sends nothing at all ends at that timeout."""
    started = time.monotonic() if started is None else started
    body = bytearray()
    while True:
        piece = response.raw.read1(1 << 16)  # what one read brings, not a full 64 KiB
        if not piece:
            return bytes(body)
        if cancelled is not None and cancelled.is_set():
            raise BodyDeadlineError("the read was cancelled")
        body += piece
        if len(body) > max_bytes:
            raise BodyLimitError(f"the body ran past {max_bytes} bytes")
        if time.monotonic() - started > deadline_s:
            raise BodyDeadlineError(f"the body took longer than {deadline_s:g} s")
