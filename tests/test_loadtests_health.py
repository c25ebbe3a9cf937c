"""Generator health: a worker's CPU over the test and its busiest window, the open-loop send
lag the master collects from the records, and the verdict that the generator, not the
server, limited the load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtests.collection import RecordCollector, RecordShipper, summary_path_for  # noqa: E402
from loadtests.health import CpuMeter, assess, percentile  # noqa: E402
from loadtests.records import RequestRecord  # noqa: E402


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99)


def test_cpu_meter_average_and_busiest_window():
    meter = CpuMeter(window_s=5.0)
    assert meter.report(1.0, 0.0) == {"cpu_s": None, "wall_s": None, "cpu_peak_pct": None}  # never started
    meter.start(cpu_s=10.0, now=100.0)
    cpu = 10.0
    # 10 s at 20% of a core, then 5 s at 90%, sampled once a second
    for second in range(1, 16):
        cpu += 0.2 if second <= 10 else 0.9
        meter.sample(cpu, 100.0 + second)
    report = meter.report(cpu, 115.0)
    assert report["cpu_s"] == pytest.approx(2.0 + 4.5)
    assert report["wall_s"] == pytest.approx(15.0)
    assert report["cpu_peak_pct"] == pytest.approx(90.0)  # the busy stretch, not the 43% average
    short = CpuMeter(window_s=5.0)
    short.start(0.0, 0.0)
    assert short.report(0.5, 2.0)["cpu_peak_pct"] == pytest.approx(25.0)  # shorter than a window: the average


def test_assess_names_what_limited_the_load():
    calm = assess([("w0", {"cpu_s": 3.0, "wall_s": 10.0, "cpu_peak_pct": 40.0}, [0.001] * 100)],
                  cpu_warn_pct=85, lag_warn_ms=50)
    assert not calm.generator_limited and calm.warnings == []
    assert calm.workers[0].cpu_pct == pytest.approx(30.0) and calm.send_lag_p99_ms == pytest.approx(1.0)

    busy = assess([("w0", {"cpu_s": 3.0, "wall_s": 10.0, "cpu_peak_pct": 97.0}, []),
                   ("w1", {"cpu_s": 1.0, "wall_s": 10.0, "cpu_peak_pct": 20.0}, [])],
                  cpu_warn_pct=85, lag_warn_ms=50)
    assert busy.generator_limited and len(busy.warnings) == 1 and "worker w0 used 97% of one core" in busy.warnings[0]
    assert busy.send_lag_p99_ms is None  # closed loop: no schedule, no lag

    late = assess([("w0", None, [0.001] * 90 + [0.3] * 10)], cpu_warn_pct=85, lag_warn_ms=50)
    assert late.generator_limited and "send lag p99" in late.warnings[0]
    assert late.workers[0].cpu_pct is None  # a worker that never reported its CPU is not judged on it


def record(number: int, **fields) -> RequestRecord:
    base = dict(request_id=f"r{number}", tag="t", worker="w", sent_at=1000.0 + number, e2e_s=0.1, ok=True, status=200)
    base.update(fields)
    return RequestRecord(**base)


def test_the_collection_summary_carries_cpu_lag_and_verdict(tmp_path):
    collector = RecordCollector(tmp_path / "r.jsonl", cpu_warn_pct=85, lag_warn_ms=50)
    collector.test_started_at = 999.5
    shipped = []
    shipper = RecordShipper("w", lambda kind, data: shipped.append((kind, data)), batch_size=2)
    for number in range(4):
        # open loop: the last request left 200 ms late
        shipper.add(record(number, scheduled_at=1000.0 + number - (0.2 if number == 3 else 0.001)))
    shipper.flush_final(1, {"cpu_s": 9.5, "wall_s": 10.0, "cpu_peak_pct": 99.0})
    for kind, data in shipped:
        if kind == "mtp_records":
            collector.receive_batch(data)
        else:
            collector.receive_flushed(data)
    summary = collector.close()
    (worker,) = summary.workers
    assert worker.complete and (worker.cpu_s, worker.wall_s, worker.cpu_peak_pct) == (9.5, 10.0, 99.0)
    generator = summary.generator
    assert generator.scheduled_requests == 4 and generator.send_lag_max_ms == pytest.approx(200.0)
    assert generator.generator_limited and len(generator.warnings) == 2  # CPU and lag
    assert summary.test_started_at == 999.5
    assert summary_path_for(tmp_path / "r.jsonl").read_text() == summary.model_dump_json(indent=2)


@pytest.mark.parametrize("skew_s, shifted", [(30.0, True), (-7.5, True), (0.05, False)])
def test_a_worker_with_a_skewed_clock_has_its_records_put_on_the_masters(tmp_path, skew_s, shifted):
    """Records of a worker on another node must land in the progressive window they ended in on the
    controller's clock: beyond the tolerance its sent_at moves by the estimated offset (the least
    master - worker difference over its batches, here with a 0.1 s delay on one); within it, nothing moves."""
    master_now = [2000.0]
    collector = RecordCollector(tmp_path / "r.jsonl", clock=lambda: master_now[0])
    delays = iter([0.1, 0.0])  # the first batch waited 100 ms in the channel
    shipper = RecordShipper(
        "w", lambda kind, data: (collector.receive_batch(data) if kind == "mtp_records" else None),
        batch_size=2, clock=lambda: master_now[0] - skew_s - next(delays, 0.0),
    )
    for number in range(4):
        shipper.add(record(number, sent_at=1990.0 + number - skew_s, scheduled_at=1990.0 + number - skew_s))
    summary = collector.close()
    written = [RequestRecord.model_validate_json(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    (worker,) = summary.workers
    if shifted:
        assert worker.clock_offset_s == pytest.approx(skew_s)
        # the first batch got the estimate its own delay allowed (+0.1 s), the second the better one
        assert [r.sent_at for r in written] == pytest.approx([1990.1, 1991.1, 1992.0, 1993.0])
        assert all(r.sent_at == r.scheduled_at for r in written)  # send lags are unchanged
    else:
        assert [r.sent_at for r in written] == [1990.0 + n - skew_s for n in range(4)]
