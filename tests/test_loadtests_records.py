"""RequestRecord: the per-request math the latency gates rely on, and its JSONL form."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtests.records import RequestRecord, read_records, write_records  # noqa: E402


def make_record(**overrides) -> RequestRecord:
    fields = dict(
        request_id="r1", tag="experiment", worker="w0", sent_at=1_700_000_000.0,
        ttft_s=0.050, e2e_s=0.050 + 32 * 0.010, output_tokens=33, chunks=33, ok=True, status=200,
    )
    fields.update(overrides)
    return RequestRecord(**fields)


def test_tpot_comes_from_usage_tokens_not_chunks():
    # a speculative stream: 1 prefill token, then 8 chunks of 4 tokens, 10 ms per token
    record = make_record(output_tokens=33, chunks=9)
    assert record.tpot_s == pytest.approx(0.010)
    # counting chunks as tokens would have said 40 ms
    assert (record.e2e_s - record.ttft_s) / (record.chunks - 1) == pytest.approx(0.040)
    assert record.tokens_per_chunk == pytest.approx(33 / 9)
    assert record.decode_tokens_per_chunk == pytest.approx(4.0)


@pytest.mark.parametrize(
    "overrides",
    [dict(output_tokens=None), dict(output_tokens=1), dict(output_tokens=0), dict(ttft_s=None)],
)
def test_tpot_is_missing_rather_than_guessed(overrides):
    assert make_record(**overrides).tpot_s is None


def test_per_chunk_views_need_chunks():
    record = make_record(chunks=0, output_tokens=None, ttft_s=None, ok=False, status=0, error="refused")
    assert record.tokens_per_chunk is None
    assert record.decode_tokens_per_chunk is None
    assert make_record(chunks=1, output_tokens=1).decode_tokens_per_chunk is None


def test_send_lag_only_for_scheduled_requests():
    assert make_record().send_lag_s is None
    lagging = make_record(scheduled_at=1_700_000_000.0 - 0.25)
    assert lagging.send_lag_s == pytest.approx(0.25)


def test_records_are_frozen():
    with pytest.raises(ValueError):
        make_record().ok = False  # type: ignore[misc]


def test_jsonl_round_trip(tmp_path):
    records = [
        make_record(),
        make_record(request_id="r2", arm="canary", replica="canary-0", scheduled_at=1_700_000_000.5,
                    dataset_index=7, finish_reason="length"),
        make_record(request_id="r3", ttft_s=None, output_tokens=None, chunks=0, ok=False, status=503,
                    error="HTTP 503: overloaded"),
        make_record(request_id="r4", ok=False, cancelled=True, error="cancelled"),
    ]
    path = tmp_path / "records.jsonl"
    assert write_records(path, records) == 4
    assert read_records(path) == records
    assert len(path.read_text().splitlines()) == 4


def test_reading_a_broken_line_names_it(tmp_path):
    path = tmp_path / "records.jsonl"
    write_records(path, [make_record()])
    with open(path, "a") as out:
        out.write('{"request_id": "x"}\n')
    with pytest.raises(ValueError, match=r"records.jsonl:2"):
        read_records(path)
