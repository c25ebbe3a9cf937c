"""Whose acceptance (rollout.judge.request_acceptance): the experiment's requests' own counters, summed as
the server counts them, and other traffic on an arm told apart from the requests a record cannot show whole."""

from __future__ import annotations

import pytest

from cluster.metrics import SpecDecodeStats
from loadtests.records import RequestRecord
from rollout.judge.acceptance import judge_acceptance
from rollout.judge.config import GatesConfig
from rollout.judge.request_acceptance import attribute, spec_decode_of_requests, unseen_steps_bound
from rollout.judge.verdicts import Verdict


def record(i: int, arm: str = "canary", histogram=(0, 0, 0, 4), drafted: int | None = 12, **kw) -> RequestRecord:
    fields = dict(request_id=f"r{i}", tag="experiment", worker="w", arm=arm, sent_at=float(i), e2e_s=0.5,
                  ttft_s=0.1, output_tokens=16, requested_max_tokens=16, chunks=5, ok=True, status=200,
                  acceptance_histogram=list(histogram) if histogram is not None else None, draft_tokens=drafted)
    return RequestRecord(**{**fields, **kw})


def test_requests_counters_sum_as_the_server_counts_them():
    # a step that accepted j drafts accepted positions 1..j (vLLM's accepted_tokens_per_pos)
    records = [record(0, histogram=(1, 2, 0, 3), drafted=18), record(1, histogram=(0, 0, 1, 1), drafted=6),
               record(2, arm="baseline", histogram=(3, 5), drafted=8)]
    canary = spec_decode_of_requests(records, "canary")
    assert canary.sums() == SpecDecodeStats(drafts=8, draft_tokens=24, accepted_tokens=2 + 2 + 9 + 3,
                                            accepted_per_position=(7, 5, 4))
    assert canary.per_request == ((6, 2 + 9), (2, 2 + 3))  # each request's (verify steps, accepted tokens)
    assert canary.mean_acceptance_length == pytest.approx(1 + 16 / 8)
    assert canary.per_position_rate == pytest.approx([7 / 8, 5 / 8, 4 / 8])
    assert spec_decode_of_requests(records, "baseline").mean_acceptance_length == pytest.approx(1 + 5 / 8)


def test_one_completed_request_without_counters_leaves_the_servers_to_count():
    records = [record(0), record(1, histogram=None, drafted=None)]
    assert spec_decode_of_requests(records, "canary") is None
    # failed and cut-off requests never carry them (no final usage chunk): they are not asked to
    cut = [record(0), record(1, histogram=None, drafted=None, cancelled=True),
           record(2, histogram=None, drafted=None, ok=False, status=500)]
    assert spec_decode_of_requests(cut, "canary").drafts == 4
    assert spec_decode_of_requests([], "canary") is None
    assert spec_decode_of_requests([record(0)], "baseline") is None


def test_other_traffic_is_told_from_requests_a_record_cannot_show_whole():
    records = [record(i) for i in range(100)] + [record(100, histogram=None, drafted=None, cancelled=True)]
    own = spec_decode_of_requests(records, "canary")
    unseen = unseen_steps_bound(records, "canary", streams=2)
    assert unseen == (1 + 2) * 16
    # the server saw the experiment's steps plus a cut-off request's and one begun before the start
    alone = attribute("canary", own + SpecDecodeStats(drafts=20, draft_tokens=60, accepted_tokens=60,
                                                      accepted_per_position=(20, 20, 20)), own, unseen)
    assert alone.counted_from == "requests" and alone.other_steps == 0 and not alone.other_traffic
    assert alone.note() is None
    # two clients sampling at temperature 1 on the canary: 150 steps that accept little
    other = SpecDecodeStats(drafts=150, draft_tokens=450, accepted_tokens=30, accepted_per_position=(20, 7, 3))
    mixed = attribute("canary", own + other, own, unseen)
    assert mixed.other_traffic and mixed.other_steps == 150 - unseen
    note = mixed.note()
    assert "other traffic reached canary" in note and "550 verify steps" in note and "400" in note
    assert f"{(own + other).mean_acceptance_length:.2f}" in note and "4.00" in note
    # the gate judged on the requests' own passes where the server's mixed counters would not
    cfg = GatesConfig(min_acceptance_length=3.5)
    assert judge_acceptance(own, cfg).verdict == Verdict.PASS
    assert judge_acceptance(own + other, cfg).verdict != Verdict.PASS


def test_without_the_requests_counters_the_server_counts_and_nothing_is_compared():
    server = SpecDecodeStats(drafts=10, draft_tokens=30, accepted_tokens=30, accepted_per_position=(10, 10, 10))
    who = attribute("canary", server, None, 0)
    assert who.counted_from == "server" and who.other_steps is None and who.note() is None
    assert attribute("canary", None, server, 0).other_steps is None
