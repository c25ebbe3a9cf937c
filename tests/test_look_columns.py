"""The looks read from arrays give the judge exactly what it reads record by record, and a contrast that
persists beyond the plan's look-to-look correlation widens the objective's intervals or stops its pass.

`experiment_looks.RecordColumns` is the calibration's fast path: a stream read once into arrays, each
look's samples and counts sliced from them. These tests hold it to the record-by-record path
(`latency_samples_by_arm`, `requests_by_arm`, and `judge_look` itself, verdicts and details) on a
stream with every kind of record the rule treats apart: failed, cancelled, untimed, another arm's.
"""

from __future__ import annotations

import math

import numpy as np

from cluster.arms import BASELINE, CANARY
from loadtests.records import RequestRecord
from rollout.judge import stats
from rollout.judge.config import GatesConfig
from rollout.judge.experiment_looks import (
    LookPlan,
    RecordColumns,
    judge_look,
    next_information,
    requests_by_arm,
)
from rollout.judge.latency import LatencySamples, judge_latency, latency_samples_by_arm
from rollout.judge.names import OBJECTIVE_NAME, TWIN_ARM
from rollout.judge.verdicts import Verdict

ARMS = (BASELINE, CANARY, TWIN_ARM)


def _stream(seed: int, n: int = 720, level_of=None) -> list[RequestRecord]:
    """Records of three arms in turn; some failed, cancelled, untimed (one output token) or of no arm."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        arm = ARMS[i % 3] if rng.random() > 0.01 else None
        look = i // 120
        level = 0.0 if level_of is None else level_of(arm, look)
        ttft = float(0.15 * math.exp(rng.normal(0.0, 0.5) + level))
        tpot = float(0.03 * math.exp(rng.normal(0.0, 0.25) + level))
        failed, cancelled, untimed = rng.random() < 0.02, rng.random() < 0.01, rng.random() < 0.01
        tokens = 1 if untimed else 16
        records.append(RequestRecord(
            request_id=f"r{i}", tag="experiment", worker="w", sent_at=float(i), pinned_arm=arm,
            arm=arm if rng.random() > 0.3 else None, ok=not failed, status=500 if failed else 200,
            ttft_s=None if failed else ttft, e2e_s=0.05 if failed else ttft + tpot * (tokens - 1),
            output_tokens=None if failed else tokens, cancelled=cancelled,
        ))
    return records


def _same_samples(a: LatencySamples, b: LatencySamples) -> None:
    for name in ("ttft_s", "tpot_s", "e2e_s", "window", "error_window"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert (a.n_errors, a.n_total) == (b.n_errors, b.n_total)


def test_the_columns_give_every_prefix_the_samples_and_counts_the_records_give():
    """Rule: for every look's prefix, the columns' samples (values, order, looks, errors, totals) and counts
    equal the record-by-record rule's."""
    records = _stream(1)
    columns = RecordColumns.of(records, ARMS)
    looks_of = [1 + i // 90 for i in range(len(records))]
    for end in (1, 89, 90, 400, len(records)):
        by_records = latency_samples_by_arm(records[:end], looks_of[:end], ARMS)
        by_columns = columns.samples_by_arm(end, looks_of[:end], ARMS)
        for arm in ARMS:
            _same_samples(by_records[arm], by_columns[arm])
        assert columns.counts(end, ARMS) == requests_by_arm(records[:end], ARMS)


def test_judge_look_with_the_columns_judges_every_look_as_the_records_do():
    """Rule: the fast path changes no verdict and no number: every gate of every look is equal, twin included."""
    records = _stream(2)
    plan = LookPlan(40, 200, 1.0, 1, 1e9, twin=True)
    cfg = GatesConfig()
    columns = RecordColumns.of(records, plan.arms)
    looks_of: list[int] = []
    fractions: list[float] = []
    start = 0
    for look, end in enumerate(range(120, len(records) + 1, 120), start=1):
        looks_of += [look] * (end - start)
        start = end
        fractions.append(next_information(fractions, plan.information(requests_by_arm(records[:end], plan.arms))))
        slow = judge_look(records[:end], looks_of, fractions, cfg, plan, None, False)
        fast = judge_look(records[:end], looks_of, fractions, cfg, plan, None, False, columns=columns)
        assert [g.model_dump() for g in slow] == [g.model_dump() for g in fast]


def test_the_look_correlation_estimate_is_corrected_for_few_looks_and_folded_up_to_the_ceiling():
    """Rule: too few looks say nothing; the lag-1 autocorrelation's small-sample bias is undone; the fold never
    lowers the plan's correlation, rounds up, and stops at the ceiling."""
    assert math.isnan(stats.look_correlation_estimate(np.arange(stats.LOOK_CORRELATION_MIN_LOOKS - 1.0)))
    rng = np.random.default_rng(3)
    g, rho = 13, 0.5
    estimates, raw = [], []
    for _ in range(4000):
        x = np.empty(g)
        x[0] = rng.normal()
        for t in range(1, g):
            x[t] = rho * x[t - 1] + math.sqrt(1 - rho * rho) * rng.normal()
        estimates.append(stats.look_correlation_estimate(x))
        raw.append(stats.lag_one_autocorrelation(x))
    assert np.mean(raw) < rho - 0.1  # the raw estimate is biased down at 13 looks
    assert abs(np.mean(estimates) - rho) < 0.1
    assert stats.folded_look_correlation(0.3, 0.5) == 0.5
    assert stats.folded_look_correlation(0.61, 0.5) == 0.65
    assert stats.folded_look_correlation(0.99, 0.5) == stats.LOOK_CORRELATION_CEILING
    assert stats.folded_look_correlation(math.nan, 0.5) == 0.5


def _drifting(seed: int, looks: int, step: float) -> tuple[LatencySamples, LatencySamples]:
    """Both arms' TPOT samples, 40 a look; the canary's log-level walks away from the baseline's by ``step`` a look
    (a trend: the contrast persists beyond any AR(1) correlation) and is 0.8 x the baseline's on average."""
    rng = np.random.default_rng(seed)
    window = np.repeat(np.arange(1, looks + 1), 40)
    trend = (window - (looks + 1) / 2.0) * step

    def arm(shift: np.ndarray) -> LatencySamples:
        tpot = 0.03 * np.exp(rng.normal(0.0, 0.05, window.size) + shift)
        return LatencySamples(ttft_s=np.full(window.size, 0.15), tpot_s=tpot, e2e_s=0.15 + 15 * tpot, n_errors=0,
                              n_total=window.size, window=window, error_window=np.zeros(0, dtype=int))

    return arm(np.zeros(window.size)), arm(math.log(0.8) - trend)


def test_a_contrast_that_trends_across_the_looks_never_passes_silently():
    """Rule: a canary whose advantage over the baseline grows look by look (the contrast a trend, its look-to-look
    correlation estimated above the ceiling) does not PASS the objective: INCONCLUSIVE, the detail naming the
    dependence beyond the plan. Without the trend the same canary passes (the check costs no power there)."""
    cfg = GatesConfig(tpot_p50_min_improvement=0.1)
    fractions = [k / 13 for k in range(1, 14)]
    baseline, canary = _drifting(4, 13, 0.02)
    objective = next(g for g in judge_latency(baseline, canary, cfg, look=13, max_looks=13, information=fractions)
                     if g.name == OBJECTIVE_NAME)
    assert objective.verdict is Verdict.INCONCLUSIVE
    assert "Dependence beyond the plan" in objective.detail
    baseline, canary = _drifting(4, 13, 0.0)
    objective = next(g for g in judge_latency(baseline, canary, cfg, look=13, max_looks=13, information=fractions)
                     if g.name == OBJECTIVE_NAME)
    assert objective.verdict is Verdict.PASS, objective.detail
