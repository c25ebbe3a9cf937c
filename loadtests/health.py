"""Is the load generator, not the server, limiting the load? Its CPU and its send lag say.

Each Locust process measures its own CPU (user + system seconds) over the test, and the
busiest 5-second window of it; the master measures, from the records as they arrive,
how late open-loop requests left against their targeted send time. A worker near a full
core, or a send lag whose p99 exceeds the limit, means the offered load was not what was
asked for: the run says so (`generator_limited`, `warnings`) instead of passing the
generator's limit off as the server's.

The percentile and number-formatting helpers of the project live here too (`percentile`,
`percentile_ms`, `median_ms`, `format_or_na`): the records' summaries, the judges and the
benchmarks use them. Nothing here imports Locust or gevent (nor, at import, numpy).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

# the window over which the peak CPU share of a worker is measured
PEAK_WINDOW_S = 5.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of unsorted values; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def percentile_ms(values, q: float, ndigits: int | None = 3) -> float | None:
    """numpy's linear percentile (q in 0..100) of values in seconds, in ms rounded to `ndigits`
    (None: unrounded); None when empty. numpy's arithmetic, which can differ from `percentile`'s
    in the last bit."""
    import numpy as np  # here: the Locust side imports this module, and no numpy

    arr = np.asarray(values, dtype=float)
    if not arr.size:
        return None
    ms = float(np.percentile(arr, q)) * 1000.0
    return ms if ndigits is None else round(ms, ndigits)


def median_ms(values) -> float | None:
    """numpy's median of values in seconds, in ms rounded to 3 digits; None when empty. np.median
    averages the two middle values, which can differ from percentile_ms(values, 50) in the last bit."""
    import numpy as np  # here: the Locust side imports this module, and no numpy

    arr = np.asarray(values, dtype=float)
    return round(float(np.median(arr)) * 1000.0, 3) if arr.size else None


def format_or_na(value: float | None, spec: str = ".2f") -> str:
    """`value` formatted with `spec`, or "n/a" for None."""
    return "n/a" if value is None else format(value, spec)


class CpuMeter:
    """CPU seconds of one process over a test, and its busiest window.

    `sample` is called about once a second with the process's CPU seconds and a monotonic
    time; the peak is the highest CPU share over any `window_s` stretch between samples.
    """

    def __init__(self, window_s: float = PEAK_WINDOW_S) -> None:
        self._window_s = window_s
        self._start: tuple[float, float] | None = None
        self._samples: deque[tuple[float, float]] = deque()
        self._peak_share: float | None = None

    @property
    def started(self) -> bool:
        return self._start is not None

    def start(self, cpu_s: float, now: float) -> None:
        self._start = (cpu_s, now)
        self._samples = deque([(cpu_s, now)])
        self._peak_share = None

    def sample(self, cpu_s: float, now: float) -> float | None:
        """Record a reading; returns the CPU share over the last full window (None before one)."""
        if self._start is None:
            return None
        self._samples.append((cpu_s, now))
        # keep the oldest sample that still spans a full window back from now
        while len(self._samples) > 2 and now - self._samples[1][1] >= self._window_s:
            self._samples.popleft()
        first_cpu, first_time = self._samples[0]
        if now - first_time >= self._window_s:
            share = (cpu_s - first_cpu) / (now - first_time)
            self._peak_share = share if self._peak_share is None else max(self._peak_share, share)
            return share
        return None

    def report(self, cpu_s: float, now: float) -> dict[str, float | None]:
        """{"cpu_s", "wall_s", "cpu_peak_pct"} since `start` (a test shorter than the window has no peak
        of its own: its average stands in)."""
        if self._start is None:
            return {"cpu_s": None, "wall_s": None, "cpu_peak_pct": None}
        self.sample(cpu_s, now)
        used = cpu_s - self._start[0]
        wall = now - self._start[1]
        peak = self._peak_share
        if peak is None and wall > 0:
            peak = used / wall
        return {"cpu_s": used, "wall_s": wall, "cpu_peak_pct": None if peak is None else 100.0 * peak}


class WorkerLoad(BaseModel):
    """One Locust process's share of the work and what it cost."""

    model_config = ConfigDict(frozen=True)

    worker: str
    cpu_s: float | None  # user + system seconds during the test
    wall_s: float | None  # the test's duration as this process saw it
    cpu_pct: float | None  # cpu_s / wall_s, in % of one core
    cpu_peak_pct: float | None  # busiest 5 s window, in % of one core
    scheduled_requests: int  # open loop: requests with a targeted send time
    send_lag_p50_ms: float | None
    send_lag_p99_ms: float | None


class GeneratorHealth(BaseModel):
    """Whether the generator kept up with what it was asked to offer."""

    model_config = ConfigDict(frozen=True)

    workers: list[WorkerLoad]
    scheduled_requests: int
    send_lag_p50_ms: float | None
    send_lag_p99_ms: float | None
    send_lag_max_ms: float | None
    cpu_warn_pct: float
    lag_warn_ms: float
    generator_limited: bool
    warnings: list[str]


def assess(
    workers: Sequence[tuple[str, dict[str, float | None] | None, Sequence[float]]],
    *,
    cpu_warn_pct: float,
    lag_warn_ms: float,
) -> GeneratorHealth:
    """From each worker's (name, CPU report, send lags in seconds), the verdict on the generator."""
    loads: list[WorkerLoad] = []
    all_lags: list[float] = []
    warnings: list[str] = []
    for name, cpu, lags in workers:
        cpu = cpu or {}
        cpu_s, wall_s, peak = cpu.get("cpu_s"), cpu.get("wall_s"), cpu.get("cpu_peak_pct")
        cpu_pct = 100.0 * cpu_s / wall_s if cpu_s is not None and wall_s else None
        p50, p99 = percentile(lags, 50), percentile(lags, 99)
        loads.append(
            WorkerLoad(
                worker=name,
                cpu_s=cpu_s,
                wall_s=wall_s,
                cpu_pct=cpu_pct,
                cpu_peak_pct=peak,
                scheduled_requests=len(lags),
                send_lag_p50_ms=None if p50 is None else 1000.0 * p50,
                send_lag_p99_ms=None if p99 is None else 1000.0 * p99,
            )
        )
        all_lags.extend(lags)
        busiest = max((v for v in (cpu_pct, peak) if v is not None), default=None)
        if busiest is not None and busiest > cpu_warn_pct:
            warnings.append(
                f"load generator worker {name} used {busiest:.0f}% of one core "
                f"(average {cpu_pct or 0:.0f}%, limit {cpu_warn_pct:g}%): the generator, not the server, "
                "may limit the load; add workers or lower the load per worker"
            )
    p50, p99, worst = percentile(all_lags, 50), percentile(all_lags, 99), max(all_lags, default=None)
    p99_ms = None if p99 is None else 1000.0 * p99
    if p99_ms is not None and p99_ms > lag_warn_ms:
        warnings.append(
            f"open-loop requests left late: send lag p99 {p99_ms:.1f} ms > {lag_warn_ms:g} ms "
            f"(p50 {1000.0 * (p50 or 0):.1f} ms, max {1000.0 * (worst or 0):.0f} ms): the generator offered less "
            "than the target rate; add users (all busy) or workers (CPU)"
        )
    return GeneratorHealth(
        workers=loads,
        scheduled_requests=len(all_lags),
        send_lag_p50_ms=None if p50 is None else 1000.0 * p50,
        send_lag_p99_ms=p99_ms,
        send_lag_max_ms=None if worst is None else 1000.0 * worst,
        cpu_warn_pct=cpu_warn_pct,
        lag_warn_ms=lag_warn_ms,
        generator_limited=bool(warnings),
        warnings=warnings,
    )
