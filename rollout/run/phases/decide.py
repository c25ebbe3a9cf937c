"""The decision: PROMOTE | ROLLBACK | INCONCLUSIVE from the gates (rollout.judge.verdicts),
committed to the store before anyone acts on it (the resume point), restored from there by a
resumed run, and finally acted on: the router sends 100% to the winner."""

from __future__ import annotations

from rollout.judge.load_curve import promote_up_to_of, qualified_reason
from rollout.judge.verdicts import Decision
from rollout.run.context import RunContext
from rollout.run.decision import Decided, candidates_reason, decide_now
from rollout.run.resume import JUDGED, PRE_JUDGEMENT_PHASES, Judgement


class RestoreJudgement:
    """A resumed run: the judgement committed before the crash stands; without one, the judging
    phases run again (the interrupted attempt's rows are kept apart as superseded: the sequential
    tests need one unbroken sequence of looks)."""

    name = "restore"

    def enabled(self, ctx: RunContext) -> bool:
        return ctx.resuming

    def run(self, ctx: RunContext) -> Decided | None:
        judgement = ctx.point.judgement
        if judgement is None:
            moved = ctx.store.supersede(ctx.run_id, PRE_JUDGEMENT_PHASES, ctx.attempt - 1)
            ctx.say(f"resume: the run died before its judgement: accuracy and experiment run again "
                    f"({moved} rows of attempt {ctx.attempt - 1} kept as superseded)")
            return None
        ctx.judged = True
        if ctx.decided:  # a preflight that fails now stands
            return None
        r = ctx.result
        r.gates = list(judgement.gates)
        r.accuracy, r.experiment = judgement.accuracy, judgement.experiment
        r.spec_decode, r.engine_warnings = dict(judgement.spec_decode), judgement.engine_warnings
        if r.experiment is not None and r.experiment.sweep_crossover is not None:  # the sweep's claim, judged again
            r.promote_up_to = promote_up_to_of(r.experiment.sweep_crossover.levels, ctx.cfg.gates)
        decision = judgement.decision
        ctx.say(f"resume: judged before the crash: {decision.value if decision else 'none'} ({judgement.reason})")
        # the Decide phase commits a judgement with its decision: one without is none to restore
        return Decided(decision, judgement.reason) if decision is not None else None


class Decide:
    """The decision from every gate judged so far, committed as the judgement."""

    name = "decide"

    def enabled(self, ctx: RunContext) -> bool:
        return not ctx.judged

    def run(self, ctx: RunContext) -> Decided | None:
        r = ctx.result
        # what decided before (preflight, an abort, the candidates' choice, a failed accuracy gate) stands
        made = None if ctx.decided else decide_now(r.gates, ctx.cfg, ctx.experiment_capped,
                                                   candidates_reason(r.winner, r.candidates))
        if made is not None:  # the sweep's claim qualifies a PROMOTE ("for concurrency <= C"), never changes it
            made = Decided(made.decision, qualified_reason(made.decision.value, made.reason, r.promote_up_to))
        decided = made or ctx.standing
        judgement = Judgement(
            decision=decided.decision, reason=decided.reason, gates=list(r.gates), preflight=r.preflight,
            accuracy=r.accuracy, experiment=r.experiment, spec_decode=dict(r.spec_decode),
            engine_warnings=r.engine_warnings,
        )
        ctx.store.put_phase_result(ctx.run_id, JUDGED, 1, judgement.stored())
        ctx.judged = True
        return made


class Finish:
    """The verdict acted on: 100% to the canary on PROMOTE, back to the baseline otherwise."""

    name = "finish"

    def enabled(self, ctx: RunContext) -> bool:
        return ctx.decided

    def run(self, ctx: RunContext) -> None:
        decision = ctx.result.decision
        ctx.say(f"decision: {decision.value.upper()} ({ctx.result.reason})")
        if decision == Decision.PROMOTE:
            ctx.set_canary_weight(100.0, "decide", "promoted")
        else:
            ctx.set_canary_weight(0.0, "decide", "rolled back" if decision == Decision.ROLLBACK else "inconclusive: stable stays")
        ctx.event("decide", decision.value, ctx.result.reason)
