"""SSE parsing, the reading of OpenAI stream chunks, and the client's timing against a
target that streams on a known schedule (benchmarks/stream_target.py).

The timing tests assert what holds on any machine (nothing before the schedule; the client's
stamps agree with when the target really sent); how close to the schedule the client
measures is benchmarks/loadgen.py's to say (`make bench-loadgen`)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import gevent
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.stream_target import TargetProcess, TokenSchedule  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from loadtests.openai_stream import (  # noqa: E402
    OpenAIStreamClient,
    StreamReader,
    RecordLabels,
    StreamRequest,
    summarise_events,
)
from loadtests.sse import TimedEvent, parse_events  # noqa: E402

LABELS = RecordLabels(request_id="r", tag="test", worker="pytest")


def sse(payload) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def completion_chunk(text, finish=None):
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": None}


def chat_chunk(delta, finish=None):
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def usage_chunk(completion_tokens, prompt_tokens=5):
    return {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}}


# --- SSE framing ---------------------------------------------------------------------


def test_events_survive_any_split_of_the_bytes():
    stream = b"".join([
        b": keep-alive comment\n\n",
        sse(completion_chunk(" a")),
        b"event: message\r\ndata: {\"x\":\r\ndata: 1}\r\n\r\n",  # CRLF, a two-line data field
        b"data:no-space\n\n",
        b"data: [DONE]\n\n",
    ])
    whole = [e.data for e in parse_events([(0.0, stream)])]
    assert whole == [json.dumps(completion_chunk(" a")), '{"x":\n1}', "no-space", "[DONE]"]
    for cut in range(1, len(stream)):
        pieces = [(1.0, stream[:cut]), (2.0, stream[cut:])]
        assert [e.data for e in parse_events(pieces)] == whole, cut


def test_an_event_is_stamped_when_its_data_line_completed():
    pieces = [(1.0, b"data: {\"a\""), (2.0, b": 1}\n"), (3.0, b"\n"), (4.0, b"data: [DONE]\n\n")]
    assert parse_events(pieces) == [TimedEvent(2.0, '{"a": 1}'), TimedEvent(4.0, "[DONE]")]


def test_a_last_event_without_its_blank_line_is_kept():
    assert [e.data for e in parse_events([(1.0, b"data: [DONE]")])] == ["[DONE]"]
    assert [e.data for e in parse_events([(1.0, b"data: [DONE]\n")])] == ["[DONE]"]


VLLM_LIKE = b"".join(
    [sse({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}) for i in range(6)]
    + [b": ping\n\n", b"data: {\"a\":\ndata: 2}\n\n", sse(usage_chunk(6)), b"data: [DONE]\n\n"]
)


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=len(VLLM_LIKE) - 1), max_size=12, unique=True),
       crlf=st.booleans())
def test_events_and_their_read_times_do_not_depend_on_how_the_bytes_were_cut(cuts, crlf):
    stream = VLLM_LIKE.replace(b"\n", b"\r\n") if crlf else VLLM_LIKE
    bounds = [0] + sorted(c for c in cuts if c < len(stream)) + [len(stream)]
    pieces = [(float(i), stream[a:b]) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    events = parse_events(pieces)
    assert [e.data for e in events] == [e.data for e in parse_events([(0.0, stream)])]
    assert len(events) == 9 and events[6].data == '{"a":\n2}'
    # each event is stamped with the read that completed its last data line
    for event in events:
        payload = f"data: {event.data.splitlines()[-1]}".encode()
        line_end = stream.index(payload) + len(payload) + (1 if crlf else 0)  # the LF of that line
        piece = next(i for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if a <= line_end < b)
        assert event.received_s == float(piece), (event, pieces)
    # read by read, as the client does, the stream says the same as parsed whole
    reader = StreamReader(started_s=-1.0, endpoint="completions")
    for read_s, piece in pieces:
        reader.feed(read_s, piece)
    incremental = reader.outcome()
    assert incremental == summarise_events(events, -1.0, "completions")
    assert (incremental.chunks, incremental.output_tokens, incremental.error) == (6, 6, None)
    assert reader.bytes == len(stream)


# --- reading OpenAI chunks -----------------------------------------------------------


def timed(*payloads, start=0.0, step=0.01):
    return [TimedEvent(start + i * step, p if isinstance(p, str) else json.dumps(p)) for i, p in enumerate(payloads)]


def test_completion_stream_with_several_tokens_per_chunk():
    events = timed(
        completion_chunk(" t"), completion_chunk(" t t t t"), completion_chunk(" t t t t", "length"),
        usage_chunk(9), "[DONE]", start=0.05, step=0.04,
    )
    outcome = summarise_events(events, started_s=0.0, endpoint="completions")
    assert outcome.ttft_s == pytest.approx(0.05)
    assert outcome.chunks == 3
    assert outcome.output_tokens == 9
    assert outcome.prompt_tokens == 5
    assert outcome.finish_reason == "length"
    assert outcome.saw_done and outcome.error is None


def test_chat_role_announcement_is_not_a_token():
    events = timed(
        chat_chunk({"role": "assistant", "content": ""}),
        chat_chunk({"content": "Hi"}),
        chat_chunk({"content": ""}),  # a step whose tokens are half a character so far
        chat_chunk({"content": ""}, "stop"),  # the EOS step
        usage_chunk(4), "[DONE]", start=1.0, step=0.1,
    )
    outcome = summarise_events(events, started_s=0.5, endpoint="chat")
    assert outcome.ttft_s == pytest.approx(0.6)  # the "Hi" chunk, not the role chunk at 0.5
    assert outcome.chunks == 3
    assert outcome.finish_reason == "stop"


def test_reasoning_content_counts_as_output():
    events = timed(chat_chunk({"role": "assistant", "reasoning_content": "think"}), usage_chunk(1), "[DONE]")
    outcome = summarise_events(events, started_s=0.0, endpoint="chat")
    assert outcome.chunks == 1 and outcome.ttft_s == 0.0


@pytest.mark.parametrize(
    "events, message",
    [
        (timed(completion_chunk(" a")), "stream ended before [DONE]"),
        ([], "no SSE events"),
        (timed(completion_chunk(" a"), {"error": {"message": "engine died", "code": 500}}, "[DONE]"),
         "server error in stream: engine died"),
        (timed("not json", "[DONE]"), "unparseable SSE data"),
    ],
)
def test_broken_streams_are_errors(events, message):
    assert message in summarise_events(events, 0.0, "completions").error


def spec_usage_chunk(completion_tokens, speculative_decoding):
    return {**usage_chunk(completion_tokens), "metrics": {"speculative_decoding": speculative_decoding}}


def test_the_servers_per_request_acceptance_rides_on_the_usage_chunk():
    # vLLM 0.32 with --per-request-spec-decode-metrics summary: the final usage chunk's metrics
    spec = {"mean_acceptance_length": 3.25, "draft_acceptance_rate": 0.75, "acceptance_histogram": [0, 1, 0, 3],
            "num_spec_steps": 4, "num_accepted_draft_tokens": 10, "num_draft_tokens": 12, "num_spec_tokens": 3}
    events = timed(completion_chunk(" t"), completion_chunk(" t t", "length"), spec_usage_chunk(3, spec), "[DONE]")
    outcome = summarise_events(events, 0.0, "completions")
    assert outcome.acceptance_histogram == (0, 1, 0, 3) and outcome.draft_tokens == 12 and outcome.error is None


@pytest.mark.parametrize("spec", [
    None, "text", {"acceptance_histogram": [1, -2], "num_draft_tokens": 3},
    {"acceptance_histogram": [1, 2.5], "num_draft_tokens": 3}, {"acceptance_histogram": [], "num_draft_tokens": 0},
    {"acceptance_histogram": [1, 2]}, {"acceptance_histogram": [1] * 70, "num_draft_tokens": 3},
    {"acceptance_histogram": [True, 2], "num_draft_tokens": 3},
])
def test_per_request_acceptance_of_another_shape_is_not_trusted_half(spec):
    events = timed(completion_chunk(" t", "length"), spec_usage_chunk(1, spec), "[DONE]")
    outcome = summarise_events(events, 0.0, "completions")
    assert outcome.acceptance_histogram is None and outcome.draft_tokens is None and outcome.error is None
    assert outcome.output_tokens == 1


def test_no_usage_means_no_token_count():
    outcome = summarise_events(timed(completion_chunk(" a"), completion_chunk(" b"), "[DONE]"), 0.0, "completions")
    assert outcome.output_tokens is None and outcome.chunks == 2 and outcome.error is None


def test_request_body_asks_for_usage():
    body = StreamRequest(endpoint="completions", model="m", max_tokens=8, prompt="p", ignore_eos=True).body()
    assert body == {"model": "m", "prompt": "p", "max_tokens": 8, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True}
    chat = StreamRequest(endpoint="chat", model=None, max_tokens=8, prompt="hello").body()
    assert chat["messages"] == [{"role": "user", "content": "hello"}] and "model" not in chat
    assert "ignore_eos" not in chat
    with pytest.raises(ValueError):
        StreamRequest(endpoint="completions", model=None, max_tokens=8)


# --- the client against a target with a known schedule -------------------------------


def test_schedule_of_the_target():
    schedule = TokenSchedule(ttft_s=0.05, tpot_s=0.01, tokens_per_chunk=4)
    plan = schedule.chunks(10)
    assert [size for _, size in plan] == [1, 4, 4, 1]
    assert plan[0][0] == pytest.approx(0.05) and plan[-1][0] == pytest.approx(0.05 + 9 * 0.01)


TTFT_S, TPOT_S = 0.040, 0.005


@pytest.fixture(scope="module", params=[1, 4], ids=["1-token-chunks", "4-token-chunks"])
def scheduled_target(request):
    with TargetProcess(ttft_ms=TTFT_S * 1000, tpot_ms=TPOT_S * 1000, tokens_per_chunk=request.param,
                       arm="baseline", replica="baseline-0") as target:
        yield target, request.param


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_client_timing_matches_the_known_schedule(scheduled_target, endpoint):
    target, tokens_per_chunk = scheduled_target
    client = OpenAIStreamClient(target.url)
    try:
        records = [
            client.stream(StreamRequest(endpoint=endpoint, model=None, max_tokens=33, prompt="a b c"),
                          RecordLabels(request_id=f"{endpoint}-{i}", tag="test", worker="pytest")).record
            for i in range(5)
        ]
    finally:
        client.close()
    sent_by_target = target.timings()  # per X-Request-Id: when the target really sent the first and last chunk
    assert all(r.ok for r in records), records[0].error
    record = records[0]
    assert (record.arm, record.replica, record.output_tokens, record.prompt_tokens) == ("baseline", "baseline-0", 33, 3)
    # the id the server gave each request, as vLLM gives it: its kind's prefix + the X-Request-Id sent
    prefix = "chatcmpl-" if endpoint == "chat" else "cmpl-"
    assert [r.server_request_id for r in records] == [f"{prefix}{endpoint}-{i}" for i in range(5)]
    assert record.chunks == 1 + 32 // tokens_per_chunk
    ttft_error_ms = (statistics.median(r.ttft_s for r in records) - TTFT_S) * 1000
    tpot_rel_error = statistics.median(r.tpot_s for r in records) / TPOT_S - 1
    print(f"vs the schedule: TTFT median error {ttft_error_ms:+.2f} ms, TPOT {tpot_rel_error:+.2%}")
    # no token before the schedule allows it (the target's timer starts after the send)
    assert all(r.ttft_s >= TTFT_S - 0.0005 for r in records), [r.ttft_s for r in records]
    assert all(r.e2e_s >= TTFT_S + 32 * TPOT_S - 0.0005 for r in records), [r.e2e_s for r in records]
    # the client's stamps are the target's sends, on the wall clock both share: the first chunk
    # when it arrived, not before it left and not at the stream's end (half the 32-token stream
    # away: a client stamping the response instead of the chunk is that far off), and the
    # stream's length from first to last chunk. How close to the send it stamps (a few ms on a
    # quiet machine; more where the client waits for a CPU) is benchmarks/loadgen.py's figure.
    # Each side pairs its wall clock with its monotonic clock by two reads in a row, and on a CPU
    # quota a process may be stopped between them (benchmarks/slowed.sh 0.5: -5.8 ms seen), so the
    # lower bound is half the TTFT: a client stamping the response's headers instead of its first
    # chunk is a whole TTFT early.
    first_chunk_error_s = statistics.median(r.sent_at + r.ttft_s - sent_by_target[r.request_id].first_sent_at
                                            for r in records)
    assert -TTFT_S / 2 < first_chunk_error_s < 16 * TPOT_S, first_chunk_error_s
    span_ratio = statistics.median((r.e2e_s - r.ttft_s) / (sent_by_target[r.request_id].last_s
                                                         - sent_by_target[r.request_id].first_s) for r in records)
    assert span_ratio == pytest.approx(1.0, abs=0.1)


def test_failures_become_records_not_exceptions():
    with TargetProcess(ttft_ms=1, tpot_ms=1) as target:
        wrong_path = OpenAIStreamClient(target.url + "/no-such-prefix")
        record = wrong_path.stream(StreamRequest(endpoint="completions", model="m", max_tokens=2, prompt="x"),
                                   LABELS).record
        wrong_path.close()
        url = target.url
    assert (record.ok, record.status) == (False, 404) and record.error.startswith("HTTP 404")
    # the target is gone now: nobody listens on its port
    refused = OpenAIStreamClient(url, connect_timeout_s=2).stream(
        StreamRequest(endpoint="completions", model="m", max_tokens=2, prompt="x"), LABELS).record
    assert (refused.ok, refused.status, refused.ttft_s) == (False, 0, None) and refused.error


def test_a_stream_that_stops_sending_times_out():
    # the first chunk after 10 ms, the next one only after 30 s: far longer than the client waits
    with TargetProcess(ttft_ms=10, tpot_ms=30_000) as target:
        client = OpenAIStreamClient(target.url, timeout_s=0.4)
        started = time.monotonic()
        record = client.stream(StreamRequest(endpoint="completions", model="m", max_tokens=3, prompt="x"),
                               LABELS).record
        waited = time.monotonic() - started
        after = client.stream(StreamRequest(endpoint="completions", model="m", max_tokens=1, prompt="x"),
                              LABELS).record  # the cut connection is not reused
        client.close()
    assert not record.ok and record.status == 200 and "read timeout" in record.error
    assert record.chunks == 1 and record.ttft_s is not None
    # the client's timeout ended it: not before 0.4 s, and long before the target's second chunk
    assert 0.4 <= waited < 15, waited
    assert after.ok, after.error


def test_a_request_killed_mid_stream_still_leaves_a_record():
    with TargetProcess(ttft_ms=20, tpot_ms=20) as target:
        client = OpenAIStreamClient(target.url)
        kept = []
        request = StreamRequest(endpoint="completions", model="m", max_tokens=100, prompt="x")  # a 2 s stream
        started = time.monotonic()
        greenlet = gevent.spawn(client.stream, request, LABELS, kept.append)
        # mid-stream by construction: the target has the request, then a few of its chunks (one
        # every 20 ms) have left, and most of the stream has not
        deadline = time.monotonic() + 30
        while target.stats()["started"] == 0:
            assert time.monotonic() < deadline, "the request never reached the target"
            gevent.sleep(0.02)
        gevent.sleep(0.3)
        greenlet.kill()
        killed_after = time.monotonic() - started
        client.close()
    assert len(kept) == 1
    record = kept[0]
    assert record.cancelled and not record.ok and record.status == 200
    assert 0.020 - 0.0005 <= record.ttft_s < killed_after and 1 < record.chunks < 100
