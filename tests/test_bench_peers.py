"""The peers benchmark (benchmarks/peers.py) reads each peer's own report right, and judges
a 4-token chunk timed as one token: on canned samples of the reports' formats (trimmed from
real runs of the pinned versions), with no network and no peer installed."""

from __future__ import annotations

import json

import pytest

from benchmarks.peers import (
    Row,
    Schedule,
    ToolTimings,
    judge_timings,
    parse_aiperf,
    parse_args,
    parse_guidellm,
    parse_inference_perf,
    parse_vllm,
)


def _dist(median: float, key: str = "median") -> dict:
    return {"mean": median * 1.01, key: median, "min": median * 0.9, "max": median * 1.2, "count": 4}


def test_guidellm_report_gives_its_ttft_and_its_ttft_free_per_token_latency(tmp_path):
    metrics = {
        "request_totals": {"successful": 4, "errored": 0, "incomplete": 0, "total": 4},
        "time_to_first_token_ms": {"successful": _dist(77.87)},
        # E2E / tokens, TTFT included: not the schedule's TPOT, so not the one read
        "time_per_output_token_ms": {"successful": _dist(10.50)},
        "inter_token_latency_ms": {"successful": _dist(9.76)},
        "output_token_count": {"successful": _dist(128.0)},
    }
    (tmp_path / "benchmarks.json").write_text(json.dumps({"benchmarks": [{"type_": "generative_benchmark",
                                                                          "metrics": metrics}]}))
    got = parse_guidellm(tmp_path, "")
    assert got == ToolTimings(ttft_p50_ms=77.87, tpot_p50_ms=9.76, itl_p50_ms=None, tokens_per_request=128.0,
                              requests=4)


def test_aiperf_report_and_its_retokenized_count(tmp_path):
    report = {"request_count": {"unit": "requests", "avg": 4.0},
              "time_to_first_token": {"unit": "ms", "avg": 143.5, "p50": 144.6, "p99": 159.3},
              "inter_token_latency": {"unit": "ms", "avg": 4.73, "p50": 4.73},
              "inter_chunk_latency": {"unit": "ms", "avg": 40.1, "p50": 40.0},
              "output_sequence_length": {"unit": "tokens", "avg": 256.0, "p50": 256.0}}
    (tmp_path / "artifacts" / "run").mkdir(parents=True)
    (tmp_path / "artifacts" / "run" / "profile_export_aiperf.json").write_text(json.dumps(report))
    got = parse_aiperf(tmp_path, "")
    assert (got.ttft_p50_ms, got.tpot_p50_ms, got.tokens_per_request, got.requests) == (144.6, 4.73, 256.0, 4)
    row = Row(tool="aiperf", version="0.13.0", streams=2, requests=4)
    judge_timings(row, got, Schedule())
    # its own tokenizer doubled the count: half the per-token latency, no chunk counted as a token
    assert row.tpot_error == pytest.approx(-0.527) and row.chunk_as_token is False
    assert row.ttft_p50_error_ms == pytest.approx(94.6)


def test_inference_perf_report_in_seconds(tmp_path):
    latency = {"time_to_first_token": _dist(0.0733), "time_per_output_token": _dist(0.00508),
               "inter_token_latency": _dist(0.0)}
    summary = {"successes": {"count": 4, "latency": latency, "output_len": _dist(256.0)}, "failures": {"count": 0}}
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "summary_lifecycle_metrics.json").write_text(json.dumps(summary))
    got = parse_inference_perf(tmp_path, "")
    assert got.ttft_p50_ms == pytest.approx(73.3) and got.tpot_p50_ms == pytest.approx(5.08)
    assert (got.itl_p50_ms, got.tokens_per_request, got.requests) == (None, 256.0, 4)


def test_a_per_chunk_itl_or_a_chunk_count_is_a_chunk_timed_as_one_token():
    schedule = Schedule()  # 4 tokens per chunk, TPOT 10 ms: a chunk every 40 ms, 33 chunks per answer
    stdout = "its table\n" + json.dumps({"ttft_p50_ms": 54.6, "tpot_median_ms": 10.1, "itl_p50_ms": 40.2,
                                         "tokens_per_request": 128, "ok": 256})
    vllm = Row(tool="vllm-bench", version="vllm", streams=32, requests=256)
    judge_timings(vllm, parse_vllm(None, stdout), schedule)
    assert vllm.chunk_as_token is True and vllm.tpot_error == pytest.approx(0.01)
    assert vllm.itl_error == pytest.approx(3.02)

    counted = Row(tool="x", version="1", streams=32, requests=256)
    judge_timings(counted, ToolTimings(50.0, 40.0, None, 33.0, 256), schedule)
    assert counted.chunk_as_token is True

    right = Row(tool="ours", version="locust", streams=32, requests=256)
    judge_timings(right, ToolTimings(51.6, 10.02, None, 128.0, 250), schedule)
    assert right.chunk_as_token is False and right.tpot_error == pytest.approx(0.002)
    assert right.notes == ["it reported 250 of 256 requests"]


def test_bad_arguments_name_the_field():
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--tools", "ours,locust-classic"])
    assert stopped.value.code == 2
    with pytest.raises(SystemExit):
        parse_args(["--streams", "32,many"])
    args = parse_args(["--tools", "ours,guidellm", "--streams", "32,128"])
    assert (args.tools, args.streams) == (["ours", "guidellm"], [32, 128])
