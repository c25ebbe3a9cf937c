"""Acceptance by prompt length and by turn (rollout.analysis.acceptance_slices): the requests' own counters, grouped."""

from __future__ import annotations

import pytest

from loadtests.records import RequestRecord
from rollout.analysis.acceptance_slices import by_prompt_length, by_turn, prompt_bucket
from rollout.record.markdown import markdown_report
from tests.test_result import recorded_document


def record(i: int, prompt_tokens: int, histogram: list[int] | None, arm: str = "canary", turn: int | None = None,
           ok: bool = True) -> RequestRecord:
    steps = sum(histogram) if histogram else 0
    return RequestRecord(request_id=f"r{i}", tag="experiment", worker="w", arm=arm, pinned_arm=arm, sent_at=float(i),
                         e2e_s=0.5, ttft_s=0.1, output_tokens=16, prompt_tokens=prompt_tokens, ok=ok,
                         status=200 if ok else 500, acceptance_histogram=histogram,
                         draft_tokens=3 * steps if histogram else None, turn=turn)


def test_buckets_double_from_64():
    assert [prompt_bucket(n) for n in (0, 63, 64, 127, 128, 300, 1023, 1024)] == [
        (0, 64), (0, 64), (64, 128), (64, 128), (128, 256), (256, 512), (512, 1024), (1024, 2048)]


def test_acceptance_that_falls_with_the_prompt_shows_in_its_buckets():
    """Short prompts accept every draft (4 steps of 3 accepted), long ones only the first (8 steps of 1):
    the arm's mean hides it, its buckets do not; failed requests and the other arm's are left out."""
    records = [record(i, 20 + i, [0, 0, 0, 4]) for i in range(5)]
    records += [record(10 + i, 600 + i, [0, 8, 0, 0]) for i in range(3)]
    records += [record(20, 30, None, ok=False), record(21, 30, [9, 0, 0, 0], arm="baseline")]
    slices = by_prompt_length(records, "canary")
    assert [(s.slice, s.requests, s.drafts) for s in slices] == [("prompt 0-63 tokens", 5, 20), ("prompt 512-1023 tokens", 3, 24)]
    assert slices[0].per_position == [1.0, 1.0, 1.0] and slices[0].mean_acceptance_length == pytest.approx(4.0)
    assert slices[1].per_position == [1.0, 0.0, 0.0] and slices[1].mean_acceptance_length == pytest.approx(2.0)
    assert by_turn(records, "canary") == []  # no sessions


def test_turns_are_sliced_and_an_arm_without_its_own_counters_has_no_slices():
    records = [record(t * 10 + i, 40 * (t + 1), [0, 1, 1, 2], turn=t) for t in range(3) for i in range(4)]
    assert [s.slice for s in by_turn(records, "canary")] == ["turn 0", "turn 1", "turn 2"]
    assert all(s.requests == 4 for s in by_turn(records, "canary"))
    # one request of the arm without counters (a server without --per-request-spec-decode-metrics): no slices at all
    assert by_prompt_length([*records, record(99, 50, None)], "canary") == []


def test_the_report_shows_slices_only_where_there_is_more_than_one():
    doc = recorded_document("promote")
    assert "Acceptance by prompt length" not in markdown_report(doc)
    records = [record(i, 20, [0, 0, 0, 2]) for i in range(3)] + [record(9, 700, [0, 2, 0, 0])]
    doc["spec_decode"]["canary"]["by_prompt_length"] = [s.model_dump() for s in by_prompt_length(records, "canary")]
    report = markdown_report(doc)
    assert "Acceptance by prompt length" in report
    assert "| canary | prompt 512-1023 tokens | 1 | 2 | 2.000 | 1.000, 0.000, 0.000 |" in report
