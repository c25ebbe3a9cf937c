"""The speculative-decoding gate: a floor on the canary's mean acceptance length, judged on confidence bounds.

`judge_acceptance(delta, cfg, ...)` judges the canary's spec-decode counters
(``cluster.metrics.SpecDecodeStats``: drafts D, draft tokens, accepted tokens,
accepted per position) against ``min_acceptance_length``. `acceptance_sd` (the
spread of accepted tokens per draft, from the per-position counters) is shared
with the progressive phase's guard (``rollout.judge.guards``).

Why bounds and not the point value: a canary whose true acceptance length sits
at the floor shows a mean above it half the time; judged as a number it would
promote at 50%, not at alpha.

Why the bounds are clustered by request: drafts of one request are not
independent (a hard prompt accepts less in every step), so the spread of
accepted tokens per draft over sqrt(D) understates the error by the design
effect: with per-prompt rates spread as a Beta of concentration 4 around the
floor, a canary exactly at the floor passed ~0.3-0.4 of the time with that SE.
The unit is the request: with request i's verify steps d_i and accepted
tokens a_i, the length is 1 + R, R = sum a_i / sum d_i (what the server's
counters give), and R's linearised (cluster-robust) variance is

    n / (n - 1) * sum (a_i - R d_i)^2 / (sum d_i)^2,

the bounds 1 + R -+ t * se with t the look's critical value at ``alpha``
(one-sided, group-sequential like every other gate) on n - 1 degrees of
freedom. The per-request counters come from the requests themselves
(``rollout.judge.request_acceptance``: the servers' per-request metrics);
server counters alone (a /metrics delta, no requests) never PASS: nothing in
them bounds the design effect. They still say the point value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cluster.metrics import SpecDecodeStats
from rollout.judge.config import GatesConfig
from rollout.judge.looks import finite_or_none, interval_or_none, resolve_information, t_critical, z
from rollout.judge.names import ACCEPTANCE_NAME
from rollout.judge.request_acceptance import RequestSpecDecodeStats
from rollout.judge.verdicts import GateResult, Verdict

__all__ = ["MIN_DRAFTS", "MIN_REQUESTS", "acceptance_sd", "acceptance_bounds", "clustered_se", "judge_acceptance"]

MIN_DRAFTS = 20  # fewer drafts: the normal approximation of the mean is not trusted, nothing is judged
MIN_REQUESTS = 20  # fewer requests (clusters): their spread is no estimate of the variance


def acceptance_sd(delta: SpecDecodeStats) -> float:
    """Standard deviation of accepted tokens per draft, from the per-position counters."""
    drafts = delta.drafts
    per_pos = list(delta.accepted_per_position)
    if per_pos and sum(per_pos) > 0 and abs(sum(per_pos) - delta.accepted_tokens) <= 0.5 + 1e-6 * delta.accepted_tokens:
        tail = [min(1.0, max(0.0, a / drafts)) for a in per_pos]  # P(A >= i), i = 1..k
        mean = sum(tail)
        second = sum((2 * i + 1) * t for i, t in enumerate(tail))  # E[A^2] = sum (2i - 1) P(A >= i)
        return math.sqrt(max(0.0, second - mean * mean))
    # No usable profile: the largest variance a value in [0, k] can have.
    k = delta.draft_tokens / drafts if drafts > 0 else 1.0
    return k / 2.0


def clustered_se(per_request: Sequence[tuple[float, float]]) -> tuple[float, float, int]:
    """(R, se of R, requests) for R = sum accepted / sum drafts over requests given as (drafts, accepted):
    the ratio estimator's linearised variance with requests as clusters (nan where no drafts)."""
    counts = np.asarray(per_request, dtype=float).reshape(-1, 2)
    counts = counts[counts[:, 0] > 0]  # a request without a verify step adds nothing to either sum
    n = counts.shape[0]
    total = counts[:, 0].sum()
    if n < 2 or total <= 0:
        return (math.nan, math.nan, n)
    ratio = counts[:, 1].sum() / total
    residual = counts[:, 1] - ratio * counts[:, 0]
    return (float(ratio), float(math.sqrt(n / (n - 1) * float(residual @ residual)) / total), n)


def acceptance_bounds(delta: RequestSpecDecodeStats, crit_lower: float, crit_upper: float) -> tuple[float, float]:
    """(lower, upper) request-clustered bounds of the mean acceptance length at critical values
    crit_lower / crit_upper (already on the requests' degrees of freedom)."""
    ratio, se, _ = clustered_se(delta.per_request)
    if not math.isfinite(ratio):
        return (math.nan, math.nan)
    return (1.0 + ratio - crit_lower * se, 1.0 + ratio + crit_upper * se)


def judge_acceptance(
    delta: SpecDecodeStats | None,
    cfg: GatesConfig,
    look: int = 1,
    max_looks: int | None = 1,
    information: Sequence[float] | None = None,
) -> GateResult:
    """Floor on the canary's mean acceptance length (gate ``acceptance_length_floor``).

    * PASS: the lower bound (level ``alpha`` at this look) is at or above the floor;
    * FAIL: the upper bound (level ``alpha``) is below the floor;
    * INCONCLUSIVE otherwise, and when ``delta`` is None (not measured), has no
      drafts, fewer than ``MIN_DRAFTS`` drafts or ``MIN_REQUESTS`` requests, or
      carries no per-request counters (server counters alone: never a pass).

    Whether zero drafts on a speculative canary is itself a failure is the
    controller's call (it knows the engine config). ``look``/``max_looks``/
    ``information`` as for the latency judge; the default is one analysis.
    """
    floor = cfg.min_acceptance_length
    mean = delta.mean_acceptance_length if delta is not None else None
    drafts = int(delta.drafts) if delta is not None else 0
    common = dict(
        name=ACCEPTANCE_NAME,
        metric="mean_acceptance_length",
        baseline=None,
        canary=finite_or_none(mean),
        threshold=floor,
        n_baseline=0,
        n_canary=drafts,
        estimate=finite_or_none(mean),
        look=look,
    )
    if floor is None:
        return GateResult(**common, verdict=Verdict.PASS, detail="Acceptance-length floor disabled (min_acceptance_length is null).")
    if delta is None:
        return GateResult(**common, verdict=Verdict.INCONCLUSIVE, detail="Canary acceptance not measured (no spec-decode counters): cannot pass.")
    if mean is None or not math.isfinite(mean):
        return GateResult(**common, verdict=Verdict.INCONCLUSIVE, detail="The canary made no drafts: no acceptance length to judge.")
    per_request = getattr(delta, "per_request", ())
    if not isinstance(delta, RequestSpecDecodeStats) or not per_request:
        return GateResult(**common, verdict=Verdict.INCONCLUSIVE, detail=(
            f"Mean acceptance length {mean:.3f} over {drafts} drafts from server counters only: without each "
            "request's own counters (engine.per_request_spec_decode_metrics) no interval is valid (drafts of one "
            "request are correlated), so the floor cannot pass."))
    boundary_look, planned, note, fractions = resolve_information(look, max_looks, cfg, information)
    crit_z = z(cfg.alpha, boundary_look, planned, cfg, fractions)
    _, se, requests = clustered_se(per_request)
    crit = t_critical(crit_z, requests - 1) if requests >= 2 else math.inf
    lower, upper = acceptance_bounds(delta, crit, crit)
    text = (
        f"Mean acceptance length {mean:.3f} over {drafts} drafts of {requests} requests, request-clustered bounds "
        f"[{lower:.3f}, {upper:.3f}] (se {se:.4f}, t={crit:.3f} on {requests - 1} df at z={crit_z:.3f}, alpha "
        f"{cfg.alpha:g} each side, look {boundary_look}/{planned}), floor {floor:g}"
    )
    result = dict(common, interval=interval_or_none(lower, upper))
    if drafts < MIN_DRAFTS or requests < MIN_REQUESTS:
        return GateResult(**result, verdict=Verdict.INCONCLUSIVE,
                          detail=f"{text}: fewer than {MIN_DRAFTS} drafts or {MIN_REQUESTS} requests.{note}")
    if lower >= floor:
        return GateResult(**result, verdict=Verdict.PASS, detail=f"{text}: lower bound clears the floor.{note}")
    if upper < floor:
        return GateResult(**result, verdict=Verdict.FAIL, detail=f"{text}: upper bound below the floor.{note}")
    return GateResult(**result, verdict=Verdict.INCONCLUSIVE, detail=f"{text}: the interval holds the floor.{note}")
