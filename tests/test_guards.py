"""Guard gates of the progressive phase: verdicts on hand-made windows, and their error rates by simulation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import stats as sps

from cluster.metrics import SpecDecodeStats
from loadtests.records import RequestRecord
from rollout.judge.config import GuardConfig
from rollout.judge.guards import (
    GUARD_ALPHA,
    GUARD_NAMES,
    enabled_guard_names,
    error_guard_fails,
    judge_guard_window,
)
from rollout.judge.verdicts import Verdict

_ids = itertools.count()


def rec(arm: str, ok: bool = True, ttft: float = 0.05, tpot: float = 0.01, tokens: int = 16, cancelled: bool = False) -> RequestRecord:
    e2e = ttft + tpot * (tokens - 1)
    return RequestRecord(
        request_id=f"r{next(_ids)}",
        tag="progressive",
        worker="w",
        arm=arm,
        sent_at=1000.0,
        ttft_s=ttft if ok else None,
        e2e_s=e2e if ok else 0.01,
        output_tokens=tokens if ok else None,
        ok=ok,
        status=200 if ok else 502,
        error=None if ok else "bad gateway",
        cancelled=cancelled,
    )


def spec(drafts: float, per_pos: tuple[float, ...]) -> SpecDecodeStats:
    return SpecDecodeStats(
        drafts=drafts, draft_tokens=drafts * len(per_pos), accepted_tokens=sum(per_pos), accepted_per_position=per_pos
    )


GOOD_SPEC = spec(100, (95, 90, 85))  # mean acceptance length 3.7
CFG = GuardConfig(window_s=10, min_requests=5, error_rate_max_increase=0.05, ttft_p95_max_s=0.5, tpot_p95_max_s=0.1,
                  min_acceptance_length=1.5)


def judge(baseline, canary, spec_delta=GOOD_SPEC, alive=True, cfg=CFG, speculative=True, **kw):
    return {g.name: g for g in judge_guard_window(baseline, canary, spec_delta, alive, cfg, speculative, **kw)}


def test_every_guard_is_reported_in_a_fixed_order():
    results = judge_guard_window([rec("baseline")] * 3, [rec("canary")] * 3, GOOD_SPEC, True, CFG, True)
    assert tuple(g.name for g in results) == GUARD_NAMES


def test_a_healthy_window_with_enough_data_passes_every_guard():
    got = judge([rec("baseline") for _ in range(40)], [rec("canary") for _ in range(10)])
    assert {name: g.verdict for name, g in got.items()} == {name: Verdict.PASS for name in GUARD_NAMES}
    assert got["guard_error_rate"].n_canary == 10 and got["guard_error_rate"].n_baseline == 40
    assert got["guard_ttft_p95_slo"].canary == pytest.approx(50.0)
    assert got["guard_acceptance_length"].canary == pytest.approx(3.7)


def test_too_few_canary_requests_is_inconclusive_never_pass():
    got = judge([rec("baseline") for _ in range(40)], [rec("canary") for _ in range(2)], spec_delta=spec(0, (0, 0, 0)))
    for name in ("guard_error_rate", "guard_ttft_p95_slo", "guard_tpot_p95_slo", "guard_acceptance_length"):
        assert got[name].verdict == Verdict.INCONCLUSIVE, got[name]
    got = judge([], [])
    assert got["guard_error_rate"].verdict == Verdict.INCONCLUSIVE
    assert got["guard_replica_health"].verdict == Verdict.PASS


def test_a_dead_canary_replica_fails_the_health_guard():
    got = judge([rec("baseline")] * 10, [rec("canary")] * 10, alive=False)
    assert got["guard_replica_health"].verdict == Verdict.FAIL
    assert "down" in got["guard_replica_health"].detail


def test_a_canary_whose_requests_all_fail_is_caught_with_a_handful_of_requests():
    baseline = [rec("baseline") for _ in range(40)]
    got = judge(baseline, [rec("canary", ok=False) for _ in range(5)], looks=5)
    g = got["guard_error_rate"]
    assert g.verdict == Verdict.FAIL and g.canary == 1.0 and g.baseline == 0.0
    assert g.interval is not None and g.interval[0] > 0.05
    # fewer than MIN_CANARY_ERRORS errors never abort, however bad they look
    assert judge(baseline, [rec("canary", ok=False) for _ in range(2)])["guard_error_rate"].verdict == Verdict.INCONCLUSIVE


def test_one_or_two_stray_errors_do_not_abort():
    baseline = [rec("baseline") for _ in range(60)]
    for errors in (1, 2):
        canary = [rec("canary", ok=False) for _ in range(errors)] + [rec("canary") for _ in range(20 - errors)]
        assert judge(baseline, canary)["guard_error_rate"].verdict != Verdict.FAIL


def test_errors_as_bad_in_the_baseline_are_not_the_canarys_fault():
    baseline = [rec("baseline", ok=False) for _ in range(20)] + [rec("baseline") for _ in range(20)]
    canary = [rec("canary", ok=False) for _ in range(5)] + [rec("canary") for _ in range(5)]
    got = judge(baseline, canary)["guard_error_rate"]
    assert got.verdict == Verdict.PASS, got.detail  # 50% vs 50%


def test_cancelled_records_are_not_errors_and_not_requests():
    canary = [rec("canary", ok=False, cancelled=True) for _ in range(10)] + [rec("canary") for _ in range(6)]
    got = judge([rec("baseline")] * 20, canary)["guard_error_rate"]
    assert got.verdict == Verdict.PASS and got.n_canary == 6 and got.canary == 0.0


def test_latency_slos_fail_only_on_evidence():
    baseline = [rec("baseline") for _ in range(40)]
    slow = [rec("canary", ttft=0.9, tpot=0.3) for _ in range(20)]
    got = judge(baseline, slow)
    assert got["guard_ttft_p95_slo"].verdict == Verdict.FAIL
    assert got["guard_tpot_p95_slo"].verdict == Verdict.FAIL
    # two slow requests of 20 put the sample p95 above the SLO, but prove nothing
    mixed = [rec("canary", ttft=0.9) for _ in range(2)] + [rec("canary") for _ in range(18)]
    got = judge(baseline, mixed)
    assert got["guard_ttft_p95_slo"].canary > 500
    assert got["guard_ttft_p95_slo"].verdict == Verdict.INCONCLUSIVE
    # tpot needs two tokens: one-token answers are no TPOT samples
    got = judge(baseline, [rec("canary", tokens=1) for _ in range(10)])
    assert got["guard_tpot_p95_slo"].verdict == Verdict.INCONCLUSIVE


def test_unconfigured_guards_are_disabled_and_named_as_such():
    cfg = GuardConfig()
    got = judge([rec("baseline")] * 10, [rec("canary", ttft=5.0)] * 10, cfg=cfg, speculative=False)
    for name in ("guard_ttft_p95_slo", "guard_tpot_p95_slo", "guard_acceptance_length"):
        assert got[name].verdict == Verdict.PASS and got[name].detail.startswith("disabled: ")
    assert enabled_guard_names(cfg, speculative_canary=False) == ["guard_replica_health", "guard_error_rate"]
    assert enabled_guard_names(CFG, speculative_canary=True) == list(GUARD_NAMES)


def test_acceptance_length_floor():
    canary = [rec("canary") for _ in range(10)]
    low = spec(200, (10, 2, 0))  # mean length 1.06
    assert judge([], canary, spec_delta=low)["guard_acceptance_length"].verdict == Verdict.FAIL
    # 1.06 with only 10 drafts: not judged
    assert judge([], canary, spec_delta=spec(10, (1, 0, 0)))["guard_acceptance_length"].verdict == Verdict.INCONCLUSIVE
    # no scrape: not judged
    assert judge([], canary, spec_delta=None)["guard_acceptance_length"].verdict == Verdict.INCONCLUSIVE
    # a speculative canary that served requests without a single draft: speculation stopped
    got = judge([], canary, spec_delta=SpecDecodeStats())["guard_acceptance_length"]
    assert got.verdict == Verdict.FAIL and "no drafts" in got.detail
    # ... even with no floor configured
    no_floor = CFG.model_copy(update={"min_acceptance_length": None})
    assert judge([], canary, spec_delta=SpecDecodeStats(), cfg=no_floor)["guard_acceptance_length"].verdict == Verdict.FAIL
    assert judge([], canary, spec_delta=GOOD_SPEC, cfg=no_floor)["guard_acceptance_length"].verdict == Verdict.PASS
    # near the floor with a wide spread: inconclusive rather than an abort
    near = spec(60, (40, 20, 20))  # 1 + 80/60 = 2.33 vs floor 2.4
    cfg = CFG.model_copy(update={"min_acceptance_length": 2.4})
    assert judge([], canary, spec_delta=near, cfg=cfg)["guard_acceptance_length"].verdict == Verdict.INCONCLUSIVE


def test_looks_must_be_positive():
    with pytest.raises(ValueError):
        judge_guard_window([], [], None, True, CFG, True, looks=0)


# -- error rates by simulation ------------------------------------------------------
ALPHA_LOOK = GUARD_ALPHA / (4 * 5)  # four statistical guards, five looks per window


@pytest.mark.parametrize(
    "p_baseline, n_baseline, n_canary",
    [(0.0, 90, 10), (0.01, 90, 10), (0.01, 50, 50), (0.05, 200, 20), (0.2, 100, 100), (0.01, 0, 30)],
)
def test_error_guard_almost_never_aborts_a_canary_as_good_as_the_baseline(p_baseline, n_baseline, n_canary):
    rng = np.random.default_rng(7)
    trials = 20_000
    kb = rng.binomial(n_baseline, p_baseline, trials)
    kc = rng.binomial(n_canary, p_baseline, trials)
    fails, _ = error_guard_fails(kb, n_baseline, kc, n_canary, 0.05, ALPHA_LOOK)
    assert fails.sum() == 0


@pytest.mark.parametrize(
    "p_baseline, n_baseline, n_canary",
    [(0.02, 90, 10), (0.02, 40, 5), (0.0, 90, 10), (0.02, 50, 50), (0.02, 500, 500), (0.1, 200, 200), (0.3, 100, 100)],
)
def test_error_guard_holds_its_level_for_a_canary_exactly_at_the_limit(p_baseline, n_baseline, n_canary):
    # the worst case the bound is about: canary error rate = baseline + limit
    rng = np.random.default_rng(11)
    trials, alpha = 400_000, 0.001
    kb = rng.binomial(n_baseline, p_baseline, trials)
    kc = rng.binomial(n_canary, p_baseline + 0.05, trials)
    fails, _ = error_guard_fails(kb, n_baseline, kc, n_canary, 0.05, alpha)
    rate = fails.mean()
    # binomial noise of the simulation: allow 3 standard errors above alpha
    assert rate <= alpha + 3 * np.sqrt(alpha / trials), rate


@pytest.mark.parametrize("n_baseline", [40, 200])
def test_error_guard_catches_a_dead_canary_with_five_requests(n_baseline):
    fails, _ = error_guard_fails(0, n_baseline, 5, 5, 0.05, ALPHA_LOOK)
    assert bool(fails)


def test_slo_guard_holds_its_level_at_the_slo():
    # P(slower than the SLO) = 5% exactly: the true p95 is the SLO
    rng = np.random.default_rng(3)
    cfg = GuardConfig(ttft_p95_max_s=0.5, min_requests=5)
    fails = 0
    trials = 2_000
    for _ in range(trials):
        n = 30
        slow = rng.random(n) < 0.05
        canary = [rec("canary", ttft=0.9 if s else 0.1) for s in slow]
        got = judge([], canary, cfg=cfg, speculative=False)
        fails += got["guard_ttft_p95_slo"].verdict == Verdict.FAIL
    assert fails == 0  # level is ~1e-4 per window: none expected in 2000
    # and the test itself is exact: the binomial tail at the smallest failing count is below the level
    alpha = GUARD_ALPHA / 2
    k = next(k for k in range(31) if sps.binom.sf(k - 1, 30, 0.05) < alpha)
    canary = [rec("canary", ttft=0.9) for _ in range(k)] + [rec("canary", ttft=0.1) for _ in range(30 - k)]
    assert judge([], canary, cfg=cfg, speculative=False)["guard_ttft_p95_slo"].verdict == Verdict.FAIL
    canary = [rec("canary", ttft=0.9) for _ in range(k - 1)] + [rec("canary", ttft=0.1) for _ in range(31 - k)]
    assert judge([], canary, cfg=cfg, speculative=False)["guard_ttft_p95_slo"].verdict != Verdict.FAIL


def test_acceptance_guard_rarely_aborts_a_canary_at_its_floor():
    # per-position acceptance 0.7 conditional: mean length 1 + .7 + .49 + .343 = 2.533
    rng = np.random.default_rng(5)
    floor = 1 + 0.7 + 0.49 + 0.343
    cfg = CFG.model_copy(update={"min_acceptance_length": floor})
    canary = [rec("canary") for _ in range(10)]
    fails = 0
    for _ in range(2_000):
        drafts = 40
        accepted = np.zeros(drafts, dtype=int)
        alive = np.ones(drafts, dtype=bool)
        per_pos = []
        for _pos in range(3):
            alive &= rng.random(drafts) < 0.7
            per_pos.append(float(alive.sum()))
            accepted += alive
        delta = spec(drafts, tuple(per_pos))
        fails += judge([], canary, spec_delta=delta, cfg=cfg)["guard_acceptance_length"].verdict == Verdict.FAIL
    assert fails <= 2
