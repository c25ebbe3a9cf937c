"""Fault corpus: a router or replica actor that never answers a control call (a hung actor, a wedged
node). The run's way back (weight 0) and its fleet start must not wait forever on it: each control
call is bounded and says what it waited for. Real Ray actors that hang on purpose.
"""

from __future__ import annotations

import time

import pytest
import ray

from cluster.fleet import FleetStartError, _get_or_fail
from cluster.router import RouterClient


@ray.remote
class Hung:
    def set_weights(self, weights):
        time.sleep(3600)

    def status(self):
        time.sleep(3600)


def test_a_hung_router_does_not_hang_the_weight_call_and_a_hung_replica_fails_the_fleet_start(local_ray):
    actor = Hung.options(max_concurrency=4).remote()
    started = time.monotonic()
    with pytest.raises(ray.exceptions.GetTimeoutError):
        RouterClient(actor, "http://127.0.0.1:9").set_canary_weight(0.0, timeout_s=2)
    with pytest.raises(FleetStartError, match="did not answer their status within 2 s"):
        _get_or_fail([actor.status.remote()], 2, "answer their status")
    assert time.monotonic() - started < 120  # bounded, not the hour the actor sleeps
    ray.kill(actor)
