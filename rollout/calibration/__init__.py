"""Calibration: the judge's error rates measured by simulation, through the judge's own functions.

`scenarios` builds the simulated worlds (including those built to break the estimators:
dependence across looks, warm-up, error bursts), `trial` runs one simulated experiment, and
`calibrate` (`mtp-canary calibrate`) runs many and writes the table. Kept out of the pure
`rollout.judge` package: it owns processes, files and a command line.
"""
