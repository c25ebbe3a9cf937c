"""The judge's speed-ups change no number: each fast path against the computation it replaced.

calibrate simulates thousands of runs through the controller's judging path, so the
judge remembers what an earlier look computed (group-sequential boundaries per prefix of
information fractions, each earlier look's own quantile-ratio bounds) and sorts each
arm's samples once. These tests compare every such path with the plain computation,
exactly (==, not approx): the same seed must give the same calibration table.
benchmarks/calibrate_compare.py checks whole ``calibrate --json`` outputs the same way.
"""

from __future__ import annotations

import numpy as np
import pytest

from rollout.judge import latency, stats
from rollout.judge.config import GatesConfig
from rollout.judge.latency import LatencySamples, judge_latency


def reference_design_effect(values: np.ndarray, blocks: np.ndarray, q: float) -> float:
    """stats.design_effect as it was written before (np.unique for blocks and ties)."""
    y, b = np.asarray(values, dtype=float).ravel(), np.asarray(blocks).ravel()
    n = y.size
    block_index = np.unique(b, return_inverse=True)[1]
    n_blocks = int(block_index.max()) + 1
    if n_blocks < 2:
        return float("nan")
    order = np.argsort(y, kind="stable")
    _, first, counts = np.unique(y[order], return_index=True, return_counts=True)
    below_share = np.clip((n * q - first) / counts, 0.0, 1.0)
    indicator = np.empty(n)
    indicator[order] = np.repeat(below_share, counts)
    block_sums = np.bincount(block_index, weights=indicator - q, minlength=n_blocks)
    return n_blocks / (n_blocks - 1) * float(np.sum(block_sums**2)) / (n * q * (1.0 - q))


@pytest.mark.parametrize("seed", range(6))
def test_the_design_effect_equals_the_np_unique_one(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 400))
    values = np.round(rng.lognormal(0, 0.3, n), int(rng.integers(1, 4)))  # ties
    values[rng.random(n) < 0.05] = np.inf  # failed requests
    blocks = rng.integers(0, 12, n) * 3 + 1  # ids with gaps
    for q in (0.5, 0.95):
        assert stats.design_effect(values, blocks, q) == reference_design_effect(values, blocks, q)
    floats = blocks.astype(float) - 5.0  # negative, non-integer ids take np.unique's path
    assert stats.design_effect(values, floats, 0.5) == reference_design_effect(values, floats, 0.5)


def test_tie_groups_and_block_index_are_np_uniques():
    rng = np.random.default_rng(9)
    values = np.sort(np.concatenate([np.round(rng.random(200), 2), [np.inf] * 4]))
    _, first, counts = np.unique(values, return_index=True, return_counts=True)
    got_first, got_counts = stats.tie_groups(values)
    assert np.array_equal(got_first, first) and np.array_equal(got_counts, counts)
    ids = rng.integers(2, 40, 300)
    index, n_blocks = stats.dense_block_index(ids)
    assert np.array_equal(index, np.unique(ids, return_inverse=True)[1]) and n_blocks == np.unique(ids).size


def test_a_cached_boundary_schedule_equals_one_computed_from_scratch():
    """A schedule computed after its prefixes (cache warm) equals the same schedule with every cache cleared."""
    schedules = [(0.1, 0.23, 0.35, 0.52, 0.61, 0.8, 1.0), (0.3, 0.6, 0.9), (0.05, 1.0)]
    for alpha in (0.05, 0.025, 0.0125):
        for spending in ("obrien_fleming", "pocock"):
            for schedule in schedules:
                stats._boundaries_at_cached.cache_clear()
                stats._boundary_state.cache_clear()
                cold = stats.boundaries_at_information(alpha, schedule, spending)
                stats._boundaries_at_cached.cache_clear()
                stats._boundary_state.cache_clear()
                for k in range(1, len(schedule)):
                    stats.boundaries_at_information(alpha, schedule[:k], spending)
                warm = stats.boundaries_at_information(alpha, schedule, spending)
                assert np.array_equal(cold, warm)


def _arm(rng, n, looks, ratio=1.0):
    tpot = 0.03 * ratio * rng.lognormal(0, 0.25, n)
    ttft = 0.2 * rng.lognormal(0, 0.6, n)
    window = np.repeat(np.arange(1, looks + 1), -(-n // looks))[:n]
    errors = 3
    return LatencySamples(ttft_s=ttft, tpot_s=tpot, e2e_s=ttft + 31 * tpot, n_errors=errors, n_total=n + errors,
                          window=window, error_window=np.array([1, looks, looks]))


@pytest.mark.parametrize("seed", range(3))
def test_remembered_earlier_looks_give_the_verdicts_of_a_fresh_judge(seed):
    """judge_latency at every look with the earlier-look memo warm equals it with the memo cleared before each call."""
    rng = np.random.default_rng(seed)
    cfg = GatesConfig(e2e_p95_max_ratio=2.0)
    looks = 6
    baseline, canary = _arm(rng, 300, looks), _arm(rng, 300, looks, ratio=0.85)
    fractions = [round((k + 1) / looks, 4) for k in range(looks)]
    for look in range(1, looks + 1):
        def upto(s: LatencySamples) -> LatencySamples:
            keep = s.window <= look
            return LatencySamples(ttft_s=s.ttft_s[keep], tpot_s=s.tpot_s[keep], e2e_s=s.e2e_s[keep],
                                  n_errors=int((s.error_window <= look).sum()),
                                  n_total=int(keep.sum() + (s.error_window <= look).sum()),
                                  window=s.window[keep], error_window=s.error_window[s.error_window <= look])
        b, c = upto(baseline), upto(canary)
        warm = judge_latency(b, c, cfg, look=look, max_looks=looks, information=fractions[:look])
        latency._EARLIER_LOOKS.clear()
        cold = judge_latency(b, c, cfg, look=look, max_looks=looks, information=fractions[:look])
        assert [g.model_dump() for g in warm] == [g.model_dump() for g in cold]
