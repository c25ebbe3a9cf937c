"""The progressive phase's steps: canary weight steps under live load, each baked over guard
windows (rollout.run.phases.progressive_windows), judged pooled, optionally paused for a person.

Flagger's scheduler loop, readable in one place (`StepRunner.run`):

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
"""

from __future__ import annotations

import math
import time

from cluster.arms import BASELINE, CANARY
from cluster.load_runner import LoadRunnerHandle
from loadtests.options import TrafficOptions
from loadtests.records import RecordsTail, RequestRecord
from loadtests.swarm import SwarmSpec
from rollout.config import RolloutStep
from rollout.judge.guards import enabled_guard_names
from rollout.judge.request_acceptance import spec_decode_of_requests
from rollout.judge.verdicts import Decision, GateResult, Verdict
from rollout.run.phases.progressive_context import ProgressiveContext, ProgressiveOutcome
from rollout.run.phases.progressive_windows import PHASE, SHIP_GRACE_S, TICK_S, Abort, WindowRunner
from rollout.run.resume import ROUTER_LEDGER, STEP_PHASE

SWARM_MARGIN_S = 120  # run time of the swarm beyond the planned steps and pauses
SWARM_STOP_TIMEOUT_S = 5.0  # in-flight requests at the end get this long, then are cancelled records
LOAD_FINISH_S = SWARM_STOP_TIMEOUT_S + 90


def run_progressive(ctx: ProgressiveContext) -> ProgressiveOutcome:
    """Run the steps of `ctx.config` and return the verdict; the canary weight is 0 on ROLLBACK.

    Raises SwarmError when the load generator fails mid-phase (infrastructure: no verdict).
    """
    return StepRunner(ctx).run()


class StepRunner:
    def __init__(self, ctx: ProgressiveContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.config
        self.windows = WindowRunner(ctx)
        self.split: list[dict] = []
        self.steps_completed = 0

    def say(self, message: str) -> None:
        self.ctx.say(message)

    # -- the load and the router's ledger -------------------------------------------------
    def swarm_spec(self) -> SwarmSpec:
        ctx, cfg, window_s = self.ctx, self.cfg, self.windows.window_s
        steps = cfg.steps[ctx.first_step :]
        planned = sum(math.ceil(s.bake_s / window_s) * (window_s + SHIP_GRACE_S) for s in steps)
        planned += sum(cfg.pause_timeout_s for s in steps if s.pause)
        out = ctx.run_dir / PHASE
        # a resumed phase writes a new file: the Swarm truncates its records file at start
        index = self.windows.window_index
        name = "records.jsonl" if index == 0 else f"records-from-window-{index + 1}.jsonl"
        options = {"ignore_eos": True, **ctx.traffic}
        options.update(model=ctx.model, records=str(out / name), tag=PHASE, rate=cfg.rate, arm_pin=None)
        return SwarmSpec(
            host=ctx.router.url,
            traffic=TrafficOptions(**options),
            users=max(cfg.users, ctx.n_workers, 1),
            run_time_s=int(math.ceil(planned + SWARM_MARGIN_S)),
            n_workers=ctx.n_workers,
            stop_timeout_s=SWARM_STOP_TIMEOUT_S,
            log_dir=out / "locust",
            master_bind_host=ctx.master_bind_host,
            env=ctx.router.client_env(),
        )

    def open_ledger(self) -> None:
        """The router's counts when the phase first began (kept across resumed attempts)."""
        ctx = self.ctx
        if ctx.store.phase_results(ctx.run_id, ROUTER_LEDGER):
            return
        counts = ctx.router.request_counts(with_rejected=True)
        if counts:
            ctx.store.put_phase_result(ctx.run_id, ROUTER_LEDGER, 1, {"router": ctx.router.id, "counts": counts})

    def requests_received(self) -> int | None:
        """Requests the router received since the phase began: every one must have a stored record."""
        ctx = self.ctx
        ledger = ctx.store.phase_results(ctx.run_id, ROUTER_LEDGER)
        if not ledger or ledger[0]["router"] != ctx.router.id:
            return None  # the router was replaced (its counts restarted at 0)
        now = ctx.router.request_counts(with_rejected=True)
        if not now:
            return None
        return sum(now.values()) - sum(ledger[0]["counts"].values())

    # -- steps ----------------------------------------------------------------------
    def run_step(self, i: int, step: RolloutStep) -> list[GateResult]:
        ctx, n_steps, windows = self.ctx, len(self.cfg.steps), self.windows
        ctx.set_canary_weight(step.canary_weight, f"step {i + 1}/{n_steps}")
        # read after the switch returned: every request counted from here on was routed at this
        # step's weight (read before it, one routed in between at the old weight was counted here)
        counts_before = ctx.router.request_counts(with_rejected=False)
        step_started = time.time()
        # 1-based, as the progress lines and `status` show it.
        ctx.store.update_run(ctx.run_id, step=i + 1, canary_weight=step.canary_weight)
        n_windows = max(1, math.ceil(step.bake_s / windows.window_s))
        ctx.event(
            "step",
            f"step {i + 1}/{n_steps}: canary {step.canary_weight:g}%, bake {n_windows} x {windows.window_s:g} s"
            + (", then pause" if step.pause else ""),
        )
        self.say(f"step {i + 1}/{n_steps}: canary {step.canary_weight:g}%, {n_windows} window(s) of {windows.window_s:g} s")
        step_records: list[RequestRecord] = []
        spec_before = windows.metrics_before
        for _ in range(n_windows):
            window = windows.new_window(i, step.canary_weight)
            windows.run_window(window)
            step_records += window.records
        step_spec = spec_decode_of_requests(step_records, CANARY) or windows.canary_delta(spec_before, windows.metrics_before)
        pooled = windows.judge(step_records, step_spec, 1, 1, judged=True)
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
            windows.rollback(reason)
            raise Abort(reason, failed)
        if step.pause:
            self.pause(i, step)
        # committed before the next step begins: a resumed run starts after the last step_done
        ctx.event("step_done", f"step {i + 1}/{n_steps} done")
        ctx.tick("progressive steps", i + 1, n_steps)
        counts_after = ctx.router.request_counts(with_rejected=False)
        sent_in_step = [r for r in step_records if r.sent_at >= step_started]
        self.split.append(step_split(i, step.canary_weight, counts_before, counts_after, sent_in_step))
        self.steps_completed = i + 1
        return pooled

    def pause(self, i: int, step: RolloutStep) -> None:
        ctx, cfg, windows = self.ctx, self.cfg, self.windows
        deadline = time.monotonic() + cfg.pause_timeout_s  # monotonic: a clock step neither ends nor extends it
        ctx.event("pause", f"after step {i + 1} (canary {step.canary_weight:g}%): waiting up to {cfg.pause_timeout_s:g} s "
                  f"for `mtp-canary promote|abort {ctx.run_id}`")
        self.say(f"PAUSED after step {i + 1}: `mtp-canary promote {ctx.run_id}` continues, `mtp-canary abort {ctx.run_id}` "
                 f"rolls back; {cfg.pause_timeout_s:g} s, then {cfg.on_pause_timeout}")

        def promote_or_timeout() -> str | None:
            got = ctx.store.take_command(ctx.run_id, accept=("promote",))
            if got is None and time.monotonic() >= deadline:
                return "timeout"
            return got

        while True:
            window = windows.new_window(i, step.canary_weight, paused=True)
            window.end = window.start + min(window.length_s, max(deadline - window.opened, TICK_S))
            command = windows.run_window(window, stop_on_command=promote_or_timeout)
            if command is None and time.monotonic() >= deadline:
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
                windows.rollback(reason)
                raise Abort(reason, [])

    # -- the phase ------------------------------------------------------------------
    def run(self) -> ProgressiveOutcome:
        ctx, cfg, windows = self.ctx, self.cfg, self.windows
        if not cfg.steps[ctx.first_step :]:
            raise ValueError("no progressive steps to run")
        if ctx.previous_load is not None:
            self.say("stopping the load an earlier attempt left running (its records are kept)")
            error = LoadRunnerHandle(ctx.previous_load).finish(LOAD_FINISH_S)
            if error:
                self.say(f"the earlier attempt's load ended with: {error}")
        windows.recover_leftovers()
        spec = self.swarm_spec()
        windows.tail = RecordsTail(spec.records_path)
        ctx.event("plan", f"{len(cfg.steps) - ctx.first_step} step(s): "
                  + " -> ".join(f"{s.canary_weight:g}%" for s in cfg.steps[ctx.first_step :])
                  + f"; guard windows of {windows.window_s:g} s")
        windows.metrics_before = windows.scrape()
        self.open_ledger()
        windows.load = LoadRunnerHandle(ctx.start_load(spec))
        try:
            outcome = self._steps()
        except BaseException:
            # the load failed, or an interrupt: no graceful wait; keep every record that arrived
            windows.load.kill()
            windows.drain()
            raise
        load_error = windows.load.finish(LOAD_FINISH_S)
        windows.drain()
        outcome.load_error = load_error
        outcome.records = windows.stored
        outcome.records_stored = ctx.store.count_request_samples(ctx.run_id, PHASE)
        outcome.requests_received = self.requests_received()
        if outcome.requests_received is not None and outcome.requests_received != outcome.records_stored:
            self.say(f"WARNING: the router received {outcome.requests_received} requests in this phase, "
                     f"the store holds {outcome.records_stored} records")
        if load_error:
            self.say(f"load generator at the end: {load_error}")
        ctx.event("done", f"{outcome.decision.value}: {outcome.reason}")
        return outcome

    def _steps(self) -> ProgressiveOutcome:
        """Every step from the first not done; the verdict of the last one (or of the abort)."""
        ctx, cfg = self.ctx, self.cfg
        self.windows.wait_for_first_records()
        pooled: list[GateResult] = []
        try:
            for i in range(ctx.first_step, len(cfg.steps)):
                pooled = self.run_step(i, cfg.steps[i])
        except Abort as abort:
            return self.outcome(Decision.ROLLBACK, abort.reason, abort.guards)
        enabled = set(enabled_guard_names(cfg.guards, ctx.speculative_canary))
        open_ = [g.name for g in pooled if g.name in enabled and g.verdict != Verdict.PASS]
        if open_:
            return self.outcome(Decision.INCONCLUSIVE, f"not enough canary data in the last step for {', '.join(open_)}", pooled)
        reason = f"every step passed its guards ({' -> '.join(f'{s.canary_weight:g}%' for s in cfg.steps)})"
        return self.outcome(Decision.PROMOTE, reason, pooled)

    def outcome(self, decision: Decision, reason: str, guards: list[GateResult]) -> ProgressiveOutcome:
        return ProgressiveOutcome(
            decision=decision,
            reason=reason,
            guards=guards,
            steps_completed=self.steps_completed,
            observed_split=self.split,
            windows=self.windows.windows_judged,
            rolled_back_at=self.windows.rolled_back_at,
        )


def step_split(i: int, weight: float, before: dict[str, int], after: dict[str, int], records: list[RequestRecord]) -> dict:
    """One step's split: the router's routed counts per arm and the client's records per arm."""
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
