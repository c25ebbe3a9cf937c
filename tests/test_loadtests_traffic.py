"""What gets sent and when: seeded datasets, arrival schedules, the --mtp-* options and
how a worker's share of the traffic is cut."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtests.arrivals import ConstantArrivals, arrival_schedule  # noqa: E402
from loadtests.datasets import (  # noqa: E402
    Gsm8kQuestions,
    JsonlPrompts,
    LengthDistribution,
    SyntheticPrompts,
    open_prompt_source,
)
from loadtests.options import TrafficOptions, cli_arguments  # noqa: E402
from loadtests.traffic import SlotPlan, TrafficShare  # noqa: E402


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# --- datasets ------------------------------------------------------------------------


def test_synthetic_prompts_are_a_function_of_seed_and_position():
    source = SyntheticPrompts(LengthDistribution.parse("uniform:20:40"), LengthDistribution.parse("64"), seed=3)
    first = [source.prompt(i) for i in range(50)]
    assert [source.prompt(i) for i in reversed(range(50))][::-1] == first  # order of access is irrelevant
    assert first == [SyntheticPrompts(source.input_tokens, source.output_tokens, seed=3).prompt(i) for i in range(50)]
    other_seed = SyntheticPrompts(source.input_tokens, source.output_tokens, seed=4)
    assert [other_seed.prompt(i).text for i in range(50)] != [p.text for p in first]
    assert all(20 <= len(p.text.split()) <= 40 for p in first)
    assert len({len(p.text.split()) for p in first}) > 5
    assert all(p.max_tokens == 64 and p.ignore_eos for p in first)


@pytest.mark.parametrize(
    "spec, low, high",
    [("128", 128, 128), ("fixed:16", 16, 16), ("uniform:5:9", 5, 9), ("normal:100:10", 50, 150),
     ("lognormal:100:0.3", 20, 500)],
)
def test_length_distributions(spec, low, high):
    distribution = LengthDistribution.parse(spec)
    rng = random.Random(0)
    samples = [distribution.sample(rng) for _ in range(400)]
    assert low <= min(samples) and max(samples) <= high
    if distribution.kind in ("normal", "lognormal"):
        assert statistics.median(samples) == pytest.approx(100, rel=0.1)


@pytest.mark.parametrize("spec", ["", "abc", "uniform:9:5", "normal:1", "fixed:0", "poisson:3"])
def test_bad_length_distributions_are_refused(spec):
    with pytest.raises(ValueError):
        LengthDistribution.parse(spec)


def test_gsm8k_questions_in_seeded_order(tmp_path):
    path = write_jsonl(tmp_path / "test.jsonl", [{"question": f"q{i}?", "answer": "#### 1"} for i in range(10)])
    source = Gsm8kQuestions(path, seed=1)
    first_pass = [source.prompt(i).text for i in range(10)]
    assert sorted(first_pass) == sorted(f"Question: q{i}?\nAnswer:" for i in range(10))  # every item once
    assert first_pass != [f"Question: q{i}?\nAnswer:" for i in range(10)]  # shuffled
    assert [Gsm8kQuestions(path, seed=1).prompt(i).text for i in range(10)] == first_pass
    second_pass = [source.prompt(i).text for i in range(10, 20)]
    assert sorted(second_pass) == sorted(first_pass) and second_pass != first_pass
    assert source.prompt(3).max_tokens is None  # the run's --mtp-max-tokens applies


def test_user_jsonl_prompts_and_chats(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [
        {"prompt": "hello", "max_tokens": 7},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    ])
    source = JsonlPrompts(path, seed=0)
    assert source.has_chats
    items = [(p.text, p.messages, p.max_tokens) for p in (source.prompt(0), source.prompt(1))]
    assert ("hello", None, 7) in items
    assert (None, ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}), None) in items
    assert not JsonlPrompts(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])).has_chats


@pytest.mark.parametrize(
    "rows, message", [([{"text": "x"}], "neither"), ([{"prompt": "x", "max_tokens": 0}], "max_tokens"), ([], "no items")]
)
def test_bad_user_jsonl_is_refused(tmp_path, rows, message):
    with pytest.raises(ValueError, match=message):
        JsonlPrompts(write_jsonl(tmp_path / "bad.jsonl", rows))


def test_open_prompt_source_needs_a_file(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        open_prompt_source("gsm8k", path=tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="needs a path"):
        open_prompt_source("jsonl")


def test_shared_prefix_prompts_are_groups_of_one_long_prefix_and_a_suffix_of_their_own():
    source = open_prompt_source("shared_prefix", input_tokens="uniform:8:16", output_tokens="12", seed=5,
                                prefix_groups=4, prefix_tokens=200)
    prompts = [source.prompt(i) for i in range(400)]
    prefixes = [p.text.split("\n", 1)[0] for p in prompts]
    assert len(set(prefixes)) == 4 and all(len(x.split()) == 200 for x in prefixes)
    assert min(prefixes.count(x) for x in set(prefixes)) > 60  # every group is used, none starved
    suffixes = [p.text.split("\n", 1)[1] for p in prompts]
    assert all(8 <= len(x.split()) <= 16 for x in suffixes) and len(set(suffixes)) > 390
    assert all(p.max_tokens == 12 and p.ignore_eos for p in prompts)
    # a function of (seed, position): any worker, any order; another seed, other prefixes
    again = open_prompt_source("shared_prefix", input_tokens="uniform:8:16", output_tokens="12", seed=5,
                               prefix_groups=4, prefix_tokens=200)
    assert [again.prompt(i) for i in reversed(range(400))][::-1] == prompts
    other = open_prompt_source("shared_prefix", seed=6, prefix_groups=4, prefix_tokens=200)
    assert not {other.prompt(i).text.split("\n", 1)[0] for i in range(50)} & set(prefixes)
    # the options carry it to every worker as flags, and refuse nonsense
    options = TrafficOptions(dataset="shared_prefix", prefix_groups=3, prefix_tokens=50, input_tokens="8", max_tokens=4)
    share = TrafficShare(options, SlotPlan(slot=0, n_slots=1, start_at=0.0))
    assert len({share.prompts.prompt(i).text.split("\n", 1)[0] for i in range(60)}) == 3
    with pytest.raises(ValueError, match="prefix_groups"):
        TrafficOptions(dataset="shared_prefix", prefix_groups=0)


# --- arrivals ------------------------------------------------------------------------


def test_constant_rate_shares_interleave_on_the_global_grid():
    shares = [ConstantArrivals(10.0, start_at=100.0, slot=s, n_slots=3) for s in range(3)]
    times = sorted(t for share in shares for t in (share.next_send_time() for _ in range(20)))
    assert times == pytest.approx([100.0 + k / 10.0 for k in range(60)])


def test_poisson_shares_add_up_to_the_global_rate():
    shares = [arrival_schedule("poisson", 20.0, 0.0, seed=5, slot=s, n_slots=4) for s in range(4)]
    per_share = [[share.next_send_time() for _ in range(500)] for share in shares]
    rates = [500 / times[-1] for times in per_share]
    assert sum(rates) == pytest.approx(20.0, rel=0.1)
    gaps = [b - a for a, b in zip(per_share[0], per_share[0][1:])]
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.15)  # exponential: CV 1
    again = arrival_schedule("poisson", 20.0, 0.0, seed=5, slot=0, n_slots=4)
    assert [again.next_send_time() for _ in range(500)] == per_share[0]


def test_gamma_burstiness_controls_regularity():
    regular = arrival_schedule("gamma", 10.0, 0.0, burstiness=16.0, seed=1)
    times = [regular.next_send_time() for _ in range(400)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.1)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(0.25, abs=0.07)  # CV = 1/sqrt(shape)


# --- options -------------------------------------------------------------------------


def parser_with_traffic_flags() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    for argument in cli_arguments():
        parser.add_argument(argument.flag, **argument.kwargs)
    return parser


def test_options_round_trip_through_the_command_line():
    options = TrafficOptions(
        dataset="gsm8k", dataset_path="/data/test.jsonl", max_tokens=64, ignore_eos=True, endpoint="chat",
        model="mimo", records="/runs/r.jsonl", tag="experiment", seed=7, arm_pin="baseline,canary", rate=12.5,
        arrival="constant", ui_latency_rows=True,
    )
    args = options.to_cli_args()
    assert "--mtp-rate" in args and "--mtp-ignore-eos" in args and "--mtp-input-tokens" not in args
    assert TrafficOptions.from_namespace(parser_with_traffic_flags().parse_args(args)) == options
    assert TrafficOptions.from_namespace(parser_with_traffic_flags().parse_args([])) == TrafficOptions()


def test_web_ui_blanks_mean_unset_and_bad_options_are_refused():
    assert TrafficOptions.model_validate({"rate": "", "model": " ", "max_tokens": "32"}).rate is None
    with pytest.raises(ValueError, match="needs --mtp-dataset-path"):
        TrafficOptions(dataset="gsm8k")
    with pytest.raises(ValueError):
        TrafficOptions(input_tokens="uniform:9:1")
    with pytest.raises(ValueError):
        TrafficOptions(rate=0)
    with pytest.raises(ValueError):
        TrafficOptions(arm_pin=" , ")


# --- a process's share of the traffic ------------------------------------------------


def test_slots_interleave_the_prompt_sequence_and_pinned_arms_see_the_same_prompts():
    options = TrafficOptions(arm_pin="baseline,canary", input_tokens="8", max_tokens=4)
    shares = [TrafficShare(options, SlotPlan(slot, 2, 0.0)) for slot in range(2)]
    tickets = [[share.next_ticket() for _ in range(6)] for share in shares]
    assert [t.prompt.index for t in tickets[0]] == [0, 0, 2, 2, 4, 4]
    assert [t.prompt.index for t in tickets[1]] == [1, 1, 3, 3, 5, 5]
    assert [t.request.pinned_arm for t in tickets[0]] == ["baseline", "canary"] * 3
    first, second = tickets[0][0].request, tickets[0][1].request
    assert first.prompt == second.prompt and first.max_tokens == second.max_tokens == 4 and first.ignore_eos
    assert all(t.scheduled_at is None for t in tickets[0])  # closed loop


def test_arm_users_keep_their_arm_and_every_arm_walks_the_same_prompts_at_its_own_pace():
    options = TrafficOptions(arm_pin="baseline,canary", arm_users=True, input_tokens="8", max_tokens=4)
    share = TrafficShare(options, SlotPlan(1, 2, 0.0))
    users = [share.join() for _ in range(4)]
    assert users == ["baseline", "canary", "baseline", "canary"]  # balanced as they start
    # the canary's users come back three times as often: its prompts run ahead, the same ones in the same order
    canary = [share.next_ticket("canary") for _ in range(6)]
    baseline = [share.next_ticket("baseline") for _ in range(2)]
    assert [t.prompt.index for t in canary] == [1, 3, 5, 7, 9, 11]
    assert [t.prompt.index for t in baseline] == [1, 3]
    assert {t.request.pinned_arm for t in canary} == {"canary"} and {t.request.pinned_arm for t in baseline} == {"baseline"}
    # a user that stops frees its place: the next one to start takes that arm
    share.leave("baseline")
    assert share.join() == "baseline"
    assert TrafficShare(TrafficOptions(arm_pin="baseline,canary"), SlotPlan(0, 1, 0.0)).join() is None  # the default


def test_arm_users_need_two_pinned_arms():
    with pytest.raises(ValueError, match="arm-users"):
        TrafficOptions(arm_pin="canary", arm_users=True)


def test_open_loop_tickets_carry_their_send_time():
    share = TrafficShare(TrafficOptions(rate=4.0, arrival="constant"), SlotPlan(1, 2, start_at=1000.0))
    assert [share.next_ticket().scheduled_at for _ in range(3)] == pytest.approx([1000.25, 1000.75, 1001.25])


def test_chat_datasets_need_the_chat_endpoint(tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match="--mtp-endpoint chat"):
        TrafficShare(TrafficOptions(dataset="jsonl", dataset_path=str(path)), SlotPlan(0, 1, 0.0))
    share = TrafficShare(TrafficOptions(dataset="jsonl", dataset_path=str(path), endpoint="chat"), SlotPlan(0, 1, 0.0))
    assert share.next_ticket().request.body()["messages"] == [{"role": "user", "content": "hi"}]
