"""A lease: the run's actors outlive a dead controller only as long as it keeps renewing.

Replica, router and load actors of a run are detached (so a controller killed with
kill -9 can be resumed by another process), which also means nothing stops them if
nobody resumes. Each holds a `Lease`: the controller renews it every few seconds
(`renew_lease` on the actor); once the lease lapses the actor runs its clean-up
(stop the server) and ends its own process. A lease that was never renewed never
lapses, so actors created without one (tests, `keep_fleet`) behave as before.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

_CHECK_S = 1.0


class Lease:
    """Ends this process `seconds` after the last `renew(seconds)`, after `on_lapse()`."""

    def __init__(self, holder: str, on_lapse: Callable[[], None] | None = None) -> None:
        self.holder = holder
        self._on_lapse = on_lapse
        self._deadline: float | None = None
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def renew(self, seconds: float) -> float:
        """Push the deadline to now + seconds (returns seconds)."""
        if seconds <= 0:
            raise ValueError(f"a lease must be renewed for a positive time, got {seconds}")
        with self._lock:
            self._deadline = time.monotonic() + seconds
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name=f"lease-{self.holder}", daemon=True)
                self._watcher.start()
        return seconds

    def release(self) -> None:
        """No deadline any more (the owner ended the run properly)."""
        with self._lock:
            self._deadline = None

    def remaining_s(self) -> float | None:
        with self._lock:
            return None if self._deadline is None else self._deadline - time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(_CHECK_S)
            left = self.remaining_s()
            if left is not None and left <= 0:
                break
        print(f"mtp-canary: lease of {self.holder} lapsed (no controller renewed it): stopping", file=sys.stderr, flush=True)
        try:
            if self._on_lapse is not None:
                self._on_lapse()
        finally:
            # The actor ends with its process; Ray marks it dead (max_restarts=0) and frees its name.
            os._exit(0)
