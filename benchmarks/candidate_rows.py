"""calibrate's several-candidates rows alone (rollout.calibration.calibrate.CANDIDATE_ROWS), without the rest of the table:

    python benchmarks/candidate_rows.py TRIALS [--workers W] [--seed S]

Every candidate exactly at the objective's bar; prints, per (K, scenario), P(a winner is named) with each
candidate judged at alpha / K (the rule) and at the whole alpha (unadjusted), and the bound alpha + 2 SE.
The trials are calibrate's own (same seeds, same keys), so `mtp-canary calibrate --trials TRIALS --seed S`
prints the same rates in its "Several candidates" table."""

from __future__ import annotations

import argparse
import math
import multiprocessing
import time

from rollout.calibration import calibrate as c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trials", type=int)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    design = c.default_design()
    sets = {key: spec for key, spec in c.trial_sets(design).items() if key.startswith("candidates/")}
    alpha = design.gates.alpha
    bound = alpha + 2 * math.sqrt(alpha * (1 - alpha) / args.trials)
    print(f"{args.trials} trials per row, seed {args.seed}, alpha {alpha:g}, alpha + 2 SE = {bound:.4f}", flush=True)
    started = time.time()
    with multiprocessing.get_context().Pool(args.workers, initializer=c._init_worker, initargs=(design,)) as pool:
        for key, spec in sets.items():
            outcomes = [o for _, chunk in pool.imap(c._run_chunk, c._chunks({key: spec}, args.trials, args.seed))
                        for o in chunk]
            split = sum(o.decision == "promote" for o in outcomes) / len(outcomes)
            whole = sum(o.unadjusted_decision == "promote" for o in outcomes) / len(outcomes)
            _, count, scenario = key.split("/")
            print(f"K={count} {scenario:<16} false promote {split:.4f}  unadjusted {whole:.4f}  "
                  f"({time.time() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
