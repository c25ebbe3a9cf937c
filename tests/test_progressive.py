"""The progressive phase end to end: a real Router actor, real Locust through it, real SQLite.

The upstreams here are the benchmark stream target (a zero-work OpenAI streaming server)
as the baseline and canary replicas, for the loop's logic (steps, windows, pause, abort).
The same phase over real vLLM CPU replicas is in tests/test_fleet.py, on that module's
one fleet (a vLLM start is the slowest thing in the suite: one fleet serves all of them).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import ray
import requests

from cluster.metrics import MetricsSnapshot
from cluster.router import Router
from loadtests.records import read_records
from rollout.config import ProgressiveConfig, RolloutStep
from rollout.judge.config import GuardConfig
from rollout.judge.verdicts import Decision
from rollout.run.phases.progressive_steps import PHASE, run_progressive
from rollout.run.store import RunStore
from tests.conftest import REPO, wait_gone
from tests.progressive_harness import Harness, assert_split_follows, locust_processes

sys.path.insert(0, str(REPO))
from benchmarks.stream_target import TargetProcess  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def router(local_ray):
    actor = Router.remote(initial_weights={"baseline": 100.0, "canary": 0.0}, seed=0)
    url = ray.get(actor.start.remote())
    yield actor, url
    ray.get(actor.stop.remote())
    ray.kill(actor)


# ======================================================================================
# Fast: stream-target upstreams
# ======================================================================================
class Targets:
    def __init__(self) -> None:
        self.procs = {"baseline-0": TargetProcess(ttft_ms=20, tpot_ms=4, replica="baseline-0"),
                      "canary-0": TargetProcess(ttft_ms=20, tpot_ms=4, replica="canary-0")}
        self.arms = {"baseline-0": "baseline", "canary-0": "canary"}

    def __enter__(self) -> "Targets":
        for proc in self.procs.values():
            proc.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            proc.__exit__(None, None, None)

    def urls(self) -> dict[str, list[str]]:
        return {arm: [self.procs[name].url for name, a in self.arms.items() if a == arm] for arm in ("baseline", "canary")}

    def alive(self) -> dict[str, bool]:
        out = {}
        for name, proc in self.procs.items():
            try:
                out[name] = requests.get(proc.url + "/health", timeout=2).status_code == 200
            except requests.RequestException:
                out[name] = False
        return out

    def kill(self, name: str) -> None:
        self.procs[name]._process.kill()
        self.procs[name]._process.wait()


@pytest.fixture
def targets(router):
    actor, _ = router
    with Targets() as t:
        ray.get(actor.set_arms.remote(t.urls()))
        ray.get(actor.set_weights.remote({"baseline": 100.0, "canary": 0.0}))
        yield t


def fast_harness(tmp_path, router, targets, run_id="fast") -> Harness:
    actor, url = router
    return Harness(tmp_path, run_id, actor, url, {n: (a, None) for n, a in targets.arms.items()},
                   scrape=lambda: {n: MetricsSnapshot() for n in targets.arms}, alive=targets.alive)


def fast_config(steps: list[dict], **kw) -> ProgressiveConfig:
    return ProgressiveConfig(
        enabled=True,
        steps=[RolloutStep(**s) for s in steps],
        guards=GuardConfig(window_s=2, min_requests=5, ttft_p95_max_s=2.0, tpot_p95_max_s=0.5),
        users=4,
        **kw,
    )


def test_steps_promote_with_the_split_following_the_weights(tmp_path, router, targets):
    h = fast_harness(tmp_path, router, targets)
    config = fast_config([{"canary_weight": 10, "bake_s": 4}, {"canary_weight": 50, "bake_s": 4},
                          {"canary_weight": 100, "bake_s": 4}])
    outcome = run_progressive(h.context(config, "stream-target", speculative=False, n_workers=1))
    assert outcome.decision == Decision.PROMOTE, outcome.reason
    assert outcome.steps_completed == 3 and outcome.windows == 6
    assert [s["canary_weight"] for s in outcome.observed_split] == [10, 50, 100]
    assert_split_follows(outcome, tolerance=5)
    assert {g.name: g.verdict.value for g in outcome.guards} == {
        "guard_replica_health": "pass", "guard_error_rate": "pass", "guard_ttft_p95_slo": "pass",
        "guard_tpot_p95_slo": "pass", "guard_acceptance_length": "pass"}
    assert [w for _, w, _ in h.weight_log] == [10, 50, 100]
    events = [e for e, _ in h.events()]
    assert events[0] == "plan" and events[-1] == "done"
    steps = [i for i, e in enumerate(events) if e == "step"]
    weights = [i for i, e in enumerate(events) if e == "weights"]
    assert len(steps) == 3 and all(w < s for w, s in zip(weights, steps))
    windows = h.window_results()
    assert [w["window"] for w in windows] == [1, 2, 3, 4, 5, 6]
    assert [w["canary_weight"] for w in windows] == [10, 10, 50, 50, 100, 100]
    assert all(len(w["gates"]) == 5 for w in windows)
    assert h.store.run(h.run_id)["step"] == 3 and h.store.run(h.run_id)["canary_weight"] == 100
    h.check_records()
    assert outcome.records == h.store.count_request_samples(h.run_id, PHASE) and outcome.load_error is None
    assert any("step 2/3 canary 50%" in line and "window 3" in line for line in h.lines)
    assert wait_gone(lambda: locust_processes(str(tmp_path))) == []


def test_swarm_stop_ends_a_distributed_run_early_with_every_record(tmp_path):
    from loadtests.options import TrafficOptions
    from loadtests.swarm import Swarm, SwarmSpec

    with TargetProcess(ttft_ms=20, tpot_ms=4) as target:
        spec = SwarmSpec(host=target.url, users=2, run_time_s=600, n_workers=1, stop_timeout_s=5,
                         traffic=TrafficOptions(records=str(tmp_path / "records.jsonl"), max_tokens=16))
        swarm = Swarm(spec)
        swarm.stop()  # asked before it runs: honoured once the master is up
        got: dict = {}
        thread = threading.Thread(target=lambda: got.setdefault("result", swarm.run()), daemon=True)
        thread.start()
        thread.join(spec.run_time_s / 2)  # stopped early: long before the run's 600 s were up
        if thread.is_alive():
            swarm.kill()
        assert not thread.is_alive(), "swarm.stop() did not end the run"
        result = got["result"]
        served = target.stats()
    assert result.summary.complete and result.master_exit_code == 0 and result.worker_exit_codes == [0]
    records = read_records(result.records_path)
    assert len(records) == result.n_records == served["started"]
    assert wait_gone(lambda: locust_processes(str(tmp_path))) == []


def test_a_canary_that_dies_mid_step_is_rolled_back_within_a_window(tmp_path, router, targets):
    h = fast_harness(tmp_path, router, targets, run_id="dies")
    config = fast_config([{"canary_weight": 50, "bake_s": 30}, {"canary_weight": 100, "bake_s": 4}])
    killed_at: list[float] = []

    def kill_later() -> None:
        store = RunStore(h.store.path)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(e["event"] == "window" for e in store.events(h.run_id)):
            time.sleep(0.2)
        time.sleep(1)
        killed_at.append(time.time())
        targets.kill("canary-0")

    killer = threading.Thread(target=kill_later)
    killer.start()
    outcome = run_progressive(h.context(config, "stream-target", speculative=False))
    killer.join()
    assert outcome.decision == Decision.ROLLBACK
    assert outcome.rolled_back_at is not None and outcome.rolled_back_at > killed_at[0]
    # within a window: the window of the kill judged it, or at the latest the one after it,
    # not the end of the 30 s bake (15 windows)
    assert len([w for w in h.window_results() if w["start"] > killed_at[0]]) <= 1, h.window_results()
    assert h.weight_log[-1][1] == 0.0
    assert {g.name for g in outcome.guards} & {"guard_replica_health", "guard_error_rate"}
    state = ray.get(router[0].get_state.remote())
    assert state["weights"]["canary"] == 0.0
    # the failing window is committed before the abort, and the abort follows at once: sooner
    # than a window (on this machine: within milliseconds)
    last = h.window_results()[-1]
    assert any(g["verdict"] == "fail" for g in last["gates"])
    committed = [r for r in h.store.all_phase_results(h.run_id) if r["phase"] == PHASE][-1]
    assert committed["look"] == last["window"]
    assert 0 <= outcome.rolled_back_at - committed["time"] < config.guards.window_s
    events = [e for e, _ in h.events()]
    assert events.index("abort") > max(i for i, e in enumerate(events) if e == "window")
    assert outcome.steps_completed == 0
    h.check_records()
    assert wait_gone(lambda: locust_processes(str(tmp_path))) == []


def test_a_pause_waits_for_promote_and_an_unanswered_pause_aborts(tmp_path, router, targets):
    h = fast_harness(tmp_path, router, targets, run_id="paused")
    config = fast_config([{"canary_weight": 20, "bake_s": 2, "pause": True}, {"canary_weight": 60, "bake_s": 2}],
                         pause_timeout_s=60)

    def promote_when_paused() -> None:
        store = RunStore(h.store.path)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(e["event"] == "pause" for e in store.events(h.run_id)):
            time.sleep(0.2)
        time.sleep(2.5)
        store.add_command(h.run_id, "promote")

    answer = threading.Thread(target=promote_when_paused)
    answer.start()
    outcome = run_progressive(h.context(config, "stream-target", speculative=False))
    answer.join()
    assert outcome.decision == Decision.PROMOTE, outcome.reason
    events = [e for e, _ in h.events()]
    assert events.index("pause") < events.index("resume") < max(i for i, e in enumerate(events) if e == "step")
    # the pause waited for the answer (sent 2.5 s after it began), and the answer, not the
    # 60 s timeout, ended it
    at = {e["event"]: e["time"] for e in h.store.events(h.run_id) if e["event"] in ("pause", "resume")}
    assert 2.5 <= at["resume"] - at["pause"] < config.pause_timeout_s, at
    assert any(w["paused"] for w in h.window_results())
    h.check_records()

    # nobody answers: the timeout decides (default: abort)
    h2 = fast_harness(tmp_path / "timeout", router, targets, run_id="unanswered")
    config = fast_config([{"canary_weight": 20, "bake_s": 2, "pause": True}, {"canary_weight": 60, "bake_s": 2}],
                         pause_timeout_s=3)
    outcome = run_progressive(h2.context(config, "stream-target", speculative=False))
    assert outcome.decision == Decision.ROLLBACK and "timed out" in outcome.reason
    assert h2.weight_log[-1][1] == 0.0 and outcome.steps_completed == 0
    assert "pause_timeout" in [e for e, _ in h2.events()]
    assert wait_gone(lambda: locust_processes(str(tmp_path))) == []


def test_an_abort_command_rolls_back_during_a_bake(tmp_path, router, targets):
    h = fast_harness(tmp_path, router, targets, run_id="aborted")
    config = fast_config([{"canary_weight": 30, "bake_s": 60}])

    def abort_soon() -> None:
        store = RunStore(h.store.path)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(e["event"] == "window" for e in store.events(h.run_id)):
            time.sleep(0.2)
        subprocess.run([sys.executable, "-m", "rollout", "abort", h.run_id, "--runs-dir", str(h.runs_dir)],
                       cwd=REPO, check=True, timeout=60)

    thread = threading.Thread(target=abort_soon)
    thread.start()
    outcome = run_progressive(h.context(config, "stream-target", speculative=False))
    thread.join()
    assert outcome.decision == Decision.ROLLBACK and "aborted by command" in outcome.reason
    # the command cut the window it arrived in, long before the 60 s bake's 30 windows were done
    windows = h.window_results()
    assert windows[-1]["closed_early"] and windows[-1]["command"] == "abort"
    assert len(windows) < 30
    assert h.weight_log[-1][1] == 0.0
    h.check_records()
    assert wait_gone(lambda: locust_processes(str(tmp_path))) == []


def test_a_second_attempt_continues_the_numbering_and_stores_leftovers_once(tmp_path, router, targets):
    # what `resume` relies on: a new run_progressive on the same run stores the records an
    # earlier attempt's load wrote but never committed, and never stores one twice
    h = fast_harness(tmp_path, router, targets, run_id="again")
    config = fast_config([{"canary_weight": 50, "bake_s": 2}])
    first = run_progressive(h.context(config, "stream-target", speculative=False))
    assert first.decision == Decision.PROMOTE
    records_file = h.runs_dir / h.run_id / PHASE / "records.jsonl"
    written = read_records(records_file)
    unread = written[0].model_copy(update={"request_id": "never-committed"})
    with open(records_file, "a") as f:
        f.write(unread.model_dump_json() + "\n" + '{"request_id": "half a li')  # and a torn last line
    before = h.store.count_request_samples(h.run_id, PHASE)
    last_window = max(w for w, _ in h.store.request_samples(h.run_id, PHASE))

    second = run_progressive(h.context(config, "stream-target", speculative=False))
    assert second.decision == Decision.PROMOTE
    samples = h.store.request_samples(h.run_id, PHASE)
    ids = [json.loads(r)["request_id"] for _, r in samples]
    assert len(ids) == len(set(ids)) and "never-committed" in ids
    new_file = h.runs_dir / h.run_id / PHASE / f"records-from-window-{last_window + 2}.jsonl"
    assert len(samples) == before + 1 + len(read_records(new_file))
    windows = [w["window"] for w in h.window_results()]
    assert windows == sorted(set(windows)) and windows[-1] > last_window + 1
    assert "recovered" in [e for e, _ in h.events()]
    assert wait_gone(lambda: locust_processes(str(tmp_path))) == []


class SteppedBackClock:
    """The controller's wall clock stepped back one hour (NTP) once `after_s` have passed;
    monotonic time and sleep are the real ones."""

    def __init__(self, after_s: float) -> None:
        self._t0 = time.monotonic()
        self._after_s = after_s
        self.monotonic = time.monotonic
        self.sleep = time.sleep

    def time(self) -> float:
        stepped = time.monotonic() - self._t0 > self._after_s
        return time.time() - (3600.0 if stepped else 0.0)


def test_a_wall_clock_stepped_back_neither_holds_a_window_open_nor_a_pause(tmp_path, router, targets, monkeypatch):
    from rollout.run.phases import progressive_steps, progressive_windows

    clock = SteppedBackClock(after_s=3.0)
    monkeypatch.setattr(progressive_windows, "time", clock)
    monkeypatch.setattr(progressive_steps, "time", clock)
    config = fast_config([{"canary_weight": 20, "bake_s": 4, "pause": True}, {"canary_weight": 60, "bake_s": 2}],
                         pause_timeout_s=4)
    done: list = []

    def run() -> None:  # the harness (its SQLite connection) made in the thread that uses it
        h = fast_harness(tmp_path, router, targets, run_id="clock")
        done.append(run_progressive(h.context(config, "stream-target", speculative=False)))

    phase = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    phase.start()
    phase.join(180)  # windows of 2 s and a 4 s pause; a clock-driven loop would wait an hour
    assert done, "the phase was still waiting on the wall clock"
    outcome = done[0]
    # the unanswered pause timed out on monotonic time: rolled back after the first step's windows
    assert outcome.decision == Decision.ROLLBACK and "timed out" in outcome.reason, outcome.reason
    assert outcome.windows >= 2 and time.monotonic() - started < 180
    assert wait_gone(lambda: locust_processes(str(tmp_path))) == []
