"""Passive outlier ejection: one replica's health as the router has seen it.

Least-outstanding picking alone favours a replica that fails fast: its requests
end at once, so it always has the fewest in flight and attracts most of the
traffic (one dead of two baseline replicas got 1,703 of 1,738 requests). So,
like Envoy's outlier detection: `threshold` consecutive failures (connect
errors, timeouts, 5xx, streams broken mid-way) eject the replica for a backoff
that doubles with each consecutive ejection up to a cap. An ejected replica is
not picked until its backoff ends; back, it is on probation: its first failure
ejects it again (a dead replica costs one request per backoff, not
`threshold`). One success ends the streak and the doubling.

Pure and clock-free (the caller passes `now`, a monotonic time), so it is
unit-tested without sockets.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EjectionPolicy:
    threshold: int = 3  # consecutive failures that eject
    base_s: float = 10.0  # first ejection's length
    max_s: float = 300.0  # cap of the doubling

    def __post_init__(self) -> None:
        if self.threshold < 1:
            raise ValueError(f"ejection threshold must be >= 1 consecutive failure, got {self.threshold}")
        if not 0 < self.base_s <= self.max_s:
            raise ValueError(f"ejection times need 0 < base_s <= max_s, got base_s={self.base_s}, max_s={self.max_s}")

    def backoff_s(self, consecutive_ejections: int) -> float:
        """Length of the n-th consecutive ejection (n from 0): base, 2 base, 4 base, ... capped."""
        # min() before the power: 2**n for a long-dead replica must not overflow.
        return min(self.max_s, self.base_s * 2.0 ** min(consecutive_ejections, 64))


@dataclass
class ReplicaHealth:
    """Failure streak and ejection of one replica (kept while the replica stays in its arm)."""

    consecutive_failures: int = 0
    consecutive_ejections: int = 0  # ejections with no success in between: the doubling exponent
    ejections: int = 0  # every ejection since the replica joined
    ejected_until: float = 0.0  # monotonic time; in the past when not ejected

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def succeeded(self) -> None:
        self.consecutive_failures = 0
        self.consecutive_ejections = 0

    def failed(self, now: float, policy: EjectionPolicy) -> float | None:
        """Count one failure; the backoff in seconds when it ejects the replica, else None.

        Failures of requests that were in flight when the replica was ejected
        do not extend the ejection: they are the same outage.
        """
        if self.ejected(now):
            return None
        self.consecutive_failures += 1
        if self.consecutive_failures < policy.threshold:
            return None
        backoff = policy.backoff_s(self.consecutive_ejections)
        self.consecutive_ejections += 1
        self.ejections += 1
        self.ejected_until = now + backoff
        # Probation: once back, one more failure ejects again.
        self.consecutive_failures = policy.threshold - 1
        return backoff


__all__ = ["EjectionPolicy", "ReplicaHealth"]
