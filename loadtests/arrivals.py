"""Open-loop arrival schedules: when each request is meant to leave, whatever the server does.

A global rate R is partitioned over n workers: worker `slot` owns its share of the
arrivals, so n workers together offer R, not n * R. For a Poisson process the shares
are independent Poisson processes of rate R / n (their superposition is the global
process); for a constant rate the shares interleave on the global grid (worker s sends
at start + (s + k n) / R). Gamma arrivals follow vLLM's benchmark convention: shape =
burstiness (1 is Poisson, below 1 burstier, above 1 more regular).

With a load profile (steps or a ramp, `loadtests.profiles`) the rate is rate x level(t):
the arrivals are drawn at the base rate in work time and mapped to the wall clock, so
the shares stay a partition of one global schedule whatever the profile.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from loadtests.profiles import LoadProfile

ArrivalKind = Literal["poisson", "constant", "gamma"]


class ArrivalSchedule(Protocol):
    def next_send_time(self) -> float:
        """The targeted wall-clock send time (epoch seconds) of the next request."""
        ...


class ConstantArrivals:
    def __init__(self, rate_per_s: float, start_at: float, slot: int = 0, n_slots: int = 1) -> None:
        _check_partition(rate_per_s, slot, n_slots)
        self._interval_s = n_slots / rate_per_s
        self._next = start_at + slot / rate_per_s

    def next_send_time(self) -> float:
        at = self._next
        self._next += self._interval_s
        return at


class GammaArrivals:
    """Renewal process with gamma inter-arrival times (Poisson when burstiness is 1)."""

    def __init__(
        self,
        rate_per_s: float,
        start_at: float,
        burstiness: float = 1.0,
        seed: int = 0,
        slot: int = 0,
        n_slots: int = 1,
    ) -> None:
        _check_partition(rate_per_s, slot, n_slots)
        if burstiness <= 0:
            raise ValueError(f"burstiness must be positive, got {burstiness}")
        share = rate_per_s / n_slots
        self._shape = burstiness
        self._scale = 1.0 / (share * burstiness)  # mean interval = shape * scale = 1 / share
        self._rng = random.Random(f"mtp-arrivals:{seed}:{slot}")
        self._next = start_at + self._draw()

    def _draw(self) -> float:
        return self._rng.gammavariate(self._shape, self._scale)

    def next_send_time(self) -> float:
        at = self._next
        self._next += self._draw()
        return at


class ProfiledArrivals:
    """A base schedule laid out in work time (seconds at level 1, starting at 0), mapped
    onto the wall clock through a load profile: instantaneous rate = base rate x level."""

    def __init__(self, base: ArrivalSchedule, profile: LoadProfile, start_at: float) -> None:
        self._base = base
        self._profile = profile
        self._start_at = start_at

    def next_send_time(self) -> float:
        return self._start_at + self._profile.time_for_work(self._base.next_send_time())


def _check_partition(rate_per_s: float, slot: int, n_slots: int) -> None:
    if rate_per_s <= 0:
        raise ValueError(f"rate must be positive, got {rate_per_s}")
    if n_slots < 1 or not 0 <= slot < n_slots:
        raise ValueError(f"worker slot {slot} is not in 0..{n_slots - 1}")


def arrival_schedule(
    kind: ArrivalKind,
    rate_per_s: float,
    start_at: float,
    *,
    burstiness: float = 1.0,
    seed: int = 0,
    slot: int = 0,
    n_slots: int = 1,
    profile: LoadProfile | None = None,
) -> ArrivalSchedule:
    """This worker's share of a global open-loop schedule (rate x level(t) with a profile;
    a time past the profile's end where the level is 0 is `inf`: never)."""
    origin = 0.0 if profile is not None else start_at
    base: ArrivalSchedule
    if kind == "constant":
        base = ConstantArrivals(rate_per_s, origin, slot, n_slots)
    elif kind == "poisson":
        base = GammaArrivals(rate_per_s, origin, 1.0, seed, slot, n_slots)
    elif kind == "gamma":
        base = GammaArrivals(rate_per_s, origin, burstiness, seed, slot, n_slots)
    else:
        raise ValueError(f"unknown arrival kind {kind!r} (poisson, constant or gamma)")
    return ProfiledArrivals(base, profile, start_at) if profile is not None else base
