"""The cluster plan's defaults that a command shows in its --help: one definition, read by the plan
(rollout.run.cluster_plan) and by `mtp-canary plan`'s arguments. Imports nothing, so a command's
--help does not load the plan, Ray or an engine to show them."""

PLACEMENT_PROBE_S = 10.0  # how long the plan waits for its trial placement group
