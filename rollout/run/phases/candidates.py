"""The candidates phase: with several candidates (config `candidates:`), the winner takes the
canary's seat before the sweep and the decision, or the run decides without one (the choice
and the hand-over: rollout.run.phases.candidate_choice)."""

from __future__ import annotations

from rollout.run.context import RunContext
from rollout.run.decision import Decided
from rollout.run.phases.candidate_choice import choose_now


class ChooseCandidate:
    """Several candidates: the winner, before the sweep and the decision."""

    name = "candidates"

    def enabled(self, ctx: RunContext) -> bool:
        return bool(ctx.cfg.candidates) and not ctx.judged and ctx.result.candidates is None

    def run(self, ctx: RunContext) -> Decided | None:
        return choose_now(ctx)
