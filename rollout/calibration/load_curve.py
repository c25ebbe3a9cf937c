"""The load-curve judgement, calibrated: simulated sweeps with a known true TPOT ratio at every load.

`mtp-canary calibrate` adds rows `load_curve` (rollout.calibration.calibrate): per world, the chance
of a wrong "up to C" claim (`promote_up_to` names a C such that some swept level <= C has a true
ratio >= the bar) and the power, P(C >= the last swept level whose true ratio is below the bar),
through the controller's own path (records -> rollout.analysis.load_sweep.level_results ->
rollout.judge.load_curve.promote_up_to). A fixed-sequence test keeps the wrong-claim rate <= alpha
by construction; the worlds are built to break the parts the argument leans on (the per-level
bootstrap under correlation, a true ratio exactly at the bar, levels the adaptive planner picks).

The records of one level (`level_records`): each prompt to the baseline, then to the canary,
in send order; n = 15 sqrt(level) + 25 prompts. Log TPOT = a shock both arms share (AR(1), rho
0.9, sd 0.15: a busy core), each arm's own slow stretches (AR(1), rho 0.8, sd 0.08: longer than
the bootstrap's blocks hold) and per-request noise (sd 0.08); the canary's is the baseline's
structure times the world's true ratio at that load.

Worlds (true ratio r(load); the bar 0.9):
    crosses_between  r = 0.6 + 0.15 log(load), levels 1, 2, 4, 8, 16: the bar is crossed at 7.39,
                     between 4 (0.808) and 8 (0.912); a claim reaching 8 is wrong.
    at_bar_level     r = 0.9 + 0.15 log(load / 4): exactly the bar at the level 4, so the level
                     the claim must stop before is the hardest one to refuse.
    flat_at_bar      r = 0.9 at every load: any claim is wrong.
    adaptive         crosses_between's curve, levels picked by the adaptive planner (doubling
                     from 1 to 64, then bisection around 0.9 and 1.0, at most 8 levels).
"""

from __future__ import annotations

import math
import multiprocessing
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from loadtests.records import RequestRecord
from rollout.analysis.crossover import AdaptivePolicy, LevelResult, next_level
from rollout.analysis.load_sweep import level_results
from rollout.judge.load_curve import promote_up_to

__all__ = ["BAR", "WORLDS", "LoadCurveWorld", "level_records", "load_curve_rows", "load_curve_trial", "format_lines"]

BAR = 0.9
ARMS = ("baseline", "canary")
FIXED_LEVELS = (1.0, 2.0, 4.0, 8.0, 16.0)
ADAPTIVE = AdaptivePolicy(start=1, max_level=64, min_step=1.0, max_levels=8, bars=(BAR, 1.0), resolution=0.5)


@dataclass(frozen=True)
class LoadCurveWorld:
    """A true TPOT ratio at every load, and the levels swept (None: the adaptive planner picks them)."""

    name: str
    ratio: Callable[[float], float]
    levels: tuple[float, ...] | None


def _log_line(at_one: float) -> Callable[[float], float]:
    return lambda load: at_one + 0.15 * math.log(load)


WORLDS = (
    LoadCurveWorld("crosses_between", _log_line(0.6), FIXED_LEVELS),
    LoadCurveWorld("at_bar_level", _log_line(BAR - 0.15 * math.log(4.0)), FIXED_LEVELS),
    LoadCurveWorld("flat_at_bar", lambda load: BAR, FIXED_LEVELS),
    LoadCurveWorld("adaptive", _log_line(0.6), None),
)


def _ar1(rng: np.random.Generator, n: int, rho: float, sd: float) -> np.ndarray:
    out, prev = np.empty(n), rng.normal(0.0, sd)
    for i, e in enumerate(rng.normal(0.0, sd * math.sqrt(1.0 - rho * rho), n)):
        prev = rho * prev + e
        out[i] = prev
    return out


def level_records(rng: np.random.Generator, level: float, true_ratio: float, *, noise: float = 1.0,
                  step_s: float = 10.0, drop: float = 0.0) -> list[RequestRecord]:
    """One level of a sweep (the module docstring): each prompt to the baseline, then to the canary."""
    n = int(15 * math.sqrt(level)) + 25
    shared = _ar1(rng, n, 0.9, 0.15 * noise)
    tpot = {
        "baseline": 0.03 * np.exp(shared + _ar1(rng, n, 0.8, 0.08 * noise) + rng.normal(0.0, 0.08 * noise, n)),
        "canary": 0.03 * true_ratio * np.exp(shared + _ar1(rng, n, 0.8, 0.08 * noise)
                                             + rng.normal(0.0, 0.08 * noise, n)),
    }
    records = []
    for i in range(n):
        for j, arm in enumerate(ARMS):
            ok = rng.random() >= drop
            records.append(RequestRecord(
                request_id=f"{level}-{i}-{arm}", tag="sweep", worker="w", arm=arm, pinned_arm=arm, level=level,
                dataset_index=i, sent_at=1000.0 + i * step_s / n + j * 1e-3, ttft_s=0.05,
                e2e_s=0.05 + float(tpot[arm][i]) * 32, output_tokens=33 if ok else 0, chunks=9, ok=ok,
                status=200 if ok else 500,
            ))
    return records


def sweep(world: LoadCurveWorld, rng: np.random.Generator, seed: int = 0) -> list[LevelResult]:
    """The world's sweep, level by level as the phase runs it (the planner steering an adaptive one)."""
    if world.levels is not None:
        return [r for level in world.levels
                for r in level_results(level_records(rng, level, world.ratio(level)), ARMS, 10.0, 1, seed=seed)]
    done: list[LevelResult] = []
    while (level := next_level(done, ADAPTIVE)) is not None:
        done += level_results(level_records(rng, level, world.ratio(level)), ARMS, 10.0, 1, seed=seed)
    return done


def load_curve_trial(world: LoadCurveWorld, rng: np.random.Generator, alpha: float, seed: int = 0) -> tuple[bool, bool | None]:
    """(wrong claim, claim reaches the last paying level) for one simulated sweep; the second is None when no
    swept level truly pays (power is not defined there)."""
    levels = sweep(world, rng, seed)
    claim = promote_up_to(levels, BAR, alpha).streams_per_replica
    loads = sorted(r.level for r in levels)
    paying = [load for load in loads if world.ratio(load) < BAR]
    # the true curves are increasing: the paying levels are the lowest ones
    wrong = claim is not None and any(world.ratio(load) >= BAR for load in loads if load <= claim)
    reaches = None if not paying else (claim is not None and claim >= max(paying))
    return wrong, reaches


CHUNK = 25  # trials per task handed to a worker


def _chunk(task: tuple[int, float, int, int, int]) -> tuple[int, int, list[tuple[bool, bool | None]]]:
    """Trials start..stop of one world, each on its own seeded stream (the result does not depend on workers)."""
    index, alpha, seed, start, stop = task
    world = WORLDS[index]
    out = []
    for trial in range(start, stop):
        rng = np.random.default_rng([seed, zlib.crc32(f"load_curve/{world.name}".encode()), trial])
        out.append(load_curve_trial(world, rng, alpha, seed=trial))
    return index, start, out


def load_curve_rows(alpha: float, trials: int, seed: int = 0, worlds: Sequence[LoadCurveWorld] = WORLDS,
                    workers: int = 1) -> list[dict]:
    """Per world: the wrong-claim rate (<= alpha by design) and the power, over `trials` seeded sweeps."""
    tasks = [(WORLDS.index(world), alpha, seed, start, min(start + CHUNK, trials))
             for world in worlds for start in range(0, trials, CHUNK)]
    if workers <= 1:
        done = [_chunk(task) for task in tasks]
    else:
        with multiprocessing.get_context().Pool(workers) as pool:
            done = list(pool.imap_unordered(_chunk, tasks))
    rows = []
    for world in worlds:
        index = WORLDS.index(world)
        outcomes = [o for _, _, chunk in sorted((d for d in done if d[0] == index), key=lambda d: d[1]) for o in chunk]
        reaches = [r for _, r in outcomes if r is not None]
        rows.append({
            "world": world.name,
            "wrong_claim_rate": float(np.mean([w for w, _ in outcomes])),
            "power": float(np.mean(reaches)) if reaches else None,
            "trials": trials,
        })
    return rows


def format_lines(rows: Sequence[dict], bound: float) -> list[str]:
    """The calibrate table's lines for these rows."""
    lines = ["", f"Load curve (promote_up_to; rollout.judge.load_curve): P(a wrong \"up to C\" claim: some swept level",
             f"<= C truly at or above the bar {BAR:g}) and the power, P(C reaches the last truly paying level).",
             f"  {'world':<20} {'wrong claim':>11} {'power':>7}"]
    for row in rows:
        flag = "  <-- above alpha + 2 SE" if row["wrong_claim_rate"] > bound else ""
        power = "n/a" if row["power"] is None else f"{row['power']:.4f}"
        lines.append(f"  {row['world']:<20} {row['wrong_claim_rate']:>11.4f} {power:>7}{flag}")
    return lines
