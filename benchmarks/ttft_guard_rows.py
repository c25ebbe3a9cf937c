"""The TTFT p95 guard alone, in every latency world calibrate simulates, at its limit and with nothing changed:

    python benchmarks/ttft_guard_rows.py TRIALS [--workers W] [--seed S] [--scenarios iid opposed_level_0.10 ...]

Per world (rollout.calibration.scenarios.LATENCY_SCENARIOS), two sets of calibrate's own trials of the demo's design
(configs/local-cpu.yaml: 10 looks of 40 per arm, cap 3.5): the canary's TTFT exactly at the cap (TPOT ratio 0.7,
so the objective passes and the run goes on), where P(guard PASS) is a false pass (target <= alpha + 2 SE), and
TTFT unchanged, where P(guard PASS) is the guard's power (PROMOTE needs it). The guard's design effects are
largest where an arm's requests share a level per look (arm_level, opposed_level): there its rank band reaches
past the sample most often. The trials are calibrate's (same keys and seeds where calibrate has the set), so
another judge can be measured on the same draws: ``git archive HEAD~1 rollout loadtests cluster tinymodel |
tar -x -C /tmp/old && PYTHONPATH=/tmp/old python benchmarks/ttft_guard_rows.py ...``."""

from __future__ import annotations

import argparse
import math
import multiprocessing
import time

from rollout.calibration import calibrate as c
from rollout.calibration.scenarios import LATENCY_SCENARIOS, TrialSpec

GATE = "ttft_p95_guard"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trials", type=int)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scenarios", nargs="*", default=list(LATENCY_SCENARIOS))
    args = parser.parse_args()
    design = c.default_design()
    cap = design.gates.ttft_p95_max_ratio
    alpha = design.gates.alpha
    bound = alpha + 2 * math.sqrt(alpha * (1 - alpha) / args.trials)
    print(f"{args.trials} trials per row, seed {args.seed}, cap {cap:g}, alpha {alpha:g}, alpha + 2 SE = {bound:.4f}",
          flush=True)
    started = time.time()
    with multiprocessing.get_context().Pool(args.workers, initializer=c._init_worker, initargs=(design,)) as pool:
        for scenario in args.scenarios:
            rates = {}
            for label, ttft in (("at_cap", cap), ("unchanged", 1.0)):
                key = f"ttft_guard/{scenario}/{label}"
                spec = TrialSpec(scenario=scenario, tpot_ratio=c.PASSING_TPOT_RATIO, ttft_ratio=ttft)
                outcomes = [o for _, chunk in pool.imap(c._run_chunk, c._chunks({key: spec}, args.trials, args.seed))
                            for o in chunk]
                passed = sum(o.verdicts.get(GATE) == "pass" for o in outcomes) / len(outcomes)
                rates[label] = passed
            print(f"{scenario:<20} false pass at the cap {rates['at_cap']:.4f}  power unchanged {rates['unchanged']:.4f}  "
                  f"({time.time() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
