"""The acceptance floor in the world drafts live in: acceptance that differs per prompt.

A hard prompt accepts less in every verify step, so the drafts of one request are correlated
and the interval must be clustered by request (rollout.judge.acceptance). The simulated world:
each request's per-position rate r drawn from a Beta, every verify step of the request accepts
j of k drafts with P(A >= j) = r^j, until its output tokens are out (as ``ignore_eos`` runs do);
the canary's true mean acceptance length (what the server's counters converge to over many
requests) is computed exactly and the floor put on it, so every PASS is a false one.
The counters reach the gate as in the experiment: per request (RequestRecord's histogram),
summed by ``spec_decode_of_requests`` over the requests before each look.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as st

from cluster.metrics import SpecDecodeStats
from loadtests.records import RequestRecord
from rollout.judge.acceptance import clustered_se, judge_acceptance
from rollout.judge.config import GatesConfig
from rollout.judge.request_acceptance import RequestSpecDecodeStats, spec_decode_of_counts, spec_decode_of_requests
from rollout.judge.verdicts import Verdict

K = 3


def true_length(decode_tokens: int, k: int, a: float, b: float, grid: int = 4001) -> float:
    """1 + E[accepted] / E[verify steps] per request, r ~ Beta(a, b): the ratio the server's counters estimate.
    Exact: expected steps and accepted tokens to emit n tokens by recursion on n, then quadrature over r."""
    r = np.linspace(0.0, 1.0, grid)[1:-1]
    weight = st.beta.pdf(r, a, b)
    weight /= weight.sum()
    p = np.stack([r**j * (1 - r) for j in range(k)] + [r**k], axis=1)  # P(A = j), j = 0..k
    mean_accepted = p @ np.arange(k + 1)
    steps = np.zeros((decode_tokens + 1, r.size))
    accepted = np.zeros((decode_tokens + 1, r.size))
    for n in range(1, decode_tokens + 1):
        steps[n], accepted[n] = 1.0, mean_accepted
        for j in range(k + 1):
            if n - 1 - j > 0:
                steps[n] += p[:, j] * steps[n - 1 - j]
                accepted[n] += p[:, j] * accepted[n - 1 - j]
    return float(1.0 + weight @ accepted[decode_tokens] / (weight @ steps[decode_tokens]))


def draw_requests(rng, n: int, decode_tokens: int, k: int, a: float, b: float) -> tuple[np.ndarray, np.ndarray]:
    """(verify steps per request, steps by drafts accepted (n, k + 1)): each request's own rate r ~ Beta(a, b)."""
    r = np.clip(rng.beta(a, b, n), 1e-12, 1 - 1e-12)
    u = rng.random((n, decode_tokens))
    accepted = np.minimum(k, np.floor(np.log(u) / np.log(r)[:, None])).astype(int)  # P(A >= j) = r^j, capped at k
    emitted = np.cumsum(1 + accepted, axis=1)
    steps = np.minimum(np.argmax(emitted >= decode_tokens, axis=1) + 1, decode_tokens)
    used = np.arange(decode_tokens)[None, :] < steps[:, None]
    histogram = np.stack([((accepted == j) & used).sum(axis=1) for j in range(k + 1)], axis=1)
    return steps, histogram


def records_of(histogram: np.ndarray, output_tokens: int) -> list[RequestRecord]:
    return [RequestRecord.model_construct(
        request_id=f"r{i}", tag="experiment", worker="w", arm="canary", pinned_arm="canary", sent_at=float(i),
        e2e_s=1.0, output_tokens=output_tokens, requested_max_tokens=output_tokens, ok=True, status=200,
        cancelled=False, acceptance_histogram=[int(x) for x in row], draft_tokens=int(row.sum()) * K)
        for i, row in enumerate(histogram)]


def false_pass_rate(trials: int, looks: int, per_look: int, output_tokens: int, concentration: float,
                    mean_rate: float, seed: int) -> tuple[float, float]:
    """(share of trials the gate PASSed at any look, share at the last look), the canary exactly at the floor."""
    a, b = concentration * mean_rate, concentration * (1 - mean_rate)
    decode_tokens = output_tokens - 1
    cfg = GatesConfig(min_acceptance_length=true_length(decode_tokens, K, a, b), alpha=0.05)
    fractions = [(i + 1) / looks for i in range(looks)]
    rng = np.random.default_rng(seed)
    any_look = last_look = 0
    for _ in range(trials):
        _, histogram = draw_requests(rng, looks * per_look, decode_tokens, K, a, b)
        records = records_of(histogram, output_tokens)
        passed = False
        for look in range(1, looks + 1):
            counters = spec_decode_of_requests(records[: look * per_look], "canary")
            verdict = judge_acceptance(counters, cfg, look=look, max_looks=looks, information=fractions[:look]).verdict
            passed |= verdict is Verdict.PASS
        any_look += passed
        last_look += verdict is Verdict.PASS
    return any_look / trials, last_look / trials


def bound(trials: int, alpha: float = 0.05) -> float:
    """alpha + 2 SE of a rate measured at alpha over ``trials`` trials: the most such a count can honestly claim."""
    return alpha + 2 * math.sqrt(alpha * (1 - alpha) / trials)


def test_the_world_is_at_the_floor():
    """The floor is the canary's true length: many requests' counters land on it (within their own SE)."""
    rng = np.random.default_rng(5)
    a, b = 4 * 0.5, 4 * 0.5
    steps, histogram = draw_requests(rng, 40_000, 127, K, a, b)
    accepted = histogram @ np.arange(K + 1)
    ratio, se, n = clustered_se(list(zip(steps.tolist(), accepted.tolist())))
    assert n == 40_000
    assert abs(1 + ratio - true_length(127, K, a, b)) < 3 * se


@pytest.mark.parametrize("looks, per_look, output_tokens, concentration, mean_rate", [
    (6, 100, 128, 4.0, 0.5),  # the GPU plan's shape (6 looks), shorter outputs: many drafts per request
    (10, 40, 16, 4.0, 0.3),   # the demo plan (10 x 40, 16 tokens)
])
def test_a_canary_at_the_floor_with_per_prompt_acceptance_passes_at_most_alpha(looks, per_look, output_tokens,
                                                                                concentration, mean_rate):
    """Drafts treated as independent passed this canary 0.18-0.52 of the time (2,000 trials, any look);
    clustered by request, at most alpha + 2 SE of 300 trials at any of the looks."""
    trials = 300
    any_look, last_look = false_pass_rate(trials, looks, per_look, output_tokens, concentration, mean_rate, seed=11)
    assert any_look <= bound(trials), (any_look, last_look)
    assert last_look <= any_look


def test_a_healthy_canary_still_passes_and_a_broken_one_fails():
    """Power where it matters: length ~2.5 against the floor 1.5 passes, ~1.1 fails, per-prompt spread and all."""
    rng = np.random.default_rng(2)
    cfg = GatesConfig(min_acceptance_length=1.5)
    for mean_rate, expected in ((0.6, Verdict.PASS), (0.05, Verdict.FAIL)):
        a, b = 4 * mean_rate, 4 * (1 - mean_rate)
        steps, histogram = draw_requests(rng, 200, 15, K, a, b)
        counters = spec_decode_of_requests(records_of(histogram, 16), "canary")
        assert judge_acceptance(counters, cfg).verdict is expected


def test_server_counters_alone_never_pass_and_too_few_requests_decide_nothing():
    cfg = GatesConfig(min_acceptance_length=1.5)
    rng = np.random.default_rng(3)
    steps, histogram = draw_requests(rng, 200, 15, K, 2.4, 1.6)
    per_position = np.stack([histogram[:, j:].sum(axis=1) for j in range(1, K + 1)], axis=1)
    counters = spec_decode_of_counts(steps, per_position)
    assert isinstance(counters, RequestSpecDecodeStats)
    assert judge_acceptance(counters, cfg).verdict is Verdict.PASS
    server = counters.sums()  # the same sums as a /metrics delta: whose requests is unknown
    assert type(server) is SpecDecodeStats and server.mean_acceptance_length == counters.mean_acceptance_length
    unclustered = judge_acceptance(server, cfg)
    assert unclustered.verdict is Verdict.INCONCLUSIVE and "server counters only" in unclustered.detail
    assert judge_acceptance(counters + counters, cfg).verdict is Verdict.INCONCLUSIVE  # a sum is no longer per request
    few = spec_decode_of_counts(steps[:10], per_position[:10])
    assert few.drafts >= 20 and judge_acceptance(few, cfg).verdict is Verdict.INCONCLUSIVE
