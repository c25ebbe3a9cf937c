"""Load profiles: how the offered load changes during one test (steps over levels, or a ramp).

A profile is a level as a function of the time since the test started: piecewise
constant for steps (`1,4,16`, each for `step_s`), linear for a ramp (`1:16` over
`ramp_s`). What a level means depends on the loop:

  closed loop   level x level_users concurrent users (e.g. streams per replica x replicas)
  open loop     level x rate requests/s, on the one global schedule shared by all workers

In open loop the schedule is laid out in "work time" (seconds at level 1): the arrival
process runs at the base rate in work time, and `time_for_work` maps each arrival back to
the wall clock, so the instantaneous rate is rate x level(t) for constant, Poisson and
gamma arrivals alike, and the partition over workers stays exact.

Nothing here imports Locust: the shape that applies a profile lives in `loadtests.shapes`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """The level goes linearly from `from_level` to `to_level` over [start_s, start_s + duration_s)."""

    start_s: float
    duration_s: float
    from_level: float
    to_level: float

    def level_at(self, offset_s: float) -> float:
        if self.from_level == self.to_level:
            return self.from_level
        return self.from_level + (self.to_level - self.from_level) * offset_s / self.duration_s

    def work_until(self, offset_s: float) -> float:
        """Integral of the level over [0, offset_s] of this segment."""
        slope = (self.to_level - self.from_level) / self.duration_s
        return self.from_level * offset_s + slope * offset_s * offset_s / 2.0

    def offset_for_work(self, work: float) -> float:
        """Inverse of `work_until` within the segment (work <= the segment's total work)."""
        slope = (self.to_level - self.from_level) / self.duration_s
        a = self.from_level
        if slope == 0.0:
            return work / a
        # a t + slope t^2 / 2 = work, solved in the form that stays exact as slope -> 0
        return 2.0 * work / (a + math.sqrt(max(0.0, a * a + 2.0 * slope * work)))


class LoadProfile:
    """Levels over time, from t = 0 (the test's start) to `duration_s`; after the end the
    last level holds (the test is stopped by then)."""

    def __init__(self, segments: Sequence[Segment], kind: str) -> None:
        if not segments:
            raise ValueError("a load profile needs at least one segment")
        for segment in segments:
            if segment.duration_s <= 0:
                raise ValueError(f"every step or ramp needs a positive duration, got {segment.duration_s}")
            if segment.from_level < 0 or segment.to_level < 0:
                raise ValueError("load levels cannot be negative")
        if all(s.from_level == 0 and s.to_level == 0 for s in segments):
            raise ValueError("a load profile with every level 0 sends nothing")
        self.kind = kind
        self.segments = tuple(segments)
        self._starts = [s.start_s for s in self.segments]
        self._work_before: list[float] = []
        total = 0.0
        for segment in self.segments:
            self._work_before.append(total)
            total += segment.work_until(segment.duration_s)
        self._total_work = total

    @classmethod
    def steps(cls, levels: Sequence[float], step_s: float) -> LoadProfile:
        if not levels:
            raise ValueError("--mtp-steps names no level")
        return cls([Segment(i * step_s, step_s, float(level), float(level)) for i, level in enumerate(levels)], "steps")

    @classmethod
    def ramp(cls, from_level: float, to_level: float, ramp_s: float) -> LoadProfile:
        return cls([Segment(0.0, ramp_s, float(from_level), float(to_level))], "ramp")

    @classmethod
    def parse_steps(cls, text: str, step_s: float) -> LoadProfile:
        try:
            levels = [float(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"--mtp-steps {text!r}: expected numbers like 1,4,16") from None
        return cls.steps(levels, step_s)

    @classmethod
    def parse_ramp(cls, text: str, ramp_s: float) -> LoadProfile:
        parts = text.split(":")
        try:
            if len(parts) != 2:
                raise ValueError
            start, end = float(parts[0]), float(parts[1])
        except ValueError:
            raise ValueError(f"--mtp-ramp {text!r}: expected FROM:TO like 1:16") from None
        return cls.ramp(start, end, ramp_s)

    @property
    def duration_s(self) -> float:
        last = self.segments[-1]
        return last.start_s + last.duration_s

    @property
    def levels(self) -> list[float]:
        """The distinct levels in order: the steps, or a ramp's two ends."""
        seen: list[float] = []
        for segment in self.segments:
            for level in (segment.from_level, segment.to_level):
                if not seen or seen[-1] != level:
                    seen.append(level)
        return seen

    @property
    def max_level(self) -> float:
        return max(max(s.from_level, s.to_level) for s in self.segments)

    def _segment_index(self, t: float) -> int:
        return max(0, bisect.bisect_right(self._starts, t) - 1)

    def level_at(self, t: float) -> float:
        """The level at `t` seconds since the start (the first level before it, the last after the end)."""
        if t < 0:
            return self.segments[0].from_level
        if t >= self.duration_s:
            return self.segments[-1].to_level
        segment = self.segments[self._segment_index(t)]
        return segment.level_at(t - segment.start_s)

    def work_until(self, t: float) -> float:
        """Integral of the level from 0 to t: the seconds at level 1 that carry the same load."""
        if t <= 0:
            return 0.0
        if t >= self.duration_s:
            return self._total_work + self.segments[-1].to_level * (t - self.duration_s)
        index = self._segment_index(t)
        segment = self.segments[index]
        return self._work_before[index] + segment.work_until(t - segment.start_s)

    def time_for_work(self, work: float) -> float:
        """Inverse of `work_until`: the earliest time by which `work` has been done (inf: never)."""
        if work <= 0:
            return 0.0
        if work > self._total_work:
            last = self.segments[-1].to_level
            return self.duration_s + (work - self._total_work) / last if last > 0 else math.inf
        # the last segment that starts with less work done (a level-0 segment is never it)
        index = bisect.bisect_left(self._work_before, work) - 1
        segment = self.segments[index]
        return segment.start_s + segment.offset_for_work(work - self._work_before[index])

    def users_at(self, t: float, level_users: float) -> int:
        """Closed loop: the users (in-flight requests) at time t."""
        return max(0, round(self.level_at(t) * level_users))

    def describe(self) -> str:
        if self.kind == "ramp":
            segment = self.segments[0]
            return f"ramp {segment.from_level:g} -> {segment.to_level:g} over {segment.duration_s:g}s"
        levels = ", ".join(f"{s.from_level:g}" for s in self.segments)
        return f"steps {levels}, {self.segments[0].duration_s:g}s each"
