"""The gate names: what decision.json, the config's `gates.enabled` and every judge call a gate."""

from __future__ import annotations

__all__ = ["OBJECTIVE_NAME", "GUARDRAIL_NAMES", "ACCURACY_NAME", "DIVERGENCE_NAME", "ACCEPTANCE_NAME", "GATE_NAMES"]

OBJECTIVE_NAME = "tpot_p50_improvement"
GUARDRAIL_NAMES = ("ttft_p95_guard", "e2e_p95_guard", "error_rate_guard")
ACCURACY_NAME = "accuracy_noninferiority"
DIVERGENCE_NAME = "output_divergence"
ACCEPTANCE_NAME = "acceptance_length_floor"
GATE_NAMES = (OBJECTIVE_NAME, *GUARDRAIL_NAMES, ACCURACY_NAME, DIVERGENCE_NAME, ACCEPTANCE_NAME)
