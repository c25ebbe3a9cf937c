"""The MiMo GPU configs' clocks hold their own plan: an accuracy item may generate all of its
5,120 tokens within its request timeout, and the experiment's warm-up and planned requests fit
its max_duration_s at a TPOT a healthy GPU arm reaches (the arithmetic of docs/gpu-cluster.md,
"Generation lengths and the wall clock")."""

from __future__ import annotations

import pytest

from rollout.config import load_config
from tests.conftest import REPO

# what each clock must hold: a whole answer at this time per token, the experiment at this TPOT
ACCURACY_S_PER_TOKEN = 0.1
EXPERIMENT_TPOT_S = 0.040


@pytest.mark.parametrize("name", ["mimo-v2.5-mtp.yaml", "mimo-v2.5-mtp-h100.yaml",
                                  "examples/mimo-v2.6-dflash-vs-no-speculation.yaml"])
def test_the_configs_clocks_hold_their_plan(name):
    cfg = load_config(REPO / "configs" / name)
    acc, exp = cfg.accuracy, cfg.experiment
    assert acc.request_timeout_s >= acc.max_tokens * ACCURACY_S_PER_TOKEN, (acc.request_timeout_s, acc.max_tokens)
    warmup = exp.requests_per_look if exp.warmup_requests_per_arm is None else exp.warmup_requests_per_arm
    streams_per_arm = exp.users_per_replica * cfg.canary.replicas
    needed_s = (warmup + exp.requests_per_arm) * exp.max_tokens * EXPERIMENT_TPOT_S / streams_per_arm
    assert needed_s <= exp.max_duration_s, (needed_s, exp.max_duration_s)
    # the load stops short of the accuracy phase's answers: their length would not fit the cap
    assert exp.max_tokens < acc.max_tokens
