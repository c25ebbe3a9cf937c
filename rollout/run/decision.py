"""The run's decision: `Decided`, what a phase hands back to the controller when it decides, and
the pure rules that make one (they read values and write nothing).

One writer. A phase never writes `ctx.result.decision` or `.reason`: its `run` returns `Decided`
(or None: nothing decided) and the controller records it (RunContext.record_decision, called by
rollout.run.controller only); later phases read it through `ctx.decided` / `ctx.standing`. The
rules of precedence are the phases' own, each stated where it applies:

    preflight     a speculative canary that never drafted: ROLLBACK (the first decision)
    restore       a resumed judgement stands unless something decided before it (a preflight failure)
    accuracy      a failed judged gate decides at once (`decide_now`); every candidate lost: the choice
    abort         `mtp-canary abort` taken in accuracy or the experiment: ROLLBACK, standing over
                  what that phase or the candidates' choice would say (RunContext.aborted)
    candidates    no winner: ROLLBACK or INCONCLUSIVE; a winner: decided later by `decide_now`
    decide        `decide_now` only when nothing decided before it
    progressive   `after_steps`: may turn a judged PROMOTE into ROLLBACK or INCONCLUSIVE, never an
                  unjudged run into PROMOTE
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rollout.config import RolloutConfig
from rollout.judge.names import GATE_PHASES
from rollout.judge.verdicts import Decision, GateResult, Verdict, counted_gates, decide, missing_gates
from rollout.record.result import CandidateSummary

UNJUDGED = "no accuracy or experiment gate was judged before the steps (guards only raise alarms)"


@dataclass(frozen=True)
class Decided:
    """A phase decided the run: what the controller records as the run's decision and reason."""

    decision: Decision
    reason: str


def aborted_by_command(phase: str) -> Decided:
    """`mtp-canary abort RUN_ID` taken during `phase`: the canary never got traffic weight."""
    return Decided(Decision.ROLLBACK, f"aborted by command during {phase}")


def decide_now(gates: Sequence[GateResult], cfg: RolloutConfig, capped: str | None = None,
               lead: str = "") -> Decided:
    """The decision the gates so far support, with its reason.

    Fail closed: a gate the config enables that no phase judged blocks PROMOTE, and the reason
    names it and what to change (rollout.judge.verdicts.decide). `capped`: the experiment hit
    max_duration_s (said first in an INCONCLUSIVE reason); `lead`: a PROMOTE's reason begins with
    it (several candidates: `candidates_reason`)."""
    gates_cfg = cfg.gates
    considered = counted_gates(list(gates), gates_cfg)  # checks it cannot name (other traffic) always count
    decision = decide(considered, gates_cfg)
    failed = [g.name for g in considered if g.verdict == Verdict.FAIL]
    open_ = [g.name for g in considered if g.verdict == Verdict.INCONCLUSIVE]
    missing = missing_gates(considered, gates_cfg)
    if decision == Decision.PROMOTE:
        reason = lead + "every gate passed: " + ", ".join(g.name for g in considered)
    elif decision == Decision.ROLLBACK:
        reason = "failed: " + ", ".join(failed)
    else:
        parts = [f"not enough evidence: {', '.join(open_)}"] if open_ else []
        if missing:
            parts.append(missing_reason(cfg, missing))
        reason = "; ".join(parts) if parts else "no gate was judged"
        if capped:
            reason = f"{capped}; {reason}"
    return Decided(decision, reason)


def missing_reason(cfg: RolloutConfig, missing: list[str]) -> str:
    """Why enabled gates were never judged, and how to promote without them (one line)."""
    by_phase: dict[str, list[str]] = {}
    for name in missing:
        by_phase.setdefault(GATE_PHASES.get(name, "experiment"), []).append(name)
    parts = []
    for phase, names in by_phase.items():
        section = getattr(cfg, phase, None)
        why = f"{phase}.enabled is false" if section is not None and not section.enabled else f"the {phase} phase did not run"
        parts.append(f"{', '.join(names)} ({why})")
    return (
        "enabled but never judged: " + "; ".join(parts)
        + ", so the run cannot promote; to promote without them, name them in gates.disabled"
    )


def candidates_reason(winner: str | None, candidates: Sequence[CandidateSummary] | None) -> str:
    """The decision's reason begins with the winner and why every other candidate lost ('' without one)."""
    if not winner or not candidates:
        return ""
    others = "; ".join(f"{c.name}: {c.reason}" for c in candidates if c.name != winner)
    return f"candidate {winner} won ({others}); "


def no_winner(decision: Decision, reasons: dict[str, str], judged: int, alpha: float, capped: str | None) -> Decided:
    """Several candidates (`judged` of them, each at `alpha`) and none won: every one rolled back (ROLLBACK)
    or one might still pass (INCONCLUSIVE); `reasons`: why each did not win."""
    others = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
    head = f"{capped}; " if capped else ""
    return Decided(decision, f"{head}no candidate won ({judged} judged at alpha {alpha:g} each): {others}")


def after_steps(judged: Decision | None, judged_reason: str | None, steps: Decided) -> Decided:
    """The run's decision once the progressive steps ended with `steps`, the run having decided `judged` before them.

    The steps' guards only raise alarms (errors, absolute SLOs on the canary's live data): they compare
    nothing with the baseline. So steps that held keep a judged PROMOTE (and the experiment's reasons),
    but never promote a run that was not judged PROMOTE; steps that alarmed are the reason."""
    if steps.decision != Decision.PROMOTE:
        return steps
    if judged == Decision.PROMOTE:
        return Decided(Decision.PROMOTE, judged_reason or "")
    # guards that held are no evidence for the canary: the run's own verdict stands
    return Decided(Decision.INCONCLUSIVE, f"{steps.reason}, but {UNJUDGED}, so the run cannot promote; {judged_reason}")
