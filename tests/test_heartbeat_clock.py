"""Liveness of a controller on another host when the wall clocks disagree: a forward step of the
reader's clock (or a skew between hosts) past `lease_s` must not make a live controller look dead,
or `resume` starts a second controller on its fleet. The reader's clock is injected
(rollout.run.store.wall_clock), never the machine's; the controller's beats come from a thread.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from rollout.run import store as store_module
from rollout.commands.cli import main
from rollout.config import load_config
from rollout.run.store import RunStore, run_controller_alive
from tests.conftest import REPO

AWAY = "other-host.invalid:77"


@pytest.fixture
def away_run(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "HEARTBEAT_S", 0.3)  # the watch lasts two beats: short here
    store = RunStore(tmp_path / "history.db")
    config = load_config(REPO / "configs" / "local-cpu.yaml").model_dump(mode="json")
    store.create_run("r-away", "demo", "m", config)
    store.update_run("r-away", controller=AWAY)
    return store


def beating(store: RunStore, stop: threading.Event) -> threading.Thread:
    def beat() -> None:
        own = RunStore(store.path)
        while not stop.wait(0.2):
            own.heartbeat("r-away")
        own.close()

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return thread


def test_a_clock_stepped_past_the_lease_does_not_make_a_beating_controller_look_dead(away_run, monkeypatch, capsys):
    # stepped forward by a day: far past any lease_s
    monkeypatch.setattr(store_module, "wall_clock", lambda: time.time() + 86400)
    stop = threading.Event()
    thread = beating(away_run, stop)
    try:
        time.sleep(0.5)
        run = away_run.run("r-away")
        assert run_controller_alive(run) is False  # by the wall clocks alone it looks gone
        assert run_controller_alive(run, away_run) is True  # its beats move on this process's clock
        assert main(["resume", "r-away", "--runs-dir", str(away_run.path.parent)]) == 2
        assert f"still controlled by {AWAY} (alive)" in capsys.readouterr().err
        assert away_run.run("r-away")["controller"] == AWAY  # not taken over
    finally:
        stop.set()
        thread.join()


def test_a_silent_controller_on_another_host_is_gone_after_its_beats_stop(away_run):
    away_run.heartbeat("r-away")
    away_run.update_run("r-away", heartbeat_at=time.time() - 3600)
    started = time.monotonic()
    assert run_controller_alive(away_run.run("r-away"), away_run) is False
    assert time.monotonic() - started >= 0.6  # watched for two beats before calling it gone


def test_status_watch_does_not_call_a_beating_controller_gone_when_the_clock_steps(away_run, monkeypatch, capsys):
    monkeypatch.setattr(store_module, "wall_clock", lambda: time.time() + 86400)
    stop = threading.Event()
    thread = beating(away_run, stop)
    decided = threading.Timer(3.0, lambda: RunStore(away_run.path).finish_run(
        "r-away", status="done", decision="rollback", exit_code=3, reason="guard failed"))
    decided.start()
    try:
        code = main(["status", "r-away", "--runs-dir", str(away_run.path.parent), "--watch", "--interval-s", "0.2"])
    finally:
        stop.set()
        thread.join()
        decided.join()
    assert code == 3  # it watched until the run decided, not exit 1 for a "gone" controller


def test_one_shot_status_does_not_call_a_beating_controller_gone_when_the_clock_steps(away_run, monkeypatch, capsys):
    monkeypatch.setattr(store_module, "wall_clock", lambda: time.time() + 86400)
    stop = threading.Event()
    thread = beating(away_run, stop)
    try:
        time.sleep(0.5)
        assert main(["status", "r-away", "--runs-dir", str(away_run.path.parent), "--json"]) == 0
    finally:
        stop.set()
        thread.join()
    out = capsys.readouterr().out
    assert json.loads(out)["controller_alive"] is True  # its beats moved on this process's clock


def test_one_shot_status_calls_a_silent_controller_on_another_host_gone(away_run, capsys):
    away_run.heartbeat("r-away")
    away_run.update_run("r-away", heartbeat_at=time.time() - 3600)
    assert main(["status", "r-away", "--runs-dir", str(away_run.path.parent)]) == 0
    assert f"controller {AWAY} is gone" in capsys.readouterr().out
