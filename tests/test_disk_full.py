"""A full disk under the runs directory, before and after the decision is committed: the store,
decision.json, the final line, the exit code and the webhook agree, the weight hook ends at 0 on an
error, and no temporary file is left.

A real small tmpfs (needs the right to mount: root, as in the CI container), the real controller
around stand-in phases, the CLI's own end (`_drive`), a real webhook receiver on loopback.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from rollout.commands import run as run_command
from rollout.run import controller as controller_module
from rollout.config import WeightHookConfig, load_config
from rollout.run.controller import Controller
from rollout.run.store import RunStore
from tests.conftest import REPO, tmpfs_mount
from tests.faults.endpoint_run import HOOK
from tests.test_controller import Promotes


@pytest.fixture(autouse=True)
def own_signals():
    """rollout.commands.run.drive installs the run's signal handlers (rollout.run.interrupts): pytest's come back after."""
    from ray._private import worker

    from rollout.run.interrupts import INTERRUPTS, SIGNALS

    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    hooks = list(worker._post_init_hooks)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    worker._post_init_hooks[:] = hooks
    INTERRUPTS.received = None
    INTERRUPTS._hooked = False


@pytest.fixture
def small_disk(tmp_path):
    yield from tmpfs_mount(tmp_path, "4m")


def fill(directory) -> None:
    """Write a ballast file until the filesystem is full."""
    fd = os.open(directory / "ballast", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (65536, 4096, 1):  # to the last byte
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


@pytest.fixture
def webhook():
    bodies: list[dict] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", bodies
    server.shutdown()


class FillsTheDisk:
    name = "progressive"

    def __init__(self, directory) -> None:
        self.directory = directory

    def enabled(self, ctx) -> bool:
        return True

    def run(self, ctx) -> None:
        fill(self.directory)


def controller(tmp_path, runs, url, monkeypatch, *phases) -> Controller:
    script = tmp_path / "hook.py"
    script.write_text(HOOK)
    config = load_config(REPO / "configs/local-cpu.yaml").model_copy(update={
        "weight_hook": WeightHookConfig(command=[sys.executable, str(script), "{weight}", str(tmp_path / "hook.log")]),
        "webhook_url": url})
    monkeypatch.setattr(controller_module, "PHASES", phases)
    return Controller(config, runs_dir=runs, run_id="r1", progress=print)


def final_line(out: str) -> str:
    return [line for line in out.splitlines() if line.startswith("mtp-canary: exit_code=")][-1]


def test_a_full_disk_before_the_decision_commit_is_an_error_in_every_record(
        tmp_path, small_disk, webhook, monkeypatch, capsys):
    url, bodies = webhook
    code = run_command.drive(controller(tmp_path, small_disk, url, monkeypatch, Promotes(), FillsTheDisk(small_disk)))
    out = capsys.readouterr()
    assert code == 1
    assert final_line(out.out) == f"mtp-canary: exit_code=1 decision=error run_dir={small_disk / 'r1'}"
    assert "mtp-canary: error: the run's end could not be recorded: OSError: [Errno 28] No space left on device" in out.err
    store = RunStore(small_disk / "history.db")
    run = store.run("r1")
    assert run["decision"] is None and run["status"] != "done"  # error, or running under a gone controller
    assert store.stable(run["model"]) is None
    decision = small_disk / "r1" / "decision.json"
    assert not decision.exists() or json.loads(decision.read_text())["exit_code"] == 1
    assert [(b["decision"], b["exit_code"]) for b in bodies] == [(None, 1)]
    assert "No space left on device" in bodies[0]["error"]
    assert (tmp_path / "hook.log").read_text().split()[-1:] == ["0"]
    assert not list((small_disk / "r1").glob(".*.tmp-*"))


def test_a_full_disk_after_the_decision_commit_keeps_the_decision_everywhere(
        tmp_path, small_disk, webhook, monkeypatch, capsys):
    url, bodies = webhook
    real = controller_module.RunStore.finish_run

    def finish_then_full(self, *args, **kwargs):
        real(self, *args, **kwargs)
        fill(small_disk)

    monkeypatch.setattr(controller_module.RunStore, "finish_run", finish_then_full)
    code = run_command.drive(controller(tmp_path, small_disk, url, monkeypatch, Promotes()))
    out = capsys.readouterr()
    assert code == 0
    assert final_line(out.out) == f"mtp-canary: exit_code=0 decision=promote run_dir={small_disk / 'r1'}"
    store = RunStore(small_disk / "history.db")
    run = store.run("r1")
    assert (run["status"], run["decision"], run["exit_code"]) == ("done", "promote", 0)
    assert store.stable(run["model"])["run_id"] == "r1"
    assert json.loads((small_disk / "r1" / "decision.json").read_text())["decision"] == "promote"
    assert [(b["decision"], b["exit_code"]) for b in bodies] == [("promote", 0)]
    assert "report: the reports beside decision.json not written" in out.out
    assert not (tmp_path / "hook.log").exists()  # a decided run's weights are the phases' own
    assert not list((small_disk / "r1").glob(".*.tmp-*"))


def test_a_pipeline_copy_that_fails_leaves_the_file_it_replaces_whole(tmp_path, small_disk):
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    (run_dir / "decision.json").write_text(json.dumps({"decision": "rollback", "pad": "x" * 200_000}))
    out = small_disk / "decision.json"
    out.write_text('{"decision": "promote"}')  # the pipeline's copy from an earlier run
    fill(small_disk)
    assert run_command.copy_out(run_dir, {"decision.json": out}) is False
    assert json.loads(out.read_text()) == {"decision": "promote"}  # whole, never a truncated half
    assert sorted(p.name for p in small_disk.iterdir()) == ["ballast", "decision.json"]  # no temporary file
