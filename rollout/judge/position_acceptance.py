"""The per-position acceptance gate: the canary's acceptance at each draft position against an expected profile.

`judge_acceptance_profile(per_request_position_counts, profile, margin, cfg, ...)` judges the
canary's acceptance rate at draft positions 1..k against ``gates.acceptance_profile`` less
``gates.acceptance_profile_margin`` (gate ``acceptance_profile``); `judge_profile_of_counters`
reads the counters a look carries (``rollout.judge.request_acceptance.RequestSpecDecodeStats``)
and says what the gate makes of a canary that does not speculate, was not measured, or made no
drafts.

What it catches: a mean acceptance length can sit above its floor while one position collapses.
vLLM runs MiMo's MTP layer 0 for every draft step, so position 1 accepts as trained and later
positions far less (MiMo-7B, k=2: 0.88 then 0.18, vLLM PR #25136); a checkpoint whose MTP layers
load into the wrong slots shows the same shape. The detail names the position.

The estimate, per position i (as vLLM counts ``accepted_tokens_per_pos``): with request r's verify
steps d_r and its steps that accepted position i a_ri, p_i = sum_r a_ri / sum_r d_r, the share of
verify steps that accepted position i. Its variance is the ratio estimator's, linearised with
requests as clusters (a hard prompt accepts less at every position of every step), exactly as the
acceptance-length floor's (``rollout.judge.acceptance.clustered_se``); the bounds are one-sided at
the look's group-sequential critical value on requests - 1 degrees of freedom, widened on the side
the residuals' skewness makes heavy (`residual_skewness`). Why: per-prompt rates pile up near 1
with a tail of hard prompts, so the residuals are left-skewed, a sample short of hard prompts shows
a high rate and a small se together, and a lower bound at t alone passed a canary exactly at the
threshold 0.069 of the time (SE 0.008, 1,000 simulated demo runs, position 1 at 0.80): the
Edgeworth term of the studentized mean (Hall 1992) restores the level. It only ever widens.

Several positions, one gate:

* FAIL when any judged position's upper bound is below profile_i - margin, each upper bound at
  alpha / m (Bonferroni over the m judged positions): a canary at or above the threshold at every
  position fails at some position with probability at most the sum of the m one-sided errors,
  alpha, whatever the dependence between positions (they share the requests, and a later position
  is accepted only where the earlier ones were, so they are strongly dependent).
* PASS when every judged position's lower bound is at or above profile_i - margin, each at alpha
  unadjusted: an intersection-union test. The null of PASS is "some position is below its
  threshold", a union; a canary below the threshold at position j passes only if position j's own
  bound clears it, which happens with probability at most alpha. No multiplicity price is owed, so
  the pass side keeps the power of one position.
* INCONCLUSIVE otherwise, with fewer than ``MIN_DRAFTS`` drafts or ``MIN_REQUESTS`` requests, and
  on server counters alone (a /metrics delta has no per-request counters: no valid interval, never
  a pass; its point values are said).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cluster.metrics import SpecDecodeStats
from rollout.judge.acceptance import MIN_DRAFTS, MIN_REQUESTS, clustered_se
from rollout.judge.config import GatesConfig
from rollout.judge.looks import finite_or_none, resolve_information, t_critical, z
from rollout.judge.names import PROFILE_NAME
from rollout.judge.request_acceptance import RequestSpecDecodeStats
from rollout.judge.verdicts import GateResult, Verdict

__all__ = ["PositionBound", "judge_acceptance_profile", "judge_profile_of_counters", "position_bounds",
           "residual_skewness"]

METRIC = "position_acceptance_rate"


@dataclass(frozen=True)
class PositionBound:
    """One draft position's acceptance rate with its one-sided bounds (``lower`` at the pass side's level,
    ``upper`` at the fail side's) and the threshold (profile - margin) it is judged against."""

    position: int  # 1-based, as vLLM numbers draft positions in its detail logs
    estimate: float
    lower: float
    upper: float
    threshold: float
    profile: float

    def text(self, margin: float) -> str:
        return (f"position {self.position} accepts {self.estimate:.2f} [{self.lower:.2f}, {self.upper:.2f}], "
                f"profile {self.profile:.2f} - margin {margin:.2f}")


def position_bounds(
    per_request_position_counts: Sequence[tuple[float, Sequence[float]]],
    profile: Sequence[float],
    margin: float,
    crit_pass: float,
    crit_fail: float,
) -> list[PositionBound]:
    """Every judged position's bounds: positions 1..min(k, len(profile)), ``crit_pass`` / ``crit_fail`` the
    z critical values of the lower / upper bounds (turned to t on the requests' degrees of freedom here)."""
    steps = np.asarray([float(d) for d, _ in per_request_position_counts], dtype=float)
    k = max((len(a) for _, a in per_request_position_counts), default=0)
    accepted = np.zeros((steps.size, k))
    for r, (_, positions) in enumerate(per_request_position_counts):
        accepted[r, : len(positions)] = positions
    out = []
    for i in range(min(k, len(profile))):
        ratio, se, requests = clustered_se(np.column_stack([steps, accepted[:, i]]))
        skew = residual_skewness(steps, accepted[:, i], ratio)
        t_pass = _widened(t_critical(crit_pass, requests - 1) if requests >= 2 else math.inf, -skew, requests)
        t_fail = _widened(t_critical(crit_fail, requests - 1) if requests >= 2 else math.inf, skew, requests)
        out.append(PositionBound(position=i + 1, estimate=ratio, lower=ratio - t_pass * se, upper=ratio + t_fail * se,
                                 threshold=float(profile[i]) - margin, profile=float(profile[i])))
    return out


def residual_skewness(steps: np.ndarray, accepted: np.ndarray, ratio: float) -> float:
    """Skewness of the requests' linearised residuals a_r - R d_r (requests with a verify step): what makes the
    studentized ratio's two tails unequal (0 where it cannot be estimated)."""
    live = steps > 0
    residual = accepted[live] - ratio * steps[live]
    second = float(np.mean(residual**2)) if residual.size else 0.0
    if residual.size < 3 or not math.isfinite(ratio) or second <= 0.0:
        return 0.0
    return float(np.mean(residual**3)) / second**1.5


def _widened(t: float, heavy_tail_skew: float, requests: int) -> float:
    """The critical value ``t`` widened by the studentized mean's Edgeworth term (Hall 1992, Johnson 1978) on the
    side whose tail the skewness makes heavy: P(T > x) = 1 - Phi(x) - skew (2x^2 + 1) phi(x) / (6 sqrt(n)), so a
    left-skewed residual (rates piled near 1, a tail of hard prompts) makes high estimates with small se too
    likely and a lower bound at t alone passes too often. Only ever widened: a noisy skewness cannot narrow it."""
    if not math.isfinite(t) or requests < 2 or heavy_tail_skew <= 0.0:
        return t
    return t + heavy_tail_skew * (2.0 * t * t + 1.0) / (6.0 * math.sqrt(requests))


def _coverage_note(profile: Sequence[float], k: int) -> str:
    if len(profile) > k:
        return f" The profile gives {len(profile)} positions, the canary drafts {k}: the first {k} are judged."
    if len(profile) < k:
        return f" The canary drafts {k} positions, the profile gives {len(profile)}: those are judged."
    return ""


def _result(common: dict, verdict: Verdict, detail: str, deciding: PositionBound | None = None) -> GateResult:
    if deciding is None:
        return GateResult(**common, verdict=verdict, detail=detail)
    interval = (deciding.lower, deciding.upper) if math.isfinite(deciding.lower + deciding.upper) else None
    return GateResult(**{**common, "canary": finite_or_none(deciding.estimate), "estimate": finite_or_none(deciding.estimate),
                         "threshold": deciding.threshold}, interval=interval, verdict=verdict, detail=detail)


def judge_acceptance_profile(
    per_request_position_counts: Sequence[tuple[float, Sequence[float]]] | None,
    profile: Sequence[float] | None,
    margin: float,
    cfg: GatesConfig,
    look: int = 1,
    max_looks: int | None = 1,
    information: Sequence[float] | None = None,
    server: SpecDecodeStats | None = None,
) -> GateResult:
    """Gate ``acceptance_profile`` on each request's (verify steps, accepted tokens at positions 1..k).

    ``per_request_position_counts`` None or empty: no per-request counters (``server``, when given, the
    server's counters, whose point values the detail says): never a pass. The returned numbers
    (estimate, interval, threshold) are the deciding position's: the failing one with the lowest
    upper bound on FAIL, else the one closest to (or furthest below) its threshold.
    """
    counts = list(per_request_position_counts or ())
    drafts = int(sum(d for d, _ in counts)) if counts else int(server.drafts) if server is not None else 0
    common = dict(name=PROFILE_NAME, metric=METRIC, baseline=None, canary=None, threshold=None, n_baseline=0,
                  n_canary=drafts, look=look)
    if profile is None:
        return _result(common, Verdict.PASS, "Per-position acceptance gate disabled (acceptance_profile is null).")
    if not counts:
        return _result(common, Verdict.INCONCLUSIVE, _server_only_text(server, profile))
    boundary_look, planned, note, fractions = resolve_information(look, max_looks, cfg, information)
    k = max(len(a) for _, a in counts)
    judged = min(k, len(profile))
    if judged == 0:
        return _result(common, Verdict.INCONCLUSIVE, "The canary's counters carry no draft position: nothing to judge.")
    crit_pass = z(cfg.alpha, boundary_look, planned, cfg, fractions)
    crit_fail = z(cfg.alpha / judged, boundary_look, planned, cfg, fractions)
    bounds = position_bounds(counts, profile, margin, crit_pass, crit_fail)
    requests = sum(1 for d, _ in counts if d > 0)
    fail_level = f"alpha {cfg.alpha:g}/{judged} over the positions" if judged > 1 else f"alpha {cfg.alpha:g}"
    head = (f"Acceptance by draft position over {drafts} verify steps of {requests} requests, request-clustered "
            f"(lower bounds at alpha {cfg.alpha:g}, upper at {fail_level}, look {boundary_look}/{planned})")
    coverage = _coverage_note(profile, k) + note
    failing = [b for b in bounds if b.upper < b.threshold]
    closest = min(bounds, key=lambda b: b.lower - b.threshold)
    if drafts < MIN_DRAFTS or requests < MIN_REQUESTS:
        return _result(common, Verdict.INCONCLUSIVE, f"{head}: fewer than {MIN_DRAFTS} drafts or {MIN_REQUESTS} "
                       f"requests; {'; '.join(b.text(margin) for b in bounds)}.{coverage}", closest)
    if failing:
        worst = min(failing, key=lambda b: b.upper - b.threshold)
        return _result(common, Verdict.FAIL, f"{head}: {'; '.join(b.text(margin) for b in failing)}: upper bound "
                       f"below the profile less the margin.{coverage}", worst)
    if all(b.lower >= b.threshold for b in bounds):
        return _result(common, Verdict.PASS, f"{head}: every position's lower bound clears the profile less the "
                       f"margin; the closest, {closest.text(margin)}.{coverage}", closest)
    open_ = [b for b in bounds if b.lower < b.threshold]
    return _result(common, Verdict.INCONCLUSIVE, f"{head}: {'; '.join(b.text(margin) for b in open_)}: the interval "
                   f"holds the profile less the margin.{coverage}", closest)


def _server_only_text(server: SpecDecodeStats | None, profile: Sequence[float]) -> str:
    if server is None or server.drafts <= 0:
        return "Canary acceptance by position not measured (no spec-decode counters): cannot pass."
    rates = ", ".join(f"position {i + 1} {a / server.drafts:.2f} (profile {p:.2f})"
                      for i, (a, p) in enumerate(zip(server.accepted_per_position, profile)))
    return (f"Acceptance by position from server counters only ({server.drafts:.0f} verify steps: {rates or 'none'}): "
            "without each request's own counters (engine.per_request_spec_decode_metrics) no interval is valid "
            "(drafts of one request are correlated), so the profile cannot pass.")


def judge_profile_of_counters(
    spec: SpecDecodeStats | None,
    speculative_canary: bool,
    cfg: GatesConfig,
    look: int = 1,
    max_looks: int | None = 1,
    information: Sequence[float] | None = None,
) -> GateResult:
    """The gate on the counters a look carries: the requests' own (`RequestSpecDecodeStats`), else the server's.

    A canary that does not speculate has no draft positions: the gate does not apply, and says so in a
    PASS whose detail is that sentence (as the progressive phase's acceptance guard records it). A
    speculative canary that made no drafts under load FAILs, as the acceptance floor does.
    """
    if cfg.acceptance_profile is not None and not speculative_canary:
        return GateResult(name=PROFILE_NAME, metric=METRIC, baseline=None, canary=None, threshold=None,
                          verdict=Verdict.PASS, look=look,
                          detail="not applicable: the canary does not speculate (no draft positions to judge).")
    if cfg.acceptance_profile is not None and spec is not None and spec.drafts <= 0:
        return GateResult(name=PROFILE_NAME, metric=METRIC, baseline=None, canary=None, threshold=None,
                          verdict=Verdict.FAIL, look=look, detail="the speculative canary made no drafts under load")
    counts = spec.position_counts() if isinstance(spec, RequestSpecDecodeStats) else ()
    return judge_acceptance_profile(counts, cfg.acceptance_profile, cfg.acceptance_profile_margin, cfg, look=look,
                                    max_looks=max_looks, information=information, server=spec)
