"""Guard gates of the progressive phase: is the canary hurting live traffic right now?

A pure function (Kayenta's rule: numbers in, verdicts out, no I/O, no clock):
`judge_guard_window(baseline, canary, spec_delta, canary_alive, cfg, speculative_canary)`
judges one guard window of the canary's live data and returns one `GateResult` per guard:

  guard_replica_health     every canary replica answers
  guard_error_rate         canary error rate minus baseline error rate
  guard_ttft_p95_slo       absolute SLO on the canary's TTFT p95      (if configured)
  guard_tpot_p95_slo       absolute SLO on the canary's TPOT p95      (if configured)
  guard_acceptance_length  floor on the canary's mean acceptance length (speculative canary)

Unlike the experiment's gates these do not compare like with like: at a 10% step
the canary is under-loaded, so its latency is not a fair comparison. They are
alarms: FAIL aborts the rollout at once, so a FAIL needs evidence, not a point
estimate that happens to sit past a threshold. PASS means "enough canary data and
nothing wrong in it"; with too little data a guard is INCONCLUSIVE, never PASS.
A guard that is not configured is PASS with a detail that starts "disabled:"
(`enabled_guard_names` says which ones count).

Error control (the false-abort rate)
------------------------------------
Each statistical guard (error rate, the two SLOs, acceptance length) fails only
when a one-sided test rejects "the canary is within its limit" at level
`alpha_look = alpha / (statistical guards * looks)`, with `alpha` =
`GUARD_ALPHA` (0.001) and `looks` the number of times the caller judges the same
window (interim looks inside the window plus the final one). By the union bound
the chance that a canary *sitting exactly at its limits* is aborted in a given
window is at most 0.001; over a phase of W windows at most W * 0.001 (e.g. 18
windows of 10 s over three 60 s steps: <= 1.8%). A canary no worse than the
baseline is far from the limits (the error guard allows +5 points), so its real
false-abort rate is orders of magnitude lower: tests/test_guards.py simulates
20,000 A/A windows per traffic shape (10% to 50% canary, 0-20% errors) and sees
no abort, and checks the level at the limit (400,000 windows per shape).
Assumption: requests are independent given the arm; correlated failures (one
slow burst) make the bound optimistic.

The rules
---------
guard_replica_health: FAIL when `canary_alive` is False (the caller confirms a
  replica dead on two consecutive polls), else PASS. Needs no data.
guard_error_rate: cancelled records (cut off by the load test stopping) are not
  requests of either arm. With e_c errors of n_c canary requests and e_b of n_b
  baseline ones, the null is "p_canary - p_baseline <= threshold"; FAIL when
  e_c >= MIN_CANARY_ERRORS (3), the observed difference exceeds the threshold,
  the one-sided lower Newcombe (hybrid Wilson score) bound of the difference at
  level alpha_look is above the threshold, and the exact binomial tail of e_c
  at rate (e_b + 1)/(n_b + 2) + threshold is below alpha_look (see
  `error_guard_fails`). A dead canary (every request fails) is caught with 4-5
  canary requests; one or two stray errors never abort. PASS when
  n_c >= min_requests and the observed difference is within the threshold;
  otherwise INCONCLUSIVE. A FAIL is allowed below min_requests: 3 of 3 requests
  failing is evidence enough.
guard_ttft_p95_slo / guard_tpot_p95_slo: with k of n successful canary requests
  slower than the SLO, the null "true p95 <= SLO" means P(slower) <= 5%; FAIL
  when P(Binomial(n, 0.05) >= k) < alpha_look (the lower confidence bound of the
  p95 is above the SLO). PASS when n >= min_requests and the observed p95 is
  within the SLO; otherwise INCONCLUSIVE.
guard_acceptance_length: from the window's /metrics deltas (drafts D, accepted
  tokens, accepted per position) the distribution of accepted tokens per draft is
  known exactly (P(A >= i) = accepted_at_position[i-1] / D), so is its variance.
  FAIL when D >= MIN_DRAFTS and the upper bound mean + z(alpha_look) * sd / sqrt(D)
  is below the floor; PASS when D >= MIN_DRAFTS and the mean is at or above it;
  otherwise INCONCLUSIVE. A speculative canary that served min_requests
  multi-token requests with zero drafts in the window FAILs (speculation stopped),
  with or without a floor. A non-speculative canary: PASS ("disabled: ...").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

from cluster.metrics import SpecDecodeStats
from loadtests.health import percentile_ms
from loadtests.records import RequestRecord
from rollout.judge import stats
from rollout.judge.acceptance import MIN_DRAFTS, MIN_REQUESTS, acceptance_sd, clustered_se  # one copy of each
from rollout.judge.config import GuardConfig
from rollout.judge.verdicts import GateResult, Verdict

__all__ = [
    "GUARD_NAMES",
    "GUARD_ALPHA",
    "MIN_CANARY_ERRORS",
    "MIN_DRAFTS",
    "ArmWindow",
    "enabled_guard_names",
    "error_guard_fails",
    "judge_guard_window",
    "summarize_arm",
]

HEALTH = "guard_replica_health"
ERRORS = "guard_error_rate"
TTFT = "guard_ttft_p95_slo"
TPOT = "guard_tpot_p95_slo"
ACCEPTANCE = "guard_acceptance_length"
GUARD_NAMES = (HEALTH, ERRORS, TTFT, TPOT, ACCEPTANCE)

GUARD_ALPHA = 0.001  # bound on the false-abort chance per window, all guards and looks together
MIN_CANARY_ERRORS = 3  # never abort on fewer canary errors than this
SLO_QUANTILE = 0.95
DISABLED = "disabled: "


@dataclass(frozen=True)
class ArmWindow:
    """One arm's requests in a window, reduced to what the guards read."""

    n: int  # requests that count (not cancelled)
    errors: int
    ttft_s: np.ndarray  # successful requests
    tpot_s: np.ndarray  # successful requests with >= 2 output tokens
    multi_token_ok: int  # successful requests that produced >= 2 tokens (could draft)
    cancelled: int

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.n if self.n else None


def summarize_arm(records: Sequence[RequestRecord]) -> ArmWindow:
    counted = [r for r in records if not r.cancelled]
    ok = [r for r in counted if r.ok]
    return ArmWindow(
        n=len(counted),
        errors=sum(1 for r in counted if not r.ok),
        ttft_s=np.array([r.ttft_s for r in ok if r.ttft_s is not None], dtype=float),
        tpot_s=np.array([r.tpot_s for r in ok if r.tpot_s is not None], dtype=float),
        multi_token_ok=sum(1 for r in ok if (r.output_tokens or 0) >= 2),
        cancelled=len(records) - len(counted),
    )


def enabled_guard_names(cfg: GuardConfig, speculative_canary: bool) -> list[str]:
    """The guards that judge something under this config (the others report 'disabled')."""
    names = [HEALTH, ERRORS]
    if cfg.ttft_p95_max_s is not None:
        names.append(TTFT)
    if cfg.tpot_p95_max_s is not None:
        names.append(TPOT)
    if speculative_canary:
        names.append(ACCEPTANCE)
    return names


def _alpha_look(cfg: GuardConfig, speculative_canary: bool, looks: int) -> float:
    statistical = [n for n in enabled_guard_names(cfg, speculative_canary) if n != HEALTH]
    return GUARD_ALPHA / (max(1, len(statistical)) * max(1, looks))


def judge_guard_window(
    baseline: list[RequestRecord],
    canary: list[RequestRecord],
    spec_delta: SpecDecodeStats | None,
    canary_alive: bool,
    cfg: GuardConfig,
    speculative_canary: bool,
    *,
    looks: int = 1,
    look: int = 1,
) -> list[GateResult]:
    """Every guard's verdict on one window of live data (see the module docstring).

    `baseline` / `canary`: the window's request records of each arm (cancelled ones
    are ignored). `spec_delta`: the canary replicas' speculative-decoding counter
    deltas over the window (None: not scraped, e.g. a replica did not answer).
    `looks`: how many times the caller judges this window (interim looks + the final
    one); each look is tested at the matching share of GUARD_ALPHA. `look` is
    recorded in the results.
    """
    if looks < 1:
        raise ValueError(f"looks must be >= 1, got {looks}")
    alpha = _alpha_look(cfg, speculative_canary, looks)
    b, c = summarize_arm(baseline), summarize_arm(canary)
    common = dict(n_baseline=b.n, n_canary=c.n, look=look)
    return [
        _health(canary_alive, common),
        _errors(b, c, cfg, alpha, common),
        _slo(TTFT, "ttft_p95_ms", b.ttft_s, c.ttft_s, cfg.ttft_p95_max_s, cfg, alpha, common),
        _slo(TPOT, "tpot_p95_ms", b.tpot_s, c.tpot_s, cfg.tpot_p95_max_s, cfg, alpha, common),
        _acceptance(spec_delta, c, cfg, speculative_canary, alpha, common),
    ]


# -- the guards ------------------------------------------------------------------
def _health(canary_alive: bool, common: dict) -> GateResult:
    return GateResult(
        name=HEALTH,
        metric="canary_replicas_alive",
        baseline=None,
        canary=1.0 if canary_alive else 0.0,
        threshold=1.0,
        verdict=Verdict.PASS if canary_alive else Verdict.FAIL,
        detail="every canary replica answers" if canary_alive else "a canary replica is down (confirmed on two polls)",
        **common,
    )


def _binom_sf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) >= k)."""
    if k <= 0 or p >= 1.0:
        return 1.0
    return float(sps.binom.sf(k - 1, n, p))


def error_guard_fails(kb, nb, kc, nc, limit: float, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """(fails, lower bound) of the error guard, vectorized over windows (the tests simulate it).

    FAIL needs all of: at least MIN_CANARY_ERRORS canary errors; an observed
    difference above `limit`; the one-sided lower Newcombe bound of
    p_canary - p_baseline at level `alpha` above `limit`; and the exact binomial
    tail P(Binomial(n_c, p_b' + limit) >= e_c) < alpha with the baseline's rate
    estimated as p_b' = (e_b + 1) / (n_b + 2). Newcombe alone is anti-conservative
    when the canary has few requests (x6 at n_c = 10); the binomial tail alone when
    the baseline's rate is uncertain; together they hold the level in every case
    tests/test_guards.py simulates.
    """
    kb, nb, kc, nc = (np.asarray(a, dtype=float) for a in (kb, nb, kc, nc))
    z = float(sps.norm.isf(alpha))
    nb_safe = np.maximum(nb, 1.0)  # no baseline data: treat as 0 of 1 (wide bound, conservative)
    nc_safe = np.maximum(nc, 1.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        diff, lower, _ = stats.newcombe_difference_interval(kb, nb_safe, kc, nc_safe, z, z)
    p0 = np.minimum(1.0, (kb + 1.0) / (nb + 2.0) + limit)
    tail = np.where(kc >= 1, sps.binom.sf(kc - 1, nc_safe, p0), 1.0)
    fails = (kc >= MIN_CANARY_ERRORS) & (nc > 0) & (diff > limit) & (lower > limit) & (tail < alpha)
    return fails, lower


def _errors(b: ArmWindow, c: ArmWindow, cfg: GuardConfig, alpha: float, common: dict) -> GateResult:
    limit = cfg.error_rate_max_increase
    rate_b = b.error_rate if b.error_rate is not None else 0.0
    base = dict(
        name=ERRORS,
        metric="error_rate_diff",
        baseline=b.error_rate,
        canary=c.error_rate,
        threshold=limit,
        estimate=(c.error_rate - rate_b) if c.error_rate is not None else None,
        **common,
    )
    counts = f"canary {c.errors}/{c.n} errors, baseline {b.errors}/{b.n}"
    if c.n == 0:
        return GateResult(**base, verdict=Verdict.INCONCLUSIVE, detail=f"no canary requests in the window ({counts})")
    diff = c.error_rate - rate_b
    fails, lower = error_guard_fails(b.errors, b.n, c.errors, c.n, limit, alpha)
    lower = float(lower)
    if math.isfinite(lower):
        base["interval"] = (lower, 1.0)
    if bool(fails):
        return GateResult(
            **base,
            verdict=Verdict.FAIL,
            detail=f"{counts}: canary error rate exceeds baseline by {diff:.3f}, lower bound {lower:.3f} > {limit:g} "
            f"(one-sided level {alpha:.2g})",
        )
    if c.n >= cfg.min_requests and diff <= limit:
        return GateResult(**base, verdict=Verdict.PASS, detail=f"{counts}: difference {diff:+.3f} within {limit:g}")
    why = f"fewer than {cfg.min_requests} canary requests" if c.n < cfg.min_requests else "difference not significant"
    return GateResult(**base, verdict=Verdict.INCONCLUSIVE, detail=f"{counts}: {why}")


def _slo(
    name: str,
    metric: str,
    baseline: np.ndarray,
    canary: np.ndarray,
    slo_s: float | None,
    cfg: GuardConfig,
    alpha: float,
    common: dict,
) -> GateResult:
    base = dict(
        name=name,
        metric=metric,
        baseline=percentile_ms(baseline, 95, ndigits=None),
        canary=percentile_ms(canary, 95, ndigits=None),
        threshold=slo_s * 1000.0 if slo_s is not None else None,
        **{**common, "n_canary": int(canary.size), "n_baseline": int(baseline.size)},
    )
    if slo_s is None:
        return GateResult(**base, verdict=Verdict.PASS, detail=DISABLED + "no SLO configured")
    n = int(canary.size)
    slow = int(np.sum(canary > slo_s))
    if n == 0:
        return GateResult(**base, verdict=Verdict.INCONCLUSIVE, detail="no successful canary requests in the window")
    p_value = _binom_sf(slow, n, 1.0 - SLO_QUANTILE)
    base["p_value"] = p_value
    p95 = base["canary"]
    counts = f"{slow}/{n} canary requests slower than {slo_s * 1000:.0f} ms, p95 {p95:.0f} ms"
    if p_value < alpha:
        return GateResult(**base, verdict=Verdict.FAIL, detail=f"{counts}: the p95 is above the SLO (p = {p_value:.2g} < {alpha:.2g})")
    if n >= cfg.min_requests and p95 <= slo_s * 1000.0:
        return GateResult(**base, verdict=Verdict.PASS, detail=f"{counts}: within the SLO")
    why = f"fewer than {cfg.min_requests} canary requests" if n < cfg.min_requests else "above the SLO but not significantly"
    return GateResult(**base, verdict=Verdict.INCONCLUSIVE, detail=f"{counts}: {why}")


def _acceptance(
    delta: SpecDecodeStats | None,
    c: ArmWindow,
    cfg: GuardConfig,
    speculative_canary: bool,
    alpha: float,
    common: dict,
) -> GateResult:
    floor = cfg.min_acceptance_length
    mean = delta.mean_acceptance_length if delta is not None else None
    base = dict(
        name=ACCEPTANCE,
        metric="mean_acceptance_length",
        baseline=None,
        canary=mean,
        threshold=floor,
        estimate=mean,
        **{**common, "n_canary": int(delta.drafts) if delta is not None else 0, "n_baseline": 0},
    )
    if not speculative_canary:
        return GateResult(**base, verdict=Verdict.PASS, detail=DISABLED + "the canary does not speculate")
    if delta is None:
        return GateResult(**base, verdict=Verdict.INCONCLUSIVE, detail="canary /metrics not scraped in this window")
    drafts = int(delta.drafts)
    if drafts <= 0:
        if c.multi_token_ok >= cfg.min_requests:
            return GateResult(
                **base,
                verdict=Verdict.FAIL,
                detail=f"the speculative canary made no drafts while serving {c.multi_token_ok} requests",
            )
        return GateResult(**base, verdict=Verdict.INCONCLUSIVE, detail="no drafts in the window (too little canary traffic)")
    if floor is None:
        return GateResult(**base, verdict=Verdict.PASS, detail=f"{drafts} drafts, mean acceptance length {mean:.2f} (no floor set)")
    z = float(sps.norm.isf(alpha))
    # drafts of one request are not independent (a hard prompt accepts less at every step): with the
    # requests' own counters the SE is clustered by request, else the drafts' spread is all there is
    _, clustered, n_requests = clustered_se(getattr(delta, "per_request", ()) or ())
    se = clustered if math.isfinite(clustered) and n_requests >= MIN_REQUESTS else acceptance_sd(delta) / math.sqrt(drafts)
    upper = mean + z * se
    base["interval"] = (mean - z * se, upper)
    text = f"mean acceptance length {mean:.2f} over {drafts} drafts (upper bound {upper:.2f}), floor {floor:g}"
    if drafts < MIN_DRAFTS:
        return GateResult(**base, verdict=Verdict.INCONCLUSIVE, detail=f"{text}: fewer than {MIN_DRAFTS} drafts")
    if upper < floor:
        return GateResult(**base, verdict=Verdict.FAIL, detail=f"{text}: below the floor")
    if mean >= floor:
        return GateResult(**base, verdict=Verdict.PASS, detail=text)
    return GateResult(**base, verdict=Verdict.INCONCLUSIVE, detail=f"{text}: below the floor but not significantly")
