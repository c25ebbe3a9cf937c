"""The decision: PROMOTE | ROLLBACK | INCONCLUSIVE from the gates (rollout.judge.verdicts),
committed to the store before anyone acts on it (the resume point), restored from there by a
resumed run, and finally acted on: the router sends 100% to the winner."""

from __future__ import annotations

from rollout.judge.names import GATE_PHASES
from rollout.judge.verdicts import Decision, Verdict, counted_gates, decide, missing_gates
from rollout.run.phases.candidates import candidates_reason
from rollout.run.resume import JUDGED, PRE_JUDGEMENT_PHASES, Judgement
from rollout.run.context import RunContext


def decide_now(ctx: RunContext) -> None:
    """The decision the gates so far support, with its reason, into ctx.result.

    Fail closed: a gate the config enables that no phase judged blocks PROMOTE, and
    the reason names it and what to change (rollout.judge.verdicts.decide).
    """
    gates_cfg = ctx.cfg.gates
    considered = counted_gates(ctx.result.gates, gates_cfg)  # checks it cannot name (other traffic) always count
    decision = decide(considered, gates_cfg)
    failed = [g.name for g in considered if g.verdict == Verdict.FAIL]
    open_ = [g.name for g in considered if g.verdict == Verdict.INCONCLUSIVE]
    missing = missing_gates(considered, gates_cfg)
    if decision == Decision.PROMOTE:
        # several candidates: which one won, and why each other lost (rollout.run.phases.candidates)
        reason = candidates_reason(ctx) + "every gate passed: " + ", ".join(g.name for g in considered)
    elif decision == Decision.ROLLBACK:
        reason = "failed: " + ", ".join(failed)
    else:
        parts = [f"not enough evidence: {', '.join(open_)}"] if open_ else []
        if missing:
            parts.append(missing_reason(ctx, missing))
        reason = "; ".join(parts) if parts else "no gate was judged"
        if ctx.experiment_capped:
            reason = f"{ctx.experiment_capped}; {reason}"
    ctx.result.decision, ctx.result.reason = decision, reason


def missing_reason(ctx: RunContext, missing: list[str]) -> str:
    """Why enabled gates were never judged, and how to promote without them (one line)."""
    by_phase: dict[str, list[str]] = {}
    for name in missing:
        by_phase.setdefault(GATE_PHASES.get(name, "experiment"), []).append(name)
    parts = []
    for phase, names in by_phase.items():
        section = getattr(ctx.cfg, phase, None)
        why = f"{phase}.enabled is false" if section is not None and not section.enabled else f"the {phase} phase did not run"
        parts.append(f"{', '.join(names)} ({why})")
    return (
        "enabled but never judged: " + "; ".join(parts)
        + ", so the run cannot promote; to promote without them, name them in gates.disabled"
    )


class RestoreJudgement:
    """A resumed run: the judgement committed before the crash stands; without one, the judging
    phases run again (the interrupted attempt's rows are kept apart as superseded: the sequential
    tests need one unbroken sequence of looks)."""

    name = "restore"

    def enabled(self, ctx: RunContext) -> bool:
        return ctx.resuming

    def run(self, ctx: RunContext) -> None:
        judgement = ctx.point.judgement
        if judgement is None:
            moved = ctx.store.supersede(ctx.run_id, PRE_JUDGEMENT_PHASES, ctx.attempt - 1)
            ctx.say(f"resume: the run died before its judgement: accuracy and experiment run again "
                    f"({moved} rows of attempt {ctx.attempt - 1} kept as superseded)")
            return
        ctx.judged = True
        if ctx.result.decision is not None:  # a preflight that fails now stands
            return
        r = ctx.result
        r.decision, r.reason, r.gates = judgement.decision, judgement.reason, list(judgement.gates)
        r.accuracy, r.experiment = judgement.accuracy, judgement.experiment
        r.spec_decode, r.engine_warnings = dict(judgement.spec_decode), judgement.engine_warnings
        ctx.say(f"resume: judged before the crash: {r.decision.value if r.decision else 'none'} ({r.reason})")


class Decide:
    """The decision from every gate judged so far, committed as the judgement."""

    name = "decide"

    def enabled(self, ctx: RunContext) -> bool:
        return not ctx.judged

    def run(self, ctx: RunContext) -> None:
        if ctx.result.decision is None:
            decide_now(ctx)
        r = ctx.result
        judgement = Judgement(
            decision=r.decision, reason=r.reason, gates=list(r.gates), preflight=r.preflight, accuracy=r.accuracy,
            experiment=r.experiment, spec_decode=dict(r.spec_decode), engine_warnings=r.engine_warnings,
        )
        ctx.store.put_phase_result(ctx.run_id, JUDGED, 1, judgement.stored())
        ctx.judged = True


class Finish:
    """The verdict acted on: 100% to the canary on PROMOTE, back to the baseline otherwise."""

    name = "finish"

    def enabled(self, ctx: RunContext) -> bool:
        return ctx.result.decision is not None

    def run(self, ctx: RunContext) -> None:
        decision = ctx.result.decision
        ctx.say(f"decision: {decision.value.upper()} ({ctx.result.reason})")
        if decision == Decision.PROMOTE:
            ctx.set_canary_weight(100.0, "decide", "promoted")
        else:
            ctx.set_canary_weight(0.0, "decide", "rolled back" if decision == Decision.ROLLBACK else "inconclusive: stable stays")
        ctx.event("decide", decision.value, ctx.result.reason)
