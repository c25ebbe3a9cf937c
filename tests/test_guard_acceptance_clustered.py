"""The progressive phase's acceptance guard: its alarm is clustered by request as the experiment's floor is.

A hard prompt accepts less at every draft step, so a window's drafts are not independent; a guard
that bounds the mean acceptance length with the drafts' spread over sqrt(drafts) rolls back a canary
sitting exactly at its floor far more often than its per-window alpha. The world is
tests/test_acceptance_clustered.py's: each request's rate drawn from a Beta around the floor.
"""

from __future__ import annotations

import math

import numpy as np

from rollout.judge.config import GuardConfig
from rollout.judge.guards import ACCEPTANCE, GUARD_ALPHA, judge_guard_window
from rollout.judge.request_acceptance import spec_decode_of_requests
from rollout.judge.verdicts import Verdict
from tests.test_acceptance_clustered import K, draw_requests, records_of, true_length

TRIALS = 300
REQUESTS, TOKENS = 60, 32


def _alarm_rate(clustered: bool, seed: int = 21) -> float:
    a, b = 4.0 * 0.5, 4.0 * 0.5  # concentration 4 around a rate of 0.5
    cfg = GuardConfig(min_acceptance_length=true_length(TOKENS - 1, K, a, b))  # the canary exactly at the floor
    rng = np.random.default_rng(seed)
    alarms = 0
    for _ in range(TRIALS):
        _, histogram = draw_requests(rng, REQUESTS, TOKENS - 1, K, a, b)
        canary = records_of(histogram, TOKENS)
        delta = spec_decode_of_requests(canary, "canary")
        assert delta is not None
        if not clustered:  # the server's sums alone: all the guard had before the requests' own counters
            delta = delta.sums()
        guards = judge_guard_window([], canary, delta, True, cfg, speculative_canary=True)
        alarms += next(g for g in guards if g.name == ACCEPTANCE).verdict is Verdict.FAIL
    return alarms / TRIALS


def test_a_canary_at_its_floor_is_rolled_back_at_most_at_the_guards_alpha():
    """Clustered by request, the alarm fires at most GUARD_ALPHA + 2 SE of 300 windows; with the drafts taken
    as independent (the sums alone) the same windows alarm far more often."""
    bound = GUARD_ALPHA + 2 * math.sqrt(GUARD_ALPHA * (1 - GUARD_ALPHA) / TRIALS)
    clustered = _alarm_rate(clustered=True)
    assert clustered <= bound, clustered
    assert _alarm_rate(clustered=False) > 5 * bound
