"""Error rates and power of the per-position acceptance gate (gates.acceptance_profile) under per-prompt acceptance.

`python benchmarks/position_acceptance.py [--plan demo|gpu] [--trials N] [--seed S]`

Each request draws its own conditional acceptance rate at every draft position from a Beta of
concentration 4 around the canary's means (rollout.calibration.scenarios.spec_decode_by_profile),
the means solved so that what the server's counters converge to (accepted at position i over
verify steps) is exactly the row's target (conditional_means_for_profile). The canary's requests
reach the gate in look order; every look judges all requests so far at the plan's information
fraction (judge_profile_of_counters, as experiment_looks.judge_look calls it). A trial counts a
PASS or a FAIL at any look (the gate alone, before any other gate could stop the phase: the
conservative count). Profile 0.90 / 0.70 / 0.50 (k=3), margin 0.10, alpha 0.05.

Plans: demo = configs/local-cpu.yaml (600 requests per arm in looks of 40, 16 output tokens);
gpu = configs/mimo-v2.5-mtp.yaml (2,400 per arm in 6 looks of 400, 512 output tokens).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from rollout.calibration.scenarios import conditional_means_for_profile, spec_decode_by_profile
from rollout.judge.config import GatesConfig
from rollout.judge.position_acceptance import judge_profile_of_counters
from rollout.judge.request_acceptance import spec_decode_of_counts
from rollout.judge.verdicts import Verdict

PROFILE = (0.90, 0.70, 0.50)
MARGIN = 0.10
CONCENTRATION = 4.0
PLANS = {"demo": (40, 600, 16), "gpu": (400, 2400, 512)}  # requests per look, per arm, output tokens
# the truth's quasi-random draws: 512-token requests make each one 30x dearer, and 4,096 Sobol points
# already put the counters' limit within ~1e-4 of the target
TRUTH_DRAWS = {16: 1 << 14, 512: 1 << 12}


def trial_verdicts(rng: np.random.Generator, means: np.ndarray, plan: tuple[int, int, int], cfg: GatesConfig) -> set[str]:
    """Verdicts the gate gave at any look of one trial."""
    per_look, per_arm, tokens = plan
    looks = math.ceil(per_arm / per_look)
    drafts, accepted = spec_decode_by_profile(rng, per_arm, tokens, means, CONCENTRATION)
    seen = set()
    for look in range(1, looks + 1):
        end = min(look * per_look, per_arm)
        spec = spec_decode_of_counts(drafts[:end], accepted[:end])
        gate = judge_profile_of_counters(spec, True, cfg, look=look, max_looks=looks,
                                         information=[min(1.0, i * per_look / per_arm) for i in range(1, look + 1)])
        seen.add(gate.verdict.value)
        if gate.verdict is not Verdict.INCONCLUSIVE:
            break
    return seen


def rate(target: tuple[float, ...], plan: tuple[int, int, int], trials: int, seed: int, verdict: str) -> tuple[float, float]:
    """(share of trials with ``verdict`` at some look, its standard error)."""
    cfg = GatesConfig(acceptance_profile=list(PROFILE), acceptance_profile_margin=MARGIN, alpha=0.05)
    means = conditional_means_for_profile(np.array(target), CONCENTRATION, plan[2], draws=TRUTH_DRAWS.get(plan[2], 1 << 14))
    rng = np.random.default_rng(seed)
    hits = sum(verdict in trial_verdicts(rng, means, plan, cfg) for _ in range(trials))
    share = hits / trials
    return share, math.sqrt(max(share * (1 - share), 1e-12) / trials)


def dropped(drop: float) -> tuple[float, ...]:
    """Position 2 at 0.70 - drop, position 3 following it (its conditional rate unchanged)."""
    second = PROFILE[1] - drop
    return (PROFILE[0], second, PROFILE[2] * second / PROFILE[1])


def detectable_drop(plan: tuple[int, int, int], trials: int, seed: int, power: float = 0.8) -> float:
    """The drop of position 2 below its profile (position 3 following) that fails with ``power``: bisection."""
    low, high = MARGIN, 0.5
    for _ in range(7):
        mid = (low + high) / 2
        if rate(dropped(mid), plan, trials, seed, "fail")[0] >= power:
            high = mid
        else:
            low = mid
    return (low + high) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", choices=sorted(PLANS), default="demo")
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    plan = PLANS[args.plan]
    rows = [
        ("false PASS: position 1 at profile - margin", (0.80, 0.70, 0.50), "pass"),
        ("false PASS: position 2 at profile - margin", (0.90, 0.60, 0.50), "pass"),
        ("false PASS: position 3 at profile - margin", (0.90, 0.70, 0.40), "pass"),
        ("false FAIL: A/A at the profile", PROFILE, "fail"),
        ("false FAIL: every position at profile - margin", (0.80, 0.60, 0.40), "fail"),
        ("power: layer-0 reuse 0.88 / 0.18 / 0.03", (0.88, 0.18, 0.03), "fail"),
    ]
    print(f"plan {args.plan}: {plan[1]} requests per arm, looks of {plan[0]}, {plan[2]} output tokens; "
          f"profile {PROFILE} margin {MARGIN}, Beta concentration {CONCENTRATION}, {args.trials} trials", flush=True)
    for name, target, verdict in rows:
        started = time.time()
        share, se = rate(target, plan, args.trials, args.seed, verdict)
        print(f"{name:50s} {share:.4f} (SE {se:.4f}; {time.time() - started:.0f} s)", flush=True)
    drop = detectable_drop(plan, max(args.trials // 4, 100), args.seed)
    print(f"{'detectable drop of position 2 at 80% power':50s} {drop:.3f} (0.70 -> {PROFILE[1] - drop:.3f})", flush=True)


if __name__ == "__main__":
    main()
