"""The weight hook: the command that moves real traffic each time the run sets the canary's weight.

The run's router splits only the run's own load. Where production traffic reaches the arms
through something else (a mesh's VirtualService, a gateway, an llm-d route: Argo Rollouts'
and Flagger's traffic routing), `weight_hook.command` is run with every weight the run sets
(progressive steps, the promotion's 100, a rollback's 0), after the router has it. No shell:
the argv's `{weight}`, `{run_id}` and `{phase}` are replaced, and the environment carries the
same as MTP_CANARY_*. A hook that fails or overruns raises `WeightHookError`: the run cannot
know where the traffic is, so it ends as an infrastructure error (never a verdict).

What a hook prints is not logged: a `kubectl` or `curl` may echo a token. Its exit status and
how long it took are.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass

from rollout.config import WeightHookConfig


class WeightHookError(RuntimeError):
    """The hook did not confirm the weight (it exited non-zero, overran or could not start)."""


@dataclass(frozen=True)
class WeightCall:
    """One call of the hook: what it was asked and how it ended."""

    weight: float
    phase: str
    seconds: float
    exit_code: int


def weight_text(weight: float) -> str:
    """'10', '12.5': a percentage as a hook's argument (no trailing .0)."""
    return f"{weight:g}"


def hook_argv(hook: WeightHookConfig, weight: float, run_id: str, phase: str) -> list[str]:
    values = {"weight": weight_text(weight), "run_id": run_id, "phase": phase}
    # str.replace, not str.format: an argument with other braces (a JSON patch) stays as written
    argv = []
    for arg in hook.command:
        for key, value in values.items():
            arg = arg.replace("{" + key + "}", value)
        argv.append(arg)
    return argv


def call_weight_hook(hook: WeightHookConfig, weight: float, run_id: str, phase: str, reason: str) -> WeightCall:
    """Run the hook once for `weight` (0-100); raise WeightHookError unless it exits 0 in time."""
    env = {
        **os.environ,
        "MTP_CANARY_WEIGHT": weight_text(weight),
        "MTP_CANARY_RUN_ID": run_id,
        "MTP_CANARY_PHASE": phase,
        "MTP_CANARY_REASON": reason,
    }
    name = os.path.basename(hook.command[0])
    t0 = time.monotonic()
    try:
        done = subprocess.run(hook_argv(hook, weight, run_id, phase), env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=hook.timeout_s)
    except subprocess.TimeoutExpired:
        raise WeightHookError(f"weight_hook ({name}) did not finish within {hook.timeout_s:g} s "
                              f"(weight_hook.timeout_s) for weight {weight_text(weight)}%") from None
    except OSError as exc:
        raise WeightHookError(f"weight_hook ({name}) could not start: {exc.strerror or exc}") from None
    seconds = time.monotonic() - t0
    if done.returncode != 0:
        raise WeightHookError(f"weight_hook ({name}) exited {done.returncode} for weight {weight_text(weight)}%")
    return WeightCall(weight=weight, phase=phase, seconds=seconds, exit_code=done.returncode)
