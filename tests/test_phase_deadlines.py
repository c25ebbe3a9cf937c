"""The preflight's smoke round and the accuracy phase end by a total deadline and read each body
within a byte cap: a replica that answers every read in time but never finishes (a byte every
0.2 s), or whose answer never ends, cannot hang the run or fill its memory. The replica is the
named fault target tests/hostile_server.py (per-read timeouts alone never fire against it).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from rollout.evals import EvalDeadlineError, EvalItem, EvalSpec, evaluate_batch
from rollout.run.context import InfrastructureError
from rollout.run.phases.preflight import smoke_every_replica
from tests.conftest import wait_gone
from tests.hostile_server import HostileServer


@pytest.fixture(scope="module")
def hostile():
    with HostileServer() as server:
        yield server


def fleet_of(**urls: str) -> SimpleNamespace:
    return SimpleNamespace(replicas=[SimpleNamespace(name=name, url=url) for name, url in urls.items()],
                           upstream_key=lambda handle: None)


def test_a_smoke_answer_that_trickles_ends_at_the_preflight_deadline_naming_the_replica(hostile):
    with pytest.raises(InfrastructureError) as err:
        smoke_every_replica(fleet_of(**{"canary-0": hostile.url + "/trickle"}), "m", deadline_s=1.0)
    assert str(err.value) == "preflight: replica canary-0 did not answer within preflight_timeout_s (1 s)"


def test_a_smoke_answer_that_never_ends_is_cut_at_its_byte_cap(hostile):
    with pytest.raises(InfrastructureError, match=r"replica canary-0 did not answer: the body ran past \d+ bytes"):
        smoke_every_replica(fleet_of(**{"canary-0": hostile.url + "/endless"}), "m", deadline_s=60.0)


def test_the_smokes_go_to_every_replica_at_once_and_a_good_one_answers(hostile):
    answers = smoke_every_replica(fleet_of(**{"baseline-0": hostile.url + "/evals-trickle"}), "m", deadline_s=10.0)
    assert answers == {"baseline-0": 1}


ITEMS = [EvalItem(id=f"g{i}", prompt_token_ids=[1, i], expected_token_ids=[7]) for i in range(3)]


def eval_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("eval-")]


def test_an_eval_batch_that_trickles_ends_at_the_phase_deadline_naming_the_arm(hostile):
    import time

    with pytest.raises(EvalDeadlineError) as err:
        evaluate_batch(hostile.url + "/evals-trickle", "m", ITEMS, ["canary"], EvalSpec(concurrency=2),
                       deadline=time.monotonic() + 1.0)
    assert "canary: 3 of 3 items unanswered" in str(err.value)
    assert wait_gone(eval_threads, 30) == []  # the in-flight requests were cancelled, not left reading


def test_an_eval_answer_that_never_ends_is_an_error_at_its_byte_cap(hostile):
    got = evaluate_batch(hostile.url + "/endless", "m", ITEMS[:1], ["canary"], EvalSpec(concurrency=1))
    assert "ran past" in got["canary"][0].error and not got["canary"][0].correct
