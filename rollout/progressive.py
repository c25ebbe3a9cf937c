"""The progressive phase: canary weight steps under live load, guard windows, abort at once.

Flagger's scheduler loop, readable in one place (`_Phase.run`):

    one Locust swarm through the router (no arm pin: the router's weighted split)
    for each step:
        set the canary weight                      (the controller's set_canary_weight)
        every guard window until the bake is over:
            tail the records, scrape /metrics deltas, poll replica health
            judge the guards (rollout.judge.guards, pure)
            commit the window's records and verdicts to the store, THEN act:
            a FAIL sets the canary weight to 0 at once -> ROLLBACK
        judge the whole step (pooled windows); a FAIL -> ROLLBACK
        pause: true -> keep judging windows while waiting for `promote` / `abort`
                       (mtp-canary promote|abort RUN_ID) up to pause_timeout_s
    the last step's pooled guards all pass -> PROMOTE
    (some guard never had enough canary data -> INCONCLUSIVE: never a silent pass)

Windows and records. The swarm's master appends records (JSON lines) to one file
as workers ship them (every ~1 s); this module reads only the complete lines it
has not read yet. A record belongs to the window in which the request *ended*
(sent_at + e2e_s, wall clock); a window is closed SHIP_GRACE_S after its end so
that the records of requests that ended inside it have arrived. A record that
arrives later still (or that ended after the window closed early) goes to the next
window: every record is stored exactly once. Records left when the load stops go
to one more window index that has records but no verdict.

Fast abort. Inside a window the guards are also judged every INTERIM_LOOK_S on the
window so far (only a FAIL acts on an interim look; the error budget is split over
the looks, see rollout.judge.guards), and replica health is polled every HEALTH_POLL_S:
a canary replica seen dead on two consecutive polls closes the window at once.
So a dead canary is rolled back within ~2 s, and a canary that starts failing
requests within a few seconds of its failures reaching INTERIM_LOOK_S, at the
latest at the first window end after it.

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
from pathlib import Path
from typing import Any

import ray

from cluster.arms import BASELINE, CANARY
from cluster.metrics import MetricsSnapshot, SpecDecodeStats
from cluster.ray_cluster import kill_quietly
from loadtests.options import TrafficOptions
from loadtests.records import RecordsTail, RequestRecord
from loadtests.swarm import SwarmError, SwarmSpec
from rollout.config import ProgressiveConfig, RolloutStep
from rollout.judge.guards import enabled_guard_names, judge_guard_window
from rollout.judge.verdicts import Decision, GateResult, Verdict
from rollout.store import RunStore

__all__ = ["ProgressiveContext", "ProgressiveOutcome", "run_progressive", "PHASE", "STEP_PHASE"]

PHASE = "progressive"  # phase name of events, window results and request samples
ROUTER_LEDGER = "progressive_router"  # phase_results look 1: the router's counts when the phase first began
STEP_PHASE = "progressive_step"  # phase_results of each step's pooled verdicts (look = step number, 1-based)

TICK_S = 0.25  # the loop's heartbeat: commands, health, records
SHIP_GRACE_S = 1.5  # workers ship records every 1 s: a window closes this long after its end
INTERIM_LOOK_S = 2.0  # guards judged on the window so far this often (FAIL only)
HEALTH_POLL_S = 1.0
DEAD_CONFIRMATIONS = 2  # consecutive polls that must see a replica dead
BASELINE_REFERENCE_MAX = 1000
SWARM_MARGIN_S = 120  # run time of the swarm beyond the planned steps and pauses
SWARM_STOP_TIMEOUT_S = 5.0  # in-flight requests at the end get this long, then are cancelled records


@dataclass
class ProgressiveContext:
    """What the progressive phase needs from the controller (callables keep it testable)."""

    run_id: str
    run_dir: Path
    config: ProgressiveConfig
    router: Any  # the Router actor handle
    router_url: str
    model: str  # served model name
    traffic: dict[str, Any]  # TrafficOptions fields of the background load (dataset, input_tokens, ...)
    set_canary_weight: Callable[[float, str], None]  # applies at once on the router and records the event
    event: Callable[[str, str], None]  # timeline event (event, reason) in phase "progressive"
    say: Callable[[str], None]
    scrape: Callable[[], dict[str, MetricsSnapshot]]  # replica name -> /metrics snapshot
    replica_arms: dict[str, str]  # replica name -> arm
    replicas_alive: Callable[[], dict[str, bool]]  # replica name -> alive
    store: RunStore
    speculative_canary: bool
    first_step: int = 0  # resume: index of the first step to run (earlier ones are done)
    n_workers: int = 1  # Locust worker processes (0: one local process)
    # the LoadRunner actor for a swarm spec (the controller names it per run; detached)
    start_load: Callable[[SwarmSpec], Any] | None = None  # default: an unnamed LoadRunner on this node
    # resume: an earlier attempt's LoadRunner still running (stopped gracefully, its records stored)
    previous_load: Any = None
    master_bind_host: str = "127.0.0.1"  # 0.0.0.0 when Locust workers run on other nodes


@dataclass
class ProgressiveOutcome:
    decision: Decision  # PROMOTE, ROLLBACK, or INCONCLUSIVE (the last step never had enough canary data)
    reason: str
    guards: list[GateResult]  # the failing ones on abort; the last step's pooled verdicts otherwise
    steps_completed: int
    observed_split: list[dict]  # per step: asked weight, canary share from the router's counts
    windows: int = 0  # guard windows judged
    records: int = 0  # request records stored for this phase
    rolled_back_at: float | None = None  # wall time the canary weight went to 0 (abort only)
    load_error: str | None = None  # the swarm's complaint at the end (records incomplete), if any
    # requests the router received during the phase (all attempts; None if the router was replaced)
    requests_received: int | None = None
    records_stored: int | None = None  # request records of the phase in the store (all attempts)


def run_progressive(ctx: ProgressiveContext) -> ProgressiveOutcome:
    """Run the steps of `ctx.config` and return the verdict; the canary weight is 0 on ROLLBACK.

    Raises SwarmError when the load generator fails mid-phase (infrastructure: no verdict).
    """
    return _Phase(ctx).run()


def ended_at(record: RequestRecord) -> float:
    return record.sent_at + record.e2e_s


# -- the load -------------------------------------------------------------------
class _Load:
    """The phase's swarm, run by a LoadRunner actor (cluster.load_runner): it outlives a dead controller."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._next_check = 0.0

    def check(self) -> None:
        """Raise if the load ended before the phase asked it to (polled at most once a second)."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + 1.0
        try:
            state = ray.get(self.actor.state.remote(), timeout=10)
        except ray.exceptions.GetTimeoutError:
            return  # a busy actor is no evidence of a dead load
        except ray.exceptions.RayError as exc:
            raise SwarmError(f"the progressive load's actor died: {type(exc).__name__}") from None
        if not state["running"]:
            raise SwarmError(f"the progressive load stopped early: {state['error'] or 'the swarm ended'}")

    def kill(self) -> None:
        try:
            ray.get(self.actor.kill.remote(), timeout=30)
        except ray.exceptions.RayError:
            pass
        kill_quietly(self.actor)

    def finish(self, timeout_s: float) -> str | None:
        """Stop gracefully; the swarm's complaint (or None). Killed if it does not end in time."""
        try:
            state = ray.get(self.actor.finish.remote(timeout_s), timeout=timeout_s + 30)
        except ray.exceptions.RayError as exc:
            kill_quietly(self.actor)
            return f"the load's actor did not answer: {type(exc).__name__}"
        kill_quietly(self.actor)
        return state["error"]


def _default_start_load(spec: SwarmSpec) -> Any:
    from cluster.load_runner import start_load_runner

    return start_load_runner(spec)


# -- the phase ------------------------------------------------------------------
@dataclass
class _Window:
    index: int
    step: int  # 0-based step index
    weight: float
    start: float  # wall clock
    end: float  # nominal end
    paused: bool = False
    records: list[RequestRecord] = field(default_factory=list)


class _Abort(Exception):
    def __init__(self, reason: str, guards: list[GateResult]):
        super().__init__(reason)
        self.reason, self.guards = reason, guards


class _Phase:
    def __init__(self, ctx: ProgressiveContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.config
        self.guards_cfg = ctx.config.guards
        self.window_s = float(self.guards_cfg.window_s)
        self.looks = max(1, math.ceil(self.window_s / INTERIM_LOOK_S))  # interim looks + the final one
        self.tail: RecordsTail | None = None
        self.load: _Load | None = None
        self.pending: list[RequestRecord] = []
        self.baseline_history: list[RequestRecord] = []
        self.dead_streak: dict[str, int] = {}
        self.next_health = 0.0
        self.metrics_before: dict[str, MetricsSnapshot] | None = None
        # a resumed phase continues the numbering (the drained records of a finished load have an index too)
        self.window_index = max(ctx.store.last_look(ctx.run_id, PHASE), ctx.store.last_sample_window(ctx.run_id, PHASE))
        self.windows_judged = 0
        self.stored = 0
        self.split: list[dict] = []
        self.steps_completed = 0
        self.rolled_back_at: float | None = None

    # -- plumbing --------------------------------------------------------------
    def say(self, message: str) -> None:
        self.ctx.say(message)  # the controller's say names the phase

    def _swarm_spec(self) -> SwarmSpec:
        ctx, cfg = self.ctx, self.cfg
        steps = cfg.steps[ctx.first_step :]
        planned = sum(math.ceil(s.bake_s / self.window_s) * (self.window_s + SHIP_GRACE_S) for s in steps)
        planned += sum(cfg.pause_timeout_s for s in steps if s.pause)
        out = ctx.run_dir / PHASE
        # a resumed phase writes a new file: the Swarm truncates its records file at start
        name = "records.jsonl" if self.window_index == 0 else f"records-from-window-{self.window_index + 1}.jsonl"
        options = {"ignore_eos": True, **ctx.traffic}
        options.update(
            model=ctx.model,
            records=str(out / name),
            tag=PHASE,
            rate=cfg.rate,
            arm_pin=None,
        )
        return SwarmSpec(
            host=ctx.router_url,
            traffic=TrafficOptions(**options),
            users=max(cfg.users, ctx.n_workers, 1),
            run_time_s=int(math.ceil(planned + SWARM_MARGIN_S)),
            n_workers=ctx.n_workers,
            stop_timeout_s=SWARM_STOP_TIMEOUT_S,
            log_dir=out / "locust",
            master_bind_host=ctx.master_bind_host,
        )

    def _read_records(self) -> None:
        assert self.tail is not None
        self.pending.extend(self.tail.read())

    def _take(self, until: float) -> list[RequestRecord]:
        """Pending records of requests that ended before `until` (removed from pending)."""
        taken = [r for r in self.pending if ended_at(r) < until]
        self.pending = [r for r in self.pending if ended_at(r) >= until]
        return taken

    def _scrape(self) -> dict[str, MetricsSnapshot] | None:
        try:
            return self.ctx.scrape()
        except Exception as exc:  # a dead replica does not answer /metrics
            self.say(f"/metrics scrape failed: {type(exc).__name__}: {str(exc)[:200]}")
            return None

    def _canary_delta(self, before, after) -> SpecDecodeStats | None:
        if before is None or after is None:
            return None
        total = SpecDecodeStats()
        for name, arm in self.ctx.replica_arms.items():
            if arm != CANARY:
                continue
            if name not in before or name not in after:
                return None
            try:
                total = total + after[name].delta(before[name]).spec_decode
            except ValueError:  # a counter went down: the replica restarted within the window
                return None
        return total

    def _poll_health(self, now: float) -> None:
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

    def _canary_alive(self) -> bool:
        return not any(
            self.dead_streak.get(name, 0) >= DEAD_CONFIRMATIONS
            for name, arm in self.ctx.replica_arms.items()
            if arm == CANARY
        )

    def _router_counts(self, with_rejected: bool = False) -> dict[str, int]:
        try:
            state = ray.get(self.ctx.router.get_state.remote(), timeout=10)
        except Exception:
            return {}
        return {
            arm: int(c["routed"]) + (int(c["rejected"]) if with_rejected else 0)
            for arm, c in state["arm_counts"].items()
        }

    def _router_id(self) -> str:
        return self.ctx.router._actor_id.hex()

    def _open_ledger(self) -> None:
        """The router's counts when the phase first began (kept across resumed attempts)."""
        if self.ctx.store.phase_results(self.ctx.run_id, ROUTER_LEDGER):
            return
        counts = self._router_counts(with_rejected=True)
        if counts:
            self.ctx.store.put_phase_result(self.ctx.run_id, ROUTER_LEDGER, 1, {"router": self._router_id(), "counts": counts})

    def _requests_received(self) -> int | None:
        """Requests the router received since the phase began: every one must have a stored record."""
        ledger = self.ctx.store.phase_results(self.ctx.run_id, ROUTER_LEDGER)
        if not ledger or ledger[0]["router"] != self._router_id():
            return None  # the router was replaced (its counts restarted at 0)
        now = self._router_counts(with_rejected=True)
        if not now:
            return None
        return sum(now.values()) - sum(ledger[0]["counts"].values())

    def _judge(
        self, records: list[RequestRecord], spec_delta, look: int, looks: int, judged: bool = False
    ) -> list[GateResult]:
        """The guards on `records` (a window, or with judged=True a step of windows already in the history)."""
        canary = [r for r in records if r.arm == CANARY]
        window_baseline = [] if judged else [r for r in records if r.arm == BASELINE]
        reference = (self.baseline_history + window_baseline)[-BASELINE_REFERENCE_MAX:]
        return judge_guard_window(
            reference,
            canary,
            spec_delta,
            self._canary_alive(),
            self.guards_cfg,
            self.ctx.speculative_canary,
            looks=looks,
            look=look,
        )

    def _rollback(self, reason: str) -> None:
        """Canary weight to 0 first (within a second of the verdict), then the paperwork."""
        self.ctx.set_canary_weight(0.0, f"guard abort: {reason}")
        self.rolled_back_at = time.time()
        try:
            self.ctx.store.update_run(self.ctx.run_id, canary_weight=0.0)
        except Exception:
            pass
        self.ctx.event("abort", reason)
        self.say(f"ABORT: {reason}; canary weight 0")

    # -- one window ------------------------------------------------------------
    def _run_window(self, window: _Window, stop_on_command: Callable[[], str | None] | None = None) -> str | None:
        """Run and judge one window; raises _Abort on a FAIL. Returns a command that ended it early."""
        ctx = self.ctx
        next_look = window.start + INTERIM_LOOK_S
        look = 0
        command = None
        early = False
        while True:
            now = time.time()
            if now >= window.end + SHIP_GRACE_S:
                break
            self.load.check()
            self._read_records()
            self._poll_health(now)
            if not self._canary_alive():
                early = True
                break
            got = ctx.store.take_command(ctx.run_id, accept=("abort",))
            if got is None and stop_on_command is not None:
                got = stop_on_command()
            if got is not None:
                command, early = got, True
                break
            if now >= next_look and now < window.end and look < self.looks - 1:
                look += 1
                next_look += INTERIM_LOOK_S
                so_far = [r for r in self.pending if ended_at(r) < now]
                interim = self._judge(so_far, None, look, self.looks)
                if any(g.verdict == Verdict.FAIL for g in interim):
                    early = True
                    break
            time.sleep(TICK_S)
        close = min(time.time(), window.end) if early else window.end
        self._read_records()
        window.records = self._take(close)
        if early and command is None:
            # a failing canary: no /metrics scrape (a hung replica would hold the verdict for its timeout)
            spec_delta = None
        else:
            after = self._scrape()
            spec_delta = self._canary_delta(self.metrics_before, after)
            self.metrics_before = after
        gates = self._judge(window.records, spec_delta, self.looks, self.looks)
        self._commit(window, gates, close, early, command)
        self.baseline_history = (self.baseline_history + [r for r in window.records if r.arm == BASELINE])[
            -BASELINE_REFERENCE_MAX:
        ]
        failed = [g for g in gates if g.verdict == Verdict.FAIL]
        if failed:
            reason = (
                f"{', '.join(g.name for g in failed)} failed in window {window.index} "
                f"(step {window.step + 1}, canary {window.weight:g}%): {failed[0].detail}"
            )
            self._rollback(reason)
            raise _Abort(reason, failed)
        if command == "abort":
            reason = f"aborted by command during step {window.step + 1} (canary {window.weight:g}%)"
            self._rollback(reason)
            raise _Abort(reason, [])
        return command

    def _commit(self, window: _Window, gates: list[GateResult], close: float, early: bool, command: str | None) -> None:
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
        n_steps = len(self.cfg.steps)
        self.say(
            f"step {window.step + 1}/{n_steps} canary {window.weight:g}%{' (paused)' if window.paused else ''} | "
            f"window {window.index} ({close - window.start:.0f} s{', closed early' if early else ''}): "
            f"requests baseline {counts[BASELINE]['requests']} canary {counts[CANARY]['requests']} "
            f"(canary errors {counts[CANARY]['errors']}) | {verdicts}"
        )
        ctx.event("window", f"window {window.index} step {window.step + 1}: " + ", ".join(f"{g.name}={g.verdict.value}" for g in gates))

    def _new_window(self, step: int, weight: float, paused: bool = False) -> _Window:
        self.window_index += 1
        start = time.time()
        return _Window(self.window_index, step, weight, start, start + self.window_s, paused)

    # -- steps -----------------------------------------------------------------
    def _run_step(self, i: int, step: RolloutStep) -> list[GateResult]:
        ctx, n_steps = self.ctx, len(self.cfg.steps)
        counts_before = self._router_counts()
        ctx.set_canary_weight(step.canary_weight, f"step {i + 1}/{n_steps}")
        step_started = time.time()
        # 1-based, as the progress lines and `status` show it.
        ctx.store.update_run(ctx.run_id, step=i + 1, canary_weight=step.canary_weight)
        n_windows = max(1, math.ceil(step.bake_s / self.window_s))
        ctx.event(
            "step",
            f"step {i + 1}/{n_steps}: canary {step.canary_weight:g}%, bake {n_windows} x {self.window_s:g} s"
            + (", then pause" if step.pause else ""),
        )
        self.say(f"step {i + 1}/{n_steps}: canary {step.canary_weight:g}%, {n_windows} window(s) of {self.window_s:g} s")
        step_records: list[RequestRecord] = []
        spec_before = self.metrics_before
        for _ in range(n_windows):
            window = self._new_window(i, step.canary_weight)
            self._run_window(window)
            step_records += window.records
        step_spec = self._canary_delta(spec_before, self.metrics_before)
        pooled = self._judge(step_records, step_spec, 1, 1, judged=True)
        ctx.store.put_phase_result(
            ctx.run_id,
            STEP_PHASE,
            i + 1,
            {"step": i, "canary_weight": step.canary_weight, "records": len(step_records),
             "gates": [g.model_dump(mode="json") for g in pooled]},
        )
        failed = [g for g in pooled if g.verdict == Verdict.FAIL]
        summary = ", ".join(f"{g.name}={g.verdict.value}" for g in pooled)
        ctx.event("step_verdict", f"step {i + 1}: {summary}")
        if failed:
            reason = f"{', '.join(g.name for g in failed)} failed over step {i + 1} (canary {step.canary_weight:g}%): {failed[0].detail}"
            self._rollback(reason)
            raise _Abort(reason, failed)
        if step.pause:
            self._pause(i, step)
        # committed before the next step begins: a resumed run starts after the last step_done
        ctx.event("step_done", f"step {i + 1}/{n_steps} done")
        counts_after = self._router_counts()
        sent_in_step = [r for r in step_records if r.sent_at >= step_started]
        self.split.append(_split(i, step.canary_weight, counts_before, counts_after, sent_in_step))
        self.steps_completed = i + 1
        return pooled

    def _pause(self, i: int, step: RolloutStep) -> None:
        ctx, cfg = self.ctx, self.cfg
        deadline = time.time() + cfg.pause_timeout_s
        ctx.event("pause", f"after step {i + 1} (canary {step.canary_weight:g}%): waiting up to {cfg.pause_timeout_s:g} s "
                  f"for `mtp-canary promote|abort {ctx.run_id}`")
        self.say(f"PAUSED after step {i + 1}: `mtp-canary promote {ctx.run_id}` continues, `mtp-canary abort {ctx.run_id}` "
                 f"rolls back; {cfg.pause_timeout_s:g} s, then {cfg.on_pause_timeout}")

        def promote_or_timeout() -> str | None:
            got = ctx.store.take_command(ctx.run_id, accept=("promote",))
            if got is None and time.time() >= deadline:
                return "timeout"
            return got

        while True:
            window = self._new_window(i, step.canary_weight, paused=True)
            window.end = min(window.end, max(deadline, window.start + TICK_S))
            command = self._run_window(window, stop_on_command=promote_or_timeout)
            if command is None and time.time() >= deadline:
                command = "timeout"
            if command == "promote":
                ctx.event("resume", f"promote command: continuing after step {i + 1}")
                self.say("promote command received: continuing")
                return
            if command == "timeout":
                ctx.event("pause_timeout", f"no answer within {cfg.pause_timeout_s:g} s: {cfg.on_pause_timeout}")
                if cfg.on_pause_timeout == "promote":
                    self.say(f"pause timed out after {cfg.pause_timeout_s:g} s: continuing (on_pause_timeout: promote)")
                    return
                reason = f"pause after step {i + 1} timed out after {cfg.pause_timeout_s:g} s (on_pause_timeout: abort)"
                self._rollback(reason)
                raise _Abort(reason, [])

    # -- the phase -------------------------------------------------------------
    def run(self) -> ProgressiveOutcome:
        ctx, cfg = self.ctx, self.cfg
        if not cfg.steps[ctx.first_step :]:
            raise ValueError("no progressive steps to run")
        if ctx.previous_load is not None:
            self.say("stopping the load an earlier attempt left running (its records are kept)")
            error = _Load(ctx.previous_load).finish(SWARM_STOP_TIMEOUT_S + 90)
            if error:
                self.say(f"the earlier attempt's load ended with: {error}")
        self._recover_leftovers()
        spec = self._swarm_spec()
        self.tail = RecordsTail(spec.records_path)
        ctx.event("plan", f"{len(cfg.steps) - ctx.first_step} step(s): "
                  + " -> ".join(f"{s.canary_weight:g}%" for s in cfg.steps[ctx.first_step :])
                  + f"; guard windows of {self.window_s:g} s")
        self.metrics_before = self._scrape()
        self._open_ledger()
        self.load = _Load((ctx.start_load or _default_start_load)(spec))
        outcome: ProgressiveOutcome
        try:
            self._wait_for_first_records()
            pooled: list[GateResult] = []
            try:
                for i in range(ctx.first_step, len(cfg.steps)):
                    pooled = self._run_step(i, cfg.steps[i])
            except _Abort as abort:
                outcome = self._outcome(Decision.ROLLBACK, abort.reason, abort.guards)
            else:
                enabled = set(enabled_guard_names(self.guards_cfg, ctx.speculative_canary))
                open_ = [g.name for g in pooled if g.name in enabled and g.verdict != Verdict.PASS]
                if open_:
                    reason = f"not enough canary data in the last step for {', '.join(open_)}"
                    outcome = self._outcome(Decision.INCONCLUSIVE, reason, pooled)
                else:
                    reason = f"every step passed its guards ({' -> '.join(f'{s.canary_weight:g}%' for s in cfg.steps)})"
                    outcome = self._outcome(Decision.PROMOTE, reason, pooled)
        except BaseException:
            # the load failed, or an interrupt: no graceful wait; keep every record that arrived
            self.load.kill()
            self._drain()
            raise
        load_error = self.load.finish(SWARM_STOP_TIMEOUT_S + 90)
        self._drain()
        outcome.load_error = load_error
        outcome.records = self.stored
        outcome.records_stored = self.ctx.store.count_request_samples(self.ctx.run_id, PHASE)
        outcome.requests_received = self._requests_received()
        if outcome.requests_received is not None and outcome.requests_received != outcome.records_stored:
            self.say(f"WARNING: the router received {outcome.requests_received} requests in this phase, "
                     f"the store holds {outcome.records_stored} records")
        if load_error:
            self.say(f"load generator at the end: {load_error}")
        ctx.event("done", f"{outcome.decision.value}: {outcome.reason}")
        return outcome

    def _wait_for_first_records(self) -> None:
        """The steps start once the load flows (Locust start-up is seconds; it must not eat a window)."""
        deadline = time.time() + 120
        while time.time() < deadline:
            self.load.check()
            self._read_records()
            if self.pending:
                return
            time.sleep(TICK_S)
        raise SwarmError("the progressive load sent no request within 120 s")

    def _recover_leftovers(self) -> None:
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

    def _drain(self) -> None:
        """Records that arrived after the last judged window: stored under one more window index."""
        if self.tail is None:
            return
        self._read_records()
        if self.pending:
            self.window_index += 1
            self.stored += self.ctx.store.add_request_samples(self.ctx.run_id, PHASE, self.window_index, self.pending)
            self.pending = []

    def _outcome(self, decision: Decision, reason: str, guards: list[GateResult]) -> ProgressiveOutcome:
        return ProgressiveOutcome(
            decision=decision,
            reason=reason,
            guards=guards,
            steps_completed=self.steps_completed,
            observed_split=self.split,
            windows=self.windows_judged,
            rolled_back_at=self.rolled_back_at,
        )


def _split(i: int, weight: float, before: dict[str, int], after: dict[str, int], records: list[RequestRecord]) -> dict:
    routed = {arm: after.get(arm, 0) - before.get(arm, 0) for arm in (BASELINE, CANARY)}
    total = sum(routed.values())
    by_records = {arm: sum(1 for r in records if r.arm == arm) for arm in (BASELINE, CANARY)}
    total_records = sum(by_records.values())
    return {
        "step": i,
        "canary_weight": weight,
        "routed": routed,
        "observed_canary_share": routed[CANARY] / total if total else None,
        "records": by_records,  # requests sent during the step's bake (client side, by the arm header)
        "records_canary_share": by_records[CANARY] / total_records if total_records else None,
    }
