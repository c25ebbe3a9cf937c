"""Every exit puts the traffic back on the stable config: signals, a dead router, a store that fails.

The real controller around stand-in phases (as in test_controller.py), a real weight hook (a
script appending each weight it is given to a file) and real signals sent to this process; the
whole `mtp-canary run` under SIGTERM is in tests/faults/test_controller_faults.py.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import ray

from rollout.run import controller as controller_module
from rollout.config import WeightHookConfig, load_config
from rollout.run.controller import Controller
from rollout.run.interrupts import INTERRUPTS, SIGNALS, Interrupted, Interrupts
from rollout.run.context import InfrastructureError
from rollout.run.store import RunStore
from tests.conftest import REPO
from tests.faults.endpoint_run import HOOK


@pytest.fixture
def run_signals():
    """The run's handlers (rollout.run.interrupts) in this process for one test, pytest's back after it.
    Not INTERRUPTS.install(): that also hooks every later ray.init of the test session."""
    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    INTERRUPTS.received = None
    for sig in SIGNALS:
        signal.signal(sig, INTERRUPTS._on_signal)
    yield INTERRUPTS
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    INTERRUPTS.received = None


def hooked_controller(tmp_path, monkeypatch, *phases) -> Controller:
    script = tmp_path / "hook.py"
    script.write_text(HOOK)
    config = load_config(REPO / "configs/local-cpu.yaml").model_copy(update={"weight_hook": WeightHookConfig(
        command=[sys.executable, str(script), "{weight}", str(tmp_path / "hook.log")], timeout_s=30)})
    monkeypatch.setattr(controller_module, "PHASES", phases)
    return Controller(config, runs_dir=tmp_path, run_id="r1", progress=lambda m: None)


def hook_weights(tmp_path) -> list[str]:
    log = tmp_path / "hook.log"
    return log.read_text().split() if log.exists() else []


class Phase:
    name = "experiment"

    def __init__(self, act) -> None:
        self.act = act

    def enabled(self, ctx) -> bool:
        return True

    def run(self, ctx) -> None:
        self.act(ctx)


def sigterm_self(ctx) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # the handler raises here


class FakeRouter:
    """A router whose actor is gone: every call raises as a dead Ray actor's does."""

    url = "http://127.0.0.1:9"
    actor = None

    def __init__(self, dead: bool) -> None:
        self.dead = dead
        self.weights: list[float] = []

    def set_canary_weight(self, weight: float, timeout_s: float = 30) -> None:
        if self.dead:
            raise ray.exceptions.RayActorError()
        self.weights.append(weight)

    def stop(self) -> None:
        pass


def test_the_first_signal_interrupts_and_a_later_one_or_one_while_shielded_is_only_said(capsys):
    interrupts = Interrupts()
    saved = signal.getsignal(signal.SIGHUP)
    signal.signal(signal.SIGHUP, interrupts._on_signal)
    try:
        with interrupts.shielded():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.2)  # handled here, and ignored
        assert interrupts.received == "SIGHUP"
        assert "SIGHUP received while the run ends: teardown goes on" in capsys.readouterr().err
        fresh = Interrupts()
        signal.signal(signal.SIGHUP, fresh._on_signal)
        with pytest.raises(Interrupted) as caught:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(5)
        assert caught.value.signal_name == "SIGHUP" and isinstance(caught.value, KeyboardInterrupt)
        os.kill(os.getpid(), signal.SIGHUP)  # the second: said, not raised
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGHUP, saved)


def test_sigterm_mid_phase_ends_like_ctrl_c_with_the_hook_at_0_and_every_record_saying_130(
        tmp_path, monkeypatch, run_signals):
    result = hooked_controller(tmp_path, monkeypatch, Phase(sigterm_self)).run()
    assert (result.exit_code, result.interrupted, result.error) == (130, "SIGTERM", "interrupted by SIGTERM")
    assert hook_weights(tmp_path)[-1:] == ["0"]
    doc = json.loads((tmp_path / "r1" / "decision.json").read_text())
    assert (doc["decision"], doc["exit_code"], doc["error"]) == (None, 130, "interrupted by SIGTERM")
    store = RunStore(tmp_path / "history.db")
    run = store.run("r1")
    assert (run["status"], run["exit_code"], run["reason"], run["canary_weight"]) == ("error", 130, "interrupted by SIGTERM", 0)
    assert ("error", "interrupted", "SIGTERM") in [(e["phase"], e["event"], e["reason"]) for e in store.events("r1")]
    assert not list((tmp_path / "r1").glob(".*.tmp-*"))


def test_a_second_sigterm_during_teardown_does_not_cut_it_short(tmp_path, monkeypatch, run_signals, capsys):
    finished = []
    controller = hooked_controller(tmp_path, monkeypatch, Phase(sigterm_self))
    real = controller._teardown

    def teardown():
        os.kill(os.getpid(), signal.SIGTERM)  # a supervisor's repeated SIGTERM, a second Ctrl-C
        time.sleep(0.5)
        real()
        finished.append(True)

    controller._teardown = teardown
    result = controller.run()
    assert finished == [True] and result.exit_code == 130
    assert "SIGTERM received while the run ends: teardown goes on" in capsys.readouterr().err
    assert json.loads((tmp_path / "r1" / "decision.json").read_text())["exit_code"] == 130
    assert hook_weights(tmp_path)[-1:] == ["0"]


def test_a_dead_router_does_not_keep_production_traffic_on_the_canary(tmp_path, monkeypatch):
    router = FakeRouter(dead=True)

    def canary_weighted_then_router_dies(ctx):
        ctx.router, ctx.canary_weight = router, 50.0  # a progressive step at 50% (router and hook)
        raise ray.exceptions.RayActorError()

    result = hooked_controller(tmp_path, monkeypatch, Phase(canary_weighted_then_router_dies)).run()
    assert result.exit_code == 1 and result.error.startswith("unexpected RayActorError")
    assert hook_weights(tmp_path) == ["0"]
    assert RunStore(tmp_path / "history.db").run("r1")["canary_weight"] == 0


def test_a_store_that_fails_first_does_not_keep_the_traffic_on_the_canary(tmp_path, monkeypatch):
    router = FakeRouter(dead=False)
    controller = hooked_controller(tmp_path, monkeypatch)

    def weighted_then_store_and_step_fail(ctx):
        ctx.router, ctx.canary_weight = router, 10.0

        def add_event(*args, **kwargs):
            raise sqlite3.OperationalError("disk I/O error")

        monkeypatch.setattr(ctx.store, "add_event", add_event)  # the error's own event cannot be stored
        raise InfrastructureError("progressive: the canary's guard window had no requests")

    monkeypatch.setattr(controller_module, "PHASES", (Phase(weighted_then_store_and_step_fail),))
    result = controller.run()
    assert result.exit_code == 1 and result.error == "progressive: the canary's guard window had no requests"
    assert hook_weights(tmp_path) == ["0"] and router.weights == [0.0]
    doc = json.loads((tmp_path / "r1" / "decision.json").read_text())
    assert doc["exit_code"] == 1 and doc["error"] == result.error
    assert RunStore(tmp_path / "history.db").run("r1")["status"] == "error"


def test_a_hook_that_does_not_confirm_0_is_part_of_the_error(tmp_path, monkeypatch):
    controller = hooked_controller(tmp_path, monkeypatch, Phase(lambda ctx: (_ for _ in ()).throw(
        InfrastructureError("router died"))))
    controller.ctx.cfg.weight_hook.command[:] = [sys.executable, "-c", "raise SystemExit(5)"]
    result = controller.run()
    assert result.exit_code == 1
    assert result.error.startswith("router died; weight_hook (python")
    assert "exited 5 for weight 0%: production traffic may still reach the canary" in result.error
    assert json.loads((tmp_path / "r1" / "decision.json").read_text())["error"] == result.error


def test_a_signal_ignored_when_the_run_started_stays_ignored():
    """`nohup mtp-canary run` (SIGHUP ignored) survives its terminal closing; SIGTERM still ends it."""
    code = ("import os, signal, time\n"
            "from rollout.run.interrupts import INTERRUPTS, Interrupted\n"
            "INTERRUPTS.install()\n"
            "os.kill(os.getpid(), signal.SIGHUP); time.sleep(0.2); print('survived SIGHUP', flush=True)\n"
            "try:\n"
            "    os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n"
            "except Interrupted as exc:\n"
            "    print('interrupted by', exc.signal_name)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert done.stdout.split("\n")[:2] == ["survived SIGHUP", "interrupted by SIGTERM"], done.stderr
