"""Real Locust runs (master and workers as processes) against the benchmark stream target:
every request sent is recorded exactly once, the timing agrees with what the target sent,
a dead worker fails the run, and no Locust process outlives its Swarm or its parent.

Only relations that hold on any machine are asserted here (the client saw the first chunk
when the target sent it, never before the schedule; nothing sent before its time); how
close to the schedule, and at what CPU cost, is `make bench-loadgen` (benchmarks/loadgen.py,
its `distributed` figures are this test's run)."""

from __future__ import annotations

import collections
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.stream_target import TargetProcess  # noqa: E402
from loadtests.options import TrafficOptions  # noqa: E402
from loadtests.records import read_records  # noqa: E402
from loadtests.swarm import Swarm, SwarmError, SwarmSpec  # noqa: E402
from tests.conftest import wait_until_gone  # noqa: E402

TTFT_S, TPOT_S, TOKENS, TOKENS_PER_CHUNK = 0.040, 0.005, 33, 4


def test_importing_the_swarm_keeps_gevent_out():
    # the Swarm runs inside Ray processes: gevent's monkey patching must never get there
    code = "import sys, loadtests.swarm; assert not {'gevent', 'locust'} & set(sys.modules), sys.modules.keys()"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_distributed_open_loop_run_records_every_request_once(tmp_path):
    with TargetProcess(ttft_ms=TTFT_S * 1000, tpot_ms=TPOT_S * 1000, tokens_per_chunk=TOKENS_PER_CHUNK) as target:
        spec = SwarmSpec(
            host=target.url,
            users=4,
            run_time_s=4,
            n_workers=2,
            stop_timeout_s=10,  # in-flight requests finish: none is cancelled
            traffic=TrafficOptions(records=str(tmp_path / "records.jsonl"), tag="experiment", max_tokens=TOKENS,
                                   rate=10.0, arrival="poisson", arm_pin="baseline,canary", seed=1),
        )
        progress = []
        swarm = Swarm(spec, on_progress=progress.append, progress_interval_s=0.5)
        result = swarm.run(timeout_s=240)
        served = target.stats()
        sent_by_target = target.timings()

    records = read_records(result.records_path)
    # nothing dropped, nothing doubled: one record per request the server saw
    assert result.n_records == len(records) == served["started"] == served["completed"] > 20
    assert len({r.request_id for r in records}) == len(records)
    assert sum(w.records_sent for w in result.summary.workers) == len(records)
    assert len(result.summary.workers) == 2 and all(w.complete for w in result.summary.workers)
    assert result.worker_exit_codes == [0, 0] and result.master_exit_code == 0
    assert all(r.ok and not r.cancelled and r.tag == "experiment" for r in records)

    # arm pinning: the arms the server saw, and every prompt to both arms
    arms = collections.Counter(r.arm for r in records)
    assert arms == collections.Counter(served["by_arm"]) and set(arms) == {"baseline", "canary"}
    by_prompt = collections.defaultdict(list)
    for record in records:
        by_prompt[record.dataset_index].append(record.arm)
    assert all(sorted(a) == ["baseline", "canary"] for a in by_prompt.values() if len(a) == 2)
    assert sum(len(a) == 2 for a in by_prompt.values()) >= len(by_prompt) - 4  # a user may stop between the two

    # the target's schedule, seen through Locust: printed here, judged in benchmarks/loadgen.py
    ttft_error_ms = (statistics.median(r.ttft_s for r in records) - TTFT_S) * 1000
    tpot_rel_error = statistics.median(r.tpot_s for r in records) / TPOT_S - 1
    print(f"swarm fidelity: TTFT median error {ttft_error_ms:.2f} ms, TPOT median error {tpot_rel_error:.2%}, "
          f"send lag median {statistics.median(r.send_lag_s for r in records) * 1000:.2f} ms")
    assert all(r.output_tokens == TOKENS and r.chunks == 9 and r.decode_tokens_per_chunk == 4.0 for r in records)
    # no token before the schedule allows it (the target's timer starts after the client sent)
    assert all(r.ttft_s >= TTFT_S - 0.0005 for r in records), min(r.ttft_s for r in records)
    assert all(r.e2e_s >= TTFT_S + (TOKENS - 1) * TPOT_S - 0.0005 for r in records), min(r.e2e_s for r in records)
    # what the client stamped is what the target sent, on the wall clock both share: the first
    # chunk when it left (not the next one, due TOKENS_PER_CHUNK * TPOT_S later), and the
    # stream's length from first to last chunk as the target timed it
    assert set(sent_by_target) >= {r.request_id for r in records}
    first_chunk_error_s = statistics.median(
        r.sent_at + r.ttft_s - sent_by_target[r.request_id].first_sent_at for r in records)
    span_ratio = statistics.median((r.e2e_s - r.ttft_s) / (sent_by_target[r.request_id].last_s
                                                         - sent_by_target[r.request_id].first_s) for r in records)
    print(f"client vs target: first chunk median {first_chunk_error_s * 1000:+.2f} ms, stream length ratio {span_ratio:.4f}")
    assert abs(first_chunk_error_s) < TOKENS_PER_CHUNK * TPOT_S, first_chunk_error_s
    assert span_ratio == pytest.approx(1.0, abs=0.1)
    # open loop: every request had a targeted time, and none left before it
    assert all(r.scheduled_at is not None and r.send_lag_s >= 0 for r in records)
    # the run reports the generator's own health: each worker's CPU and the send lag
    generator = result.generator
    assert sorted(w.worker for w in generator.workers) == sorted({r.worker for r in records})
    for w in generator.workers:
        # the run lasted its 4 s; the share is the CPU measured over that time, which no
        # process can exceed on this machine's cores
        assert w.cpu_s > 0 and w.wall_s >= 3 and w.cpu_pct == pytest.approx(100 * w.cpu_s / w.wall_s)
        assert w.cpu_s <= w.wall_s * os.cpu_count()
    assert generator.scheduled_requests == len(records)
    assert generator.send_lag_p50_ms == pytest.approx(1000 * statistics.median(r.send_lag_s for r in records), rel=0.2)

    assert progress and progress[-1].requests_done == len(records)
    assert [p.requests_done for p in progress] == sorted(p.requests_done for p in progress)
    assert wait_until_gone(swarm.pids, 10.0) == []


def test_local_run_keeps_records_of_requests_cut_off_at_the_end(tmp_path):
    # A token a second: each user's first request lasts 40 s, far past the 10 s run, so every
    # request is still in flight at the end by construction (not by the timing of the stop)
    # and each user sends exactly one. 10 s: time enough for the users to start on a slow machine.
    with TargetProcess(ttft_ms=20, tpot_ms=1000, tokens_per_chunk=1) as target:
        spec = SwarmSpec(
            host=target.url, users=3, run_time_s=10, n_workers=0, stop_timeout_s=0,  # in-flight requests are cut
            traffic=TrafficOptions(records=str(tmp_path / "local.jsonl"), max_tokens=40, endpoint="chat", model="m"),
        )
        swarm = Swarm(spec)
        result = swarm.run(timeout_s=240)
        served = target.stats()
    records = read_records(result.records_path)
    assert result.n_records == len(records) and [w.worker for w in result.summary.workers] == ["local"]
    # the users' in-flight requests, kept and marked: one per user that got to send
    assert 1 <= len(records) <= 3 and all(r.cancelled for r in records)
    assert all(not r.ok and r.status == 200 and r.chunks >= 1 and r.ttft_s is not None for r in records)
    # every request the server saw has its record; none finished
    assert served["started"] == len(records) and served["completed"] == 0
    assert wait_until_gone(swarm.pids, 10.0) == []


def test_a_worker_that_dies_fails_the_run(tmp_path):
    with TargetProcess(ttft_ms=10, tpot_ms=5) as target:
        spec = SwarmSpec(host=target.url, users=2, run_time_s=600, n_workers=2,
                         traffic=TrafficOptions(records=str(tmp_path / "r.jsonl"), max_tokens=10))
        swarm: Swarm

        def kill_a_worker_once_traffic_flows(progress):
            if progress.requests_done > 0 and progress.workers_alive == 2:
                os.kill(swarm.worker_pids[0], signal.SIGKILL)

        swarm = Swarm(spec, on_progress=kill_a_worker_once_traffic_flows, progress_interval_s=0.2)
        started = time.monotonic()
        with pytest.raises(SwarmError, match="worker 0 died"):  # during the run: the end says "exited"
            swarm.run(timeout_s=300)
    assert time.monotonic() - started < spec.run_time_s / 2  # failed at once, not at the end of the run
    assert wait_until_gone(swarm.pids, 10.0) == []


def test_locust_processes_exit_when_their_parent_is_killed(tmp_path):
    with TargetProcess(ttft_ms=10, tpot_ms=5) as target:
        driver = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(REPO)!r})
            from loadtests.options import TrafficOptions
            from loadtests.swarm import Swarm, SwarmSpec
            spec = SwarmSpec(host={target.url!r}, users=2, run_time_s=60, n_workers=1,
                             traffic=TrafficOptions(records={str(tmp_path / "r.jsonl")!r}, max_tokens=10))
            swarm = None
            def report(progress):
                if progress.requests_done:
                    print(*swarm.pids, flush=True)
            swarm = Swarm(spec, on_progress=report, progress_interval_s=0.2)
            swarm.run()
        """)
        parent = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
        try:
            pids = [int(p) for p in parent.stdout.readline().split()]
        finally:
            parent.kill()  # no chance to clean up: like a Ray worker killed hard
            parent.wait()
        assert len(pids) == 2
        assert wait_until_gone(pids, 40.0) == []


def test_an_interrupt_kills_every_locust_process(tmp_path):
    spec = SwarmSpec(host="http://127.0.0.1:9", users=2, run_time_s=60, n_workers=2,
                     traffic=TrafficOptions(records=str(tmp_path / "r.jsonl")))

    def interrupt(_progress):
        raise KeyboardInterrupt  # what Ctrl-C in the driver looks like

    swarm = Swarm(spec, on_progress=interrupt)
    with pytest.raises(KeyboardInterrupt):
        swarm.run()
    assert len(swarm.pids) == 3 and wait_until_gone(swarm.pids, 10.0) == []
