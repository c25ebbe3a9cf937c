"""The gate names: what decision.json, the config's `gates.enabled` and every judge call a gate."""

from __future__ import annotations

__all__ = [
    "OBJECTIVE_NAME",
    "GUARDRAIL_NAMES",
    "ACCURACY_NAME",
    "DIVERGENCE_NAME",
    "ACCEPTANCE_NAME",
    "SAMPLE_RATIO_NAME",
    "GOODPUT_NAME",
    "PREFIX_CACHE_NAME",
    "PROFILE_NAME",
    "GATE_NAMES",
    "GATE_PHASES",
    "TWIN_ARM",
]

# the second baseline arm (rollout.config.TWIN, twin_baseline: the A/A noise floor)
TWIN_ARM = "twin"

OBJECTIVE_NAME = "tpot_p50_improvement"
GUARDRAIL_NAMES = ("ttft_p95_guard", "e2e_p95_guard", "error_rate_guard")
ACCURACY_NAME = "accuracy_noninferiority"
DIVERGENCE_NAME = "output_divergence"
ACCEPTANCE_NAME = "acceptance_length_floor"
SAMPLE_RATIO_NAME = "sample_ratio"
# judged only when gates.slo sets a bound; not one of the Holm-adjusted latency guardrails (a family of its own)
GOODPUT_NAME = "goodput_guard"
# judged only when gates.prefix_cache_max_drop is set; a family of its own, as the goodput gate
PREFIX_CACHE_NAME = "prefix_cache_guard"
# judged only when gates.acceptance_profile is set: the canary's acceptance at each draft position
PROFILE_NAME = "acceptance_profile"
GATE_NAMES = (
    OBJECTIVE_NAME, *GUARDRAIL_NAMES, ACCURACY_NAME, DIVERGENCE_NAME, ACCEPTANCE_NAME, SAMPLE_RATIO_NAME, GOODPUT_NAME,
    PREFIX_CACHE_NAME, PROFILE_NAME,
)

# the run phase (rollout.config section) whose data judges each gate: with that phase
# disabled the gate cannot be judged, so the run cannot promote while the gate is enabled
GATE_PHASES = {
    OBJECTIVE_NAME: "experiment",
    **{name: "experiment" for name in GUARDRAIL_NAMES},
    ACCEPTANCE_NAME: "experiment",
    SAMPLE_RATIO_NAME: "experiment",
    GOODPUT_NAME: "experiment",
    PREFIX_CACHE_NAME: "experiment",
    PROFILE_NAME: "experiment",
    ACCURACY_NAME: "accuracy",
    DIVERGENCE_NAME: "accuracy",
}
