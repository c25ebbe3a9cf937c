"""A pytest plugin that prints, per test, its wall time and the machine's CPU seconds in it.

    .venv/bin/python -m pytest -p benchmarks.cpu_per_test -m vllm

Why: on a slowed machine (`benchmarks/slowed.sh 0.5`, a quota of half a core) a test can take no
less than its CPU seconds / 0.5, so a test whose CPU seconds are small next to its wall time waits
(bakes, open-loop traces, polls) and could overlap with another, while one near 2 CPU-s per second
(both cores busy) only gets shorter by doing less. The CPU is the whole machine's (/proc/stat: user,
nice, system, irq, softirq), not the test process's: a test's vLLM servers, Ray and Locust are not
its children for the kernel's accounting. Measure on a machine with nothing else running; one test
at a time (without xdist), or the figures of tests that ran together are mixed.
"""

from __future__ import annotations

import os
import time

import pytest

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_started: dict[str, tuple[float, float]] = {}
_rows: list[tuple[str, float, float]] = []


def machine_busy_s() -> float:
    """CPU seconds the machine has spent busy since boot, all cores together."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _CLOCK_TICKS


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _started[item.nodeid] = (time.monotonic(), machine_busy_s())


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    # after the test's teardown: a module fixture torn down there counts to the module's last test
    if nodeid in _started:
        wall0, cpu0 = _started.pop(nodeid)
        _rows.append((nodeid, time.monotonic() - wall0, machine_busy_s() - cpu0))


def pytest_terminal_summary(terminalreporter) -> None:
    if not _rows:
        return
    write = terminalreporter.write_line
    write("")
    write("wall s | CPU s (machine) | cores busy | test")
    for nodeid, wall, cpu in sorted(_rows, key=lambda row: -row[2]):
        write(f"{wall:7.1f} | {cpu:7.1f} | {cpu / wall if wall > 0 else 0:4.2f} | {nodeid}")
    total_wall = sum(row[1] for row in _rows)
    total_cpu = sum(row[2] for row in _rows)
    write(f"{total_wall:7.1f} | {total_cpu:7.1f} | {total_cpu / total_wall if total_wall else 0:4.2f} | all "
          f"{len(_rows)} tests (the floor at a quota of half a core: {total_cpu / 0.5 / 60:.1f} min)")
