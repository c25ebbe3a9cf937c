"""The progressive phase's guard windows: records tailed into windows, /metrics deltas,
replica health, the guards judged (rollout.judge.guards) and committed before anyone acts.

Windows and records. The swarm's master appends records (JSON lines) to one file
as workers ship them (every ~1 s); only the complete lines not read yet are read.
A record belongs to the window in which the request *ended* (sent_at + e2e_s, wall
clock); a window is closed SHIP_GRACE_S after its end so that the records of
requests that ended inside it have arrived. A record that arrives later still (or
that ended after the window closed early) goes to the next window: every record is
stored exactly once. Records left when the load stops go to one more window index
that has records but no verdict.

Fast abort. Inside a window the guards are also judged every INTERIM_LOOK_S on the
window so far (only a FAIL acts on an interim look; the error budget is split over
the looks, see rollout.judge.guards), and replica health is polled every
HEALTH_POLL_S: a canary replica seen dead on two consecutive polls closes the
window at once. So a dead canary is rolled back within ~2 s, and a canary that
starts failing requests within a few seconds of its failures reaching
INTERIM_LOOK_S, at the latest at the first window end after it.

The error guard's baseline reference is the baseline's records of this phase so
far (the latest BASELINE_REFERENCE_MAX), not only the window's: at a 100% step the
baseline serves nothing, and a longer reference makes the bound tight. Latency
guards judge the canary against absolute SLOs only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.arms import BASELINE, CANARY
from cluster.load_runner import LoadRunnerHandle
from cluster.router import ROUTER_WATCH_NAME
from cluster.metrics import MetricsSnapshot, SpecDecodeStats, spec_decode_delta
from loadtests.records import RecordsTail, RequestRecord
from loadtests.swarm import SwarmError
from rollout.judge.guards import judge_guard_window
from rollout.judge.request_acceptance import spec_decode_of_requests
from rollout.judge.verdicts import GateResult, Verdict
from rollout.run.phases.progressive_context import ProgressiveContext
from rollout.run.resume import PROGRESSIVE as PHASE
from rollout.run.context import InfrastructureError

TICK_S = 0.25  # the loop's heartbeat: commands, health, records
SHIP_GRACE_S = 1.5  # workers ship records every 1 s: a window closes this long after its end
INTERIM_LOOK_S = 2.0  # guards judged on the window so far this often (FAIL only)
HEALTH_POLL_S = 1.0
DEAD_CONFIRMATIONS = 2  # consecutive polls that must see a replica dead
BASELINE_REFERENCE_MAX = 1000
FIRST_RECORD_TIMEOUT_S = 120


def ended_at(record: RequestRecord) -> float:
    return record.sent_at + record.e2e_s


@dataclass
class Window:
    index: int
    step: int  # 0-based step index
    weight: float
    start: float  # wall clock (what records' sent_at are compared with)
    end: float  # nominal end, wall clock
    paused: bool = False
    records: list[RequestRecord] = field(default_factory=list)
    # time.monotonic() at the start: the loop waits by elapsed monotonic time, so a wall clock
    # stepped back (NTP) cannot hold a window open, nor one stepped forward close it at once
    opened: float = field(default_factory=time.monotonic)

    @property
    def length_s(self) -> float:
        return self.end - self.start

    def elapsed_s(self) -> float:
        return time.monotonic() - self.opened


class Abort(Exception):
    """A guard failed (or a command or a pause timeout ended the phase): the canary is at weight 0."""

    def __init__(self, reason: str, guards: list[GateResult]):
        super().__init__(reason)
        self.reason, self.guards = reason, guards


class WindowRunner:
    """Runs guard windows one after another over one load; keeps the records and the health streaks."""

    def __init__(self, ctx: ProgressiveContext) -> None:
        self.ctx = ctx
        self.n_steps = len(ctx.config.steps)
        self.guards_cfg = ctx.config.guards
        self.window_s = float(self.guards_cfg.window_s)
        self.looks = max(1, math.ceil(self.window_s / INTERIM_LOOK_S))  # interim looks + the final one
        self.tail: RecordsTail | None = None
        self.load: LoadRunnerHandle | None = None
        self.pending: list[RequestRecord] = []
        self.baseline_history: list[RequestRecord] = []
        self.dead_streak: dict[str, int] = {}
        self.next_health = 0.0
        self.metrics_before: dict[str, MetricsSnapshot] | None = None
        # a resumed phase continues the numbering (the drained records of a finished load have an index too)
        self.window_index = max(ctx.store.last_look(ctx.run_id, PHASE), ctx.store.last_sample_window(ctx.run_id, PHASE))
        self.windows_judged = 0
        self.stored = 0
        self.rolled_back_at: float | None = None

    def say(self, message: str) -> None:
        self.ctx.say(message)  # the controller's say names the phase

    # -- records, metrics, health ---------------------------------------------------
    def read_records(self) -> None:
        assert self.tail is not None
        self.pending.extend(self.tail.read())

    def take(self, until: float) -> list[RequestRecord]:
        """Pending records of requests that ended before `until` (removed from pending)."""
        taken = [r for r in self.pending if ended_at(r) < until]
        self.pending = [r for r in self.pending if ended_at(r) >= until]
        return taken

    def scrape(self) -> dict[str, MetricsSnapshot] | None:
        try:
            return self.ctx.scrape()
        except Exception as exc:  # a dead replica does not answer /metrics
            self.say(f"/metrics scrape failed: {type(exc).__name__}: {str(exc)[:200]}")
            return None

    def canary_delta(self, before, after) -> SpecDecodeStats | None:
        canaries = [name for name, arm in self.ctx.replica_arms.items() if arm == CANARY]
        return spec_decode_delta(before, after, canaries)

    def poll_health(self, now: float) -> None:
        if now < self.next_health:
            return
        self.next_health = now + HEALTH_POLL_S
        try:
            alive = self.ctx.replicas_alive()
        except Exception as exc:  # cannot tell: no evidence either way
            self.say(f"health poll failed: {type(exc).__name__}: {str(exc)[:200]}")
            return
        for name in self.ctx.replica_arms:
            if name in alive:
                self.dead_streak[name] = 0 if alive[name] else self.dead_streak.get(name, 0) + 1
        # the router's actor gone: no request reaches either arm and the windows judge nothing (seen: 0
        # requests a window for the whole bake): where the traffic is, is unknown, so no verdict
        router_down = alive.get(ROUTER_WATCH_NAME) is False
        self.dead_streak[ROUTER_WATCH_NAME] = self.dead_streak.get(ROUTER_WATCH_NAME, 0) + 1 if router_down else 0
        if self.dead_streak[ROUTER_WATCH_NAME] >= DEAD_CONFIRMATIONS:
            raise InfrastructureError(f"{PHASE}: router died (its actor is gone): no verdict on the steps")

    def canary_alive(self) -> bool:
        return not any(
            self.dead_streak.get(name, 0) >= DEAD_CONFIRMATIONS
            for name, arm in self.ctx.replica_arms.items()
            if arm == CANARY
        )

    # -- verdicts ---------------------------------------------------------------------
    def judge(self, records: list[RequestRecord], spec_delta, look: int, looks: int, judged: bool = False) -> list[GateResult]:
        """The guards on `records` (a window, or with judged=True a step of windows already in the history)."""
        canary = [r for r in records if r.arm == CANARY]
        window_baseline = [] if judged else [r for r in records if r.arm == BASELINE]
        reference = (self.baseline_history + window_baseline)[-BASELINE_REFERENCE_MAX:]
        return judge_guard_window(
            reference,
            canary,
            spec_delta,
            self.canary_alive(),
            self.guards_cfg,
            self.ctx.speculative_canary,
            looks=looks,
            look=look,
        )

    def rollback(self, reason: str) -> None:
        """Canary weight to 0 first (within a second of the verdict), then the paperwork."""
        self.ctx.set_canary_weight(0.0, f"guard abort: {reason}")
        self.rolled_back_at = time.time()
        try:
            self.ctx.store.update_run(self.ctx.run_id, canary_weight=0.0)
        except Exception:
            pass
        self.ctx.event("abort", reason)
        self.say(f"ABORT: {reason}; canary weight 0")

    # -- one window ---------------------------------------------------------------------
    def new_window(self, step: int, weight: float, paused: bool = False) -> Window:
        self.window_index += 1
        start = time.time()
        return Window(self.window_index, step, weight, start, start + self.window_s, paused)

    def run_window(self, window: Window, stop_on_command: Callable[[], str | None] | None = None) -> str | None:
        """Run and judge one window; raises Abort on a FAIL. Returns a command that ended it early."""
        close, early, command = self._watch(window, stop_on_command)
        self.read_records()
        window.records = self.take(close)
        if early and command is None:
            # a failing canary: no /metrics scrape (a hung replica would hold the verdict for its timeout)
            spec_delta = None
        else:
            after = self.scrape()
            spec_delta = self.canary_delta(self.metrics_before, after)
            self.metrics_before = after
        # the window's own canary requests' counters where they carry them (rollout.judge.request_acceptance)
        spec_delta = spec_decode_of_requests(window.records, CANARY) or spec_delta
        gates = self.judge(window.records, spec_delta, self.looks, self.looks)
        self.commit(window, gates, close, early, command)
        self.baseline_history = (self.baseline_history + [r for r in window.records if r.arm == BASELINE])[
            -BASELINE_REFERENCE_MAX:
        ]
        failed = [g for g in gates if g.verdict == Verdict.FAIL]
        if failed:
            reason = (
                f"{', '.join(g.name for g in failed)} failed in window {window.index} "
                f"(step {window.step + 1}, canary {window.weight:g}%): {failed[0].detail}"
            )
            self.rollback(reason)
            raise Abort(reason, failed)
        if command == "abort":
            reason = f"aborted by command during step {window.step + 1} (canary {window.weight:g}%)"
            self.rollback(reason)
            raise Abort(reason, [])
        return command

    def _watch(self, window: Window, stop_on_command: Callable[[], str | None] | None) -> tuple[float, bool, str | None]:
        """Tick until the window closes: (close time, closed early, the command that closed it)."""
        ctx = self.ctx
        next_look = INTERIM_LOOK_S  # elapsed seconds
        look = 0
        command = None
        early = False
        while True:
            elapsed = window.elapsed_s()
            if elapsed >= window.length_s + SHIP_GRACE_S:
                break
            now = window.start + elapsed  # wall time on the window's own clock
            self.load.check()
            self.read_records()
            self.poll_health(time.monotonic())
            if not self.canary_alive():
                early = True
                break
            got = ctx.store.take_command(ctx.run_id, accept=("abort",))
            if got is None and stop_on_command is not None:
                got = stop_on_command()
            if got is not None:
                command, early = got, True
                break
            if elapsed >= next_look and elapsed < window.length_s and look < self.looks - 1:
                look += 1
                next_look += INTERIM_LOOK_S
                so_far = [r for r in self.pending if ended_at(r) < now]
                interim = self.judge(so_far, None, look, self.looks)
                if any(g.verdict == Verdict.FAIL for g in interim):
                    early = True
                    break
            time.sleep(TICK_S)
        close = window.start + min(window.elapsed_s(), window.length_s) if early else window.end
        return close, early, command

    def commit(self, window: Window, gates: list[GateResult], close: float, early: bool, command: str | None) -> None:
        """Records and verdicts into the store before anyone acts on them."""
        ctx = self.ctx
        stored = ctx.store.add_request_samples(ctx.run_id, PHASE, window.index, window.records)
        self.stored += stored
        counts = {
            arm: {
                "requests": sum(1 for r in window.records if r.arm == arm and not r.cancelled),
                "errors": sum(1 for r in window.records if r.arm == arm and not r.cancelled and not r.ok),
                "cancelled": sum(1 for r in window.records if r.arm == arm and r.cancelled),
            }
            for arm in (BASELINE, CANARY)
        }
        ctx.store.put_phase_result(
            ctx.run_id,
            PHASE,
            window.index,
            {
                "window": window.index,
                "step": window.step,
                "canary_weight": window.weight,
                "paused": window.paused,
                "start": window.start,
                "end": close,
                "closed_early": early,
                "command": command,
                "records": len(window.records),
                "records_stored": stored,
                "requests": counts,
                "gates": [g.model_dump(mode="json") for g in gates],
            },
        )
        self.windows_judged += 1
        verdicts = ", ".join(f"{g.name.removeprefix('guard_')} {g.verdict.value}" for g in gates)
        self.say(
            f"step {window.step + 1}/{self.n_steps} canary {window.weight:g}%{' (paused)' if window.paused else ''} | "
            f"window {window.index} ({close - window.start:.0f} s{', closed early' if early else ''}): "
            f"requests baseline {counts[BASELINE]['requests']} canary {counts[CANARY]['requests']} "
            f"(canary errors {counts[CANARY]['errors']}) | {verdicts}"
        )
        ctx.event("window", f"window {window.index} step {window.step + 1}: " + ", ".join(f"{g.name}={g.verdict.value}" for g in gates))

    # -- before the first window and after the last ------------------------------------
    def wait_for_first_records(self) -> None:
        """The steps start once the load flows (Locust start-up is seconds; it must not eat a window)."""
        deadline = time.monotonic() + FIRST_RECORD_TIMEOUT_S
        while time.monotonic() < deadline:
            self.load.check()
            self.read_records()
            if self.pending:
                return
            time.sleep(TICK_S)
        raise SwarmError(f"the progressive load sent no request within {FIRST_RECORD_TIMEOUT_S} s")

    def recover_leftovers(self) -> None:
        """A resumed phase first stores what an earlier attempt's load wrote but nobody committed.

        Request ids make this idempotent: records already stored are not stored twice.
        """
        files = sorted((self.ctx.run_dir / PHASE).glob("records*.jsonl"))
        leftovers = [r for path in files for r in RecordsTail(path).read()]
        if not leftovers:
            return
        stored = self.ctx.store.add_request_samples(self.ctx.run_id, PHASE, self.window_index + 1, leftovers)
        if stored:
            self.window_index += 1
            self.stored += stored
            self.ctx.event("recovered", f"{stored} records of an earlier attempt stored as window {self.window_index}")

    def drain(self) -> None:
        """Records that arrived after the last judged window: stored under one more window index."""
        if self.tail is None:
            return
        self.read_records()
        if self.pending:
            self.window_index += 1
            self.stored += self.ctx.store.add_request_samples(self.ctx.run_id, PHASE, self.window_index, self.pending)
            self.pending = []
