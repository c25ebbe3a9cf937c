"""The noise_floor rows of calibrate alone (aa_placement_0.95/0.8, twin_power_0.7), quickly:
`python benchmarks/noise_floor_rows.py TRIALS` (prints each row's objective pass rate)."""
import sys, time
from rollout.calibration import calibrate as c
from rollout.judge.names import OBJECTIVE_NAME
d = c.default_design()
specs = c._noise_floor_specs(d)
n = int(sys.argv[1])
for name in ("aa_placement_0.95", "aa_placement_0.8", "twin_power_0.7"):
    t = time.time(); hits = 0
    for i in range(n):
        o = c.simulate_trial(d, specs[name], c._trial_rng(0, "noise_floor/" + name, i))
        hits += o.verdicts.get(OBJECTIVE_NAME) == "pass"
    print(name, "objective pass rate", hits / n, f"({n} trials, {time.time()-t:.0f} s)", flush=True)
