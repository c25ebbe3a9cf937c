"""How a run's progress reaches the person who started it: live bars where the output is a
terminal, plain lines where it is not (a pipeline's log, `ray job submit`, a file).

Phases say what happens in lines (`RunContext.say`) and, where work has a size, where it stands
(`RunContext.tick(task, done, total)`: replicas ready, accuracy items, the experiment's requests
against its plan, progressive steps, sweep levels). `PlainProgress` prints the lines and drops
the ticks, because every phase already says its counts in its lines, so a log loses nothing.
`TerminalProgress` prints the same lines above one rich bar per task (rich: a well-kept library,
and one vLLM and Ray already bring).

Lines are printed as text, never as rich markup: a run's messages carry brackets (timestamps,
replica logs) that markup would swallow or misread.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Protocol, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text


class RunProgress(Protocol):
    """What a run reports its progress to: a line, and a task's position."""

    def __call__(self, message: str) -> None: ...

    def advance(self, task: str, done: int, total: int) -> None: ...

    def close(self) -> None: ...


class PlainProgress:
    """One line per message, flushed at once (a pipeline's log shows it as it happens)."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream

    def __call__(self, message: str) -> None:
        print(message, file=self.stream or sys.stdout, flush=True)

    def advance(self, task: str, done: int, total: int) -> None:
        """Nothing: the phase's own line already says the count."""

    def close(self) -> None:
        pass


class TerminalProgress:
    """The run's lines, scrolling above a live bar per task; a task's bar stays when it is done."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console()
        self.bars = Progress(
            TextColumn("{task.description}", markup=False),  # a task name is text, as lines are
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.tasks: dict[str, TaskID] = {}
        self._lock = threading.Lock()  # the fleet's watcher and the phase thread both report
        self._started = False

    def __call__(self, message: str) -> None:
        self.console.print(Text(message), soft_wrap=True, highlight=False)

    def advance(self, task: str, done: int, total: int) -> None:
        total = max(int(total), 1)
        done = min(max(int(done), 0), total)
        with self._lock:
            if not self._started:
                self.bars.start()
                self._started = True
            if task not in self.tasks:
                self.tasks[task] = self.bars.add_task(task, total=total, completed=done)
            else:
                self.bars.update(self.tasks[task], total=total, completed=done)

    def close(self) -> None:
        with self._lock:
            if self._started:
                self.bars.stop()
                self._started = False


def wants_bars(stream: TextIO, environ: dict[str, str] | None = None) -> bool:
    """Bars only on an interactive terminal that can draw them: not a pipe or file, not
    TERM=dumb, not where MTP_CANARY_PLAIN_PROGRESS is set (a terminal recorded to a log)."""
    env = os.environ if environ is None else environ
    try:
        interactive = stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real stream
        return False
    return interactive and env.get("TERM", "") != "dumb" and not env.get("MTP_CANARY_PLAIN_PROGRESS")


def progress_for(stream: TextIO | None = None) -> RunProgress:
    """The display a command should report to on this stream (stdout by default)."""
    stream = stream or sys.stdout
    if wants_bars(stream):
        return TerminalProgress(Console(file=stream))
    return PlainProgress(stream)
