"""The latency gates: the TPOT p50 objective and the TTFT / E2E p95 and error-rate guardrails.

`judge_latency(baseline, canary, cfg, ...)` judges quantile ratios canary /
baseline on repeated confidence bounds intersected over the looks, and the
error-rate difference with Newcombe bounds; the guardrails' rollback side is
Holm-adjusted. `LatencySamples` is one arm's input;
`latency_samples_from_records` builds it from the load test's records.

How a quantile ratio is bounded at each look (``rollout.judge.stats``):

* failed requests (not cancelled ones) are +inf ranks in every latency
  quantile, so a canary that turns its slowest requests into errors gains
  nothing (the error-rate guardrail judges the errors themselves as before);
* each arm's quantile has exact order-statistic bounds at the look's level,
  widened to the block-robust (Woodruff, t on blocks - 1 df) band by the
  arm's design effect; never narrower than the iid band, never clipped: a
  bound whose rank lies past the sample does not exist, so a band past the
  canary's top or the baseline's bottom leaves the pass side (the ratio's
  upper bound) without a bound and the gate INCONCLUSIVE, one past the
  baseline's top or the canary's bottom leaves the fail side without one
  (the pass side reads neither);
* blocks are the looks when the samples carry their look (``window``), else
  runs of ``RUN_BLOCK_REQUESTS`` consecutive samples. A latency level shared
  by all requests of a look is invisible inside one look, so no quantile gate
  reaches a verdict before an arm has samples from 2 blocks (with the looks
  as blocks: never at look 1), and the few degrees of freedom of the first
  looks make early verdicts need large effects;
* ties (a measurement tick) move each bound to the neighbouring distinct
  value; a zero-width band or interval is INCONCLUSIVE, never PASS;
* the arms are combined by MOVER on the log scale;
* with the looks as blocks the arms are paired by look: a look is one stretch
  of time for both, so a level it gives both arms cancels in the ratio and one
  it gives them in opposite directions adds up. The ratio's cluster-robust
  variance from both arms' block sums, over the sum of the arms' own, scales
  both design effects (t on looks - 1 df); arms treated as independent held
  alpha with independent levels only (0.096 with opposed ones,
  benchmarks/latency_calibration.py).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

import pydantic
from pydantic import Field
from scipy import special

from loadtests.records import RequestRecord
from rollout.judge import stats
from rollout.judge.config import GatesConfig
from rollout.judge.looks import (
    CODE_TO_VERDICT,
    finite_or_none,
    holm_levels,
    interval_or_none,
    resolve_information,
    upper_is_good_verdict,
    z,
)
from rollout.judge.names import GUARDRAIL_NAMES, OBJECTIVE_NAME
from rollout.judge.verdicts import GateResult, Verdict, is_enabled

__all__ = [
    "LatencySamples",
    "latency_samples_from_records",
    "latency_samples_by_arm",
    "judge_latency",
    "cumulative_bounds",
    "sample_design_effect",
    "RUN_BLOCK_REQUESTS",
    "RatioBounds",
    "tpot_p50_ratio_bounds",
    "LookDependence",
    "look_dependence",
]

#: Block length, in consecutive samples, when the samples carry no look ids.
#: Twice the 10-request stall runs measured on the demo (a run of stalls
#: mostly falls in one block), and short enough for ~10 blocks at 200 per arm.
RUN_BLOCK_REQUESTS = 20


@dataclass(frozen=True)
class LatencySamples:
    """One arm's per-request latencies so far (successful requests only) and its failed requests.

    ``n_total`` counts every request sent, errors included. ``window``, when
    given, holds for every sample the look (1-based window number) in which it
    arrived; the judge then intersects the repeated confidence intervals of
    all looks so far, so a verdict once reached is never taken back and an
    interval never widens as data accrue, and it uses the looks as the blocks
    of its block-robust bounds. ``error_window``, when given, holds the look
    of each of the ``n_errors`` failed requests. Failed requests count as
    +inf in every latency quantile; without ``error_window`` they are spread
    evenly through the samples' order (and looks). Samples are in completion
    order (within a look at least): runs of them are the blocks when there
    is no ``window``.
    """

    ttft_s: np.ndarray
    tpot_s: np.ndarray
    e2e_s: np.ndarray
    n_errors: int
    n_total: int
    window: np.ndarray | None = None
    error_window: np.ndarray | None = None


def _record_arm(record: RequestRecord) -> str | None:
    # the controller's rule: the arm that answered, else the one it was pinned to
    return record.served_arm


def latency_samples_from_records(records: Sequence[RequestRecord], looks_of: Sequence[int], arm: str) -> LatencySamples:
    """One arm's `LatencySamples` from the load test's records, ``looks_of[i]`` the look of ``records[i]``.

    Exactly the controller's rule (cancelled requests are neither samples nor
    errors; an ok request without TTFT or TPOT, e.g. a one-token output, is
    counted in ``n_total`` only), plus the look of every failed request
    (``error_window``), so errors enter the quantiles in their own block.
    Records are expected in completion order within each look.
    """
    return latency_samples_by_arm(records, looks_of, (arm,))[arm]


def latency_samples_by_arm(
    records: Sequence[RequestRecord], looks_of: Sequence[int], arms: Sequence[str]
) -> dict[str, LatencySamples]:
    """`latency_samples_from_records` of every arm in ``arms``, in one pass over the records
    (every look reads all records so far)."""
    if len(records) != len(looks_of):
        raise ValueError(f"one look per record needed: {len(looks_of)} for {len(records)} records")
    columns: dict[str, tuple[list, list, list, list, list]] = {arm: ([], [], [], [], []) for arm in arms}
    n_total = dict.fromkeys(arms, 0)
    for r, w in zip(records, looks_of):
        if r.cancelled:
            continue
        mine = columns.get(_record_arm(r))
        if mine is None:
            continue
        ttft, tpot, e2e, window, failed = mine
        n_total[_record_arm(r)] += 1
        if not r.ok:
            failed.append(w)
            continue
        r_tpot = r.tpot_s  # a computed property: read once
        if r.ttft_s is not None and r_tpot is not None:
            ttft.append(r.ttft_s)
            tpot.append(r_tpot)
            e2e.append(r.e2e_s)
            window.append(w)
    return {
        arm: LatencySamples(
            ttft_s=np.array(ttft, dtype=float),
            tpot_s=np.array(tpot, dtype=float),
            e2e_s=np.array(e2e, dtype=float),
            n_errors=len(failed),
            n_total=n_total[arm],
            window=np.array(window, dtype=int),
            error_window=np.array(failed, dtype=int),
        )
        for arm, (ttft, tpot, e2e, window, failed) in columns.items()
    }


# ---------------------------------------------------------------------------
# Latency (quantile ratios, error rate) -- array kernels shared with calibrate
# ---------------------------------------------------------------------------


def cumulative_bounds(
    lower_by_look: np.ndarray, upper_by_look: np.ndarray, usable_by_look: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Running intersection of repeated confidence intervals over looks (axis 0).

    Looks without enough data restrict nothing. With probability >= 1 - 2
    alpha all repeated intervals cover the truth simultaneously, so their
    intersection does too (Jennison & Turnbull 2000, sec. 9.1): verdicts
    become monotone and intervals never widen.
    """
    usable = np.asarray(usable_by_look, dtype=bool)
    lower = np.where(usable, lower_by_look, -np.inf)
    upper = np.where(usable, upper_by_look, np.inf)
    return np.maximum.accumulate(lower, axis=0), np.minimum.accumulate(upper, axis=0)


@dataclass(frozen=True)
class _ArmLook:
    """One arm's samples of one latency field up to one look: what its quantile band needs.

    ``sorted_values``: the successful samples then +inf per failed request;
    ``n_blocks`` blocks with samples, ``deff`` the design effect of the
    quantile judged (NaN with fewer than 2 blocks); ``distinct`` the distinct
    finite values (every band of the arm needs them for its tie rule).
    ``look_ids`` / ``look_sums``: when the blocks are looks (the same time
    windows in both arms), each look with samples and its `stats.quantile_block_sums`,
    for pairing the arms by look; None when the blocks are runs of requests.
    """

    sorted_values: np.ndarray
    n_ok: int
    n_errors: int
    n_blocks: int
    deff: float
    distinct: np.ndarray | None = None
    look_ids: np.ndarray | None = None
    look_sums: np.ndarray | None = None

    def band(self, q: float, level: float, df: float | None = None, critical: float | None = None) -> stats.QuantileBand:
        return stats.quantile_band(self.sorted_values, q, level, self.deff, self.n_blocks, df, self.distinct, critical)

    def iid_variance(self, q: float) -> float:
        """The iid variance of the log quantile, read off an order-statistic band (inf where it touches +inf)."""
        if self.n_ok < 2:
            return math.inf
        with np.errstate(invalid="ignore"):  # +inf (failed requests) in the band: an infinite SE, handled below
            _, se = stats.log_quantile_with_se(self.sorted_values, q)
        return float(se) ** 2 if math.isfinite(float(se)) else math.inf

    def block_variance(self, q: float) -> float:
        """Block-robust variance of the log quantile, up to a constant: design effect x the iid SE squared."""
        if not math.isfinite(self.deff):
            return math.inf
        iid = self.iid_variance(q)
        return self.deff * iid if math.isfinite(iid) else math.inf


@dataclass(frozen=True)
class _ArmPair:
    """Both arms of one look as their ratio's bounds use them: design effects scaled by the pairing, and the df.

    ``pairing``: the ratio's variance with the arms paired by look, looks taken as
    independent, over the sum of the arms' own (`stats.paired_block_variance_factor`);
    ``drift_factor``: the drift-robust variance (`stats.drift_long_run_variance` of the
    per-look contrast) over that one. Each arm's design effect is multiplied by both,
    so the MOVER combination of the arms' bands carries the drift-robust paired
    variance; ``pairing`` NaN where the arms are not paired
    (blocks are runs of requests, or an SE is infinite): then the arms count as
    independent (t on Welch's df). Paired, ``looks`` and ``correlation`` set the
    critical values (`critical`): the drift-robust law over that many looks, for
    look-to-look correlations up to ``correlation``.
    ``autocorrelation``: lag-1 autocorrelation of the baseline's, the canary's and the
    contrast's per-look series.
    """

    baseline: _ArmLook
    canary: _ArmLook
    df: float
    pairing: float
    looks: int = 0
    correlation: float = 0.0
    autocorrelation: tuple[float, float, float] = (math.nan, math.nan, math.nan)
    drift_factor: float = math.nan  # drift-robust over independent-looks variance (above 1: levels persist)
    correlation_estimate: float = math.nan  # the contrast's own look-to-look correlation (`stats.look_correlation_estimate`)

    def critical(self, level: float) -> float | None:
        """The critical value at ``level`` when paired by look (None: t on ``df``)."""
        if not math.isfinite(self.pairing):
            return None
        return stats.drift_critical_value(level, self.looks, self.correlation)


def _pair_arms(bl: _ArmLook, cl: _ArmLook, q: float, correlation: float) -> _ArmPair:
    """The arms paired by look where their blocks are looks (drift-robust), else independent (Welch df).

    A look is one stretch of time for both arms: a level it gives both (a
    disturbance of the machine) cancels in the ratio, one it gives them in
    opposite directions (replicas fighting for the same cores) adds up; the arms'
    own design effects see neither. A level that persists across looks (drift,
    a replica's state) makes consecutive looks alike: the per-look contrast's
    long-run variance (`stats.drift_long_run_variance`) counts it where a sum of
    independent looks would not.
    """
    vb, vc = bl.block_variance(q), cl.block_variance(q)
    welch = stats.welch_df(vb, bl.n_blocks - 1, vc, cl.n_blocks - 1)
    ib, ic = bl.iid_variance(q), cl.iid_variance(q)
    if bl.look_ids is None or cl.look_ids is None or bl.look_sums is None or cl.look_sums is None:
        return _ArmPair(bl, cl, welch, math.nan)
    if not all(map(math.isfinite, (vb, vc, ib, ic))):
        return _ArmPair(bl, cl, welch, math.nan)
    scale_b = math.sqrt(ib / (bl.sorted_values.size * q * (1.0 - q)))
    scale_c = math.sqrt(ic / (cl.sorted_values.size * q * (1.0 - q)))
    independent = stats.paired_block_variance_factor(bl.look_ids, bl.look_sums, scale_b, cl.look_ids, cl.look_sums, scale_c)
    if not math.isfinite(independent):
        return _ArmPair(bl, cl, welch, math.nan)
    series_b, series_c, contrast = stats.paired_look_series(bl.look_ids, bl.look_sums, scale_b, cl.look_ids, cl.look_sums, scale_c)
    looks = int(contrast.size)
    own = (
        bl.look_ids.size / (bl.look_ids.size - 1) * float(np.sum(series_b**2))
        + cl.look_ids.size / (cl.look_ids.size - 1) * float(np.sum(series_c**2))
    )
    scaling = float(stats.drift_long_run_variance(contrast)) / own
    if not (math.isfinite(scaling) and scaling > 0.0):
        return _ArmPair(bl, cl, welch, math.nan)
    autocorrelation = tuple(stats.lag_one_autocorrelation(x) for x in (series_b, series_c, contrast))
    return _ArmPair(
        replace(bl, deff=bl.deff * scaling), replace(cl, deff=cl.deff * scaling), float(looks - 1), independent,
        looks=looks, correlation=correlation, autocorrelation=autocorrelation,  # type: ignore[arg-type]
        drift_factor=scaling / independent, correlation_estimate=stats.look_correlation_estimate(contrast),
    )


@dataclass(frozen=True)
class _ArmSeries:
    """One arm's samples of one latency field, failed requests as +inf, with the block and look of each.

    ``looks`` is None when the samples carry no look ids (then only the
    current look is judged, and blocks are runs of consecutive samples).
    ``order``: a stable argsort of ``values``, shared by every look's subset.
    """

    values: np.ndarray
    is_error: np.ndarray
    blocks: np.ndarray
    looks: np.ndarray | None
    dropped: int
    block_kind: str
    order: np.ndarray | None = None

    def _keep(self, look: int | None) -> np.ndarray | None:
        return None if (self.looks is None or look is None) else self.looks <= look

    def digest(self, look: int | None) -> bytes:
        """A fingerprint of the samples and blocks up to ``look``: equal fingerprints, equal `up_to`."""
        keep = self._keep(look)
        values, blocks = (self.values, self.blocks) if keep is None else (self.values[keep], self.blocks[keep])
        h = hashlib.blake2b(digest_size=16)
        h.update(np.ascontiguousarray(values).tobytes())
        h.update(blocks.dtype.str.encode())  # '<i8': the dtype's own short code (its str() is slow to build)
        h.update(np.ascontiguousarray(blocks).tobytes())
        return h.digest()

    def up_to(self, look: int | None, q: float) -> _ArmLook:
        keep = self._keep(look)
        order = self.order if self.order is not None else np.argsort(self.values, kind="stable")
        if keep is None:
            values, blocks, errors = self.values, self.blocks, self.is_error
        else:
            values, blocks, errors = self.values[keep], self.blocks[keep], self.is_error[keep]
            # the subset's stable order is the whole series' stable order restricted to it
            position = np.cumsum(keep) - 1
            order = position[order[keep[order]]]
        sorted_values = values[order]
        block_index, n_blocks = stats.dense_block_index(blocks)
        groups = stats.tie_groups(sorted_values)
        sums = stats.quantile_block_sums(sorted_values, order, block_index, n_blocks, q, groups)
        deff = stats.design_effect_of_block_sums(sums, sorted_values.size, q) if n_blocks >= 2 else float("nan")
        n_errors = int(errors.sum())
        distinct = sorted_values[groups[0]]
        distinct = distinct[np.isfinite(distinct)]
        look_ids = np.unique(blocks) if self.looks is not None else None
        look_sums = sums if self.looks is not None else None
        return _ArmLook(sorted_values, int(values.size) - n_errors, n_errors, n_blocks, deff, distinct, look_ids, look_sums)


def _arm_series(samples: LatencySamples, field: str) -> _ArmSeries:
    """The arm's finite positive samples of ``field`` (others dropped and counted) and its errors as +inf."""
    raw = np.asarray(getattr(samples, field), dtype=float).ravel()
    keep = np.isfinite(raw) & (raw > 0)
    values = raw[keep]
    n_ok, n_errors = int(values.size), max(int(samples.n_errors), 0)
    window = None
    if samples.window is not None:
        window = np.asarray(samples.window).ravel()
        if window.size != raw.size:
            raise ValueError(f"window ids ({window.size}) must match the samples ({raw.size})")
        window = window[keep]
    # Where the errors sit when their looks are not given: evenly through the
    # samples' order, so they neither cluster in one block nor vanish.
    spread = np.minimum(((np.arange(n_errors) + 0.5) * n_ok / max(n_errors, 1)).astype(int), max(n_ok - 1, 0))
    if window is not None:
        if samples.error_window is not None:
            error_looks = np.asarray(samples.error_window).ravel()
            if error_looks.size != n_errors:
                raise ValueError(f"error_window ({error_looks.size}) must hold the look of each of the {n_errors} errors")
        else:
            error_looks = window[spread] if n_ok else np.ones(n_errors, dtype=int)
        looks = np.concatenate([window, error_looks]).astype(int)
        blocks, kind = looks, "looks"
    else:
        positions = np.concatenate([np.arange(n_ok), spread if n_ok else np.arange(n_errors)])
        looks, blocks, kind = None, positions // RUN_BLOCK_REQUESTS, f"runs of {RUN_BLOCK_REQUESTS} requests"
    all_values = np.concatenate([values, np.full(n_errors, np.inf)])
    return _ArmSeries(
        values=all_values,
        is_error=np.concatenate([np.zeros(n_ok, dtype=bool), np.ones(n_errors, dtype=bool)]),
        blocks=blocks,
        looks=looks,
        dropped=int(raw.size - n_ok),
        block_kind=kind,
        order=np.argsort(all_values, kind="stable"),
    )


def sample_design_effect(samples: LatencySamples, field: str, q: float) -> float:
    """The design effect (block-robust over iid variance) of one arm's ``field`` q-quantile, as the judge uses it.

    ``field``: "ttft_s", "tpot_s" or "e2e_s". Blocks are the looks when the
    samples carry them, else runs of `RUN_BLOCK_REQUESTS`; failed requests
    count as +inf. NaN with fewer than 2 blocks.
    """
    return _arm_series(samples, field).up_to(None, q).deff


def _level_of(z_value: float) -> float:
    """One-sided level of a critical z (the order-statistic bands work in levels, not z)."""
    return float(special.ndtr(-z_value)) if math.isfinite(z_value) else 0.0


@dataclass(frozen=True)
class _LookPlan:
    """Where a call sits in the sequential design, as `resolve_information` resolved it.

    ``look`` is the caller's look number (reported in every GateResult),
    ``boundary_look`` the look whose boundary applies, ``planned`` the planned
    looks, ``note`` the text appended to every detail, ``information`` the
    observed information fractions (None: equal steps over ``planned``).
    """

    look: int
    boundary_look: int
    planned: int
    note: str
    information: tuple[float, ...] | None


@dataclass(frozen=True)
class _QuantileRatioBounds:
    """One quantile ratio canary/baseline with its repeated-CI bounds (log scale) at the current look.

    ``upper`` is the pass-side bound (alpha); ``lowers`` holds the fail-side
    bound at each requested fail level (one per Holm step for guardrails).
    ``usable``: some look so far had bounds (enough samples and blocks, bands
    inside the samples on the pass side, non-degenerate); ``why_not`` says why
    the current one has none, or why its fail side has none ("" when it has
    both). ``dropped``: non-finite/non-positive samples removed (baseline,
    canary); ``errors``: failed requests counted as +inf;
    ``deff``/``blocks``: each arm's design effect and block count now.
    """

    name: str
    metric: str
    baseline_ms: float | None
    canary_ms: float | None
    log_threshold: float
    threshold: float
    log_estimate: float
    upper: float
    lowers: tuple[float, ...]
    usable: bool
    n_baseline: int
    n_canary: int
    looks_used: int
    dropped: tuple[int, int]
    why_not: str = ""
    errors: tuple[int, int] = (0, 0)
    deff: tuple[float, float] = (math.nan, math.nan)
    blocks: tuple[int, int] = (0, 0)
    block_kind: str = "looks"
    tie_widened: bool = False
    pairing: float = math.nan
    autocorrelation: tuple[float, float, float] = (math.nan, math.nan, math.nan)  # baseline, canary, contrast
    drift_factor: float = math.nan
    looks_paired: int = 0
    correlation: float = 0.0  # the look-to-look correlation the critical values held for (folded: see below)
    correlation_estimate: float = math.nan  # the contrast's own, now (`stats.look_correlation_estimate`)
    beyond_plan: bool = False  # that estimate above `stats.LOOK_CORRELATION_CEILING`: no critical value covers it


@dataclass(frozen=True)
class _ErrorRateBounds:
    """Error counts of both arms and the Newcombe bounds of the rate difference canary - baseline.

    ``diff``/``upper`` are None (and ``lowers`` empty) when an arm recorded no
    requests at all; ``lowers`` holds the fail-side bound per Holm step.
    """

    usable: bool
    can_fail: bool
    nb: int
    nc: int
    eb: int
    ec: int
    diff: float | None = None
    upper: float | None = None
    lowers: tuple[float, ...] = ()
    deff: tuple[float, float] = (1.0, 1.0)  # each arm's error-count design effect over the looks (bursts)


def _error_count_design_effect(samples: LatencySamples) -> float:
    """The arm's error-count design effect over its looks (`stats.count_design_effect`); 1 without looks."""
    if samples.window is None or samples.error_window is None:
        return 1.0
    errors = np.asarray(samples.error_window, dtype=int).ravel()
    successes = np.asarray(samples.window, dtype=int).ravel()
    looks = np.union1d(errors, successes)
    if looks.size < 2:
        return 1.0
    error_counts = np.array([np.count_nonzero(errors == lk) for lk in looks], dtype=float)
    request_counts = error_counts + np.array([np.count_nonzero(successes == lk) for lk in looks], dtype=float)
    return stats.count_design_effect(error_counts, request_counts)


@dataclass(frozen=True)
class _HolmStep:
    """How Holm's step-down treated one guardrail: rejected or not, and the level it was last tested at."""

    rejected: bool
    level_index: int
    level: float


def _why_no_bounds(
    pair: _ArmPair, q: float, level: float, cfg: GatesConfig, label: str
) -> tuple[str, stats.QuantileBand | None, stats.QuantileBand | None]:
    """Why a look gives no pass-side bounds ("" when it does), with the arms' bands at the pass level."""
    bl, cl, df = pair.baseline, pair.canary, pair.df
    critical = pair.critical(level)
    if min(bl.n_ok, cl.n_ok) < cfg.min_requests_per_arm:
        return f"Too few {label} samples ({bl.n_ok}/{cl.n_ok} < {cfg.min_requests_per_arm} per arm).", None, None
    if min(bl.n_blocks, cl.n_blocks) < 2:
        return (
            f"Needs samples from at least 2 blocks per arm (has {bl.n_blocks}/{cl.n_blocks}): a latency level "
            "shared by one block's requests cannot be told from the arms' difference inside it."
        ), None, None
    bb, cb = bl.band(q, level, df, critical), cl.band(q, level, df, critical)
    n_needed = stats.samples_needed(q, level)
    if min(bb.n, cb.n) < n_needed:
        return (
            f"The p{round(q * 100)}'s exact rank band at level {level:.3g} needs >= {n_needed} samples per arm "
            f"(has {bb.n}/{cb.n}, failed requests included)."
        ), None, None
    # The pass side (the ratio's upper bound) reads the baseline's lower rank and the canary's upper one
    # only: a band past the sample on the other side (the baseline's upper, the canary's lower) leaves
    # the fail side unbounded (MOVER gives -inf there), not the pass side.
    if not (bb.lower_rank >= 1 and cb.upper_rank <= cb.n):
        return (
            f"The block-robust rank band ({_critical_text(pair, level)} at level {level:.3g}, design effect "
            f"{bl.deff:.2f}/{cl.deff:.2f}{_pairing_text(pair.pairing, ' ')}) reaches past the sample: more samples or "
            "looks needed."
        ), None, None
    if bb.among_failures or cb.among_failures:
        return (
            f"The {label} p{round(q * 100)} falls among the failed requests (+inf ranks) of an arm: no finite bound "
            "(the error-rate guardrail judges the errors)."
        ), None, None
    if bb.degenerate or cb.degenerate:
        return "Degenerate band (every sample in it tied, nothing to widen by): never a pass.", None, None
    return "", bb, cb


def _point_values(b_now, c_now, q: float) -> tuple[float | None, float | None, float, bool]:
    """(baseline ms, canary ms, log ratio estimate, whether ties widened a band) of the quantile now."""
    point_b = b_now.band(q, 0.5) if b_now.sorted_values.size else None
    point_c = c_now.band(q, 0.5) if c_now.sorted_values.size else None
    has_data = point_b is not None and point_c is not None
    log_estimate = stats.mover_log_ratio_bounds(point_b, point_c)[0] if has_data else math.nan

    def ms(point) -> float | None:
        return math.exp(point.log_estimate) * 1e3 if point and math.isfinite(point.log_estimate) else None

    tie_widened = bool((point_b is not None and point_b.tie_widened) or (point_c is not None and point_c.tie_widened))
    return ms(point_b), ms(point_c), float(log_estimate), tie_widened


@lru_cache(maxsize=65536)
def _look_levels(
    alphas: tuple[float, ...], look: int, planned: int, spending: str, information: tuple[float, ...] | None
) -> tuple[float, ...]:
    """The one-sided level of each alpha's critical value at ``look`` (`looks.z`, `_level_of`), remembered:
    every look re-derives the levels of all earlier looks."""
    cfg = _Spending(spending)
    return tuple(_level_of(z(alpha, look, planned, cfg, information)) for alpha in alphas)  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Spending:
    """What `looks.z` reads of the gates config: the spending function."""

    spending: str


@dataclass(frozen=True)
class _OneLook:
    """One look's own bounds of a quantile ratio (log scale), before the intersection over looks."""

    usable: bool
    upper: float
    lowers: tuple[float, ...]
    why_not: str
    pairing: float = math.nan  # `_ArmPair.pairing` of the look
    autocorrelation: tuple[float, float, float] = (math.nan, math.nan, math.nan)  # `_ArmPair`'s
    drift_factor: float = math.nan
    looks: int = 0


def _one_look_bounds(
    bl: _ArmLook, cl: _ArmLook, q: float, pass_level: float, fail_levels: tuple[float, ...], cfg: GatesConfig, label: str
) -> _OneLook:
    """The look's pass-side upper bound and fail-side lower bounds (one per level), or why it has none."""
    pair = _pair_arms(bl, cl, q, cfg.look_correlation_max)
    dependence = {"pairing": pair.pairing, "autocorrelation": pair.autocorrelation, "drift_factor": pair.drift_factor,
                  "looks": pair.looks}
    why_not, bb, cb = _why_no_bounds(pair, q, pass_level, cfg, label)
    if bb is None or cb is None:
        return _OneLook(False, math.inf, (), why_not, **dependence)
    bl, cl, df = pair.baseline, pair.canary, pair.df
    _, low_at_pass, up = stats.mover_log_ratio_bounds(bb, cb)
    if not low_at_pass < up:
        return _OneLook(False, math.inf, (), "Zero-width interval (all the band's samples tied): never a pass.", **dependence)
    lowers = tuple(
        stats.mover_log_ratio_bounds(bl.band(q, level, df, pair.critical(level)), cl.band(q, level, df, pair.critical(level)))[1]
        for level in fail_levels
    )
    if not all(map(math.isfinite, lowers)):
        why_not = (
            f"No lower bound yet: the baseline's upper or the canary's lower rank band (design effect "
            f"{bl.deff:.2f}/{cl.deff:.2f}) reaches past the sample, so the {label} p{round(q * 100)} cannot fail here."
        )
    return _OneLook(True, up, lowers, why_not, **dependence)


# An earlier look's own bounds depend only on its samples (fingerprinted), the quantile and
# the levels: the controller's next look, and every simulated trial's, recomputes them
# unchanged, so they are remembered (cleared when full; a hit returns the very numbers a
# fresh computation would).
_EARLIER_LOOKS: dict[tuple, _OneLook] = {}
_EARLIER_LOOKS_MAX = 50_000


def _look_key(
    b_series: _ArmSeries, c_series: _ArmSeries, look: int | None, q: float, pass_level: float,
    fail_levels: tuple[float, ...], cfg: GatesConfig, label: str,
) -> tuple:
    # everything `_one_look_bounds` reads: the arms' samples and blocks up to the look, q, levels, the sample floor
    # (and whether the blocks are looks: only then are the arms paired by look)
    paired = b_series.looks is not None and c_series.looks is not None
    return (
        b_series.digest(look), c_series.digest(look), paired, q, pass_level, fail_levels, cfg.min_requests_per_arm,
        cfg.look_correlation_max, label,
    )


def _remember(key: tuple, one: _OneLook) -> None:
    if len(_EARLIER_LOOKS) >= _EARLIER_LOOKS_MAX:
        _EARLIER_LOOKS.clear()
    _EARLIER_LOOKS[key] = one


def _earlier_look_bounds(
    b_series: _ArmSeries, c_series: _ArmSeries, look: int, q: float, pass_level: float,
    fail_levels: tuple[float, ...], cfg: GatesConfig, label: str,
) -> _OneLook:
    key = _look_key(b_series, c_series, look, q, pass_level, fail_levels, cfg, label)
    one = _EARLIER_LOOKS.get(key)
    if one is None:
        one = _one_look_bounds(b_series.up_to(look, q), c_series.up_to(look, q), q, pass_level, fail_levels, cfg, label)
        _remember(key, one)
    return one


def _folded(cfg: GatesConfig, b_now: _ArmLook, c_now: _ArmLook, q: float) -> tuple[GatesConfig, float]:
    """(the gates config every look's critical values use, the contrast's look-to-look correlation estimate).

    Where the contrast's own correlation (estimated on all looks so far) exceeds
    ``gates.look_correlation_max``, every look's critical values are those of that correlation
    (`stats.folded_look_correlation`): a run whose looks persist more than the plan assumed gets
    the wider intervals its dependence needs.
    """
    estimate = _pair_arms(b_now, c_now, q, cfg.look_correlation_max).correlation_estimate
    folded = stats.folded_look_correlation(estimate, cfg.look_correlation_max)
    if folded > cfg.look_correlation_max:
        cfg = cfg.model_copy(update={"look_correlation_max": folded})
    return cfg, estimate


def _quantile_ratio_bounds(
    *,
    name: str,
    metric: str,
    q: float,
    field: str,
    baseline: LatencySamples,
    canary: LatencySamples,
    threshold: float,
    cfg: GatesConfig,
    plan: _LookPlan,
    fail_levels: Sequence[float],
    fold: bool = False,
) -> _QuantileRatioBounds:
    """Repeated-CI bounds for one quantile ratio, at the pass level and each fail level.

    Returns the numbers a guardrail or the objective needs: point values,
    the pass-side upper bound (alpha), the fail-side lower bound at each of
    ``fail_levels`` (Holm steps), usability flags. Each look's bounds are
    MOVER combinations of the arms' block-robust order-statistic bands; a
    look without them (see `_why_no_bounds`) restricts nothing. ``fold``: see `_folded`.
    """
    boundary_look, planned, information = plan.boundary_look, plan.planned, plan.information
    label = metric.split("_")[0].upper()
    b_series, c_series = _arm_series(baseline, field), _arm_series(canary, field)
    use_windows = b_series.looks is not None and c_series.looks is not None
    looks = list(range(1, boundary_look + 1)) if use_windows else [boundary_look]

    n_looks = len(looks)
    usable = np.zeros(n_looks, dtype=bool)
    upper_own = np.full(n_looks, np.inf)
    lower_own = np.full((len(fail_levels), n_looks), -np.inf)
    why_not = ""
    b_now, c_now = b_series.up_to(None, q), c_series.up_to(None, q)
    cfg, estimate = _folded(cfg, b_now, c_now, q) if fold and use_windows else (cfg, math.nan)
    now: _OneLook | None = None
    for i, lk in enumerate(looks):
        upto = lk if (use_windows and lk < boundary_look) else None
        prefix = None if information is None else tuple(information[:lk])
        pass_level, *rest = _look_levels((cfg.alpha, *fail_levels), lk, planned, cfg.spending, prefix)
        levels = tuple(rest)
        if upto is None:  # the current look: its arms kept for the point values, its bounds remembered for the next
            one = now = _one_look_bounds(b_now, c_now, q, pass_level, levels, cfg, label)
            _remember(_look_key(b_series, c_series, None, q, pass_level, levels, cfg, label), one)
        else:
            one = _earlier_look_bounds(b_series, c_series, upto, q, pass_level, levels, cfg, label)
        why_not = one.why_not
        if one.usable:
            usable[i] = True
            upper_own[i] = one.upper
            lower_own[:, i] = one.lowers

    _, upper = cumulative_bounds(np.full(n_looks, -np.inf), upper_own, usable)
    lowers = tuple(float(cumulative_bounds(row, np.full(n_looks, np.inf), usable)[0][-1]) for row in lower_own)
    assert now is not None
    baseline_ms, canary_ms, log_estimate, tie_widened = _point_values(b_now, c_now, q)
    return _QuantileRatioBounds(
        name=name,
        metric=metric,
        baseline_ms=baseline_ms,
        canary_ms=canary_ms,
        log_threshold=math.log(threshold),
        threshold=threshold,
        log_estimate=float(log_estimate),
        upper=float(upper[-1]),
        lowers=lowers,
        usable=bool(usable.any()),
        n_baseline=b_now.n_ok,
        n_canary=c_now.n_ok,
        looks_used=int(usable.sum()),
        dropped=(b_series.dropped, c_series.dropped),
        why_not=why_not,
        errors=(b_now.n_errors, c_now.n_errors),
        deff=(b_now.deff, c_now.deff),
        pairing=now.pairing, autocorrelation=now.autocorrelation, drift_factor=now.drift_factor,
        looks_paired=now.looks, correlation=cfg.look_correlation_max, correlation_estimate=estimate,
        beyond_plan=bool(estimate > stats.LOOK_CORRELATION_CEILING),
        blocks=(b_now.n_blocks, c_now.n_blocks), block_kind=b_series.block_kind, tie_widened=tie_widened,
    )


def _error_rate_bounds(
    baseline: LatencySamples, canary: LatencySamples, cfg: GatesConfig, plan: _LookPlan, fail_levels: Sequence[float]
) -> _ErrorRateBounds:
    """Newcombe bounds of the error-rate difference: upper at alpha, lower at each fail level.

    Errors come in bursts: each arm's counts enter Wilson's limits divided by its error-count
    design effect over the looks (an effective sample size: a burst of B errors in one look
    weighs about as one), so a few bursts cannot pass for many independent errors.
    """
    boundary_look, planned, information = plan.boundary_look, plan.planned, plan.information
    nb, nc = int(baseline.n_total), int(canary.n_total)
    eb, ec = int(baseline.n_errors), int(canary.n_errors)
    if nb < 1 or nc < 1:
        return _ErrorRateBounds(usable=False, can_fail=False, nb=nb, nc=nc, eb=eb, ec=ec)
    db, dc = _error_count_design_effect(baseline), _error_count_design_effect(canary)
    counts = (eb / db, nb / db, ec / dc, nc / dc)
    z_pass = z(cfg.alpha, boundary_look, planned, cfg, information)
    diff, _, upper = stats.newcombe_difference_interval(*counts, np.inf, z_pass)
    lowers = []
    for level in fail_levels:
        _, lower, _ = stats.newcombe_difference_interval(*counts, z(level, boundary_look, planned, cfg, information), np.inf)
        lowers.append(float(lower))
    return _ErrorRateBounds(
        usable=min(nb, nc) >= cfg.min_requests_per_arm,
        # An error-rate jump can be judged with few requests (Newcombe's
        # interval keeps its coverage), so a canary that errors on everything
        # fails even before the latency gates have enough samples.
        can_fail=True,
        nb=nb,
        nc=nc,
        eb=eb,
        ec=ec,
        diff=float(diff),
        upper=float(upper),
        lowers=tuple(lowers),
        deff=(db, dc),
    )


def _level_text(level: float) -> str:
    return f"{level:.4g}"


def _deff_text(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else "n/a"


def _pairing_text(pairing: float, lead: str = "; ") -> str:
    """How pairing the arms by look scaled the ratio's variance ("" when they are not paired)."""
    if not math.isfinite(pairing):
        return ""
    return f"{lead}paired by look: x{pairing:.2f} the arms' own variances, drift-robust over the looks"


def _critical_text(pair: _ArmPair, level: float) -> str:
    critical = pair.critical(level)
    if critical is None:
        return f"t on {pair.df:.1f} df"
    return f"drift-robust critical value {critical:.2f} over {pair.looks} looks, correlation <= {pair.correlation:g}"


def _dependence_text(bounds: _QuantileRatioBounds) -> str:
    """The detail's sentence on dependence across looks ("" when the arms are not paired by look)."""
    if not math.isfinite(bounds.pairing):
        return ""
    rb, rc, rd = (f"{r:.2f}" if math.isfinite(r) else "n/a" for r in bounds.autocorrelation)
    factor = f"{bounds.drift_factor:.2f}" if math.isfinite(bounds.drift_factor) else "n/a"
    estimate = bounds.correlation_estimate
    observed = f"; its look-to-look correlation estimated {estimate:.2f}" if math.isfinite(estimate) else ""
    return (
        f" Dependence across {bounds.looks_paired} looks: lag-1 autocorrelation baseline {rb}, canary {rc}, "
        f"contrast {rd}{observed}; variance x{factor} that of independent looks; critical values hold for look-to-look "
        f"correlation <= {bounds.correlation:g}."
    )


def _blocks_text(bounds: _QuantileRatioBounds) -> str:
    """The detail's sentence on blocks, design effects, errors and ties (the numbers a reader checks)."""
    text = (
        f"Blocks: {bounds.block_kind}; design effect (block/iid variance) baseline {_deff_text(bounds.deff[0])}, "
        f"canary {_deff_text(bounds.deff[1])} over {bounds.blocks[0]}/{bounds.blocks[1]} blocks"
        f"{_pairing_text(bounds.pairing)}; "
        f"failed requests as +inf: baseline {bounds.errors[0]}, canary {bounds.errors[1]}."
    ) + _dependence_text(bounds)
    if bounds.tie_widened:
        text += " Ties: bounds widened to the neighbouring distinct values."
    return text


def _not_usable_reason(bounds: _QuantileRatioBounds, reason: str) -> str:
    """The reason, or why the gate has no bounds; with the current look's gap when an earlier look had some."""
    if not bounds.usable:
        return bounds.why_not
    return f"{reason} {bounds.why_not}" if bounds.why_not else reason


def _ratio_gate_result(
    bounds: _QuantileRatioBounds,
    verdict: Verdict,
    lower_log: float,
    fail_level: float,
    reason: str,
    cfg: GatesConfig,
    plan: _LookPlan,
) -> GateResult:
    """The GateResult of a quantile-ratio gate (objective or guardrail), bounds back on the ratio scale."""
    estimate = math.exp(bounds.log_estimate) if math.isfinite(bounds.log_estimate) else None
    lower = math.exp(lower_log) if not math.isnan(lower_log) else float("nan")
    upper = math.exp(bounds.upper) if not math.isnan(bounds.upper) else float("nan")
    bounded = math.isfinite(lower_log) and math.isfinite(bounds.upper)  # a bound at 0 or inf is no interval
    interval = interval_or_none(lower, upper) if (bounded and lower <= upper) else None
    windows = f"intersected over {bounds.looks_used} look(s)" if bounds.looks_used > 1 else "this look"
    dropped = ""
    if any(bounds.dropped):
        dropped = f" Dropped non-finite/non-positive samples: baseline {bounds.dropped[0]}, canary {bounds.dropped[1]}."
    dropped += f" {_blocks_text(bounds)}"
    return GateResult(
        name=bounds.name,
        metric=bounds.metric,
        baseline=finite_or_none(bounds.baseline_ms),
        canary=finite_or_none(bounds.canary_ms),
        threshold=bounds.threshold,
        verdict=verdict,
        estimate=finite_or_none(estimate),
        interval=interval,
        n_baseline=bounds.n_baseline,
        n_canary=bounds.n_canary,
        look=plan.look,
        detail=(
            f"{reason} Bounds: lower at alpha {_level_text(fail_level)}, upper at alpha {_level_text(cfg.alpha)}, "
            f"look {plan.boundary_look}/{plan.planned} ({cfg.spending} spending), {windows}; latencies in ms.{dropped}{plan.note}"
        ),
    )


def _objective_result(baseline: LatencySamples, canary: LatencySamples, cfg: GatesConfig, plan: _LookPlan) -> GateResult:
    """The TPOT p50 objective: both sides at alpha, no multiplicity.

    Pass is the promote side; fail means 'does not deliver the improvement',
    not a false-alarm risk, so it needs no Holm adjustment.
    """
    alpha = cfg.alpha
    threshold = 1.0 - cfg.tpot_p50_min_improvement
    bounds = _quantile_ratio_bounds(
        name=OBJECTIVE_NAME, metric="tpot_p50_ratio", q=0.5, field="tpot_s", baseline=baseline, canary=canary,
        threshold=threshold, cfg=cfg, plan=plan, fail_levels=[alpha], fold=True,
    )
    lower_log = bounds.lowers[0]
    code = int(upper_is_good_verdict(lower_log, bounds.upper, bounds.log_threshold, bounds.usable, bounds.usable))
    verdict = CODE_TO_VERDICT[code]
    beyond = ""
    if bounds.beyond_plan:  # no critical value covers such looks: never a pass, and the detail says why
        beyond = (
            f" Dependence beyond the plan: the looks' TPOT contrast persists more (look-to-look correlation estimated "
            f"{bounds.correlation_estimate:.2f} > {stats.LOOK_CORRELATION_CEILING:g}: a drift or a trend) than any "
            "critical value covers; a twin baseline or a longer run is needed."
        )
        if verdict is Verdict.PASS:
            verdict = Verdict.INCONCLUSIVE
    if verdict is Verdict.PASS:
        reason = f"TPOT p50 ratio upper bound {math.exp(bounds.upper):.4f} < {threshold:.4g}: improvement shown."
    elif verdict is Verdict.FAIL:
        reason = f"TPOT p50 ratio lower bound {math.exp(lower_log):.4f} > {threshold:.4g}: the required improvement is absent."
    elif beyond and bounds.usable and bounds.upper < bounds.log_threshold:
        reason = f"TPOT p50 ratio upper bound {math.exp(bounds.upper):.4f} < {threshold:.4g}, but not a pass."
    else:
        reason = _not_usable_reason(bounds, f"TPOT p50 ratio interval straddles {threshold:.4g}.")
    reason += beyond
    return _ratio_gate_result(bounds, verdict, lower_log, alpha, reason, cfg, plan)


def _guardrail_bounds(
    name: str, baseline: LatencySamples, canary: LatencySamples, cfg: GatesConfig, plan: _LookPlan, levels: Sequence[float]
) -> _QuantileRatioBounds | _ErrorRateBounds:
    """The bounds one guardrail is judged on, with its fail side at every Holm level.

    A p95 over looks whose tail events cluster needs many samples for its band to fit; the quantile
    guardrails keep the drift-robust variance but take the critical values of independent looks
    (the worst case up to gates.look_correlation_max is the objective's, the promote claim's):
    at the demo's 15 x 40 a TTFT p95 of ratio 1.06 against 3.5 had no band at 0.5 under contention."""
    if name in ("ttft_p95_guard", "e2e_p95_guard"):
        cfg = cfg.model_copy(update={"look_correlation_max": 0.0})
    if name == "ttft_p95_guard":
        return _quantile_ratio_bounds(
            name=name, metric="ttft_p95_ratio", q=0.95, field="ttft_s", baseline=baseline, canary=canary,
            threshold=cfg.ttft_p95_max_ratio, cfg=cfg, plan=plan, fail_levels=levels,
        )
    if name == "e2e_p95_guard":
        assert cfg.e2e_p95_max_ratio is not None
        return _quantile_ratio_bounds(
            name=name, metric="e2e_p95_ratio", q=0.95, field="e2e_s", baseline=baseline, canary=canary,
            threshold=cfg.e2e_p95_max_ratio, cfg=cfg, plan=plan, fail_levels=levels,
        )
    return _error_rate_bounds(baseline, canary, cfg, plan, levels)


def _holm_steps(
    bounds_by_gate: Sequence[_QuantileRatioBounds | _ErrorRateBounds], cfg: GatesConfig, levels: Sequence[float]
) -> list[_HolmStep]:
    """Holm's step-down over the guardrails' fail sides: which are rejected, and at which level each was tested."""
    m = len(bounds_by_gate)
    crossings = np.zeros((m, m), dtype=bool)
    for j, bounds in enumerate(bounds_by_gate):
        if isinstance(bounds, _ErrorRateBounds):
            if bounds.can_fail:
                crossings[j] = np.array(bounds.lowers) > cfg.error_rate_max_increase
        elif bounds.usable:
            crossings[j] = np.array(bounds.lowers) > bounds.log_threshold
    rejected = stats.holm_step_down(crossings)
    n_rejected = int(rejected.sum())
    # The level each guardrail was last tested at: the rejecting step for the
    # rejected ones, the step where Holm stopped for the others.
    level_index = {
        True: max(n_rejected - 1, 0),
        False: min(n_rejected, m - 1),
    }
    steps = []
    for j in range(m):
        index = level_index[bool(rejected[j])]
        steps.append(_HolmStep(rejected=bool(rejected[j]), level_index=index, level=levels[index]))
    return steps


def _error_rate_result(bounds: _ErrorRateBounds, step: _HolmStep, holm: str, cfg: GatesConfig, plan: _LookPlan) -> GateResult:
    """The error-rate guardrail's GateResult (``holm`` is the Holm sentence for its detail)."""
    name = "error_rate_guard"
    threshold = cfg.error_rate_max_increase
    if bounds.diff is None or bounds.upper is None:
        return GateResult(
            name=name, metric="error_rate_diff", baseline=None, canary=None, threshold=threshold,
            verdict=Verdict.INCONCLUSIVE, n_baseline=bounds.nb, n_canary=bounds.nc, look=plan.look,
            detail=f"No requests recorded in an arm.{plan.note}",
        )
    upper = bounds.upper
    passed = bounds.usable and upper < threshold
    failed = step.rejected
    verdict = Verdict.FAIL if failed else (Verdict.PASS if passed else Verdict.INCONCLUSIVE)
    lower = bounds.lowers[step.level_index]
    if failed:
        reason = f"Error-rate increase lower bound {lower:.4f} > {threshold:g}."
    elif passed:
        reason = f"Error-rate increase upper bound {upper:.4f} < {threshold:g}."
    elif not bounds.usable:
        reason = f"Too few requests ({bounds.nb}/{bounds.nc} < {cfg.min_requests_per_arm} per arm) to pass."
    else:
        reason = f"Error-rate increase interval [{lower:.4f}, {upper:.4f}] straddles {threshold:g}."
    return GateResult(
        name=name,
        metric="error_rate_diff",
        baseline=bounds.eb / bounds.nb,
        canary=bounds.ec / bounds.nc,
        threshold=threshold,
        verdict=verdict,
        estimate=bounds.diff,
        interval=interval_or_none(lower, upper) if lower <= upper else None,
        n_baseline=bounds.nb,
        n_canary=bounds.nc,
        look=plan.look,
        detail=(
            f"{reason} Errors {bounds.eb}/{bounds.nb} baseline vs {bounds.ec}/{bounds.nc} "
            f"canary; Newcombe hybrid score bounds on counts divided by each arm's error-count design effect over "
            f"the looks (bursts: baseline {bounds.deff[0]:.2f}, canary {bounds.deff[1]:.2f}), upper at alpha {_level_text(cfg.alpha)}, look "
            f"{plan.boundary_look}/{plan.planned}.{holm}{plan.note}"
        ),
    )


def _quantile_guardrail_result(
    bounds: _QuantileRatioBounds, step: _HolmStep, holm: str, cfg: GatesConfig, plan: _LookPlan
) -> GateResult:
    """A p95-ratio guardrail's GateResult: fail as Holm decided, pass on the upper bound at alpha."""
    upper_ok = bounds.usable and bounds.upper < bounds.log_threshold
    failed = step.rejected
    verdict = Verdict.FAIL if failed else (Verdict.PASS if upper_ok else Verdict.INCONCLUSIVE)
    lower_log = bounds.lowers[step.level_index]
    label = bounds.metric.replace("_ratio", "").replace("_", " ").upper()
    if failed:
        reason = f"{label} ratio lower bound {math.exp(lower_log):.4f} > {bounds.threshold:g}."
    elif upper_ok:
        reason = f"{label} ratio upper bound {math.exp(bounds.upper):.4f} < {bounds.threshold:g}."
    else:
        reason = _not_usable_reason(bounds, f"{label} ratio interval straddles {bounds.threshold:g}.")
    return _ratio_gate_result(bounds, verdict, lower_log, step.level, reason + holm, cfg, plan)


def _guardrail_results(
    guardrails: Sequence[str], baseline: LatencySamples, canary: LatencySamples, cfg: GatesConfig, plan: _LookPlan
) -> list[GateResult]:
    """The enabled guardrails' results, their rollback side Holm-adjusted across them."""
    m = len(guardrails)
    levels = holm_levels(cfg.alpha, m)
    bounds_by_gate = [_guardrail_bounds(name, baseline, canary, cfg, plan, levels) for name in guardrails]
    results = []
    for bounds, step in zip(bounds_by_gate, _holm_steps(bounds_by_gate, cfg, levels)):
        holm = f" Holm over {m} guardrail(s): rollback side tested at alpha {_level_text(step.level)}."
        if isinstance(bounds, _ErrorRateBounds):
            results.append(_error_rate_result(bounds, step, holm, cfg, plan))
        else:
            results.append(_quantile_guardrail_result(bounds, step, holm, cfg, plan))
    return results


def judge_latency(
    baseline: LatencySamples,
    canary: LatencySamples,
    cfg: GatesConfig,
    look: int = 1,
    max_looks: int | None = None,
    information: Sequence[float] | None = None,
) -> list[GateResult]:
    """Latency objective and guardrails from per-request samples.

    Gates (those enabled): ``tpot_p50_improvement`` (objective: ratio of TPOT
    p50 canary/baseline must be <= 1 - tpot_p50_min_improvement),
    ``ttft_p95_guard``, ``e2e_p95_guard`` (when configured) and
    ``error_rate_guard``. Ratios are judged on repeated confidence bounds
    (block-robust order-statistic bands combined by MOVER, failed requests as
    +inf, alpha spending over ``max_looks``); the guardrails' rollback side is
    Holm-adjusted across the enabled guardrails; the promote side of each gate
    is at alpha (intersection-union). Fewer than ``min_requests_per_arm``
    samples or 2 blocks in an arm, a pass-side band past the sample, or a
    zero-width interval: inconclusive.

    ``information``, when given, holds the information fraction (requests so
    far / requests planned) of every look 1..look: alpha is then spent at
    those fractions (looks by evidence) instead of on ``max_looks`` equal steps.
    """
    boundary_look, planned, note, fractions = resolve_information(look, max_looks, cfg, information)
    plan = _LookPlan(look=look, boundary_look=boundary_look, planned=planned, note=note, information=fractions)
    results: list[GateResult] = []
    if is_enabled(OBJECTIVE_NAME, cfg):
        results.append(_objective_result(baseline, canary, cfg, plan))
    guardrails = [name for name in GUARDRAIL_NAMES if is_enabled(name, cfg)]
    if guardrails:
        results.extend(_guardrail_results(guardrails, baseline, canary, cfg, plan))
    return results


@dataclass(frozen=True)
class RatioBounds:
    """A TPOT p50 ratio other / baseline with its two-sided repeated confidence bounds (ratio scale),
    as the objective bounds canary / baseline; ``lower``/``upper`` None where no look had bounds."""

    estimate: float | None
    lower: float | None
    upper: float | None
    usable: bool
    n_baseline: int
    n_other: int
    deff: tuple[float, float]
    blocks: tuple[int, int]
    why_not: str


def tpot_p50_ratio_bounds(
    baseline: LatencySamples,
    other: LatencySamples,
    cfg: GatesConfig,
    look: int = 1,
    max_looks: int | None = None,
    information: Sequence[float] | None = None,
) -> RatioBounds:
    """The objective's interval (both sides at alpha, the same block-robust bands, looks and spending)
    for the TPOT p50 ratio ``other`` / ``baseline``: the A/A noise floor when ``other`` is a twin baseline."""
    boundary_look, planned, note, fractions = resolve_information(look, max_looks, cfg, information)
    plan = _LookPlan(look=look, boundary_look=boundary_look, planned=planned, note=note, information=fractions)
    bounds = _quantile_ratio_bounds(
        name="tpot_noise_floor", metric="tpot_p50_ratio", q=0.5, field="tpot_s", baseline=baseline, canary=other,
        threshold=1.0, cfg=cfg, plan=plan, fail_levels=[cfg.alpha],
    )
    bounded = bounds.usable and math.isfinite(bounds.lowers[0]) and math.isfinite(bounds.upper)
    return RatioBounds(
        estimate=math.exp(bounds.log_estimate) if math.isfinite(bounds.log_estimate) else None,
        lower=math.exp(bounds.lowers[0]) if bounded else None,
        upper=math.exp(bounds.upper) if bounded else None,
        usable=bounded,
        n_baseline=bounds.n_baseline,
        n_other=bounds.n_canary,
        deff=bounds.deff,
        blocks=bounds.blocks,
        why_not=bounds.why_not,
    )


class LookDependence(pydantic.BaseModel):
    """How much the TPOT p50 of each arm persists from look to look (decision.json's ``experiment.dependence``)."""

    looks: int = Field(description="Looks with samples of both arms.")
    autocorrelation: dict[str, float | None] = Field(
        description="Lag-1 autocorrelation of each arm's per-look share of its TPOT p50's error, and of their "
        "contrast (canary - baseline): near 0 when looks are independent, positive when a level persists."
    )
    design_effect: float | None = Field(
        description="The contrast's drift-robust variance over the variance that treats looks as independent "
        "(above 1: persistence the intervals widened for)."
    )
    look_correlation_max: float = Field(description="The look-to-look correlation the plan's critical values hold for.")
    correlation_estimate: float | None = Field(
        None, description="The contrast's own look-to-look correlation, its lag-1 autocorrelation corrected for the "
        "few looks (None before 6 looks)."
    )
    critical_correlation: float | None = Field(
        None, description="The correlation the objective's critical values held for at the last look: the plan's, "
        "or the estimate rounded up (at most 0.9) where it was larger."
    )
    beyond_plan: bool = Field(
        False, description="The estimate is above 0.9 (a drift or a trend no critical value covers): the objective "
        "cannot pass, and says so."
    )

    @pydantic.model_serializer(mode="wrap")
    def _without_unread(self, handler: pydantic.SerializerFunctionWrapHandler) -> dict:
        # a document written before the estimate was read keeps its own keys when it is read and written again
        data = handler(self)
        for key in ("correlation_estimate", "critical_correlation"):
            if data.get(key) is None:
                data.pop(key, None)
        if not data.get("beyond_plan", False):
            data.pop("beyond_plan", None)
        return data


def look_dependence(baseline: LatencySamples, canary: LatencySamples, cfg: GatesConfig) -> LookDependence | None:
    """The TPOT p50's dependence across looks as the objective's intervals see it (None without looks in both;
    its numbers None before two looks of both arms)."""
    b_series, c_series = _arm_series(baseline, "tpot_s"), _arm_series(canary, "tpot_s")
    if b_series.looks is None or c_series.looks is None or not (b_series.values.size and c_series.values.size):
        return None
    pair = _pair_arms(b_series.up_to(None, 0.5), c_series.up_to(None, 0.5), 0.5, cfg.look_correlation_max)
    if not math.isfinite(pair.pairing):
        return LookDependence(
            looks=int(np.union1d(b_series.looks, c_series.looks).size),
            autocorrelation={"baseline": None, "canary": None, "contrast": None},
            design_effect=None, look_correlation_max=cfg.look_correlation_max,
        )
    rb, rc, rd = (finite_or_none(r) for r in pair.autocorrelation)
    estimate = pair.correlation_estimate
    return LookDependence(
        looks=pair.looks, autocorrelation={"baseline": rb, "canary": rc, "contrast": rd},
        design_effect=finite_or_none(pair.drift_factor), look_correlation_max=cfg.look_correlation_max,
        correlation_estimate=finite_or_none(estimate),
        critical_correlation=stats.folded_look_correlation(estimate, cfg.look_correlation_max),
        beyond_plan=bool(estimate > stats.LOOK_CORRELATION_CEILING),
    )
