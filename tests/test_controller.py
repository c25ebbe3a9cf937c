"""The controller's end of a run, fail closed: only a completed, judged run may promote, and
the store is decided (with the stable mark, in one transaction) before decision.json exists.

The phases are stand-ins here (what the real ones do is tested over real vLLM in
test_fleet.py and test_cli_run.py); the controller around them is the real one.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import ray

from rollout.run import controller as controller_module
from rollout.config import load_config
from rollout.run.controller import Controller
from rollout.run.decision import Decided
from rollout.judge.verdicts import Decision
from rollout.run.store import RunStore, controller_alive
from tests.conftest import REPO


class Promotes:
    """A decide phase that commits PROMOTE (what Decide does after passing gates)."""

    name = "decide"

    def enabled(self, ctx) -> bool:
        return True

    def run(self, ctx) -> Decided:
        ctx.result.arms = self.arms(ctx)
        return Decided(Decision.PROMOTE, "every gate passed")

    def arms(self, ctx) -> dict:
        return {"baseline": {"replicas": 1, "engine": {"model": "m"}}, "canary": {"replicas": 1, "engine": {"model": "m", "k": 3}}}


class Raises:
    """A later phase that breaks in a way no phase anticipates."""

    name = "progressive"

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def enabled(self, ctx) -> bool:
        return True

    def run(self, ctx) -> None:
        raise self.exc


def controller(tmp_path, monkeypatch, *phases) -> Controller:
    monkeypatch.setattr(controller_module, "PHASES", phases)
    return Controller(load_config(REPO / "configs/local-cpu.yaml"), runs_dir=tmp_path, run_id="r1", progress=lambda m: None)


def test_a_promote_followed_by_an_unexpected_error_is_an_error_never_a_promotion(tmp_path, monkeypatch):
    died = ray.exceptions.RayActorError()  # e.g. the router actor died in a progressive step
    result = controller(tmp_path, monkeypatch, Promotes(), Raises(died)).run()
    assert result.exit_code == 1 and result.error.startswith("unexpected RayActorError")
    doc = json.loads((tmp_path / "r1" / "decision.json").read_text())
    assert doc["decision"] is None and doc["exit_code"] == 1 and "RayActorError" in doc["error"]
    assert not (tmp_path / "r1" / "promoted.yaml").exists()
    store = RunStore(tmp_path / "history.db")
    run = store.run("r1")
    assert (run["status"], run["decision"], run["exit_code"]) == ("error", None, 1)
    assert store.stable(run["model"]) is None
    assert ("error", "infrastructure_error") in [(e["phase"], e["event"]) for e in store.events("r1")]


def test_a_bug_in_a_phase_is_an_error_too(tmp_path, monkeypatch):
    result = controller(tmp_path, monkeypatch, Promotes(), Raises(KeyError("canary"))).run()
    assert result.exit_code == 1 and result.decision == Decision.PROMOTE and result.error == "unexpected KeyError: 'canary'"
    assert not (tmp_path / "r1" / "promoted.yaml").exists()


def test_a_promotion_is_in_the_store_with_its_stable_mark_before_decision_json_exists(tmp_path, monkeypatch):
    seen = {}
    real = controller_module.stage_file

    def stage_file(path, text):
        staged = real(path, text)
        commit = staged.commit

        def committed():  # decision.json goes in place only now
            store = RunStore(tmp_path / "history.db")
            run = store.run("r1")
            seen.update(status=run["status"], decision=run["decision"], stable=store.stable(run["model"]))
            assert not (tmp_path / "r1" / "decision.json").exists()
            commit()

        staged.commit = committed
        return staged

    monkeypatch.setattr(controller_module, "stage_file", stage_file)
    result = controller(tmp_path, monkeypatch, Promotes()).run()
    assert result.exit_code == 0
    assert seen["status"] == "done" and seen["decision"] == "promote"
    assert seen["stable"]["run_id"] == "r1" and seen["stable"]["engine"] == {"model": "m", "k": 3}
    assert (tmp_path / "r1" / "promoted.yaml").exists()
    assert json.loads((tmp_path / "r1" / "decision.json").read_text())["decision"] == "promote"
    assert not list((tmp_path / "r1").glob(".*.tmp-*"))  # no temporary file left beside them


def test_two_writers_never_collide_on_an_event_sequence_number(tmp_path):
    RunStore(tmp_path / "h.db").create_run("r", "n", "m", {})
    errors: list[BaseException] = []

    def write(who: str) -> None:
        store = RunStore(tmp_path / "h.db")
        try:
            for i in range(60):
                store.add_event("r", "p", who, str(i))
        except BaseException as exc:  # an IntegrityError on (run_id, seq) before the fix
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(RunStore(tmp_path / "h.db").events("r")) == 180


def test_only_one_resume_can_claim_a_run(tmp_path):
    store = RunStore(tmp_path / "h.db")
    store.create_run("r", "n", "m", {})
    store.update_run("r", controller="host-a:1")
    assert store.claim("r", "host-b:2", previous="host-a:1")
    assert not store.claim("r", "host-c:3", previous="host-a:1")  # the other resume saw the same dead one
    assert store.run("r")["controller"] == "host-b:2"


def test_a_controller_on_another_host_is_alive_while_its_heartbeat_is_fresh():
    other = "some-other-host.invalid:4242"
    assert socket.gethostname() != "some-other-host.invalid"
    assert controller_alive(other) is None  # no heartbeat: cannot tell, and callers treat it as alive
    assert controller_alive(other, heartbeat_at=time.time() - 5, stale_after_s=60) is True
    assert controller_alive(other, heartbeat_at=time.time() - 120, stale_after_s=60) is False


def test_the_lease_keeper_beats_and_survives_what_its_callables_raise(tmp_path):
    from rollout.run.context import LeaseKeeper

    beats = []

    def broken_actors():
        raise RuntimeError("dictionary changed size during iteration")

    def beat():
        beats.append(time.monotonic())
        if len(beats) == 1:
            raise OSError("database is locked")

    keeper = LeaseKeeper(10, broken_actors, heartbeat=beat)
    keeper.start()  # interval max(1, 10 / 6) s
    try:
        deadline = time.monotonic() + 30
        while len(beats) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        keeper.stop()
    assert len(beats) >= 3  # it kept going after both callables raised
