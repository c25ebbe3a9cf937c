"""A run's progress: bars on a terminal, plain lines elsewhere, nothing of a line lost to markup."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from rollout.run.progress_display import PlainProgress, TerminalProgress, progress_for, wants_bars
from rollout.run.context import RunContext

REPO = Path(__file__).resolve().parent.parent


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_bars_and_every_line_verbatim():
    out = io.StringIO()
    display = TerminalProgress(Console(file=out, force_terminal=True, width=120, color_system=None))
    # brackets that rich markup would eat ("[bold]") or misread ("[12:00:01]")
    display("[12:00:01] fleet: canary-0 starting (40 s) | [bold]INFO[/bold] loading")
    display.advance("accuracy items", 64, 128)
    display.advance("accuracy items", 128, 128)
    display.advance("replicas ready", 1, 2)
    display.close()
    text = out.getvalue()
    assert "[12:00:01] fleet: canary-0 starting (40 s) | [bold]INFO[/bold] loading" in text
    assert "accuracy items" in text and "128/128" in text
    assert "replicas ready" in text and "1/2" in text


def test_a_count_beyond_its_total_or_a_zero_total_still_draws():
    out = io.StringIO()
    display = TerminalProgress(Console(file=out, force_terminal=True, width=100, color_system=None))
    display.advance("experiment requests (fewest arm)", 450, 400)  # the last look can pass the plan
    display.advance("sweep 1,2 (s)", 0, 0)
    display.close()
    assert "400/400" in out.getvalue() and "0/1" in out.getvalue()


def test_a_pipe_gets_plain_lines_and_no_bar():
    out = io.StringIO()
    display = PlainProgress(out)
    display("[12:00:01] accuracy: 64/128 items")
    display.advance("accuracy items", 64, 128)
    display.close()
    assert out.getvalue() == "[12:00:01] accuracy: 64/128 items\n"


def test_bars_only_where_a_terminal_can_draw_them():
    assert not wants_bars(io.StringIO(), {"TERM": "xterm"})
    assert wants_bars(FakeTerminal(), {"TERM": "xterm"})
    assert not wants_bars(FakeTerminal(), {"TERM": "dumb"})
    assert not wants_bars(FakeTerminal(), {"TERM": "xterm", "MTP_CANARY_PLAIN_PROGRESS": "1"})
    closed = io.StringIO()
    closed.close()
    assert not wants_bars(closed, {})
    assert isinstance(progress_for(io.StringIO()), PlainProgress)


def test_the_run_context_ticks_only_a_display_that_draws():
    lines: list[str] = []

    class Recording(PlainProgress):
        ticks: list[tuple[str, int, int]] = []

        def __call__(self, message: str) -> None:
            lines.append(message)

        def advance(self, task: str, done: int, total: int) -> None:
            self.ticks.append((task, done, total))

    def context(progress) -> RunContext:
        return RunContext(cfg=None, run_id="r", run_dir=Path("."), store=None, result=None, progress=progress,
                          cache_dir=Path("."), point=None, namespace="n")

    recording = Recording()
    ctx = context(recording)
    ctx.tick("accuracy items", 32, 128)
    ctx.say("accuracy: 32/128 items")
    assert recording.ticks == [("accuracy items", 32, 128)]
    assert lines[-1].endswith("] accuracy: 32/128 items")
    context(lines.append).tick("accuracy items", 64, 128)  # a plain callable: no bar, no error
    assert len(lines) == 1


def test_the_cli_draws_bars_on_a_terminal_and_lines_in_a_pipe():
    """The same command, its stdout once a pseudo-terminal and once a pipe."""
    script = (
        "from rollout.commands.run import progress_display\n"
        "d = progress_display()\n"
        "d('[00:00:00] fleet: starting 2 replica(s)')\n"
        "d.advance('replicas ready', 2, 2)\n"
        "d.close()\n"
        "print(type(d).__name__)\n"
    )
    env = {**os.environ, "TERM": "xterm", "PYTHONPATH": str(REPO)}
    env.pop("MTP_CANARY_PLAIN_PROGRESS", None)
    piped = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == "[00:00:00] fleet: starting 2 replica(s)\nPlainProgress\n"

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=follower, stderr=subprocess.PIPE)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    shown = b"".join(chunks).decode(errors="replace")
    assert "TerminalProgress" in shown and "replicas ready" in shown and "2/2" in shown
    assert "[00:00:00] fleet: starting 2 replica(s)" in shown
