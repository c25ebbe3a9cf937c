"""Several candidates (config `candidates:`): the winner chosen from each candidate's gates
(rollout.judge.candidates, each judged at alpha / K), and the canary's seat handed to it before
the sweep and the decision. From then on the winner's replicas are the canary's: the sweep, the
router's canary weight, the progressive phase, the stable mark and promoted.yaml are the
winner's, and the losers' replicas are stopped. Without a winner the seat stays empty and the
run rolls back (every candidate did) or is inconclusive. The winner's ratio, the lowest of K
estimates, comes with a winner's-curse note (rollout.judge.selection).

Shared by the candidates phase (rollout.run.phases.candidates) and the accuracy phase, which
chooses at once when every candidate already lost; the choice's decision is returned, never
written (rollout.run.decision)."""

from __future__ import annotations

from cluster.arms import BASELINE, CANARY
from rollout.judge.candidates import CandidateChoice, CandidateResult, candidate_gates, choose_winner
from rollout.judge.names import OBJECTIVE_NAME
from rollout.judge.selection import winners_curse_note
from rollout.judge.verdicts import Decision, decide
from rollout.record.result import CandidateSummary
from rollout.run.context import RunContext
from rollout.run.decision import Decided, no_winner


def choose_now(ctx: RunContext) -> Decided | None:
    """Each candidate's verdict and reason into ctx.result.candidates, the winner into the canary's
    seat (an action on the fleet and the router). Returns the run's decision when no candidate won;
    None with a winner (the decision phase judges its gates) or when the run stands decided already
    (an abort: nobody is promoted, whatever the gates said so far)."""
    cfg = ctx.cfg
    share = candidate_gates(cfg.gates, len(cfg.candidates))
    results = [
        CandidateResult(c.name, ctx.engines[c.name].num_speculative_tokens, list(ctx.candidate_gates.get(c.name, [])),
                        ctx.engines[c.name].speculation)
        for c in cfg.candidates
    ]
    choice = choose_winner(results, share)
    standing = ctx.standing
    if standing is not None:
        choice = CandidateChoice(choice.decision, None, {
            name: f"not promoted: {standing.reason} (its gates so far: {reason})"
            for name, reason in choice.reasons.items()})
    ctx.result.candidates = [
        CandidateSummary(name=r.name, speculative_tokens=r.speculative_tokens, speculation=r.speculation, alpha=share.alpha,
                         decision=r.decision(share), reason=choice.reasons[r.name], gates=list(r.gates))
        for r in results
    ]
    for name, reason in choice.reasons.items():
        ctx.say(f"candidates: {name}: {reason}")
    ctx.event("candidates", "chosen", f"winner {choice.winner}" if choice.winner else choice.decision.value)
    if standing is not None:
        return None
    if choice.winner is None:
        return no_winner(choice.decision, choice.reasons, len(results), share.alpha, ctx.experiment_capped)
    ctx.result.winner = choice.winner  # from here on ctx.canary_arm is the winner's
    take_the_seat(ctx, choice.winner)
    # the winner's gates are the run's: the sweep (on the winner) and the decision follow as for one canary
    won = results[[r.name for r in results].index(choice.winner)]
    ctx.result.gates += won.gates
    # its ratio is the lowest of K estimates: say how far that selection may have flattered it
    objective = next((g for g in won.gates if g.name == OBJECTIVE_NAME), None)
    note = winners_curse_note(choice.winner, objective.estimate if objective else None,
                              objective.interval if objective else None, len(results), share.alpha)
    if note is not None:
        ctx.result.winner_note = note
        ctx.say(f"candidates: {note}")
    return None


def lost_candidates(ctx: RunContext) -> frozenset[str]:
    """Candidates whose gates so far (preflight, accuracy) already decide a rollback: they cannot win.
    The rule is `decide`'s, as the final choice applies it: a FAIL of a gate the config does not judge
    (gates.disabled) loses nothing."""
    return frozenset(name for name, gates in ctx.candidate_gates.items()
                     if decide(gates, ctx.cfg.gates) is Decision.ROLLBACK)


def take_the_seat(ctx: RunContext, winner: str) -> None:
    """The winner's replicas become the canary arm (router, fleet, engines); the losers stop. The config is
    not rewritten: promoted.yaml and the stable mark read the seat's arm (`ctx.canary_arm`, from result.winner)."""
    losers = [c.name for c in ctx.cfg.candidates if c.name != winner]
    ctx.engines[CANARY] = ctx.engines[winner]
    ctx.result.arms[CANARY] = {**ctx.result.arms[winner], "candidate": winner}
    ctx.fleet.hand_over(winner, CANARY)
    urls = ctx.fleet.urls()
    # losers are left out of the router first (no request reaches a replica being stopped), then stopped
    ctx.router.set_arms({BASELINE: urls[BASELINE], CANARY: urls[CANARY]}, ctx.fleet.upstream_keys())
    ctx.fleet.retire(losers)
    ctx.say(f"candidates: {winner} takes the canary's place; stopped {', '.join(losers)}")
    ctx.event("candidates", "seat", f"{winner} is the canary")
