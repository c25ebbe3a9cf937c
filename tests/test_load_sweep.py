"""Speedup vs load: the per-level summary of a stepped sweep (pure)."""

from __future__ import annotations

import pytest

from loadtests.records import RequestRecord
from rollout.analysis.load_sweep import summarize_sweep, sweep_table


def record(i: int, arm: str, level: float, tpot_s: float, tokens: int = 33, chunks: int = 9, ok: bool = True,
           cancelled: bool = False) -> RequestRecord:
    ttft = 0.1
    return RequestRecord(request_id=f"{arm}-{level}-{i}", tag="sweep", worker="w", arm=arm, level=level,
                         sent_at=1000.0 + i, ttft_s=ttft, e2e_s=ttft + tpot_s * (tokens - 1), output_tokens=tokens,
                         chunks=chunks, ok=ok, status=200 if ok else 500, cancelled=cancelled)


def test_each_level_gets_its_own_ratio_and_client_acceptance_view():
    records = []
    for i in range(10):
        records += [record(i, "baseline", 1, 0.030), record(i, "canary", 1, 0.015)]
        records += [record(i, "baseline", 4, 0.050), record(i, "canary", 4, 0.045)]
    records.append(record(99, "canary", 4, 9.0, cancelled=True))  # cut off by the stop: not a sample
    records.append(record(98, "canary", 4, 9.0, ok=False))  # an error counts, its latency does not
    rows = summarize_sweep(records, ("baseline", "canary"), step_s=10)
    assert [r["level"] for r in rows] == [1, 4]
    assert rows[0]["tpot_ratio"] == pytest.approx(0.5, abs=1e-3)
    assert rows[1]["tpot_ratio"] == pytest.approx(0.9, abs=1e-3)
    canary4 = rows[1]["arms"]["canary"]
    assert canary4["requests"] == 11 and canary4["errors"] == 1
    assert canary4["tpot_p50_ms"] == pytest.approx(45.0, abs=0.01)
    assert canary4["tokens_per_chunk"] == pytest.approx(4.0)  # (33 - 1) / (9 - 1)
    assert rows[0]["arms"]["baseline"]["output_tokens_per_s"] == pytest.approx(33.0)  # 10 x 33 tokens / 10 s
    table = sweep_table(rows, ("baseline", "canary"))
    assert len(table) == 4 and "| 1 | 30.00 | 15.00 | 0.50 |" in table[2]


def test_a_level_without_canary_latency_has_no_ratio():
    rows = summarize_sweep([record(0, "baseline", 2, 0.03)], ("baseline", "canary"), step_s=5)
    assert rows[0]["tpot_ratio"] is None and rows[0]["arms"]["canary"]["requests"] == 0
    assert "n/a" in sweep_table(rows, ("baseline", "canary"))[2]


def test_goodput_vs_load_with_an_slo():
    from rollout.judge.config import SloConfig

    records = []
    for i in range(10):
        # at 1 stream every request meets a 40 ms TPOT bound; at 4 the canary's do, the baseline's
        # slow half misses it, and one failed canary request misses whatever its latency
        records += [record(i, "baseline", 1, 0.030), record(i, "canary", 1, 0.015)]
        records += [record(i, "baseline", 4, 0.030 if i < 5 else 0.050), record(i, "canary", 4, 0.035)]
    records.append(record(98, "canary", 4, 0.01, ok=False))
    rows = summarize_sweep(records, ("baseline", "canary"), step_s=10, slo=SloConfig(tpot_s=0.040))
    assert [(r["arms"]["baseline"]["goodput"], r["arms"]["canary"]["goodput"]) for r in rows] == [
        (1.0, 1.0), (0.5, pytest.approx(10 / 11))]
    table = sweep_table(rows, ("baseline", "canary"))
    assert table[-1].startswith("Goodput vs load") and "4 streams 0.50 / 0.91" in table[-1]
    assert all(arm["goodput"] is None for row in summarize_sweep(records, ("baseline", "canary"), step_s=10)
               for arm in row["arms"].values())  # no SLO, no goodput
