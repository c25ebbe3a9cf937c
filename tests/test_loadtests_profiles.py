"""Stepped and ramped load: the profile's arithmetic, the open-loop schedule that follows it
(still one global schedule partitioned over the workers), the flags, and real Locust runs
where the shape sets the users per level and every record carries its level."""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.stream_target import TargetProcess  # noqa: E402
from loadtests.arrivals import arrival_schedule  # noqa: E402
from loadtests.options import TrafficOptions, cli_arguments  # noqa: E402
from loadtests.profiles import LoadProfile  # noqa: E402
from loadtests.records import read_records  # noqa: E402
from loadtests.swarm import Swarm, SwarmSpec  # noqa: E402
from loadtests.traffic import SlotPlan, TrafficShare  # noqa: E402

# --- the profile -------------------------------------------------------------------------


def test_steps_hold_each_level_for_its_duration():
    profile = LoadProfile.parse_steps("1,4,16", 10)
    assert profile.duration_s == 30 and profile.levels == [1, 4, 16] and profile.max_level == 16
    assert [profile.level_at(t) for t in (-1, 0, 9.99, 10, 19.99, 20, 29.99, 30, 99)] == [1, 1, 1, 4, 4, 16, 16, 16, 16]
    assert [profile.users_at(t, level_users=2) for t in (5, 15, 25)] == [2, 8, 32]
    # the work done by t, in seconds at level 1, and back
    assert profile.work_until(15) == pytest.approx(10 + 4 * 5)
    assert profile.time_for_work(30) == pytest.approx(15)
    assert profile.time_for_work(profile.work_until(30) + 16) == pytest.approx(31)  # past the end: last level


def test_a_ramp_rises_linearly():
    profile = LoadProfile.parse_ramp("0:10", 10)
    assert [profile.level_at(t) for t in (0, 2.5, 5, 10)] == [0, 2.5, 5, 10]
    assert profile.work_until(10) == pytest.approx(50)
    assert profile.time_for_work(12.5) == pytest.approx(5)  # integral of t over [0, 5]
    assert profile.users_at(7.4, level_users=1) == 7


@given(
    levels=st.lists(st.one_of(st.just(0.0), st.floats(min_value=0.01, max_value=50)), min_size=1, max_size=5)
    .filter(lambda ls: max(ls) > 0),
    step_s=st.floats(min_value=0.1, max_value=100),
    fraction=st.floats(min_value=0.0, max_value=1.2),
)
def test_time_for_work_inverts_work_until(levels, step_s, fraction):
    profile = LoadProfile.steps(levels, step_s)
    t = fraction * profile.duration_s
    work = profile.work_until(t)
    back = profile.time_for_work(work)
    # the earliest time with that much work done: t itself, or the start of the level-0 stretch before it
    assert back <= t + 1e-6 * max(1.0, t)
    assert profile.work_until(back) == pytest.approx(work, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("text", ["", "a,b", "1,-2", "0,0"])
def test_bad_steps_are_refused(text):
    with pytest.raises(ValueError):
        LoadProfile.parse_steps(text, 10)


@pytest.mark.parametrize("text", ["4", "1:2:3", "x:4", "-1:4"])
def test_bad_ramps_are_refused(text):
    with pytest.raises(ValueError):
        LoadProfile.parse_ramp(text, 10)


# --- the open-loop schedule under a profile ------------------------------------------------


def test_constant_arrivals_follow_the_steps_on_one_global_grid():
    profile = LoadProfile.parse_steps("1,4", 5)  # 2 req/s for 5 s, then 8 req/s
    shares = [arrival_schedule("constant", 2.0, 1000.0, slot=s, n_slots=3, profile=profile) for s in range(3)]
    times = sorted(t for share in shares for t in (share.next_send_time() for _ in range(20)))
    first, second = [t for t in times if t < 1005.0], [t for t in times if 1005.0 <= t < 1010.0]
    assert first == pytest.approx([1000.0 + k / 2.0 for k in range(10)])
    assert second == pytest.approx([1005.0 + k / 8.0 for k in range(40)])


def test_poisson_shares_follow_the_level():
    profile = LoadProfile.parse_steps("1,5", 40)
    shares = [arrival_schedule("poisson", 5.0, 0.0, seed=3, slot=s, n_slots=2, profile=profile) for s in range(2)]
    counts = collections.Counter()
    for share in shares:
        while (t := share.next_send_time()) < 80:
            counts[int(t // 40)] += 1
    assert counts[0] == pytest.approx(5 * 40, rel=0.2) and counts[1] == pytest.approx(25 * 40, rel=0.1)


def test_tickets_carry_the_level_they_are_due_at():
    options = TrafficOptions(rate=2.0, arrival="constant", steps="1,3", step_s=2)
    share = TrafficShare(options, SlotPlan(0, 1, start_at=100.0))
    due = [share.next_ticket().scheduled_at for _ in range(10)]
    assert due == pytest.approx([100, 100.5, 101, 101.5, 102, 102 + 1 / 6, 102 + 2 / 6, 102.5, 102 + 4 / 6, 102 + 5 / 6])
    assert [share.level_at(t) for t in due] == [1, 1, 1, 1, 3, 3, 3, 3, 3, 3]
    assert TrafficShare(TrafficOptions(), SlotPlan(0, 1, 0.0)).level_at(5.0) is None


# --- flags and specs -------------------------------------------------------------------------


def test_profile_flags_round_trip_and_stay_out_of_the_web_form():
    options = TrafficOptions(steps="1,4,16", step_s=30, level_users=4, cpu_warn_pct=70, lag_warn_ms=20)
    parser = argparse.ArgumentParser()
    for argument in cli_arguments():
        parser.add_argument(argument.flag, **argument.kwargs)
    args = options.to_cli_args()
    assert "--mtp-steps" in args and "--mtp-ramp" not in args
    assert TrafficOptions.from_namespace(parser.parse_args(args)) == options
    off_form = {a.flag for a in cli_arguments() if not a.in_web_ui}
    assert {"--mtp-steps", "--mtp-step-s", "--mtp-ramp", "--mtp-ramp-s", "--mtp-level-users"} <= off_form


def test_profile_options_are_checked():
    with pytest.raises(ValueError, match="exclude each other"):
        TrafficOptions(steps="1,2", ramp="1:2")
    with pytest.raises(ValueError, match="--mtp-steps"):
        TrafficOptions(steps="one,two")
    traffic = TrafficOptions(records="/tmp/r.jsonl", steps="1,2", step_s=5)
    assert SwarmSpec(host="http://h", traffic=traffic, users=2).duration_s == 10  # the profile sets the length
    with pytest.raises(ValueError, match="cut the load profile"):
        SwarmSpec(host="http://h", traffic=traffic, users=2, run_time_s=8)
    with pytest.raises(ValueError, match="run_time_s is required"):
        SwarmSpec(host="http://h", traffic=TrafficOptions(records="/tmp/r.jsonl"), users=2)


# --- real runs -------------------------------------------------------------------------------


def in_flight_at(records, t: float) -> int:
    return sum(1 for r in records if r.sent_at <= t < r.sent_at + r.e2e_s)


def most_in_flight(records, t0: float, t1: float) -> int:
    """The most requests in flight at once during [t0, t1): the count only rises when one is sent."""
    return max(in_flight_at(records, t) for t in [t0] + [r.sent_at for r in records if t0 <= r.sent_at < t1])


def test_closed_loop_steps_over_two_workers(tmp_path):
    """The shape sets level x level_users users across both workers; records carry the level."""
    with TargetProcess(ttft_ms=20, tpot_ms=10, tokens_per_chunk=1) as target:
        spec = SwarmSpec(host=target.url, users=2, n_workers=2, stop_timeout_s=10,
                         traffic=TrafficOptions(records=str(tmp_path / "steps.jsonl"), max_tokens=20,
                                                steps="1,3", step_s=3, level_users=2))
        result = Swarm(spec).run(timeout_s=240)
    records = read_records(result.records_path)
    start = result.summary.test_started_at
    assert start is not None and result.n_records == len(records)
    assert {r.level for r in records} == {1.0, 3.0}
    assert all(r.level == (1.0 if r.sent_at - start < 3 else 3.0) for r in records)
    # the users per level: closed loop, each user has at most one request in flight, so the most
    # in flight at once is the number of users (2, then 6), exactly, however slow the machine;
    # each request (~0.2 s) dwarfs a user's gap between two, so all of them overlap at some moment
    assert most_in_flight(records, start, start + 3.0) == 2
    assert most_in_flight(records, start + 3.0, start + 6.0) == 6
    assert len({r.worker for r in records if r.level == 3.0}) == 2  # both workers carry the load
    # the profile ended the test: no request sent after it, none before it started
    assert all(start <= r.sent_at < start + 6.0 + 1.5 for r in records)
    assert {w.worker for w in result.generator.workers} == {r.worker for r in records}


def test_open_loop_steps_keep_the_global_schedule(tmp_path):
    with TargetProcess(ttft_ms=10, tpot_ms=5, tokens_per_chunk=4) as target:
        spec = SwarmSpec(host=target.url, users=8, n_workers=0, stop_timeout_s=10,
                         traffic=TrafficOptions(records=str(tmp_path / "open.jsonl"), max_tokens=9, rate=5.0,
                                                arrival="constant", steps="1,4", step_s=2))
        result = Swarm(spec).run(timeout_s=240)
    records = read_records(result.records_path)
    start = result.summary.test_started_at
    by_level = collections.Counter(r.level for r in records)
    # 5 req/s for 2 s, then 20 req/s for 2 s: 10 + 40 due times, and nothing due after the
    # profile's end
    grid = [0.2 * k for k in range(10)] + [2.0 + 0.05 * k for k in range(40)]
    scheduled = sorted(r.scheduled_at - start for r in records)
    assert scheduled[:12] == pytest.approx(grid[:12])
    assert all(r.scheduled_at < start + 4.0 for r in records)
    # each due time once, each on the grid; a request due just before the end may still be
    # waiting for a late sender when the test stops, so only due times near the end may miss
    assert len(set(scheduled)) == len(scheduled) and by_level[1.0] == 10 and by_level[4.0] <= 40
    on_grid = [min(grid, key=lambda g: abs(g - t)) for t in scheduled]
    assert scheduled == pytest.approx(on_grid, abs=1e-6)
    missing = sorted(set(grid) - set(on_grid))
    assert all(t >= 3.0 for t in missing), missing
    assert result.generator.scheduled_requests == len(records)
    # send lag: nothing left before its time, and the generator reports what the records say
    assert all(r.send_lag_s >= 0 for r in records)
    assert result.generator.send_lag_p50_ms == pytest.approx(
        1000 * statistics.median(r.send_lag_s for r in records), rel=0.2, abs=0.01)


def test_a_generator_that_cannot_keep_up_says_so(tmp_path):
    # 20 requests/s of 0.2 s each need 4 users; one user falls further behind with every request
    # (0.15 s per request: p99 past 500 ms after ~5 requests; 8 s leave room for a slow start)
    with TargetProcess(ttft_ms=10, tpot_ms=10, tokens_per_chunk=1) as target:
        spec = SwarmSpec(host=target.url, users=1, run_time_s=8, n_workers=0, stop_timeout_s=5,
                         traffic=TrafficOptions(records=str(tmp_path / "late.jsonl"), max_tokens=20, rate=20.0,
                                                arrival="constant", lag_warn_ms=50))
        result = Swarm(spec).run(timeout_s=240)
    assert result.generator_limited
    assert result.generator.send_lag_p99_ms > 500
    assert any("send lag p99" in w for w in result.warnings)
    assert "generator limited" in (result.log_dir / "master.log").read_text()
