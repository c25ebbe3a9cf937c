"""ReplicaWatch: a death is confirmed by consecutive polls; no answer is no evidence."""

from __future__ import annotations

import pytest

from rollout.phases.replica_watch import ReplicaWatch
from rollout.run_context import InfrastructureError


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


def test_a_replica_that_does_not_answer_is_left_out_and_never_dies():
    alive, _ = scripted({"a": True})  # b timed out every time: not in the answer
    watch = ReplicaWatch("accuracy", alive, every_s=1, confirmations=2)
    for now in range(10):
        watch.tick(now)
    watch.check()
    assert watch.dead() == []


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
