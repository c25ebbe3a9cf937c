"""Workloads that look like production: multi-turn sessions (a user keeps its conversation,
every arm gets the same histories) and trace replay (this project's JSONL, Mooncake and
BurstGPT formats, open loop at the trace's times). Pure parts first, then real Locust runs
against the benchmark stream target: sessions in order on every arm, a trace's send times
kept (the send lag check), every record with the id the server gave it."""

from __future__ import annotations

import collections
import json
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.stream_target import TargetProcess  # noqa: E402
from loadtests import sample_traces  # noqa: E402
from loadtests.datasets import (  # noqa: E402
    MOONCAKE_BLOCK_TOKENS,
    LengthDistribution,
    MultiTurnSessions,
    TracePrompts,
    TraceRow,
    load_trace,
    open_prompt_source,
)
from loadtests.options import TrafficOptions  # noqa: E402
from loadtests.records import read_records  # noqa: E402
from loadtests.swarm import Swarm, SwarmSpec  # noqa: E402
from loadtests.traffic import SlotPlan, TrafficShare  # noqa: E402
from tests.conftest import wait_until_gone  # noqa: E402

TRACES = sample_traces.SAMPLE_DIR


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- multi-turn sessions -------------------------------------------------------------


def test_a_turn_carries_its_whole_history_and_is_a_function_of_seed_session_and_turn():
    source = MultiTurnSessions(3, LengthDistribution.parse("uniform:4:8"), LengthDistribution.parse("6"), seed=2)
    prompts = [source.prompt(i) for i in range(6)]
    assert [(p.session, p.turn) for p in prompts] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    # each turn's prompt is the previous turn's, its (scripted, 6-word) reply, and a new message
    for earlier, later in [(prompts[0], prompts[1]), (prompts[1], prompts[2])]:
        assert later.text.startswith(earlier.text + " ")
        reply, _, rest = later.text[len(earlier.text) + 1:].partition("\n")
        assert len(reply.split()) == 6 and rest.startswith("User: ") and rest.endswith("\nAssistant:")
    assert not prompts[3].text.startswith(prompts[2].text[:20])  # a new session starts afresh
    assert all(p.max_tokens == 6 and p.ignore_eos for p in prompts)
    assert [source.prompt(i) for i in reversed(range(6))][::-1] == prompts  # random access, any order
    other = MultiTurnSessions(3, source.input_tokens, source.output_tokens, seed=3)
    assert other.prompt(1).text != prompts[1].text


def test_chat_sessions_are_messages_user_and_assistant_in_turn():
    source = open_prompt_source("multi_turn", input_tokens="5", output_tokens="3", turns=3, chat=True)
    assert source.has_chats
    roles = [m["role"] for m in source.prompt(2).messages]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    assert source.prompt(2).messages[:3] == source.prompt(1).messages
    with pytest.raises(ValueError, match="at least one turn"):
        MultiTurnSessions(0, LengthDistribution.parse("5"), LengthDistribution.parse("5"))


def test_each_user_keeps_its_session_and_sends_every_turn_to_every_arm_in_order():
    options = TrafficOptions(dataset="multi_turn", turns=3, arm_pin="baseline,canary", input_tokens="4", max_tokens=4)
    share = TrafficShare(options, SlotPlan(1, 2, 0.0))  # slot 1 of 2: sessions 1, 3, 5, ...
    alice, bob = share.conversation(), share.conversation()
    # the two users interleave as they come back; each walks its own session
    tickets = [(name, share.next_ticket(None, user)) for _ in range(7) for name, user in (("a", alice), ("b", bob))]
    walked = collections.defaultdict(list)
    for name, ticket in tickets:
        walked[name].append((ticket.prompt.session, ticket.prompt.turn, ticket.request.pinned_arm))
    assert walked["a"][:6] == [(1, 0, "baseline"), (1, 0, "canary"), (1, 1, "baseline"), (1, 1, "canary"),
                               (1, 2, "baseline"), (1, 2, "canary")]
    assert [s for s, _, _ in walked["b"][:6]] == [3] * 6
    assert walked["a"][6] == (5, 0, "baseline") and walked["b"][6] == (7, 0, "baseline")  # next sessions of slot 1
    # both arms got the same prompt for every turn
    same_turn = collections.defaultdict(set)
    for _, ticket in tickets:
        same_turn[ticket.prompt.index].add(ticket.request.prompt)
    assert all(len(texts) == 1 for texts in same_turn.values())
    assert TrafficShare(TrafficOptions(arm_pin="baseline,canary"), SlotPlan(0, 1, 0.0)).conversation() is None


def test_with_arm_users_every_arm_walks_the_same_sessions_at_its_own_pace():
    options = TrafficOptions(dataset="multi_turn", turns=2, arm_pin="baseline,canary", arm_users=True,
                             input_tokens="4", max_tokens=4)
    share = TrafficShare(options, SlotPlan(0, 1, 0.0))
    canary_user, baseline_user = share.conversation(), share.conversation()
    canary = [share.next_ticket("canary", canary_user).prompt for _ in range(4)]
    baseline = [share.next_ticket("baseline", baseline_user).prompt for _ in range(2)]
    assert [(p.session, p.turn) for p in canary] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert baseline == canary[:2]


# --- traces --------------------------------------------------------------------------


def test_the_shipped_sample_traces_are_what_their_generator_writes():
    for name, text in sample_traces.sample_texts().items():
        assert (TRACES / name).read_text() == text, f"{name}: run python -m loadtests.sample_traces"


@pytest.mark.parametrize("name, trace_format, rows", [("sample.jsonl", "jsonl", 120),
                                                      ("mooncake_sample.jsonl", "mooncake", 100),
                                                      ("burstgpt_sample.csv", "burstgpt", None)])
def test_every_sample_trace_loads_in_time_order_from_zero(name, trace_format, rows):
    loaded = load_trace(TRACES / name, trace_format)
    assert loaded[0].at_s == 0.0 and [r.at_s for r in loaded] == sorted(r.at_s for r in loaded)
    assert 30 < loaded[-1].at_s < 120  # a minute or two of traffic
    assert all(r.input_tokens >= 1 and r.output_tokens >= 1 for r in loaded)
    if rows is not None:
        assert len(loaded) == rows
    else:  # BurstGPT's failed requests (no response tokens) are left out
        lines = (TRACES / name).read_text().splitlines()[1:]
        failed = sum(line.split(",")[3] == "0" for line in lines)
        assert failed > 0 and len(loaded) == len(lines) - failed


def test_trace_prompts_keep_the_rows_lengths_times_and_sharing():
    rows = [TraceRow(0.0, 10, 5), TraceRow(1.0, 12, 6, session_id="s"), TraceRow(2.5, 20, 7, session_id="s"),
            TraceRow(3.0, 30, 8, prefix_id="p", prefix_tokens=16), TraceRow(4.0, 25, 9, prefix_id="p", prefix_tokens=16)]
    trace = TracePrompts(rows, seed=1, speedup=2.0)
    prompts = [trace.prompt(i) for i in range(10)]
    assert [len(p.text.split()) for p in prompts[:5]] == [10, 12, 20, 30, 25]
    assert [p.max_tokens for p in prompts[:5]] == [5, 6, 7, 8, 9] and all(p.ignore_eos for p in prompts)
    # due at the row's time / speed-up; the second pass starts one mean gap (1 s) after the last row
    assert [p.trace_offset_s for p in prompts] == pytest.approx([0, 0.5, 1.25, 1.5, 2.0, 2.5, 3.0, 3.75, 4.0, 4.5])
    words = [p.text.split() for p in prompts]
    assert words[2][:12] == words[1]  # a session's later turn extends the earlier one word for word
    assert words[3][:16] == words[4][:16] and words[3][16:] != words[4][16:25]  # a shared prefix, own suffixes
    assert words[5] != words[0] and words[7][:12] == words[6]  # the next pass: fresh words, the same sharing


def test_mooncake_rows_that_share_a_block_id_share_its_words(tmp_path):
    path = write(tmp_path / "m.jsonl", "".join(json.dumps(r) + "\n" for r in [
        {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 700, "output_length": 4, "hash_ids": [1, 3]},
        {"timestamp": 500, "input_length": 100, "output_length": 4, "hash_ids": [9]},
    ]))
    rows = load_trace(path, "mooncake")
    assert [r.at_s for r in rows] == [0.0, 0.5, 1.5]  # milliseconds, sorted
    trace = TracePrompts(rows)
    first, _, second = (trace.prompt(i).text.split() for i in range(3))
    assert len(first) == 600 and len(second) == 700
    assert first[:MOONCAKE_BLOCK_TOKENS] == second[:MOONCAKE_BLOCK_TOKENS]
    assert first[MOONCAKE_BLOCK_TOKENS:] != second[MOONCAKE_BLOCK_TOKENS:600]


@pytest.mark.parametrize("trace_format, text, message", [
    ("jsonl", '{"timestamp": 0, "input_tokens": 5}\n', "output_tokens must be a positive integer"),
    ("jsonl", '{"timestamp": -1, "input_tokens": 5, "output_tokens": 5}\n', "timestamp must be a non-negative"),
    ("jsonl", '{"timestamp": 0, "input_tokens": 5, "output_tokens": 5, "session_id": [1]}\n', "session_id must be"),
    ("jsonl", "", "holds no requests"),
    ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": 5, "hash_ids": "x"}\n', "hash_ids must be"),
    ("burstgpt", "Timestamp,Model\n0,m\n", "no column Request tokens, Response tokens"),
    ("burstgpt", "Timestamp,Request tokens,Response tokens\nsoon,1,1\n", ":2: Timestamp, Request tokens"),
])
def test_a_bad_trace_is_refused_naming_the_line_and_field(tmp_path, trace_format, text, message):
    path = write(tmp_path / "trace", text)
    with pytest.raises(ValueError, match=message):
        load_trace(path, trace_format)


def test_a_trace_sets_its_own_times_and_every_arm_gets_each_row_at_its_time():
    with pytest.raises(ValueError, match="sets its own send times"):
        TrafficOptions(dataset="trace", dataset_path=str(TRACES / "sample.jsonl"), rate=2.0)
    with pytest.raises(ValueError, match="needs --mtp-dataset-path"):
        TrafficOptions(dataset="trace")
    options = TrafficOptions(dataset="trace", dataset_path=str(TRACES / "sample.jsonl"), trace_speedup=4.0,
                             arm_pin="baseline,canary")
    assert options.open_loop
    rows = load_trace(TRACES / "sample.jsonl")
    share = TrafficShare(options, SlotPlan(1, 2, start_at=100.0))  # slot 1 of 2: rows 1, 3, 5, ...
    tickets = [share.next_ticket() for _ in range(6)]
    assert [t.prompt.index for t in tickets] == [1, 1, 3, 3, 5, 5]
    assert [t.request.pinned_arm for t in tickets] == ["baseline", "canary"] * 3
    assert [t.scheduled_at for t in tickets] == pytest.approx([100 + rows[i].at_s / 4 for i in (1, 1, 3, 3, 5, 5)])


# --- real Locust runs ----------------------------------------------------------------


def test_a_multi_turn_run_sends_each_sessions_turns_in_order_with_the_same_history_to_both_arms(tmp_path):
    with TargetProcess(ttft_ms=5, tpot_ms=2, tokens_per_chunk=2) as target:
        spec = SwarmSpec(
            host=target.url, users=3, run_time_s=6, n_workers=2, stop_timeout_s=10,
            traffic=TrafficOptions(records=str(tmp_path / "records.jsonl"), dataset="multi_turn", turns=3,
                                   input_tokens="6", max_tokens=8, arm_pin="baseline,canary", seed=4),
        )
        swarm = Swarm(spec)
        result = swarm.run(timeout_s=240)
    records = read_records(result.records_path)
    assert len(records) > 12 and all(r.ok for r in records)
    source = MultiTurnSessions(3, LengthDistribution.parse("6"), LengthDistribution.parse("8"), seed=4)
    by_session = collections.defaultdict(list)
    for record in sorted(records, key=lambda r: r.sent_at):
        assert record.dataset_index == record.session * 3 + record.turn
        by_session[record.session].append(record)
    assert len(by_session) >= 3
    for session, turns in by_session.items():
        # one user, one worker: turn after turn, each to the baseline then the canary, never overlapping
        assert len({r.worker for r in turns}) == 1
        assert [(r.turn, r.arm) for r in turns] == [(t, arm) for t in range(3) for arm in ("baseline", "canary")][:len(turns)]
        assert all(a.sent_at + a.e2e_s <= b.sent_at + 1e-3 for a, b in zip(turns, turns[1:]))
        # the same history on both arms: the prompt of the same turn, as long as the source says
        for record in turns:
            expected = source.prompt(record.dataset_index).text
            assert record.prompt_tokens == len(expected.split())
    # every record carries the id the server gave it (the target does as vLLM: cmpl- + X-Request-Id)
    assert all(r.server_request_id == f"cmpl-{r.request_id}" for r in records)
    assert wait_until_gone(swarm.pids, 10.0) == []


def test_a_trace_replay_keeps_the_traces_send_times(tmp_path):
    trace_path = TRACES / "sample.jsonl"
    speedup = 10.0  # the trace's first ~6 s at 10x: ~12 requests/s per arm
    with TargetProcess(ttft_ms=5, tpot_ms=1, tokens_per_chunk=4) as target:
        spec = SwarmSpec(
            host=target.url, users=16, run_time_s=6, n_workers=2, stop_timeout_s=10,
            traffic=TrafficOptions(records=str(tmp_path / "records.jsonl"), dataset="trace", dataset_path=str(trace_path),
                                   trace_speedup=speedup, arm_pin="baseline,canary", seed=2),
        )
        result = Swarm(spec).run(timeout_s=240)
    records = read_records(result.records_path)
    rows = load_trace(trace_path)
    trace = TracePrompts(rows, seed=2, speedup=speedup)
    assert len(records) > 30 and all(r.ok for r in records)
    start = min(r.scheduled_at - trace.prompt(r.dataset_index).trace_offset_s for r in records)
    for record in records:
        prompt = trace.prompt(record.dataset_index)
        # due exactly at the row's time on the replay's clock, with the row's lengths
        assert record.scheduled_at - start == pytest.approx(prompt.trace_offset_s, abs=1e-6)
        assert record.requested_max_tokens == rows[record.dataset_index % len(rows)].output_tokens
        assert record.send_lag_s >= 0
    # both arms got every row they both saw at the same time
    arms = collections.defaultdict(set)
    for record in records:
        arms[record.dataset_index].add(record.arm)
    assert sum(len(a) == 2 for a in arms.values()) >= len(arms) - 4
    # the trace's send times kept: each request left within 2% of its offset into the replay (a few ms
    # here; where it is is benchmarks/loadgen.py's figure, and the generator reports its lag itself)
    span_s = max(trace.prompt(r.dataset_index).trace_offset_s for r in records)
    late = [r.send_lag_s for r in records]
    print(f"trace replay: {len(records)} requests over {span_s:.1f} s, send lag median "
          f"{statistics.median(late) * 1000:.1f} ms, max {max(late) * 1000:.1f} ms")
    assert statistics.median(late) <= 0.02 * span_s
    assert result.generator.scheduled_requests == len(records)
