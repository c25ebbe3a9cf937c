"""Seeing a replica die in the phases that have no guard windows (accuracy, experiment).

A verdict built on the survivors of a dead replica is wrong in a known direction (the
router's least-outstanding pick sends a fast-failing replica most requests; its arm's
errors or its missing latency then decide), so a confirmed death ends the run as an
infrastructure error naming the replica. One failed poll is not a death: a replica busy
on two shared cores may miss a 2 s /health deadline, so a death is confirmed by
consecutive polls (the progressive phase does the same with its own streaks).

A replica that stops answering at all (SIGSTOP, a hung engine, a wedged host) fails no
request fast: its requests wait for the router's timeouts, and a stalled *baseline* makes
the canary look better on every one-sided gate. So silence is evidence too once it lasts:
no answer in `confirmations` consecutive polls spanning at least `stall_after_s` is a
stall, and ends the run the same way. One slow answer is not (a busy replica on shared
cores may miss a 5 s /health deadline now and then, but not for most of a minute).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from cluster.router import ROUTER_WATCH_NAME as ROUTER
from rollout.run.context import InfrastructureError

POLL_EVERY_S = 5.0
CONFIRMATIONS = 3
CONFIRM_SPACING_S = 2.0
STALL_AFTER_S = 45.0
# alive() also answers for the router actor, under ROUTER (every other name is a replica's):
# with it gone every request fails on both arms alike, and no verdict may come of that


def _named(names: list[str], where: Callable[[str], str | None] = lambda name: None) -> str:
    """'replica canary-0 on node 10.0.0.3 (lost: Ray lists it dead)', the router by its name."""
    parts = []
    for name in names:
        place = None if name == ROUTER else where(name)
        parts.append(name if name == ROUTER else f"replica {name}" + (f" {place}" if place else ""))
    return ", ".join(parts)


class ReplicaWatch:
    """Polls `alive()` (replica name -> True alive / False down / None no answer in time; a name
    left out is no evidence) and keeps streaks of downs and of silences. `where(name)` says where a
    replica ran ("on node IP ..."), for the cause line: a lost node is named, not only its replica."""

    def __init__(self, phase: str, alive: Callable[[], dict[str, bool | None]], every_s: float = POLL_EVERY_S,
                 confirmations: int = CONFIRMATIONS, stall_after_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 where: Callable[[str], str | None] = lambda name: None) -> None:
        self.phase = phase
        self._alive = alive
        self._where = where
        self.every_s = every_s
        self.confirmations = confirmations
        self.stall_after_s = STALL_AFTER_S if stall_after_s is None else stall_after_s
        self._clock = clock
        self.dead_streak: dict[str, int] = {}
        self.silent_streak: dict[str, int] = {}
        self.silent_since: dict[str, float] = {}
        self._last_poll_at = 0.0
        self._next_poll = 0.0

    def poll(self, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        try:
            alive = self._alive()
        except Exception:  # cannot tell: no evidence either way
            return
        for name, ok in alive.items():
            if ok is None:
                self.silent_streak[name] = self.silent_streak.get(name, 0) + 1
                self.silent_since.setdefault(name, now)
                continue
            self.silent_streak[name] = 0
            self.silent_since.pop(name, None)
            self.dead_streak[name] = 0 if ok else self.dead_streak.get(name, 0) + 1
        self._last_poll_at = now

    def tick(self, now: float | None = None) -> None:
        """Poll when one is due (call it from a phase's loop)."""
        now = self._clock() if now is None else now
        if now >= self._next_poll:
            self._next_poll = now + self.every_s
            self.poll(now)

    def dead(self) -> list[str]:
        return sorted(name for name, streak in self.dead_streak.items() if streak >= self.confirmations)

    def _silent_for(self, name: str) -> float:
        return self._last_poll_at - self.silent_since.get(name, math.inf)

    def stalled(self) -> list[str]:
        return sorted(
            name for name, streak in self.silent_streak.items()
            if streak >= self.confirmations and self._silent_for(name) >= self.stall_after_s
        )

    def check(self) -> None:
        """Raise InfrastructureError if a replica's death or stall is confirmed."""
        dead = self.dead()
        if dead:
            raise InfrastructureError(
                f"{self.phase}: {_named(dead, self._safe_where)} died (no answer in {self.confirmations} consecutive "
                f"health polls); no verdict is built on the survivors"
            )
        stalled = self.stalled()
        if stalled:
            longest = max(self._silent_for(name) for name in stalled)
            raise InfrastructureError(
                f"{self.phase}: {_named(stalled, self._safe_where)} stalled (no answer to /health for {longest:.0f} s, "
                f"{self.confirmations}+ polls in a row); no verdict is built on it"
            )

    def _safe_where(self, name: str) -> str | None:
        try:
            return self._where(name)
        except Exception:  # where it ran is a courtesy of the cause line, never a second failure
            return None

    def _pending(self) -> bool:
        """A down or a silence seen but not yet confirmed either way."""
        stalled = set(self.stalled())
        return any(0 < s < self.confirmations for s in self.dead_streak.values()) or any(
            s > 0 and name not in stalled for name, s in self.silent_streak.items()
        )

    def confirm(self, spacing_s: float = CONFIRM_SPACING_S) -> None:
        """Poll now; a replica seen down (or silent) is polled again until it answers, or its death
        (its stall: up to stall_after_s) is confirmed."""
        self.poll()
        while self._pending():
            time.sleep(spacing_s)
            self.poll()
        self.check()
