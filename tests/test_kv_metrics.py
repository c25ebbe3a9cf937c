"""The KV cache record of an arm (decision.json arms.<arm>.kv, report.md) from vLLM's /metrics.

tests/data/vllm_metrics/ holds two real /metrics pages of a vLLM 0.32 CPU server (the tiny MiMo-V2
checkpoint, k=1 MTP, 1 GiB KV cache): one taken while 3 greedy streams ran, one after they ended.
They are parsed with prometheus_client's parser, as a replica's scrape is."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.metrics import KvCacheStats, MetricsSampler, kv_stats, parse_metrics
from rollout.record.document import DecisionDocument
from rollout.record.markdown import _kv_cache as kv_section
from tests.conftest import REPO


def _kv_cache(doc: dict) -> list[str]:
    """report.md's KV cache lines of a decision.json holding `doc` (read as the renderer reads it)."""
    return kv_section(DecisionDocument.of(doc))

DATA = REPO / "tests" / "data" / "vllm_metrics"
BUSY = (DATA / "cpu-tiny-3-streams.txt").read_text()
IDLE = (DATA / "cpu-tiny-idle.txt").read_text()


def with_preemptions(text: str, count: float) -> str:
    """The page as the server would show it after `count` preemptions (the counter's one line)."""
    line = next(l for l in text.splitlines() if l.startswith("vllm:num_preemptions_total{"))
    return text.replace(line, line.rsplit(" ", 1)[0] + f" {count}")


def test_a_real_metrics_page_gives_usage_preemptions_and_capacity():
    busy, idle = parse_metrics(BUSY), parse_metrics(IDLE)
    assert busy.kv_cache_usage == pytest.approx(0.0014650225857648635)
    assert idle.kv_cache_usage == 0.0
    assert busy.preemptions == 0.0 and busy.requests_running == 3.0
    # vllm:cache_config_info's labels: 8192 blocks of 128 tokens; vLLM's own token count beside them
    assert busy.num_gpu_blocks == 8192 and busy.block_size == 128 and busy.kv_capacity_tokens == 239674
    assert parse_metrics(with_preemptions(IDLE, 7)).preemptions == 7


def test_a_page_without_kv_metrics_reads_as_unknown_not_zero():
    bare = "\n".join(l for l in IDLE.splitlines() if "kv_cache_usage" not in l and "cache_config_info" not in l)
    snap = parse_metrics(bare + "\n")
    assert snap.kv_cache_usage is None and snap.num_gpu_blocks is None and snap.kv_capacity_tokens is None
    assert kv_stats([{"r": snap}], ["r"]).usage_peak is None


def test_an_arm_gets_peak_and_mean_usage_and_the_preemptions_of_the_phase():
    start, busy, end = parse_metrics(with_preemptions(IDLE, 2)), parse_metrics(BUSY), parse_metrics(with_preemptions(IDLE, 5))
    other = parse_metrics(with_preemptions(IDLE, 1))
    samples = [{"canary-0": start, "canary-1": other}, {"canary-0": busy, "baseline-0": end}, {"canary-0": end, "canary-1": other}]
    stats = kv_stats(samples, ["canary-0", "canary-1"])
    assert stats.samples == 3
    assert stats.usage_peak == pytest.approx(busy.kv_cache_usage)
    assert stats.usage_mean == pytest.approx(busy.kv_cache_usage / 5)  # 5 replica samples, one of them busy
    # preemptions during the phase, not since boot: canary-0 went 2 -> 5, canary-1 stayed at 1
    assert stats.preemptions == 3
    assert (stats.capacity_tokens, stats.num_gpu_blocks, stats.block_size) == (239674, 8192, 128)


def test_a_restart_or_a_replica_never_scraped_leaves_the_preemptions_unknown():
    high, low = parse_metrics(with_preemptions(IDLE, 9)), parse_metrics(IDLE)
    assert kv_stats([{"r": high}, {"r": low}], ["r"]).preemptions is None  # the counter went down
    assert kv_stats([{"r": low}], ["r", "never"]).preemptions is None
    assert kv_stats([], ["r"]) == KvCacheStats()


def test_the_sampler_keeps_the_phases_own_scrapes_and_its_own():
    calls = []
    lock = threading.Lock()

    def scrape():
        with lock:
            calls.append(threading.current_thread().name)
        return {"r": parse_metrics(BUSY)}

    sampler = MetricsSampler(scrape, every_s=0.05).start()
    assert sampler.recording()["r"].kv_cache_usage > 0  # the phase's scrape goes through and is kept
    deadline = time.monotonic() + 30
    while "metrics-sampler" not in calls and time.monotonic() < deadline:
        time.sleep(0.05)
    samples = sampler.stop()
    assert "metrics-sampler" in calls and len(samples) == len(calls)
    assert kv_stats(samples, ["r"]).samples == len(calls)


def test_report_md_shows_each_arms_kv_cache_and_nothing_without_it():
    stats = kv_stats([{"b": parse_metrics(BUSY)}, {"b": parse_metrics(with_preemptions(IDLE, 4))}], ["b"])
    doc = {"arms": {"baseline": {"kv": stats.to_dict()}, "canary": {"kv": KvCacheStats().to_dict()}}}
    lines = _kv_cache(doc)
    row = next(l for l in lines if l.startswith("| baseline |"))
    assert "| 0.1% | 0.1% | 4 | 239674 | 8192 x 128 | n/a | 2 |" in row  # no prompt token queried between the pages
    assert next(l for l in lines if l.startswith("| canary |")) == "| canary | n/a | n/a | n/a | n/a | n/a | n/a | 0 |"
    assert _kv_cache({"arms": {"baseline": {"replicas": 1}}}) == []


def with_prefix_cache(text: str, queries: float, hits: float) -> str:
    """The page as the server would show it after `queries` prompt tokens looked up, `hits` found."""
    for name, value in (("vllm:prefix_cache_queries_total{", queries), ("vllm:prefix_cache_hits_total{", hits)):
        line = next(l for l in text.splitlines() if l.startswith(name))
        text = text.replace(line, line.rsplit(" ", 1)[0] + f" {value}")
    return text


def test_the_prefix_cache_hit_rate_of_an_arm_is_its_hits_over_its_queries_in_the_phase():
    # the real page's counters (queries 12, hits 0), then the phase's rises on two replicas
    assert (parse_metrics(IDLE).prefix_cache_queries, parse_metrics(IDLE).prefix_cache_hits) == (12.0, 0.0)
    samples = [{"c-0": parse_metrics(with_prefix_cache(IDLE, 100, 10)), "c-1": parse_metrics(with_prefix_cache(IDLE, 0, 0))},
               {"c-0": parse_metrics(with_prefix_cache(IDLE, 1100, 810)), "c-1": parse_metrics(with_prefix_cache(IDLE, 1000, 200))}]
    stats = kv_stats(samples, ["c-0", "c-1"])
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (2000, 1000)  # 1000 + 1000, 800 + 200
    assert stats.prefix_cache_hit_rate == 0.5  # not the mean of the replicas' rates (0.8, 0.2)
    row = next(l for l in _kv_cache({"arms": {"canary": {"kv": stats.to_dict()}}}) if l.startswith("| canary |"))
    assert "| 50.0% of 2000 |" in row
    # a restart (the counter went down) or nothing queried: unknown, never a rate of 0
    restarted = [{"r": parse_metrics(with_prefix_cache(IDLE, 500, 400))}, {"r": parse_metrics(with_prefix_cache(IDLE, 50, 0))}]
    assert kv_stats(restarted, ["r"]).prefix_cache_hit_rate is None
    still = [{"r": parse_metrics(IDLE)}, {"r": parse_metrics(IDLE)}]
    assert kv_stats(still, ["r"]).prefix_cache_queries == 0 and kv_stats(still, ["r"]).prefix_cache_hit_rate is None
    # an old decision.json without the counters still renders
    old = {k: v for k, v in stats.to_dict().items() if not k.startswith("prefix_cache")}
    assert "| n/a |" in next(l for l in _kv_cache({"arms": {"canary": {"kv": old}}}) if l.startswith("| canary |"))
