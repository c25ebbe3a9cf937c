"""decision.json arms.<arm>.kv read back (rollout.record.document.KvRecord) has the fields cluster.metrics.KvCacheStats
writes, one list of them: each read leniently (a document older than a field still reads)."""

from __future__ import annotations

from cluster.metrics import KvCacheStats
from rollout.record.document import KvRecord


def test_a_kv_record_reads_back_every_field_kv_cache_stats_writes():
    stats = KvCacheStats(samples=4, usage_peak=0.75, usage_mean=0.5, preemptions=0.0, capacity_tokens=4096.0,
                         num_gpu_blocks=256.0, block_size=16.0, prefix_cache_queries=200.0, prefix_cache_hits=50.0)
    written = stats.to_dict()
    assert list(KvRecord.model_fields) == list(written)
    assert KvRecord.model_validate(written).model_dump() == written
    assert KvRecord().model_dump() == KvCacheStats().to_dict()  # the same defaults


def test_a_kv_section_older_than_the_prefix_cache_counters_still_reads():
    old = {"samples": 3, "usage_peak": 0.4, "usage_mean": 0.2, "preemptions": None, "capacity_tokens": 1024,
           "num_gpu_blocks": 64, "block_size": 16}
    record = KvRecord.model_validate(old)
    assert record.prefix_cache_hits is None and record.prefix_cache_hit_rate is None and record.samples == 3
    assert KvRecord.model_validate({"samples": None, "usage_peak": None}).samples is None  # lenient, never refused
