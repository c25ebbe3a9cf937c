"""The signals that end a run, and the teardown they must not cut short.

SIGINT (Ctrl-C), SIGTERM (`ray job stop`, a CI cancel, a pod deletion) and SIGHUP (a closed
terminal or ssh session) all end a run the same way: the first one raises `Interrupted` (a
KeyboardInterrupt) in the main thread; the controller then puts the traffic back on the stable
config, tears the fleet down, records the error and exits 130. A signal that arrives while the
controller tears down (`shielded()`) is said in one line and otherwise ignored: a second Ctrl-C
or a supervisor's repeated SIGTERM must not leave GPUs reserved or traffic on the canary.
SIGKILL is what stops a teardown at once.

`ray.init` installs Ray's own handlers over the driver's (a Python one that exits, a C++ one that
dumps a stack and dies without teardown): `install()` also registers itself to run again after
every `ray.init` of this process (Ray's post-init hooks), so the run's handlers are the ones in
force for the whole run.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_INTERRUPTED = 130  # what a shell reports for Ctrl-C; every signal that ends a run exits with it


class Interrupted(KeyboardInterrupt):
    """The run was told to stop by a signal; `signal_name` says which (SIGTERM, SIGINT, SIGHUP)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class Interrupts:
    """The process's run-ending signals: the first raises Interrupted, later ones (or any while
    shielded) are noted and ignored."""

    def __init__(self) -> None:
        self.received: str | None = None  # the first signal's name
        self._shield = 0
        self._hooked = False
        self._ignored: set[int] | None = None  # ignored when the process started (nohup, a background job)

    def install(self) -> None:
        """Handle SIGINT, SIGTERM and SIGHUP here, now and after every later ray.init (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if self._ignored is None:  # `nohup` means SIGHUP does not end the run; a background job ignores SIGINT
            self._ignored = {sig for sig in SIGNALS if signal.getsignal(sig) == signal.SIG_IGN}
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN if sig in self._ignored else self._on_signal)
        if not self._hooked:
            self._hooked = True
            try:
                from ray._private import worker

                worker._post_init_hooks.append(self.install)
            except (ImportError, AttributeError):  # a Ray without the list: tests/test_signals.py fails
                pass

    def _on_signal(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None or self._shield:
            self.received = self.received or name
            print(f"mtp-canary: {name} received while the run ends: teardown goes on (SIGKILL stops it at once)",
                  file=sys.stderr, flush=True)
            return
        self.received = name
        raise Interrupted(name)

    @contextmanager
    def shielded(self) -> Iterator[None]:
        """While inside, a signal does not interrupt (the teardown and the run's record)."""
        self._shield += 1
        try:
            yield
        finally:
            self._shield -= 1


# one per process: signal handlers are the process's
INTERRUPTS = Interrupts()
