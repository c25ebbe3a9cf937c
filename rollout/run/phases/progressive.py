"""The progressive phase in the run: canary weight steps with bake time for a canary the
experiment judged fit (or when nothing was judged before them); the judged verdict stands only
if every step holds. A resumed run continues after the last committed step.

The steps' guards only raise alarms (errors, absolute SLOs on the canary's live data): they
compare nothing with the baseline. So the steps may turn a judged PROMOTE into ROLLBACK, and a
run that judged nothing into ROLLBACK, but never an unjudged run into PROMOTE: the phase returns
the revised decision (rollout.run.decision.after_steps) and the controller records it."""

from __future__ import annotations

import time
from typing import Any

from cluster.load_runner import start_load_runner
from cluster.ray_cluster import find_actor, kill_quietly
from rollout.judge.verdicts import Decision, GateResult
from rollout.run.phases.progressive_context import ProgressiveContext
from rollout.run.phases.progressive_steps import run_progressive
from rollout.run.phases.web_ui import with_console
from rollout.record.result import ProgressiveSummary
from rollout.run.resume import PROGRESSIVE_OUTCOME, ProgressiveVerdict
from rollout.run.context import RunContext
from rollout.run.decision import UNJUDGED, Decided, after_steps

PROGRESSIVE_SEED_OFFSET = 1000  # the progressive load's prompts differ from the experiment's


def advisory_reason(cfg, canary_arm) -> str | None:
    """Why the steps are advisory: servers someone else runs (endpoints) take real traffic the
    run's router does not split, and without a weight_hook nothing moves it (None: the steps move
    the traffic they judge)."""
    external = [name for name, arm in (("baseline", cfg.baseline), ("canary", canary_arm)) if arm.endpoints]
    if not external or cfg.weight_hook is not None:
        return None
    return (f"advisory: {' and '.join(external)} run elsewhere (endpoints) and no weight_hook moves their traffic; "
            "the steps weighed this run's own load only")


def load_name(attempt: int) -> str:
    return f"load-attempt-{attempt}"


class Progressive:
    name = "progressive"

    def enabled(self, ctx: RunContext) -> bool:
        # a run that judges nothing before the steps has no gates; one with candidates always judged them
        judged_nothing = not ctx.result.gates and ctx.result.candidates is None
        # a ROLLBACK (an abort, say, before any gate was judged) never ramps the canary: stable stays
        rolled_back = ctx.result.decision == Decision.ROLLBACK
        return ctx.cfg.progressive.enabled and (ctx.result.decision == Decision.PROMOTE or (judged_nothing and not rolled_back))

    def run(self, ctx: RunContext) -> Decided:
        prog = ctx.cfg.progressive
        done = ctx.point.progressive if ctx.resuming else None
        if done is not None:  # the phase had ended before the crash: its verdict stands
            ctx.result.progressive = done.summary
            return self._apply(ctx, done.decision, done.reason, list(done.guards))
        # every step done but no verdict committed (died in between): the last step bakes again
        first_step = min(ctx.point.steps_done, len(prog.steps) - 1)
        previous = self._previous_loads(ctx) if ctx.resuming else []
        if len(previous) > 1:
            for actor in previous[:-1]:  # older attempts' loads: their lease will end them; end them now
                kill_quietly(actor)
        if first_step:
            ctx.say(f"progressive: resuming after step {first_step} of {len(prog.steps)}")
        ctx.say(
            "progressive: steps "
            + " -> ".join(f"{s.canary_weight:g}%" + (" (pause)" if s.pause else "") for s in prog.steps)
        )
        advisory = advisory_reason(ctx.cfg, ctx.canary_arm)
        if advisory:
            ctx.say(f"progressive: {advisory}")
        if ctx.result.decision != Decision.PROMOTE:
            ctx.say(f"progressive: {UNJUDGED}: the steps can roll the canary back, they cannot promote it")
        ctx.event("progressive", "start", f"{len(prog.steps)} steps" + (f"; {advisory}" if advisory else ""))
        t0 = time.monotonic()
        outcome = run_progressive(self._context(ctx, first_step, previous[-1] if previous else None))
        ctx.result.progressive = ProgressiveSummary(
            steps_completed=outcome.steps_completed,
            observed_split=outcome.observed_split,
            requests_received=outcome.requests_received,
            records_stored=outcome.records_stored,
            attempt=ctx.attempt,
            duration_s=time.monotonic() - t0,
            advisory=advisory,
        )
        verdict = ProgressiveVerdict(outcome.decision, outcome.reason, outcome.guards, ctx.result.progressive)
        ctx.store.put_phase_result(ctx.run_id, PROGRESSIVE_OUTCOME, 1, verdict.stored())
        return self._apply(ctx, outcome.decision, outcome.reason, outcome.guards)

    @staticmethod
    def _context(ctx: RunContext, first_step: int, previous_load: Any) -> ProgressiveContext:
        exp = ctx.cfg.experiment
        return ProgressiveContext(
            run_id=ctx.run_id,
            run_dir=ctx.run_dir,
            config=ctx.cfg.progressive,
            router=ctx.router,
            model=ctx.served_model,
            traffic={**ctx.traffic.fields(), "seed": exp.seed + PROGRESSIVE_SEED_OFFSET},
            set_canary_weight=lambda weight, reason: ctx.set_canary_weight(weight, "progressive", reason),
            event=lambda event, reason: ctx.event("progressive", event, reason),
            say=lambda message: ctx.say(f"progressive: {message}"),
            tick=ctx.tick,
            scrape=ctx.fleet.metrics,
            replica_arms=ctx.replica_arms(),
            replicas_alive=ctx.replicas_alive,
            store=ctx.store,
            speculative_canary=ctx.speculative_canary,
            n_workers=exp.workers,
            first_step=first_step,
            start_load=lambda spec: Progressive._start_load(ctx, spec),
            previous_load=previous_load,
            master_bind_host=ctx.traffic.master_bind_host,
        )

    @staticmethod
    def _apply(ctx: RunContext, decision: Decision, reason: str, guards: list[GateResult]) -> Decided:
        """The steps' guards join the run's gates; the decision they leave (after_steps' rule)."""
        ctx.result.gates += guards
        return after_steps(ctx.result.decision, ctx.result.reason, Decided(decision, reason))

    @staticmethod
    def _start_load(ctx: RunContext, spec) -> Any:
        """The progressive load's LoadRunner: named per attempt, detached, leased."""
        name = load_name(ctx.attempt)
        # a load of its own (detached, so it outlives the controller): its master serves the
        # console again at the URL the experiment's had
        spec = with_console(ctx, spec, "progressive")
        actor = start_load_runner(spec, name=name, namespace=ctx.namespace, placement=ctx.cfg.experiment.worker_placement,
                                  lease_s=ctx.cfg.lease_s)
        ctx.leased[name] = actor
        return actor

    @staticmethod
    def _previous_loads(ctx: RunContext) -> list[Any]:
        found = [find_actor(load_name(n), namespace=ctx.namespace) for n in range(1, ctx.attempt)]
        return [actor for actor in found if actor is not None]
