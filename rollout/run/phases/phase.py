"""What every phase is: a name, whether it runs, and how; what it hands back when it decides."""

from __future__ import annotations

from typing import Protocol

from rollout.run.context import RunContext
from rollout.run.decision import Decided


class Phase(Protocol):
    name: str

    def enabled(self, ctx: RunContext) -> bool:
        """Whether the phase runs, given the config and what the phases before it found."""
        ...

    def run(self, ctx: RunContext) -> Decided | None:
        """Do the phase's work; raise InfrastructureError (or a load/fleet error) when it cannot measure.
        Returns the decision when the phase decided the run (the controller records it), else None."""
        ...
