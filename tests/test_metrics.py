import pytest

from cluster.metrics import MetricsSnapshot, SpecDecodeStats, parse_metrics, spec_decode_delta

# Lines as vLLM 0.32 (CPU build) prints them, k=3, trimmed.
PAGE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 48.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 144.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 96.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} 48.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="2"} 18.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 240.0
"""


def test_parse_spec_decode_counters_and_derived_rates():
    snap = parse_metrics(PAGE)
    sd = snap.spec_decode
    assert (sd.drafts, sd.draft_tokens, sd.accepted_tokens) == (48, 144, 96)
    assert sd.accepted_per_position == (48, 30, 18)
    assert sd.acceptance_rate == pytest.approx(96 / 144)
    assert sd.mean_acceptance_length == pytest.approx(1 + 96 / 48)
    assert sd.per_position_rate == pytest.approx([1.0, 30 / 48, 18 / 48])
    assert snap.requests_running == 2
    assert snap.generation_tokens == 240


def test_expected_length_for_shorter_k_from_the_per_position_profile():
    sd = parse_metrics(PAGE).spec_decode
    assert sd.expected_length_for_k(1) == pytest.approx(2.0)
    assert sd.expected_length_for_k(2) == pytest.approx(1 + 1 + 30 / 48)
    assert sd.expected_length_for_k(3) == pytest.approx(sd.mean_acceptance_length)
    assert sd.expected_length_for_k(4) is None


def test_delta_is_the_window_not_the_total():
    before = parse_metrics(PAGE)
    after_page = PAGE.replace("} 48.0\n# HELP vllm:spec_decode_num_draft_tokens", "} 58.0\n# HELP vllm:spec_decode_num_draft_tokens")
    after_page = after_page.replace("} 144.0", "} 174.0").replace("} 96.0", "} 116.0")
    delta = parse_metrics(after_page).delta(before)
    assert delta.spec_decode.drafts == 10
    assert delta.spec_decode.draft_tokens == 30
    assert delta.spec_decode.accepted_tokens == 20
    assert delta.spec_decode.mean_acceptance_length == pytest.approx(3.0)


def test_a_counter_that_went_down_means_a_restart_and_is_refused():
    before = parse_metrics(PAGE)
    with pytest.raises(ValueError, match="restarted"):
        MetricsSnapshot().delta(before)


def test_no_spec_decode_means_no_rates_not_zero():
    snap = parse_metrics("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n")
    assert snap.spec_decode.acceptance_rate is None
    assert snap.spec_decode.mean_acceptance_length is None
    assert snap.spec_decode.per_position_rate is None


def test_stats_add_over_replicas():
    a = SpecDecodeStats(10, 30, 15, (8, 5, 2))
    b = SpecDecodeStats(10, 30, 30, (10, 10, 10))
    total = a + b
    assert total.drafts == 20 and total.accepted_tokens == 45
    assert total.accepted_per_position == (18, 15, 12)


def test_an_arms_delta_is_unknown_when_a_replica_is_missing_or_restarted_never_partial():
    def snap(drafts: float, accepted: float) -> MetricsSnapshot:
        return MetricsSnapshot(spec_decode=SpecDecodeStats(drafts, 3 * drafts, accepted, (accepted,)))

    before = {"canary-0": snap(10, 20), "canary-1": snap(5, 5)}
    after = {"canary-0": snap(20, 40), "canary-1": snap(15, 25)}
    both = spec_decode_delta(before, after, ["canary-0", "canary-1"])
    assert (both.drafts, both.accepted_tokens) == (20, 40)
    # one replica gone from the later scrape: unknown, not the other replica's (lower) numbers
    assert spec_decode_delta(before, {"canary-0": after["canary-0"]}, ["canary-0", "canary-1"]) is None
    # restarted in between (its counters went down): unknown
    assert spec_decode_delta(before, {**after, "canary-1": snap(1, 1)}, ["canary-0", "canary-1"]) is None
    assert spec_decode_delta(None, after, ["canary-0"]) is None
