"""The prefix-cache gate (rollout.judge.prefix_cache): verdicts on known counters, fail-closed on
unknown ones, and its error rates simulated on the real design: per-look counters of both arms
whose rates swing together with the load (a burst of one prefix group) and on their own."""

from __future__ import annotations

import math
import random

import pytest

from rollout.judge.config import GatesConfig
from rollout.judge.prefix_cache import PrefixCacheLooks, judge_prefix_cache
from rollout.judge.verdicts import Verdict, is_enabled

CFG = GatesConfig(prefix_cache_max_drop=0.1)
LOOKS = 10


def cumulative(rates: list[float], queries: list[float]) -> list[tuple[float, float]]:
    hits = total = 0.0
    out = []
    for rate, q in zip(rates, queries):
        hits += rate * q
        total += q
        out.append((hits, total))
    return out


def world(rng: random.Random, baseline_rate: float, canary_rate: float, shared_sd: float = 0.08,
          own_sd: float = 0.03) -> PrefixCacheLooks:
    shared = [rng.gauss(0, shared_sd) for _ in range(LOOKS)]
    # looks by requests: each look about the same prompt tokens (prompt lengths vary: +-25%)
    queries = {arm: [rng.uniform(15_000, 25_000) for _ in range(LOOKS)] for arm in ("b", "c")}
    clip = lambda r: min(1.0, max(0.0, r))  # noqa: E731
    b = [clip(baseline_rate + s + rng.gauss(0, own_sd)) for s in shared]
    c = [clip(canary_rate + s + rng.gauss(0, own_sd)) for s in shared]
    return PrefixCacheLooks(cumulative(b, queries["b"]), cumulative(c, queries["c"]))


def sequential_verdict(counters: PrefixCacheLooks, cfg: GatesConfig = CFG) -> Verdict:
    """The gate judged at looks 1..10 as the experiment judges it, stopping at its first verdict."""
    for look in range(1, LOOKS + 1):
        partial = PrefixCacheLooks(counters.baseline[:look], counters.canary[:look])
        result = judge_prefix_cache(partial, cfg, look=look, max_looks=LOOKS,
                                    information=[i / LOOKS for i in range(1, look + 1)])
        if result.verdict is not Verdict.INCONCLUSIVE:
            return result.verdict
    return Verdict.INCONCLUSIVE


def test_opt_in_and_verdicts_on_known_counters():
    assert not is_enabled("prefix_cache_guard", GatesConfig()) and is_enabled("prefix_cache_guard", CFG)
    with pytest.raises(ValueError, match="prefix_cache_max_drop is null"):
        GatesConfig(enabled=["prefix_cache_guard"])
    steady = [20_000.0] * LOOKS
    baseline = [0.60, 0.62, 0.58, 0.61, 0.63, 0.59, 0.60, 0.62, 0.61, 0.64]
    canary = [0.61, 0.60, 0.59, 0.60, 0.62, 0.60, 0.59, 0.61, 0.62, 0.61]
    same = PrefixCacheLooks(cumulative(baseline, steady), cumulative(canary, steady))
    result = judge_prefix_cache(same, CFG, look=10, max_looks=LOOKS)
    assert result.verdict is Verdict.PASS and result.interval[1] < 0.1
    assert result.baseline == pytest.approx(0.61) and result.canary == pytest.approx(0.605)
    zeroed = PrefixCacheLooks(cumulative([0.6, 0.62] * 5, steady), cumulative([0.0, 0.01] * 5, steady))
    result = judge_prefix_cache(zeroed, CFG, look=10, max_looks=LOOKS)
    assert result.verdict is Verdict.FAIL and result.interval[0] > 0.1 and "hits far less" in result.detail


def test_unknown_counters_never_pass():
    good = cumulative([0.6] * 3, [20_000.0] * 3)
    for counters in (None, PrefixCacheLooks(good, [good[0], None, good[2]]),
                     PrefixCacheLooks(good, [good[0], (10.0, 100.0), good[2]])):  # a restarted replica's counters fell
        result = judge_prefix_cache(counters, CFG, look=3, max_looks=LOOKS)
        assert result.verdict is Verdict.INCONCLUSIVE and "cannot pass" in result.detail
    one_look = judge_prefix_cache(PrefixCacheLooks(good[:1], good[:1]), CFG, look=1, max_looks=LOOKS)
    assert one_look.verdict is Verdict.INCONCLUSIVE and "at least 2 looks" in one_look.detail
    nothing_hit = cumulative([0.0, 0.002, 0.0], [20_000.0] * 3)
    result = judge_prefix_cache(PrefixCacheLooks(nothing_hit, nothing_hit), CFG, look=3, max_looks=LOOKS)
    assert result.verdict is Verdict.INCONCLUSIVE and "Neither arm's prefix cache hit" in result.detail
    idle = cumulative([0.0] * 3, [100.0] * 3)
    assert "Fewer than" in judge_prefix_cache(PrefixCacheLooks(idle, idle), CFG, look=3, max_looks=LOOKS).detail


@pytest.mark.parametrize("shared_sd", [0.0, 0.05, 0.12])
def test_error_rates_at_the_margin_and_without_a_difference(shared_sd):
    # 4,000 sequential runs at the margin: a canary exactly at the margin passes (a false promote) and
    # fails (a false rollback) each at most alpha + 2 SE; a shared look level (0.05, 0.12: bursts of one
    # prefix group) cancels in the pairing, so the power to pass a canary that hits as the baseline
    # does stays high
    rng = random.Random(int(shared_sd * 100))
    trials, alpha = 4000, CFG.alpha
    bound = alpha + 2 * math.sqrt(alpha * (1 - alpha) / trials)
    at_margin = [sequential_verdict(world(rng, 0.6, 0.5, shared_sd)) for _ in range(trials)]
    equal = [sequential_verdict(world(rng, 0.6, 0.6, shared_sd)) for _ in range(500)]
    false_pass = sum(v is Verdict.PASS for v in at_margin) / trials
    false_fail = sum(v is Verdict.FAIL for v in at_margin) / trials
    power = sum(v is Verdict.PASS for v in equal) / len(equal)
    print(f"shared sd {shared_sd}: false pass at the margin {false_pass:.3f}, false fail at the margin {false_fail:.3f}, "
          f"power A/A {power:.3f} (bound {bound:.3f})")
    assert false_pass <= bound and false_fail <= bound
    assert power >= 0.8
