"""Proof by simulation: the error rates and power of the gates, measured.

``run_calibration(trials, seed)`` simulates many canary runs with realistic
data and pushes them through the gate code the controller runs
(the ``rollout.judge`` kernels and ``rollout.judge.stats``), with the controller's look
schedule: ``max_looks`` equal windows, a look after each, stop as soon as
``is_final``. The simulation is vectorised over trials (numpy), so it calls
the array kernels the judges are built from rather than the per-run
``judge_*`` wrappers; ``verify_against_judges`` replays simulated trials
through the real ``judge_latency``/``judge_accuracy`` and counts
disagreements (the tests require zero).

What is simulated, and why
--------------------------
Latency (per arm, per request; successful requests only, errors counted):
    TPOT and TTFT are lognormal per request, multiplied by a load factor that
    both arms share (each window has its own level, and load drifts within a
    window), because the arms run at the same time under the same offered
    load per replica (Kayenta's rule, DESIGN.md). TTFT reacts more strongly
    to load than TPOT (queueing). A few percent of requests hit a stall
    (preemption, a long prefill in the batch) that multiplies their latency
    by 1 + Pareto(1.5): a heavy tail with infinite variance. E2E = TTFT +
    TPOT * (output tokens - 1) with lognormal output lengths.
Accuracy (paired items): each item falls in one of four cells (both right,
    both wrong, only baseline right, only canary right). With no true change
    the arms still disagree on ``discordance`` of the items (GPU batching
    makes greedy outputs flip a few answers either way); a drop of d points
    moves d of the items from 'both right' to 'only baseline right'.
Divergence: canary and twin diverge from the baseline on independent items
    at the same rate (A/A).

Scenarios reported
------------------
* ``aa``: nothing changes. false_rollback_rate = P(any guardrail, the
  accuracy gate or the divergence gate fails at any of the planned looks)
  -- counted over all looks, not only until the run would have stopped, so
  it bounds the real rate from above. false_promote_rate = P(the objective
  passes at some look), an upper bound of P(PROMOTE).
* ``boundary``: the canary's TPOT p50 is exactly (1 - min improvement) x
  the baseline's. false_promote_rate = P(objective passes at some look).
* ``guardrail_boundary``: TTFT p95 ratio exactly at its limit and the error
  rate exactly ``error_rate_max_increase`` higher: the Holm family's
  false-rollback rate.
* ``accuracy_boundary``: the canary's accuracy drop exactly equals the
  margin: P(pass) and P(fail) at any look, both errors.
* ``latency``: power to show a TPOT p50 improvement of 5/10/20% (the
  objective asked only 'is the canary faster', min improvement 0, which is
  the question Kayenta's Mann-Whitney answers), mean samples per arm until
  the objective is decided, and the same data judged once at the full
  horizon by our interval (``fixed_power``) and by a Kayenta-style
  Mann-Whitney at 98% confidence (``kayenta_power``).
* ``accuracy``: power to detect a drop of 1/2/3 points (margin 0: 'is the
  canary worse'), mean items until decided, vs the unpaired two-proportion
  z-test on all items of the same data.
* ``broken_config``: 95% -> 1% accuracy, checked after every item with the
  always-valid rule (``judge_accuracy(..., interim=True)``): items to fail.

At the configured thresholds (``boundary``) the power of a correct judge is,
by construction, at most alpha; that is why power is reported for detecting
a change rather than for clearing the configured minimum.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from rollout.judge import stats
from rollout.judge.accuracy import early_stop_log_threshold, judge_accuracy
from rollout.judge.config import GatesConfig
from rollout.judge.latency import LatencySamples, cumulative_bounds, judge_latency
from rollout.judge.looks import FAIL_CODE, INCONCLUSIVE_CODE, PASS_CODE, holm_levels, upper_is_good_verdict
from rollout.judge.names import ACCURACY_NAME, DIVERGENCE_NAME, GUARDRAIL_NAMES, OBJECTIVE_NAME
from rollout.judge.verdicts import Verdict, is_enabled

__all__ = [
    "LatencyModel",
    "AccuracyModel",
    "CalibrationDesign",
    "run_calibration",
    "verify_against_judges",
    "format_table",
    "main",
]


@dataclass(frozen=True)
class LatencyModel:
    """Per-request latency generator (seconds); see the module docstring."""

    tpot_median_s: float = 0.030
    tpot_sigma: float = 0.25
    ttft_median_s: float = 0.25
    ttft_sigma: float = 0.6
    output_tokens_median: float = 180.0
    output_tokens_sigma: float = 0.8
    window_load_sigma: float = 0.20  # log-sd of the shared per-window load level
    drift_load_sigma: float = 0.10  # log-sd of the shared load drift inside a window
    drift_segments: int = 10  # load drift pieces per window
    tpot_load_exponent: float = 1.0
    ttft_load_exponent: float = 2.0  # queueing: TTFT reacts more to load
    stall_probability: float = 0.03
    stall_pareto_shape: float = 1.5
    error_rate: float = 0.002


@dataclass(frozen=True)
class AccuracyModel:
    """Paired eval outcomes; defaults echo gsm8k on MiMo (0.95, 1319 items)."""

    baseline_accuracy: float = 0.95
    discordance: float = 0.03  # share of items the arms disagree on with no true change
    divergence_rate: float = 0.02  # canary and twin greedy divergence from baseline (A/A)
    broken_accuracy: float = 0.01


@dataclass(frozen=True)
class CalibrationDesign:
    requests_per_window: int = 100  # successful requests per arm per window (look)
    eval_items: int = 1319
    latency_effects: tuple[float, ...] = (0.05, 0.10, 0.20)
    accuracy_drops_points: tuple[float, ...] = (1.0, 2.0, 3.0)
    broken_check_items: int = 200  # items simulated for the broken-config scenario
    latency: LatencyModel = field(default_factory=LatencyModel)
    accuracy: AccuracyModel = field(default_factory=AccuracyModel)


# ---------------------------------------------------------------------------
# Simulated data
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _ArmData:
    ttft: np.ndarray  # (trials, looks, n)
    tpot: np.ndarray
    e2e: np.ndarray
    errors: np.ndarray  # (trials, looks) errors per window


def _shared_load(rng: np.random.Generator, trials: int, looks: int, n: int, model: LatencyModel) -> np.ndarray:
    window = rng.normal(0.0, model.window_load_sigma, (trials, looks, 1))
    drift = rng.normal(0.0, model.drift_load_sigma, (trials, looks, model.drift_segments))
    segment = (np.arange(n) * model.drift_segments) // n
    return window + drift[:, :, segment]  # log load, shared by both arms


def _simulate_arm(
    rng: np.random.Generator,
    log_load: np.ndarray,
    model: LatencyModel,
    tpot_ratio: float = 1.0,
    ttft_ratio: float = 1.0,
    error_rate: float | None = None,
) -> _ArmData:
    shape = log_load.shape
    stall = np.where(rng.random(shape) < model.stall_probability, 1.0 + rng.pareto(model.stall_pareto_shape, shape), 1.0)
    tpot = (
        model.tpot_median_s
        * tpot_ratio
        * np.exp(model.tpot_load_exponent * log_load + rng.normal(0.0, model.tpot_sigma, shape))
        * np.sqrt(stall)
    )
    ttft = (
        model.ttft_median_s
        * ttft_ratio
        * np.exp(model.ttft_load_exponent * log_load + rng.normal(0.0, model.ttft_sigma, shape))
        * stall
    )
    tokens = np.maximum(2.0, np.round(model.output_tokens_median * np.exp(rng.normal(0.0, model.output_tokens_sigma, shape))))
    e2e = ttft + tpot * (tokens - 1.0)
    p_error = model.error_rate if error_rate is None else error_rate
    # Errors come on top of the n successful requests of a window (the load
    # generator keeps offering load): n_total = successes + errors.
    errors = rng.binomial(shape[-1], p_error / (1.0 - p_error), shape[:2])
    return _ArmData(ttft=ttft, tpot=tpot, e2e=e2e, errors=errors)


# ---------------------------------------------------------------------------
# The latency judge, vectorised over trials (mirrors latency.judge_latency)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _LatencyVerdicts:
    names: tuple[str, ...]
    codes: np.ndarray  # (looks, trials, gates)
    n_per_look: np.ndarray  # (looks,) successful samples per arm at each look


def _log_quantiles_by_look(values: np.ndarray, q: float) -> tuple[np.ndarray, np.ndarray]:
    trials, looks, n = values.shape
    logs, ses = [], []
    for look in range(1, looks + 1):
        pooled = np.sort(values[:, :look, :].reshape(trials, look * n), axis=-1)
        log_q, se = stats.log_quantile_with_se(pooled, q)
        logs.append(log_q)
        ses.append(se)
    return np.stack(logs), np.stack(ses)  # (looks, trials)


def _z_by_look(alpha: float, looks: int, cfg: GatesConfig) -> np.ndarray:
    return np.array([stats.critical_value(alpha, k, looks, cfg.spending) for k in range(1, looks + 1)])[:, None]


def _ratio_bounds(
    baseline: np.ndarray, canary: np.ndarray, q: float, cfg: GatesConfig, levels: Sequence[float]
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Cumulative upper bound (pass side, alpha) and lower bounds per level, log scale, (looks, trials)."""
    looks = baseline.shape[1]
    log_b, se_b = _log_quantiles_by_look(baseline, q)
    log_c, se_c = _log_quantiles_by_look(canary, q)
    usable = np.ones_like(log_b, dtype=bool)  # every look has >= min_requests_per_arm (checked by caller)
    _, _, _, upper_own = stats.log_ratio_interval(log_b, se_b, log_c, se_c, np.inf, _z_by_look(cfg.alpha, looks, cfg))
    _, upper = cumulative_bounds(np.full_like(upper_own, -np.inf), upper_own, usable)
    lowers = []
    for level in levels:
        _, _, lower_own, _ = stats.log_ratio_interval(log_b, se_b, log_c, se_c, _z_by_look(level, looks, cfg), np.inf)
        lower, _ = cumulative_bounds(lower_own, np.full_like(lower_own, np.inf), usable)
        lowers.append(lower)
    return upper, lowers


def _latency_verdicts(baseline: _ArmData, canary: _ArmData, cfg: GatesConfig) -> _LatencyVerdicts:
    trials, looks, n = baseline.tpot.shape
    if looks != cfg.max_looks:
        raise ValueError("simulated windows must equal cfg.max_looks")
    if n < cfg.min_requests_per_arm:
        raise ValueError("simulate at least min_requests_per_arm requests per window")
    names: list[str] = []
    codes: list[np.ndarray] = []
    alpha = cfg.alpha

    if is_enabled(OBJECTIVE_NAME, cfg):
        upper, (lower,) = _ratio_bounds(baseline.tpot, canary.tpot, 0.5, cfg, [alpha])
        names.append(OBJECTIVE_NAME)
        codes.append(upper_is_good_verdict(lower, upper, math.log(1.0 - cfg.tpot_p50_min_improvement), True, True))

    guardrails = [name for name in GUARDRAIL_NAMES if is_enabled(name, cfg)]
    m = len(guardrails)
    if m:
        levels = holm_levels(alpha, m)
        crossings = np.zeros((looks, trials, m, m), dtype=bool)
        pass_flags = np.zeros((looks, trials, m), dtype=bool)
        for j, name in enumerate(guardrails):
            if name in ("ttft_p95_guard", "e2e_p95_guard"):
                field_name, limit = (
                    ("ttft", cfg.ttft_p95_max_ratio) if name == "ttft_p95_guard" else ("e2e", cfg.e2e_p95_max_ratio)
                )
                upper, lowers = _ratio_bounds(getattr(baseline, field_name), getattr(canary, field_name), 0.95, cfg, levels)
                log_limit = math.log(limit)
                pass_flags[:, :, j] = upper < log_limit
                crossings[:, :, j, :] = np.stack(lowers, axis=-1) > log_limit
            else:
                eb = np.cumsum(baseline.errors, axis=1).T  # (looks, trials)
                ec = np.cumsum(canary.errors, axis=1).T
                ns = (np.arange(1, looks + 1) * n)[:, None]
                nb, nc = ns + eb, ns + ec
                _, _, upper = stats.newcombe_difference_interval(eb, nb, ec, nc, np.inf, _z_by_look(alpha, looks, cfg))
                pass_flags[:, :, j] = upper < cfg.error_rate_max_increase
                for i, level in enumerate(levels):
                    _, lower, _ = stats.newcombe_difference_interval(eb, nb, ec, nc, _z_by_look(level, looks, cfg), np.inf)
                    crossings[:, :, j, i] = lower > cfg.error_rate_max_increase
        rejected = stats.holm_step_down(crossings)
        for j, name in enumerate(guardrails):
            names.append(name)
            codes.append(np.where(rejected[:, :, j], FAIL_CODE, np.where(pass_flags[:, :, j], PASS_CODE, INCONCLUSIVE_CODE)))
    return _LatencyVerdicts(
        names=tuple(names),
        codes=np.stack(codes, axis=-1),
        n_per_look=np.arange(1, looks + 1) * n,
    )


def _first_look(mask: np.ndarray) -> np.ndarray:
    """Index of the first True along axis 0, or -1 (mask: (looks, trials))."""
    any_true = mask.any(axis=0)
    return np.where(any_true, mask.argmax(axis=0), -1)


def _final_mask(codes: np.ndarray) -> np.ndarray:
    """verdicts.is_final per look and trial, from verdict codes (looks, trials, gates)."""
    return (codes == FAIL_CODE).any(axis=-1) | (codes != INCONCLUSIVE_CODE).all(axis=-1)


def _samples_at(first: np.ndarray, n_per_look: np.ndarray) -> np.ndarray:
    return np.where(first >= 0, n_per_look[np.maximum(first, 0)], n_per_look[-1])


# ---------------------------------------------------------------------------
# The accuracy judge, vectorised (mirrors accuracy.judge_accuracy)
# ---------------------------------------------------------------------------


def _paired_items(
    rng: np.random.Generator, trials: int, items: int, model: AccuracyModel, drop: float
) -> tuple[np.ndarray, np.ndarray]:
    """(baseline_correct, canary_correct), each (trials, items) bool."""
    only_canary = model.discordance / 2.0
    only_baseline = model.discordance / 2.0 + drop
    both_right = model.baseline_accuracy - only_baseline
    if both_right < 0 or 1.0 - model.baseline_accuracy - only_canary < 0:
        raise ValueError("accuracy model cells must be non-negative")
    u = rng.random((trials, items))
    baseline = u < model.baseline_accuracy  # both right or only baseline right
    canary = (u < both_right) | ((u >= model.baseline_accuracy) & (u < model.baseline_accuracy + only_canary))
    return baseline, canary


def _look_ends(items: int, looks: int) -> np.ndarray:
    return np.array([round(items * k / looks) for k in range(1, looks + 1)])


def _paired_verdicts(first: np.ndarray, second: np.ndarray, margin: float, cfg: GatesConfig) -> tuple[np.ndarray, np.ndarray]:
    """Verdict codes (looks, trials) of the paired margin gate, and items per look."""
    trials, items = first.shape
    looks = cfg.max_looks
    ends = _look_ends(items, looks)
    n12 = np.cumsum(first & ~second, axis=1)[:, ends - 1].T  # (looks, trials)
    n21 = np.cumsum(~first & second, axis=1)[:, ends - 1].T
    ns = ends[:, None].astype(float)
    alpha_fail = cfg.alpha * (1.0 - cfg.early_stop_alpha_fraction)
    lower, upper = stats.tango_interval(n12, n21, ns, _z_by_look(alpha_fail, looks, cfg), _z_by_look(cfg.alpha, looks, cfg))
    enough = ns >= cfg.min_eval_items
    codes = upper_is_good_verdict(lower, upper, margin, enough, enough)
    early_item = _early_stop_items(first.astype(np.int8) - second.astype(np.int8), margin, -1.0, cfg)
    early_by_look = (early_item[None, :] >= 0) & (early_item[None, :] < ends[:, None])
    return np.where(early_by_look, FAIL_CODE, codes), ends


def _early_stop_items(x: np.ndarray, margin: float, lower_bound: float, cfg: GatesConfig) -> np.ndarray:
    """0-based item index where the always-valid rule first fires, or -1."""
    threshold = early_stop_log_threshold(cfg)
    if not math.isfinite(threshold):
        return np.full(x.shape[0], -1)
    log_wealth = stats.betting_log_wealth(x, margin, lower_bound)
    return _first_look((log_wealth >= threshold).T)


# ---------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------


def _rate(mask: np.ndarray) -> float:
    return float(np.mean(mask))


@dataclass(frozen=True)
class _CalibrationRun:
    """What every scenario of one calibration shares: its setup and its random streams.

    ``streams`` yields one independent generator per simulated data set. The
    scenarios draw them in a fixed order, so that one seed reproduces the same
    numbers; a scenario added or reordered changes every later one.
    """

    trials: int
    cfg: GatesConfig
    design: CalibrationDesign
    streams: Iterator[np.random.Generator]

    @property
    def looks(self) -> int:
        return self.cfg.max_looks

    @property
    def n(self) -> int:
        """Successful requests per arm per window."""
        return self.design.requests_per_window

    def next_stream(self) -> np.random.Generator:
        return next(self.streams)

    def latency_pair(
        self, tpot_ratio: float = 1.0, ttft_ratio: float = 1.0, canary_error_rate: float | None = None
    ) -> tuple[_ArmData, _ArmData]:
        """Baseline and canary latencies under one shared load, from the next stream."""
        rng = self.next_stream()
        lat_model = self.design.latency
        load = _shared_load(rng, self.trials, self.looks, self.n, lat_model)
        baseline = _simulate_arm(rng, load, lat_model)
        canary = _simulate_arm(rng, load, lat_model, tpot_ratio, ttft_ratio, canary_error_rate)
        return baseline, canary


def _no_harm_indices(names: Sequence[str]) -> list[int]:
    """Positions of the gates that can only roll back (every latency gate but the objective)."""
    return [i for i, name in enumerate(names) if name != OBJECTIVE_NAME]


def _objective_passes(verdicts: _LatencyVerdicts, trials: int) -> np.ndarray:
    """Per trial: whether the objective passed at some look (all False when it is disabled)."""
    if OBJECTIVE_NAME in verdicts.names:
        return (verdicts.codes[:, :, verdicts.names.index(OBJECTIVE_NAME)] == PASS_CODE).any(axis=0)
    return np.zeros(trials, bool)


def _aa_scenario(run: _CalibrationRun) -> dict:
    """A/A, nothing changes: false rollbacks of every no-harm gate at any look, false promotes of the objective."""
    trials, cfg, items, acc_model = run.trials, run.cfg, run.design.eval_items, run.design.accuracy
    baseline, canary = run.latency_pair()
    aa = _latency_verdicts(baseline, canary, cfg)
    guard_idx = _no_harm_indices(aa.names)
    latency_false_fail = (aa.codes[:, :, guard_idx] == FAIL_CODE).any(axis=(0, 2))
    objective_pass_aa = _objective_passes(aa, trials)

    acc_rng = run.next_stream()
    b_correct, c_correct = _paired_items(acc_rng, trials, items, acc_model, 0.0)
    acc_codes, _ = _paired_verdicts(b_correct, c_correct, cfg.accuracy_margin, cfg)
    accuracy_false_fail = (acc_codes == FAIL_CODE).any(axis=0)
    div_rng = run.next_stream()
    canary_div = div_rng.random((trials, items)) < acc_model.divergence_rate
    twin_div = div_rng.random((trials, items)) < acc_model.divergence_rate
    div_codes, _ = _paired_verdicts(canary_div, twin_div, cfg.divergence_margin, cfg)
    divergence_false_fail = (div_codes == FAIL_CODE).any(axis=0)
    if not is_enabled(ACCURACY_NAME, cfg):
        accuracy_false_fail[:] = False
    if not is_enabled(DIVERGENCE_NAME, cfg):
        divergence_false_fail[:] = False
    any_false_fail = latency_false_fail | accuracy_false_fail | divergence_false_fail

    aa_final = _first_look(_final_mask(aa.codes))
    return {
        "false_promote_rate": _rate(objective_pass_aa),
        "false_rollback_rate": _rate(any_false_fail),
        "false_rollback_latency_guardrails": _rate(latency_false_fail),
        "false_rollback_accuracy": _rate(accuracy_false_fail),
        "false_rollback_divergence": _rate(divergence_false_fail),
        "mean_samples_to_final": float(np.mean(_samples_at(aa_final, aa.n_per_look))),
    }


def _boundary_scenario(run: _CalibrationRun) -> dict:
    """True TPOT improvement exactly the configured minimum: P(objective passes), P(all latency gates pass)."""
    trials, cfg = run.trials, run.cfg
    baseline, canary = run.latency_pair(tpot_ratio=1.0 - cfg.tpot_p50_min_improvement)
    bd = _latency_verdicts(baseline, canary, cfg)
    objective_pass = _objective_passes(bd, trials)
    bd_final = _first_look(_final_mask(bd.codes))
    promoted = np.zeros(trials, bool)
    has_final = bd_final >= 0
    promoted[has_final] = (bd.codes[bd_final[has_final], np.flatnonzero(has_final)] == PASS_CODE).all(axis=-1)
    return {
        "tpot_p50_ratio": 1.0 - cfg.tpot_p50_min_improvement,
        "false_promote_rate": _rate(objective_pass),
        "latency_promote_rate": _rate(promoted),
    }


def _guardrail_boundary_scenario(run: _CalibrationRun) -> dict:
    """Guardrails exactly at their limits: the Holm family's false-rollback rate."""
    cfg = run.cfg
    baseline, canary = run.latency_pair(
        ttft_ratio=cfg.ttft_p95_max_ratio, canary_error_rate=run.design.latency.error_rate + cfg.error_rate_max_increase
    )
    gb = _latency_verdicts(baseline, canary, cfg)
    gb_idx = _no_harm_indices(gb.names)
    return {
        "guardrails": [gb.names[i] for i in gb_idx],
        "false_rollback_rate": _rate((gb.codes[:, :, gb_idx] == FAIL_CODE).any(axis=(0, 2))),
    }


def _accuracy_boundary_scenario(run: _CalibrationRun) -> dict:
    """Accuracy drop exactly at the non-inferiority margin.

    Both verdicts are errors here: a pass promotes a canary that is not
    non-inferior, a fail rolls back one that is within the margin.
    """
    cfg = run.cfg
    rng = run.next_stream()
    b_correct, c_correct = _paired_items(rng, run.trials, run.design.eval_items, run.design.accuracy, cfg.accuracy_margin)
    margin_codes, _ = _paired_verdicts(b_correct, c_correct, cfg.accuracy_margin, cfg)
    return {
        "drop_points": 100.0 * cfg.accuracy_margin,
        "false_promote_rate": _rate((margin_codes == PASS_CODE).any(axis=0)),
        "false_rollback_rate": _rate((margin_codes == FAIL_CODE).any(axis=0)),
    }


def _latency_power_rows(run: _CalibrationRun) -> list[dict]:
    """Power to detect each TPOT improvement, sequential vs fixed horizon vs Kayenta's Mann-Whitney."""
    trials, looks, n = run.trials, run.looks, run.n
    detect_cfg = run.cfg.model_copy(update={"tpot_p50_min_improvement": 0.0})
    fixed_cfg = detect_cfg.model_copy(update={"max_looks": 1})

    def pooled(arm: _ArmData) -> np.ndarray:
        """All windows' TPOT samples as one look, (trials, 1, looks * n)."""
        return arm.tpot.reshape(trials, 1, looks * n)

    latency_rows = []
    for effect in run.design.latency_effects:
        baseline, canary = run.latency_pair(tpot_ratio=1.0 - effect)
        verdicts = _latency_verdicts(baseline, canary, detect_cfg)
        obj = verdicts.codes[:, :, verdicts.names.index(OBJECTIVE_NAME)]
        decided = _first_look(obj != INCONCLUSIVE_CODE)
        all_final = _first_look(_final_mask(verdicts.codes))
        all_pass = (verdicts.codes == PASS_CODE).all(axis=-1).any(axis=0)
        # Fixed horizon: one analysis of all windows, full alpha at once.
        fixed_upper, (fixed_lower,) = _ratio_bounds(pooled(baseline), pooled(canary), 0.5, fixed_cfg, [fixed_cfg.alpha])
        fixed_pass = upper_is_good_verdict(fixed_lower, fixed_upper, 0.0, True, True)[-1] == PASS_CODE
        kayenta_p = stats.mann_whitney_less_pvalue(
            baseline.tpot.reshape(trials, looks * n), canary.tpot.reshape(trials, looks * n)
        )
        latency_rows.append(
            {
                "effect": effect,
                "power": _rate((obj == PASS_CODE).any(axis=0)),
                "mean_samples": float(np.mean(_samples_at(decided, verdicts.n_per_look))),
                "fixed_power": _rate(fixed_pass),
                "fixed_samples": int(looks * n),
                "kayenta_power": _rate(kayenta_p < 0.01),
                "mean_samples_all_gates": float(np.mean(_samples_at(all_final, verdicts.n_per_look))),
                "promote_rate": _rate(all_pass),
            }
        )
    return latency_rows


def _accuracy_power_rows(run: _CalibrationRun) -> list[dict]:
    """Power to detect each accuracy drop, paired sequential vs the unpaired two-proportion z-test."""
    cfg, trials, items = run.cfg, run.trials, run.design.eval_items
    detect_acc = cfg.model_copy(update={"accuracy_margin": 0.0})
    accuracy_rows = []
    for drop_points in run.design.accuracy_drops_points:
        rng = run.next_stream()
        b_correct, c_correct = _paired_items(rng, trials, items, run.design.accuracy, drop_points / 100.0)
        codes, ends = _paired_verdicts(b_correct, c_correct, 0.0, detect_acc)
        decided = _first_look(codes != INCONCLUSIVE_CODE)
        unpaired_p = stats.two_proportion_less_pvalue(b_correct.sum(axis=1), c_correct.sum(axis=1), items)
        accuracy_rows.append(
            {
                "drop_points": drop_points,
                "power": _rate((codes == FAIL_CODE).any(axis=0)),
                "mean_items": float(np.mean(_samples_at(decided, ends))),
                "unpaired_power": _rate(unpaired_p < cfg.alpha),
                "unpaired_items": int(items),
            }
        )
    return accuracy_rows


def _broken_config_scenario(run: _CalibrationRun) -> dict:
    """Broken config (95% -> 1%), checked after every item with the always-valid rule: items to fail."""
    cfg, acc_model = run.cfg, run.design.accuracy
    rng = run.next_stream()
    check = run.design.broken_check_items
    b_correct = rng.random((run.trials, check)) < acc_model.baseline_accuracy
    c_correct = rng.random((run.trials, check)) < acc_model.broken_accuracy
    fired = _early_stop_items(b_correct.astype(np.int8) - c_correct.astype(np.int8), cfg.accuracy_margin, -1.0, cfg)
    caught = fired >= 0
    return {
        "baseline_accuracy": acc_model.baseline_accuracy,
        "canary_accuracy": acc_model.broken_accuracy,
        "caught_rate": _rate(caught),
        "mean_items_to_fail": float(np.mean(fired[caught] + 1)) if caught.any() else None,
        "max_items_to_fail": int(np.max(fired[caught] + 1)) if caught.any() else None,
        "within_items": check,
    }


def _design_summary(run: _CalibrationRun) -> dict:
    """The simulated setup, for the published table."""
    return {
        "max_looks": run.looks,
        "requests_per_window_per_arm": run.n,
        "eval_items": run.design.eval_items,
        "spending": run.cfg.spending,
        "latency_model": asdict(run.design.latency),
        "accuracy_model": asdict(run.design.accuracy),
    }


def run_calibration(
    trials: int = 2000,
    seed: int = 0,
    cfg: GatesConfig | None = None,
    design: CalibrationDesign | None = None,
) -> dict:
    """Simulate ``trials`` canary runs per scenario; return the calibration table.

    Keys: ``alpha``, ``aa`` {false_promote_rate, false_rollback_rate, ...},
    ``boundary`` {false_promote_rate, ...}, ``guardrail_boundary``
    {false_rollback_rate}, ``accuracy_boundary`` {false_promote_rate,
    false_rollback_rate}, ``latency`` [{effect, power, mean_samples,
    fixed_power, fixed_samples, kayenta_power, ...}], ``accuracy``
    [{drop_points, power, mean_items, unpaired_power, unpaired_items}],
    ``broken_config``, ``simulation_se`` (binomial standard error of a rate
    equal to alpha) and ``design`` (the simulated setup).
    """
    if trials < 1:
        raise ValueError("trials must be >= 1")
    cfg = cfg or GatesConfig()
    design = design or CalibrationDesign()
    run = _CalibrationRun(trials=trials, cfg=cfg, design=design, streams=iter(np.random.default_rng(seed).spawn(64)))
    # A dict display evaluates left to right, so the scenarios run, and draw
    # their random streams, in the order of the published keys below.
    return {
        "alpha": cfg.alpha,
        "trials": trials,
        "seed": seed,
        "simulation_se": math.sqrt(cfg.alpha * (1.0 - cfg.alpha) / trials),
        "aa": _aa_scenario(run),
        "boundary": _boundary_scenario(run),
        "guardrail_boundary": _guardrail_boundary_scenario(run),
        "accuracy_boundary": _accuracy_boundary_scenario(run),
        "latency": _latency_power_rows(run),
        "accuracy": _accuracy_power_rows(run),
        "broken_config": _broken_config_scenario(run),
        "design": _design_summary(run),
    }


# ---------------------------------------------------------------------------
# Cross-check against the per-run judges
# ---------------------------------------------------------------------------


def verify_against_judges(trials: int = 5, seed: int = 1, cfg: GatesConfig | None = None) -> int:
    """Replay simulated trials through judge_latency / judge_accuracy.

    Returns the number of (trial, look, gate) verdicts where the vectorised
    simulation and the real judge functions disagree (0 expected).
    """
    cfg = cfg or GatesConfig(e2e_p95_max_ratio=1.3)
    design = CalibrationDesign(requests_per_window=max(40, cfg.min_requests_per_arm), eval_items=300)
    rng = np.random.default_rng(seed)
    looks, n = cfg.max_looks, design.requests_per_window
    mismatches = 0

    # Latency near the thresholds, so that all verdicts occur.
    load = _shared_load(rng, trials, looks, n, design.latency)
    baseline = _simulate_arm(rng, load, design.latency)
    canary = _simulate_arm(rng, load, design.latency, tpot_ratio=0.88, ttft_ratio=1.1, error_rate=0.01)
    sim = _latency_verdicts(baseline, canary, cfg)
    window = np.repeat(np.arange(1, looks + 1), n)

    def samples(arm: _ArmData, t: int, k: int) -> LatencySamples:
        errors = int(arm.errors[t, :k].sum())
        return LatencySamples(
            ttft_s=arm.ttft[t, :k].ravel(),
            tpot_s=arm.tpot[t, :k].ravel(),
            e2e_s=arm.e2e[t, :k].ravel(),
            n_errors=errors,
            n_total=k * n + errors,
            window=window[: k * n],
        )

    to_code = {Verdict.PASS: PASS_CODE, Verdict.FAIL: FAIL_CODE, Verdict.INCONCLUSIVE: INCONCLUSIVE_CODE}
    for t in range(trials):
        for k in range(1, looks + 1):
            results = judge_latency(samples(baseline, t, k), samples(canary, t, k), cfg, look=k)
            by_name = {r.name: to_code[r.verdict] for r in results}
            for g, name in enumerate(sim.names):
                mismatches += int(by_name.get(name) != sim.codes[k - 1, t, g])

    b_correct, c_correct = _paired_items(rng, trials, design.eval_items, design.accuracy, 0.02)
    codes, ends = _paired_verdicts(b_correct, c_correct, cfg.accuracy_margin, cfg)
    for t in range(trials):
        for k in range(1, looks + 1):
            result = judge_accuracy(b_correct[t, : ends[k - 1]], c_correct[t, : ends[k - 1]], cfg, look=k)
            mismatches += int(to_code[result.verdict] != codes[k - 1, t])
    return mismatches


# ---------------------------------------------------------------------------
# Human-readable table
# ---------------------------------------------------------------------------


def format_table(result: dict) -> str:
    """The calibration result as a few aligned text tables."""
    alpha = result["alpha"]
    se = result.get("simulation_se", float("nan"))
    design = result.get("design", {})
    lines = [
        f"Calibration: {result.get('trials', '?')} simulated runs per scenario, seed {result.get('seed', '?')}, "
        f"alpha {alpha:g} (simulation SE at alpha: {se:.4f})",
        f"Design: {design.get('max_looks', '?')} looks x {design.get('requests_per_window_per_arm', '?')} requests "
        f"per arm per window; {design.get('eval_items', '?')} paired eval items; {design.get('spending', '?')} spending",
        "",
        "Error rates (target <= alpha)",
        f"  A/A false rollback (any no-harm gate fails at any look)   {result['aa']['false_rollback_rate']:.4f}",
        f"  A/A false promote                                           {result['aa']['false_promote_rate']:.4f}",
        f"  Boundary false promote (TPOT ratio = {result['boundary']['tpot_p50_ratio']:.2f})              "
        f"{result['boundary']['false_promote_rate']:.4f}",
    ]
    if "accuracy_boundary" in result:
        ab = result["accuracy_boundary"]
        lines.append(
            f"  Accuracy drop = margin ({ab['drop_points']:.0f} pt): false promote {ab['false_promote_rate']:.4f}, "
            f"false rollback {ab['false_rollback_rate']:.4f}"
        )
    if "guardrail_boundary" in result:
        lines.append(
            f"  Guardrails at their limits: false rollback (Holm)         {result['guardrail_boundary']['false_rollback_rate']:.4f}"
        )
    lines += [
        "",
        "Latency: detect a TPOT p50 improvement (samples per arm; 'n all gates' and 'promote': every latency",
        "gate incl. TTFT p95 and error-rate guardrails decided / passed, objective asking only 'faster')",
        f"  {'effect':>6}  {'power':>6}  {'mean n':>7}  {'fixed power':>11}  {'fixed n':>7}  {'Kayenta MW98':>12}"
        f"  {'n all gates':>11}  {'promote':>7}",
    ]
    for row in result["latency"]:
        lines.append(
            f"  {row['effect']:>6.0%}  {row['power']:>6.3f}  {row['mean_samples']:>7.0f}  {row['fixed_power']:>11.3f}  "
            f"{row['fixed_samples']:>7d}  {row['kayenta_power']:>12.3f}  {row.get('mean_samples_all_gates', float('nan')):>11.0f}"
            f"  {row.get('promote_rate', float('nan')):>7.3f}"
        )
    lines += [
        "",
        "Accuracy: detect a drop (paired sequential vs unpaired fixed two-proportion test)",
        f"  {'drop':>6}  {'power':>6}  {'mean items':>10}  {'unpaired power':>14}  {'unpaired items':>14}",
    ]
    for row in result["accuracy"]:
        lines.append(
            f"  {row['drop_points']:>4.0f}pt  {row['power']:>6.3f}  {row['mean_items']:>10.0f}  "
            f"{row['unpaired_power']:>14.3f}  {row['unpaired_items']:>14d}"
        )
    broken = result.get("broken_config")
    if broken:
        lines += [
            "",
            f"Broken config ({broken['baseline_accuracy']:.0%} -> {broken['canary_accuracy']:.0%}), checked after every item: "
            f"caught {broken['caught_rate']:.3f} within {broken['within_items']} items, mean "
            f"{broken['mean_items_to_fail']:.1f}, max {broken['max_items_to_fail']} items",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``mtp-canary calibrate [--trials N] [--seed S] [--json]`` (the CLI wires this)."""
    parser = argparse.ArgumentParser(prog="mtp-canary calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000, help="simulated runs per scenario (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args(argv)
    result = run_calibration(trials=args.trials, seed=args.seed)
    sys.stdout.write(json.dumps(result, indent=2, default=float) + "\n" if args.json else format_table(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
