"""Seeing a replica die in the phases that have no guard windows (accuracy, experiment).

A verdict built on the survivors of a dead replica is wrong in a known direction (the
router's least-outstanding pick sends a fast-failing replica most requests; its arm's
errors or its missing latency then decide), so a confirmed death ends the run as an
infrastructure error naming the replica. One failed poll is not a death: a replica busy
on two shared cores may miss a 2 s /health deadline, so a death is confirmed by
consecutive polls (the progressive phase does the same with its own streaks).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rollout.run_context import InfrastructureError

POLL_EVERY_S = 5.0
CONFIRMATIONS = 3
CONFIRM_SPACING_S = 2.0


class ReplicaWatch:
    """Polls `alive()` (replica name -> alive; a name left out is no evidence) and keeps streaks."""

    def __init__(self, phase: str, alive: Callable[[], dict[str, bool]], every_s: float = POLL_EVERY_S,
                 confirmations: int = CONFIRMATIONS) -> None:
        self.phase = phase
        self._alive = alive
        self.every_s = every_s
        self.confirmations = confirmations
        self.dead_streak: dict[str, int] = {}
        self._next_poll = 0.0

    def poll(self) -> None:
        try:
            alive = self._alive()
        except Exception:  # cannot tell: no evidence either way
            return
        for name, ok in alive.items():
            self.dead_streak[name] = 0 if ok else self.dead_streak.get(name, 0) + 1

    def tick(self, now: float | None = None) -> None:
        """Poll when one is due (call it from a phase's loop)."""
        now = time.monotonic() if now is None else now
        if now >= self._next_poll:
            self._next_poll = now + self.every_s
            self.poll()

    def dead(self) -> list[str]:
        return sorted(name for name, streak in self.dead_streak.items() if streak >= self.confirmations)

    def check(self) -> None:
        """Raise InfrastructureError if a replica's death is confirmed."""
        dead = self.dead()
        if dead:
            raise InfrastructureError(
                f"{self.phase}: replica {', '.join(dead)} died (no answer in {self.confirmations} consecutive "
                f"health polls); no verdict is built on the survivors"
            )

    def confirm(self, spacing_s: float = CONFIRM_SPACING_S) -> None:
        """Poll now; a replica seen down is polled again until its death is confirmed or it answers."""
        self.poll()
        while any(0 < s < self.confirmations for s in self.dead_streak.values()):
            time.sleep(spacing_s)
            self.poll()
        self.check()
