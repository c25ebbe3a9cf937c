"""ReplicaWatch: a death is confirmed by consecutive polls; no answer is no evidence."""

from __future__ import annotations

import pytest

from rollout.run.phases.replica_watch import ReplicaWatch
from rollout.run.context import InfrastructureError


def scripted(*answers: dict[str, bool]):
    """alive() answering each poll from the script (the last answer repeats)."""
    calls = []

    def alive() -> dict[str, bool]:
        calls.append(1)
        return answers[min(len(calls), len(answers)) - 1]

    return alive, calls


def test_one_missed_poll_is_not_a_death_and_three_in_a_row_are():
    alive, _ = scripted({"a": True, "b": False}, {"a": True, "b": True}, {"a": True, "b": False})
    watch = ReplicaWatch("experiment", alive, every_s=1, confirmations=3)
    for now in range(3):
        watch.tick(now)
    watch.check()  # b was down once, then back: no death
    alive, _ = scripted({"a": True, "b": False})
    watch = ReplicaWatch("experiment", alive, every_s=1, confirmations=3)
    for now in range(2):
        watch.tick(now)
    watch.check()
    watch.tick(2)
    with pytest.raises(InfrastructureError, match="experiment: replica b died"):
        watch.check()


def test_a_replica_left_out_of_the_answer_is_no_evidence_and_never_dies():
    alive, _ = scripted({"a": True})  # b unknown to alive(): not in the answer
    watch = ReplicaWatch("accuracy", alive, every_s=1, confirmations=2)
    for now in range(100):
        watch.tick(now)
    watch.check()
    assert watch.dead() == [] and watch.stalled() == []


def test_a_silent_replica_is_a_stall_only_after_enough_polls_and_enough_time():
    """SIGSTOP or a hung engine: no answer at all. Three silent polls within 10 s are not a stall (a busy
    replica may miss a few deadlines); silence in 3+ polls over stall_after_s is, and one answer resets it."""
    alive, _ = scripted({"a": True, "b": None})
    watch = ReplicaWatch("experiment", alive, every_s=5, confirmations=3, stall_after_s=45)
    for now in range(0, 45, 5):  # silent from 0 to 40 s: 9 polls, not yet 45 s
        watch.tick(now)
    watch.check()
    watch.tick(45)
    with pytest.raises(InfrastructureError, match=r"experiment: replica b stalled \(no answer to /health for 45 s"):
        watch.check()
    alive, _ = scripted(*([{"b": None}] * 8 + [{"b": True}] + [{"b": None}] * 8))
    watch = ReplicaWatch("experiment", alive, every_s=5, confirmations=3, stall_after_s=45)
    for now in range(0, 85, 5):  # silent 0-35 s, an answer at 40 s, silent 45-80 s: never 45 s in a row
        watch.tick(now)
    watch.check()
    assert watch.stalled() == []


def test_confirm_waits_out_a_silence_until_it_answers_or_is_a_stall():
    clock = [0.0]

    def tick_clock() -> float:
        clock[0] += 2.0
        return clock[0]

    alive, calls = scripted({"a": True, "b": None}, {"a": True, "b": None}, {"a": True, "b": True})
    ReplicaWatch("accuracy", alive, confirmations=3, clock=tick_clock).confirm(spacing_s=0)
    assert len(calls) == 3  # waited for b's answer
    alive, calls = scripted({"a": True, "b": None})
    with pytest.raises(InfrastructureError, match="replica b stalled"):
        ReplicaWatch("accuracy", alive, confirmations=3, stall_after_s=10, clock=tick_clock).confirm(spacing_s=0)
    assert len(calls) == 6  # silent at 2, 4, ..., 12: 10 s of silence


def test_confirm_repolls_a_replica_seen_down_until_it_answers_or_is_confirmed_dead():
    alive, calls = scripted({"a": True, "b": False}, {"a": True, "b": True})
    ReplicaWatch("accuracy", alive, confirmations=3).confirm(spacing_s=0)
    assert len(calls) == 2  # down once, up on the second poll: no error
    alive, calls = scripted({"a": True, "b": False})
    with pytest.raises(InfrastructureError, match="replica b died"):
        ReplicaWatch("accuracy", alive, confirmations=3).confirm(spacing_s=0)
    assert len(calls) == 3
    alive, calls = scripted({"a": True, "b": True})
    ReplicaWatch("accuracy", alive, confirmations=3).confirm(spacing_s=0)
    assert len(calls) == 1  # all up: one poll, no wait


def test_a_failing_poll_is_no_evidence():
    def alive():
        raise TimeoutError("ray.get timed out")

    watch = ReplicaWatch("experiment", alive, every_s=1, confirmations=1)
    watch.tick(0)
    watch.check()


def test_the_cause_names_the_node_a_replica_ran_on_and_whether_it_is_lost():
    """A raylet or host that dies takes its replicas: the cause line names the node, not only the replica."""
    alive, _ = scripted({"canary-0": False})
    where = {"canary-0": "on node 10.43.7.3 (lost: Ray lists the node dead)"}.get
    watch = ReplicaWatch("experiment", alive, every_s=1, confirmations=2, where=where)
    for now in range(2):
        watch.tick(now)
    with pytest.raises(InfrastructureError, match=r"replica canary-0 on node 10\.43\.7\.3 \(lost: Ray lists the node dead\) died"):
        watch.check()

    def broken(name):
        raise RuntimeError("no fleet")

    watch = ReplicaWatch("experiment", scripted({"canary-0": False})[0], every_s=1, confirmations=1, where=broken)
    watch.tick(0)
    with pytest.raises(InfrastructureError, match="experiment: replica canary-0 died"):  # where is a courtesy
        watch.check()
