"""Does the latency judge hold its error rate when requests are not independent? Measured, by seeded simulation.

Every simulated run goes through ``rollout.judge.latency.judge_latency`` itself, at the
default ``GatesConfig``, with the demo's design: 40 requests per arm per look, 600 per
arm planned (15 looks), alpha spent at information n / 600. One call at the last look
judges all fifteen looks (the judge intersects the repeated intervals of every look so
far, so a gate that passed at some look still passes at the last one, unless the
intervals of two looks became disjoint).

Per arm and request (log scale; the canary's latencies are the baseline's distribution
times the true ratio):

* TPOT = 30 ms x lognormal(0, 0.25), TTFT = 250 ms x lognormal(0, 0.3), E2E = TTFT + 150 TPOT;
* ``level``: a latency level per arm per look, N(0, sd), shared by that look's requests
  (load on that arm's replica during that look); drawn independently per arm, or
  ``level_link`` +1: one level per look for both arms (a disturbance of the whole
  machine, e.g. another tenant), -1: the canary's level is minus the baseline's (two
  replicas fighting for the same cores: one is slow while the other is fast);
* ``drift``: a random walk within each look per arm, reset at each look, sd at the
  look's end as given;
* ``stalls``: runs of 10 consecutive requests, each run stalled with probability 0.1,
  a stall doubling TTFT and TPOT;
* ``tick``: TPOT quantised to 1 ms (latent ratio exactly the one given);
* ``heavy``: TPOT lognormal(0, 1), or 30 ms x (1 + Pareto(1.5));
* ``unequal``: the baseline gets 60 requests per look, the canary 40;
* ``timeouts``: the canary's slowest 1% of TTFT become errors (+inf in the judge).

Rows: the objective's pass rate with the TPOT ratio exactly at its threshold (0.90: a
false promote, target <= alpha + 2 simulation SE), the TTFT p95 guard's pass rate with
the TTFT ratio exactly at its limit (1.25), the objective's power at ratios 0.7 and
0.8 (target at 0.7: >= 0.9), and the TTFT guard's pass rate when TTFT is unchanged
(PROMOTE needs every gate to pass, so this bounds the run's power; reported).

    .venv/bin/python benchmarks/latency_calibration.py [--trials 2000] [--seed 1] [--json]

The same script measures another judge on the same draws, e.g. the previous commit's:
``git archive HEAD~1 rollout loadtests cluster | tar -x -C /tmp/old &&
PYTHONPATH=/tmp/old python benchmarks/latency_calibration.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rollout.judge.config import GatesConfig
from rollout.judge.latency import LatencySamples, judge_latency

LOOKS = 15
REQUESTS_PER_LOOK = 40
REQUESTS_PER_ARM = 600
STALL_RUN = 10
STALL_PROBABILITY = 0.1
STALL_FACTOR = 2.0
TICK_S = 0.001
TPOT_THRESHOLD = 0.90  # 1 - the default tpot_p50_min_improvement
TTFT_LIMIT = 1.25  # the default ttft_p95_max_ratio


@dataclass(frozen=True)
class Scenario:
    """One simulated design: what the arms' latencies look like, which gate is counted, the true ratio."""

    name: str
    gate: str = "tpot_p50_improvement"
    tpot_ratio: float = TPOT_THRESHOLD
    ttft_ratio: float = 1.0
    level_sd: float = 0.0
    level_link: int = 0  # 0: the arms' levels are independent; +1: one level for both; -1: opposite levels
    drift_sd: float = 0.0
    stalls: bool = False
    tick: bool = False
    tpot_tail: str = "lognormal"  # lognormal | heavy_lognormal | pareto
    baseline_per_look: int = REQUESTS_PER_LOOK
    canary_per_look: int = REQUESTS_PER_LOOK
    canary_timeouts: float = 0.0
    kind: str = "error"  # error: target <= alpha; power: target reported (>= 0.9 at ratio 0.7)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("iid"),
    Scenario("level_0.05", level_sd=0.05),
    Scenario("level_0.10", level_sd=0.10),
    # the looks are the same time windows for both arms: a level in one arm is rarely independent of the other's
    Scenario("level_0.10_shared", level_sd=0.10, level_link=1),
    Scenario("level_0.10_opposed", level_sd=0.10, level_link=-1),
    Scenario("drift_0.10", drift_sd=0.10),
    Scenario("stall_runs_10", stalls=True),
    Scenario("tick_1ms", tick=True),
    Scenario("unequal_n_60_40", baseline_per_look=60),
    Scenario("heavy_lognormal_sd1", tpot_tail="heavy_lognormal"),
    Scenario("heavy_pareto_1.5", tpot_tail="pareto"),
    Scenario("ttft_guard_stall_runs", gate="ttft_p95_guard", tpot_ratio=0.7, ttft_ratio=TTFT_LIMIT, stalls=True),
    Scenario("ttft_guard_level_0.10_opposed", gate="ttft_p95_guard", tpot_ratio=0.7, ttft_ratio=TTFT_LIMIT, level_sd=0.10, level_link=-1),
    Scenario("ttft_guard_timeouts_1pct", gate="ttft_p95_guard", tpot_ratio=0.7, ttft_ratio=TTFT_LIMIT, canary_timeouts=0.01),
    Scenario("power_0.7_iid", tpot_ratio=0.7, kind="power"),
    Scenario("power_0.7_level_0.05", tpot_ratio=0.7, level_sd=0.05, kind="power"),
    Scenario("power_0.8_iid", tpot_ratio=0.8, kind="power"),
    Scenario("power_0.8_level_0.05", tpot_ratio=0.8, level_sd=0.05, kind="power"),
    # PROMOTE needs every gate: how often the TTFT p95 guard clears 1.25 when nothing changed
    Scenario("ttft_guard_power_1.0_iid", gate="ttft_p95_guard", tpot_ratio=0.7, kind="power"),
    Scenario("ttft_guard_power_1.0_level_0.05", gate="ttft_p95_guard", tpot_ratio=0.7, level_sd=0.05, kind="power"),
    Scenario("ttft_guard_power_1.0_level_0.10", gate="ttft_p95_guard", tpot_ratio=0.7, level_sd=0.10, kind="power"),
    Scenario("ttft_guard_power_1.0_level_0.10_shared", gate="ttft_p95_guard", tpot_ratio=0.7, level_sd=0.10, level_link=1, kind="power"),
)


def _correlated_log_effect(
    rng: np.random.Generator, scenario: Scenario, per_look: int, linked_level: np.ndarray | None = None
) -> np.ndarray:
    """Log-latency offsets shared by requests (level, drift, stall runs), in completion order, one arm.

    ``linked_level``: this arm's per-look level when the arms' levels are linked (else drawn here)."""
    n = LOOKS * per_look
    effect = np.zeros(n)
    if linked_level is not None:
        effect += np.repeat(linked_level, per_look)
    elif scenario.level_sd:
        effect += np.repeat(rng.normal(0.0, scenario.level_sd, LOOKS), per_look)
    if scenario.drift_sd:
        steps = rng.normal(0.0, scenario.drift_sd / math.sqrt(per_look), (LOOKS, per_look))
        effect += np.cumsum(steps, axis=1).ravel()
    if scenario.stalls:
        runs = math.ceil(n / STALL_RUN)
        stalled = np.repeat(rng.random(runs) < STALL_PROBABILITY, STALL_RUN)[:n]
        effect += np.where(stalled, math.log(STALL_FACTOR), 0.0)
    return effect


def _tpot(rng: np.random.Generator, scenario: Scenario, n: int) -> np.ndarray:
    if scenario.tpot_tail == "pareto":
        return 0.03 * (1.0 + rng.pareto(1.5, n))
    sd = 1.0 if scenario.tpot_tail == "heavy_lognormal" else 0.25
    return 0.03 * rng.lognormal(0.0, sd, n)


def simulate_arm(
    rng: np.random.Generator, scenario: Scenario, canary: bool, linked_level: np.ndarray | None = None
) -> LatencySamples:
    """One arm's samples over the planned looks, with the look of every sample and every error."""
    per_look = scenario.canary_per_look if canary else scenario.baseline_per_look
    n = LOOKS * per_look
    effect = np.exp(_correlated_log_effect(rng, scenario, per_look, linked_level))
    tpot = _tpot(rng, scenario, n) * effect * (scenario.tpot_ratio if canary else 1.0)
    ttft = 0.25 * rng.lognormal(0.0, 0.3, n) * effect * (scenario.ttft_ratio if canary else 1.0)
    if scenario.tick:
        tpot = np.maximum(np.round(tpot / TICK_S), 1.0) * TICK_S
    e2e = ttft + 150 * tpot
    window = np.repeat(np.arange(1, LOOKS + 1), per_look)
    ok = np.ones(n, dtype=bool)
    if canary and scenario.canary_timeouts:
        ok[np.argsort(ttft)[n - int(round(scenario.canary_timeouts * n)):]] = False  # the slowest time out
    extra = {}
    if "error_window" in {f.name for f in dataclasses.fields(LatencySamples)}:
        extra["error_window"] = window[~ok]
    return LatencySamples(
        ttft_s=ttft[ok], tpot_s=tpot[ok], e2e_s=e2e[ok], n_errors=int((~ok).sum()), n_total=n, window=window[ok], **extra
    )


def information_fractions(scenario: Scenario) -> list[float]:
    least = min(scenario.baseline_per_look, scenario.canary_per_look)
    return [min(1.0, least * k / REQUESTS_PER_ARM) for k in range(1, LOOKS + 1)]


def pass_rate(scenario: Scenario, trials: int, seed: int, cfg: GatesConfig | None = None) -> tuple[float, float]:
    """(share of runs in which the scenario's gate passes, its simulation SE), through judge_latency."""
    cfg = cfg or GatesConfig()
    rng = np.random.default_rng(seed)
    fractions = information_fractions(scenario)
    passes = 0
    for _ in range(trials):
        level = rng.normal(0.0, scenario.level_sd, LOOKS) if scenario.level_link else None
        baseline = simulate_arm(rng, scenario, False, level)
        canary = simulate_arm(rng, scenario, True, None if level is None else scenario.level_link * level)
        results = judge_latency(baseline, canary, cfg, look=LOOKS, max_looks=LOOKS, information=fractions)
        passes += next(r for r in results if r.name == scenario.gate).verdict.value == "pass"
    rate = passes / trials
    return rate, math.sqrt(max(rate * (1.0 - rate), 1e-12) / trials)


def run(trials: int, seed: int, scenarios: Sequence[Scenario] = SCENARIOS) -> dict:
    cfg = GatesConfig()
    alpha = cfg.alpha
    alpha_se = math.sqrt(alpha * (1 - alpha) / trials)
    rows = []
    for scenario in scenarios:
        started = time.perf_counter()
        # a row's draws depend on its name, not its position: --only reproduces the full table's rows
        rate, se = pass_rate(scenario, trials, seed * 100_003 + zlib.crc32(scenario.name.encode()), cfg)
        if scenario.kind == "error":
            target, ok = f"<= {alpha + 2 * alpha_se:.4f}", rate <= alpha + 2 * alpha_se
        else:
            shown = scenario.gate == "tpot_p50_improvement" and scenario.tpot_ratio <= 0.7
            target, ok = (">= 0.9", rate >= 0.9) if shown else ("(reported)", True)
        rows.append(
            {
                "scenario": scenario.name,
                "gate": scenario.gate,
                "kind": scenario.kind,
                "true_ratio": scenario.ttft_ratio if scenario.gate == "ttft_p95_guard" else scenario.tpot_ratio,
                "pass_rate": rate,
                "se": se,
                "target": target,
                "meets_target": bool(ok),
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    return {"trials": trials, "seed": seed, "alpha": alpha, "alpha_se": alpha_se, "rows": rows}


def format_table(result: dict) -> str:
    lines = [
        f"Latency judge calibration: {result['trials']} runs per row, seed {result['seed']}, alpha {result['alpha']:g} "
        f"(simulation SE at alpha {result['alpha_se']:.4f}); {LOOKS} looks x {REQUESTS_PER_LOOK} requests per arm, information n/{REQUESTS_PER_ARM}",
        f"{'scenario':28} {'gate':22} {'ratio':>6} {'pass rate':>10} {'SE':>7}  {'target':>10}  ok",
    ]
    for row in result["rows"]:
        lines.append(
            f"{row['scenario']:28} {row['gate']:22} {row['true_ratio']:6.2f} {row['pass_rate']:10.4f} {row['se']:7.4f}  "
            f"{row['target']:>10}  {'yes' if row['meets_target'] else 'NO'}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", nargs="*", help="scenario names to run (default: all)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    scenarios = [s for s in SCENARIOS if not args.only or s.name in args.only]
    result = run(args.trials, args.seed, scenarios)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
