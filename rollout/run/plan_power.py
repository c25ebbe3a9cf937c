"""The run config as `rollout.judge.power` reads it: the plan whose detectable effects `plan` and the run state.

The judge is pure (numbers in, numbers out); this is where a RolloutConfig becomes its `PowerPlan`
(the gates at alpha / K with K candidates, the items the accuracy phase will judge, the experiment's
planned requests and looks). `rollout.commands.plan` and the run's first phase both read it here.
"""

from __future__ import annotations

from pathlib import Path

from rollout.judge.candidates import candidate_gates
from rollout.judge.power import PowerPlan

__all__ = ["GOLDEN_DISCORDANCE", "eval_items", "power_plan"]

GOLDEN_DISCORDANCE = 0.005  # the power figures' allowance for a golden set's arms disagreeing with no true change


def eval_items(spec) -> int | None:
    """How many paired items the accuracy phase will judge (None: unknown before the engines exist, a tiny
    model's own golden set without a limit)."""
    from rollout.evals import GSM8K_TEST

    path = Path(spec.path) if spec.path else (GSM8K_TEST if spec.kind == "gsm8k" else None)
    try:
        lines = sum(1 for line in path.open(encoding="utf-8") if line.strip()) if path is not None else None
    except OSError:  # the accuracy phase says what is wrong with the file
        lines = None
    if spec.limit is not None:
        return min(spec.limit, lines) if lines is not None else spec.limit
    return lines


def power_plan(cfg) -> PowerPlan:
    """The plan `rollout.judge.power` reads: the gates (at alpha / K with K candidates, as each is judged),
    the accuracy phase's items and the experiment's judged requests per arm, looks and output tokens."""
    arms = list(cfg.candidates) or [cfg.canary]
    exp = cfg.experiment
    return PowerPlan(
        gates=candidate_gates(cfg.gates, len(arms)),
        eval_items=eval_items(cfg.accuracy) if cfg.accuracy.enabled else None,
        requests_per_arm=exp.requests_per_arm if exp.enabled else None,
        planned_looks=exp.planned_looks,
        output_tokens=exp.max_tokens,
        speculative_tokens=min(arm.engine.num_speculative_tokens for arm in arms),
        # greedy outputs of a golden set agree unless the canary breaks them (tiny model: exactly); gsm8k on a
        # real model: the calibration's 3%
        discordance=GOLDEN_DISCORDANCE if cfg.accuracy.kind == "golden" else None,
    )
