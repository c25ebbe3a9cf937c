"""Proof by simulation: the error rates and power of the design the controller runs, measured.

``mtp-canary calibrate [--config RUN.yaml] [--trials N] [--seed S] [--json] [--workers W]``
simulates ``trials`` canary runs per row and pushes each through the controller's own
judging path (``rollout.calibration.trial``: the looks of
``rollout.judge.experiment_looks``, ``judge_accuracy`` / ``judge_divergence`` in the
accuracy phase's batches, ``verdicts.decide``) under the run's ``gates:``,
``experiment:`` (requests_per_look, requests_per_arm, min_looks, window_s) and
``accuracy:`` (items, batch_size) config -- by default the demo's
(configs/local-cpu.yaml, embedded below). No statistic is copied here, so the
numbers follow every change to the judges. The simulated world is
``rollout.calibration.scenarios``.

Rows
----
* ``scenarios``: per latency scenario, ``false_promote_rate`` = P(the TPOT objective
  is PASS when the controller stops) with the canary exactly at the objective's bar
  (true TPOT p50 ratio 1 - tpot_p50_min_improvement) and the guardrails quiet;
  ``false_rollback_rate`` = P(a gate other than the objective is FAIL when the
  controller stops) with identical arms (A/A; the objective's own FAIL there is the
  right answer, and it ends the run as the controller would).
* ``pass_at_limit``: one gate's true value exactly at its limit (objective at its
  bar, a guardrail at its ratio / error-rate limit, accuracy drop = margin,
  divergence at its cap, acceptance length = floor), the other gates comfortably
  passing (true TPOT ratio 0.7): P(that gate is PASS at the stop). The goodput gate
  (when ``gates.slo`` sets a bound) sits at its margin in the correlated world
  ``GOODPUT_SCENARIO`` (a per-look arm-level latency): the canary's TTFT factor
  (``scenarios.goodput_boundary_spec``) makes its true goodput exactly
  ``goodput_max_decrease`` below the baseline's.
* ``power``: true TPOT ratio 0.8 and 0.7 (iid, guardrails quiet): P(objective PASS)
  and the mean completed requests per arm the controller judged when it stopped.
* ``decision``: every gate at its limit at once, accuracy phase then experiment:
  P(PROMOTE) and P(ROLLBACK) of the whole decision.
* ``noise_floor``: the experiment as ``twin_baseline: true`` runs it (a twin baseline
  arm, ``rollout.judge.noise_floor``: the objective cannot pass while the A/A TPOT p50
  ratio twin / baseline excludes 1), whatever the config says about the twin.
  ``aa_placement_S``: the canary exactly at the objective's bar against the twin (its
  config is no better than the bar), the baseline's replica on cores slower by 1/S, so
  canary / baseline measures S x bar and twin / baseline S: P(objective PASS) is a
  false promote the noise floor must stop. ``twin_power_R``: the canary truly at R, a
  true A/A twin: P(objective PASS), the power the floor leaves.
* ``goodput_aa`` (when ``gates.slo`` sets a bound and the goodput gate is enabled): per
  latency scenario, P(the goodput gate is FAIL) with identical arms, from the
  scenarios' A/A trials. Its rollback side is a family of its own at alpha, not one of
  Holm's guardrail family (that family's rollback side holds its familywise rate at
  alpha over the TTFT/E2E p95 and error-rate guardrails): the experiment's A/A false
  rollback is bounded by alpha (Holm's family) + alpha (goodput), a union bound.
* ``candidates``: per (K, scenario) of ``CANDIDATE_ROWS``, K candidate arms beside the
  baseline in one closed loop, every one exactly at the objective's bar, each judged
  against the shared baseline at alpha / K (``rollout.judge.candidates``):
  ``false_promote_rate`` = P(a winner is named); ``unadjusted_false_promote_rate`` =
  the same trials judged at alpha per candidate (the inflation the split prevents).
* ``load_curve``: the sweep's judged claim ``promote_up_to`` (``rollout.calibration.load_curve``):
  per world of correlated sweeps with a known true TPOT ratio at every load, P(a wrong "up to C"
  claim) and the power, P(C reaches the last truly paying level swept).

Every rate is <= alpha by design on its promote side (intersection-union), so
``simulation_se`` (the binomial SE of a rate equal to alpha) says how far a
measured rate may sit above alpha by chance.

The simulation functions are pure (seeded per trial, so a result does not depend
on the number of workers); the command line around them (`mtp-canary calibrate`: the
run config read, the run timed, progress on stderr) is ``rollout.commands.calibrate``.
"""

from __future__ import annotations

import fnmatch
import math
import multiprocessing
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pydantic
from scipy import optimize
from pydantic import Field

from cluster.arms import BASELINE, CANARY
from cluster.metrics import SpecDecodeStats
from loadtests.records import RequestRecord
from rollout.judge.candidates import CandidateLooks, CandidateResult, candidate_gates, candidate_view, choose_winner
from rollout.calibration.trial import (
    accuracy_skips_experiment,
    cumulative_canary_spec,
    decide_trial,
    look_ends,
    run_accuracy_batches,
    run_experiment_looks,
)
from rollout.calibration.load_curve import WORLDS as LOAD_CURVE_WORLDS, format_lines as load_curve_lines, load_curve_rows
from rollout.judge.config import GatesConfig
from rollout.judge.experiment_looks import LookPlan, next_information, requests_by_arm, warmup_end
from rollout.judge.names import (
    ACCEPTANCE_NAME,
    ACCURACY_NAME,
    DIVERGENCE_NAME,
    GOODPUT_NAME,
    GUARDRAIL_NAMES,
    OBJECTIVE_NAME,
)
from rollout.calibration.scenarios import (
    DEPENDENCE_SCENARIOS,
    LATENCY_SCENARIOS,
    AccuracyWorld,
    LatencyWorld,
    StreamShape,
    TrialSpec,
    candidate_arms,
    goodput_boundary_spec,
    paired_items,
    simulate_records,
    spec_decode_by_request,
)
from rollout.judge.verdicts import Decision, is_enabled

__all__ = [
    "DEMO_RUN_CONFIG",
    "CalibrationDesign",
    "design_from_run_config",
    "default_design",
    "TrialOutcome",
    "simulate_trial",
    "run_calibration",
    "format_table",
]

POWER_TPOT_RATIOS = (0.8, 0.7)
PLACEMENT_FACTORS = (0.8, 0.95)  # the baseline's cores slower by 1/S than the twin's and the canary's
TWIN_POWER_RATIOS = (0.7,)
PASSING_TPOT_RATIO = 0.7  # the objective comfortably passes while another gate sits at its limit
GOODPUT_SCENARIO = "arm_level_0.10"  # the goodput gate at its margin: a per-look arm-level latency (correlated requests)
CHUNK_TRIALS = 25  # trials per task handed to a worker
GOOD_CANARY_TPOT_RATIO = 0.7  # a good canary in the dependence worlds: a true 30% TPOT gain, every other gate quiet
BURST_SCENARIO = "error_bursts_10"  # the error-rate guard at its limit with errors in bursts
# The several-candidates rows: (candidates, latency scenario), every candidate at the objective's bar. iid
# gives the candidates the least in common (the baseline's requests are all they share: the most room for
# "one of them passes by chance"); arm_level_0.10 adds each arm's per-look swing, the demo's machine.
CANDIDATE_ROWS = ((2, "iid"), (3, "iid"), (3, "arm_level_0.10"))

# The sections of configs/local-cpu.yaml (`make demo`) the calibration reads; tests check
# that they equal what rollout.config.load_config makes of that file.
DEMO_RUN_CONFIG: dict[str, Any] = {
    "baseline": {"replicas": 1, "engine": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}},
    "canary": {"replicas": 1, "engine": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}},
    "twin_baseline": False,
    "accuracy": {"enabled": True, "kind": "golden", "limit": 64, "batch_size": 32},
    "experiment": {
        "enabled": True, "requests_per_look": 40, "requests_per_arm": 600, "window_s": 10, "min_looks": 1,
        "max_duration_s": 900.0, "users_per_replica": 2, "max_tokens": 16,
    },
    "gates": {
        "alpha": 0.05, "accuracy_margin": 0.05, "divergence_margin": 0.05, "tpot_p50_min_improvement": 0.0,
        "ttft_p95_max_ratio": 3.5, "error_rate_max_increase": 0.05, "min_acceptance_length": 1.5,
        "min_requests_per_arm": 30, "min_eval_items": 16,
    },
}
DEMO_SOURCE = "embedded default: configs/local-cpu.yaml (make demo)"
FULL_EVAL_ITEMS = {"gsm8k": 1319, "golden": 160}  # items of a set without accuracy.limit (gsm8k test; the tiny golden)


# -- the design, from a run config ------------------------------------------------------
class _ExperimentSection(pydantic.BaseModel, extra="ignore"):
    """The run config's ``experiment:`` fields the design uses (defaults as rollout.config.ExperimentConfig).

    ``warmup_requests_per_arm``: the simulated stream starts cold in the warm-up worlds, so its
    first records are left out as the controller leaves them out (None: one look's worth)."""

    enabled: bool = True
    requests_per_look: int = Field(100, ge=5)
    requests_per_arm: int = Field(500, ge=5)
    window_s: float = Field(30, ge=1)
    min_looks: int = Field(1, ge=1)
    max_duration_s: float = Field(1800, gt=0)
    users_per_replica: int = Field(2, ge=1)
    max_tokens: int = Field(64, ge=2)
    warmup_requests_per_arm: int | None = Field(None, ge=0)

    @property
    def warmup(self) -> int:
        return self.requests_per_look if self.warmup_requests_per_arm is None else self.warmup_requests_per_arm


class _AccuracySection(pydantic.BaseModel, extra="ignore"):
    """The run config's ``accuracy:`` fields the design uses (defaults as rollout.config.AccuracyConfig)."""

    enabled: bool = True
    kind: str = "golden"
    limit: int | None = Field(None, ge=1)
    batch_size: int = Field(16, ge=1)


@dataclass(frozen=True)
class CalibrationDesign:
    """The run's design as the simulation runs it, and the simulated world."""

    source: str
    gates: GatesConfig
    plan: LookPlan
    shape: StreamShape
    experiment_enabled: bool
    accuracy_enabled: bool
    eval_items: int
    batch_size: int
    twin: bool
    speculative_canary: bool
    latency: LatencyWorld = field(default_factory=LatencyWorld)
    accuracy: AccuracyWorld = field(default_factory=AccuracyWorld)

    def summary(self) -> dict[str, Any]:
        """The design, for the published table (``config`` of the JSON)."""
        return {
            "source": self.source,
            "requests_per_look": self.plan.requests_per_look,
            "requests_per_arm": self.plan.requests_per_arm,
            "planned_looks": self.plan.planned_looks,
            "min_looks": self.plan.min_looks,
            "window_s": self.plan.min_interval_s,
            "users_per_arm": self.shape.users_per_arm,
            "output_tokens": self.shape.output_tokens,
            "speculative_tokens": self.shape.speculative_tokens,
            "experiment_enabled": self.experiment_enabled,
            "accuracy_enabled": self.accuracy_enabled,
            "eval_items": self.eval_items,
            "batch_size": self.batch_size,
            "twin_baseline": self.twin,
            "gates": self.gates.model_dump(mode="json"),
            "latency_world": asdict(self.latency),
            "accuracy_world": asdict(self.accuracy),
        }


def _section(data: Mapping[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)  # type: ignore[assignment]
    return data


def design_from_run_config(data: Mapping[str, Any], source: str) -> CalibrationDesign:
    """The design of a run config given as plain data (a parsed YAML file or RolloutConfig.model_dump())."""
    gates = GatesConfig(**(data.get("gates") or {}))
    experiment = _ExperimentSection(**(data.get("experiment") or {}))
    accuracy = _AccuracySection(**(data.get("accuracy") or {}))
    if experiment.requests_per_look > experiment.requests_per_arm:
        raise ValueError("experiment.requests_per_look must be <= experiment.requests_per_arm")
    plan = LookPlan(
        experiment.requests_per_look, experiment.requests_per_arm, float(experiment.window_s), experiment.min_looks,
        float(experiment.max_duration_s), warmup_requests_per_arm=experiment.warmup,
    )
    speculative = _section(data, "canary", "engine", "speculative_config", "num_speculative_tokens") or 0
    replicas = int(_section(data, "baseline", "replicas") or 1)
    items = accuracy.limit if accuracy.limit is not None else FULL_EVAL_ITEMS.get(accuracy.kind, FULL_EVAL_ITEMS["gsm8k"])
    return CalibrationDesign(
        source=source,
        gates=gates,
        plan=plan,
        shape=StreamShape(
            requests_per_arm=plan.requests_per_arm,
            requests_per_look=plan.requests_per_look,
            users_per_arm=experiment.users_per_replica * replicas,
            output_tokens=experiment.max_tokens,
            speculative_tokens=int(speculative) if speculative else 0,
            warmup_per_arm=experiment.warmup,
        ),
        experiment_enabled=experiment.enabled,
        accuracy_enabled=accuracy.enabled,
        eval_items=int(items),
        batch_size=accuracy.batch_size,
        twin=bool(data.get("twin_baseline", False)),
        speculative_canary=bool(speculative),
    )


def default_design() -> CalibrationDesign:
    return design_from_run_config(DEMO_RUN_CONFIG, DEMO_SOURCE)


# -- one trial ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TrialOutcome:
    """What one simulated run ended with: every gate's last verdict, the decision, the requests judged."""

    verdicts: dict[str, str]
    decision: str
    requests_per_arm: float | None  # mean over the arms of completed requests judged; None without an experiment
    looks: int
    # several candidates (TrialSpec.candidates > 1): the same trial's decision had every candidate been judged
    # at the whole alpha (what the split across candidates prevents); None for one candidate
    unadjusted_decision: str | None = None


_TEMPLATE = RequestRecord(request_id="simulated", tag="experiment", worker="calibrate", sent_at=0.0, e2e_s=0.0, ok=True, status=200)


def _without_warmup(records: list[RequestRecord], plan: LookPlan) -> list[RequestRecord]:
    """The records after the warm-up (`experiment_looks.warmup_end`), as the controller judges them."""
    end = warmup_end(records, plan) if plan.warmup_requests_per_arm else 0
    return records[end or 0:]


def _experiment(rng: np.random.Generator, design: CalibrationDesign, spec: TrialSpec):
    plan = replace(design.plan, twin=True) if spec.twin_tpot_ratio is not None else design.plan
    records = _without_warmup(simulate_records(rng, design.latency, spec, design.shape, _TEMPLATE), plan)
    canary_ok = [r.request_id for r in records if r.arm == CANARY and r.ok]
    k = design.shape.speculative_tokens if design.speculative_canary else 0
    if k > 0:
        drafts, accepted = spec_decode_by_request(rng, len(canary_ok), design.shape.output_tokens, k, spec.acceptance_length)
    else:  # a canary that does not speculate: no counters (its acceptance gate is the config's call)
        drafts, accepted = np.zeros(len(canary_ok)), np.zeros((len(canary_ok), 0))
    spec_at = cumulative_canary_spec(records, canary_ok, drafts, accepted)
    ends = look_ends(records, plan)
    return run_experiment_looks(records, ends, plan, design.gates, spec_at, design.speculative_canary)


def _candidates_trial(design: CalibrationDesign, spec: TrialSpec, rng: np.random.Generator) -> TrialOutcome:
    """One run with ``spec.candidates`` candidates as the controller runs it: the experiment's records of
    all arms in one closed loop, a look when every arm has its share (the information fraction is the
    least-served arm's), each candidate judged against the shared baseline at its share of alpha by
    ``candidates.CandidateLooks`` (its gates standing from the look they are final), the winner by
    ``candidates.choose_winner``; the same looks judged at the whole alpha give ``unadjusted_decision``."""
    arms = candidate_arms(spec.candidates)
    every_arm = replace(design.plan, candidates=arms)
    records = _without_warmup(simulate_records(rng, design.latency, spec, design.shape, _TEMPLATE), every_arm)
    k = design.shape.speculative_tokens if design.speculative_canary else 0
    ends = look_ends(records, every_arm)
    # each candidate's counters at a look: over its view of the records, whose index a prefix count maps to
    spec_at: dict[str, Callable[[int], SpecDecodeStats]] = {}
    for arm in arms:
        ok = [r.request_id for r in records if r.arm == arm and r.ok]
        if k > 0:
            drafts, accepted = spec_decode_by_request(rng, len(ok), design.shape.output_tokens, k, spec.acceptance_length)
        else:
            drafts, accepted = np.zeros(len(ok)), np.zeros((len(ok), 0))
        view, _ = candidate_view(records, [0] * len(records), arm)
        at_view = cumulative_canary_spec(view, ok, drafts, accepted)
        in_view = np.cumsum([0] + [r.served_arm in (BASELINE, arm) for r in records])
        spec_at[arm] = lambda end, at_view=at_view, in_view=in_view: at_view(int(in_view[end]))
    runs = {"split": CandidateLooks(arms, candidate_gates(design.gates, spec.candidates), design.plan),
            "whole": CandidateLooks(arms, design.gates, design.plan)}
    stopped_at: dict[str, int] = {}  # run -> the record index its last look ended at
    looks_of: list[int] = []
    fractions: list[float] = []
    start, looks = 0, 0
    for look, end in enumerate(ends, start=1):
        looks_of += [look] * (end - start)
        start = end
        judged = records[:end]
        fractions.append(next_information(fractions, every_arm.information(requests_by_arm(judged, arms=every_arm.arms))))
        for key, run in runs.items():
            if key in stopped_at:
                continue
            stop = run.look(look, judged, looks_of, fractions, spec_of=lambda name: spec_at[name](end),
                            speculative=dict.fromkeys(arms, design.speculative_canary))
            if key == "split":
                looks = look
            if stop is not None or look == len(ends):
                stopped_at[key] = end
        if len(stopped_at) == len(runs):
            break
    results = {key: [CandidateResult(arm, k, run.gates.get(arm, [])) for arm in arms] for key, run in runs.items()}
    # The experiment alone is simulated (as the scenarios rows: the accuracy phase's gates are not part of the
    # question), so a candidate's decision is over the experiment gates the config enables.
    judged_names = [g.name for g in results["split"][0].gates if is_enabled(g.name, design.gates)]
    experiment_only = design.gates.model_copy(update={"enabled": judged_names})
    split_choice = choose_winner(results["split"], experiment_only)
    whole_choice = choose_winner(results["whole"], experiment_only)
    counts = requests_by_arm(records[: stopped_at.get("split", 0)], arms=every_arm.arms)
    return TrialOutcome(
        verdicts={f"{result.name}:{g.name}": g.verdict.value for result in results["split"] for g in result.gates},
        decision=split_choice.decision.value,
        requests_per_arm=float(np.mean(list(counts.values()))) if ends else None,
        looks=looks,
        unadjusted_decision=whole_choice.decision.value,
    )


def simulate_trial(design: CalibrationDesign, spec: TrialSpec, rng: np.random.Generator) -> TrialOutcome:
    """One canary run: the accuracy phase (when the spec and the config have it), then the experiment."""
    if spec.candidates > 1:
        return _candidates_trial(design, spec, rng)
    accuracy = experiment = None
    if spec.run_accuracy and design.accuracy_enabled:
        baseline, canary, canary_div, twin_div = paired_items(rng, design.eval_items, design.accuracy, spec, design.twin)
        accuracy = run_accuracy_batches(baseline, canary, canary_div, twin_div, design.gates, design.batch_size)
    if spec.run_experiment and design.experiment_enabled and not accuracy_skips_experiment(accuracy, design.gates):
        experiment = _experiment(rng, design, spec)
    gates = (accuracy.gates if accuracy else []) + (experiment.gates if experiment else [])
    return TrialOutcome(
        verdicts={g.name: g.verdict.value for g in gates},
        decision=decide_trial(accuracy, experiment, design.gates).value,
        requests_per_arm=float(np.mean(list(experiment.requests.values()))) if experiment else None,
        looks=len(experiment.looks) if experiment else 0,
    )


# -- the rows' trial sets ----------------------------------------------------------------
def _limit_specs(design: CalibrationDesign) -> dict[str, TrialSpec]:
    """Gate name -> the trials that put that gate exactly at its limit (enabled gates only)."""
    cfg, world = design.gates, design.latency
    bar = 1.0 - cfg.tpot_p50_min_improvement
    specs = {
        OBJECTIVE_NAME: TrialSpec(tpot_ratio=bar),
        "ttft_p95_guard": TrialSpec(tpot_ratio=PASSING_TPOT_RATIO, ttft_ratio=cfg.ttft_p95_max_ratio),
        "error_rate_guard": TrialSpec(
            tpot_ratio=PASSING_TPOT_RATIO, canary_error_rate=world.error_rate + cfg.error_rate_max_increase
        ),
        ACCURACY_NAME: TrialSpec(run_accuracy=True, run_experiment=False, accuracy_drop=cfg.accuracy_margin),
        DIVERGENCE_NAME: _divergence_at_cap(design, TrialSpec(run_accuracy=True, run_experiment=False)),
    }
    if cfg.e2e_p95_max_ratio is not None:
        specs["e2e_p95_guard"] = TrialSpec(
            tpot_ratio=PASSING_TPOT_RATIO, ttft_ratio=_ttft_factor_for_e2e_ratio(design, cfg.e2e_p95_max_ratio)
        )
    if cfg.min_acceptance_length is not None and design.speculative_canary:
        specs[ACCEPTANCE_NAME] = TrialSpec(tpot_ratio=PASSING_TPOT_RATIO, acceptance_length=cfg.min_acceptance_length)
    if cfg.goodput_slo is not None:
        try:
            specs[GOODPUT_NAME] = goodput_boundary_spec(
                world, TrialSpec(scenario=GOODPUT_SCENARIO, tpot_ratio=PASSING_TPOT_RATIO), design.shape,
                cfg.goodput_slo.bounds, cfg.goodput_max_decrease,
            )
        except ValueError:  # an SLO so strict that no canary drops exactly the margin: no boundary to simulate
            pass
    order = [OBJECTIVE_NAME, *GUARDRAIL_NAMES, ACCURACY_NAME, DIVERGENCE_NAME, ACCEPTANCE_NAME, GOODPUT_NAME]
    return {name: specs[name] for name in order if name in specs and is_enabled(name, cfg)}


def _divergence_at_cap(design: CalibrationDesign, spec: TrialSpec) -> TrialSpec:
    margin = design.gates.divergence_margin
    if design.twin:
        return replace(spec, canary_divergence_excess=margin)
    return replace(spec, canary_divergence_rate=margin)


def _ttft_factor_for_e2e_ratio(design: CalibrationDesign, target: float, samples: int = 200_000) -> float:
    """The canary TTFT factor that puts the iid world's true E2E p95 ratio at ``target`` (canary TPOT at 0.7)."""
    world, tokens = design.latency, design.shape.output_tokens
    rng = np.random.default_rng(0)
    ttft = world.ttft_median_s * np.exp(rng.normal(0.0, world.ttft_sigma, samples))
    tpot = world.tpot_median_s * np.exp(rng.normal(0.0, world.tpot_sigma, samples))
    base = np.quantile(ttft + tpot * (tokens - 1), 0.95)

    def gap(factor: float) -> float:
        return float(np.quantile(factor * ttft + PASSING_TPOT_RATIO * tpot * (tokens - 1), 0.95) / base - target)

    return float(optimize.brentq(gap, 1e-3, 1e3))


def _noise_floor_specs(design: CalibrationDesign) -> dict[str, TrialSpec]:
    """The twin-baseline rows' trials by row name (see the module docstring)."""
    bar = 1.0 - design.gates.tpot_p50_min_improvement
    specs = {f"aa_placement_{s:g}": TrialSpec(tpot_ratio=bar * s, twin_tpot_ratio=s) for s in PLACEMENT_FACTORS}
    specs |= {f"twin_power_{r:g}": TrialSpec(tpot_ratio=r, twin_tpot_ratio=1.0) for r in TWIN_POWER_RATIOS}
    return specs


def trial_sets(design: CalibrationDesign) -> dict[str, TrialSpec]:
    """Every set of trials the report needs, by key (a set several rows share is simulated once)."""
    bar = 1.0 - design.gates.tpot_p50_min_improvement
    sets: dict[str, TrialSpec] = {}
    if design.experiment_enabled:
        for scenario in LATENCY_SCENARIOS:
            sets[f"{scenario}/at_bar"] = TrialSpec(scenario=scenario, tpot_ratio=bar)
            sets[f"{scenario}/aa"] = TrialSpec(scenario=scenario)
        for ratio in POWER_TPOT_RATIOS:
            sets[f"power/{ratio:g}"] = TrialSpec(tpot_ratio=ratio)
        for name, spec in _noise_floor_specs(design).items():
            sets[f"noise_floor/{name}"] = spec
        for count, scenario in CANDIDATE_ROWS:
            sets[f"candidates/{count}/{scenario}"] = TrialSpec(scenario=scenario, tpot_ratio=bar, candidates=count)
        # as the run config runs them: with its twin baseline (a true A/A twin in the same world) when it has one
        twin = 1.0 if design.twin else None
        for scenario in DEPENDENCE_SCENARIOS:
            sets[f"{scenario}/at_bar"] = TrialSpec(scenario=scenario, tpot_ratio=bar, twin_tpot_ratio=twin)
            sets[f"{scenario}/aa"] = TrialSpec(scenario=scenario, twin_tpot_ratio=twin)
            sets[f"{scenario}/good"] = TrialSpec(scenario=scenario, tpot_ratio=GOOD_CANARY_TPOT_RATIO, twin_tpot_ratio=twin)
        cfg_limit = design.gates
        if is_enabled("error_rate_guard", cfg_limit):
            sets[f"{BURST_SCENARIO}/error_limit"] = TrialSpec(
                scenario=BURST_SCENARIO, tpot_ratio=PASSING_TPOT_RATIO,
                canary_error_rate=design.latency.error_rate + cfg_limit.error_rate_max_increase,
            )
    for gate, spec in _limit_specs(design).items():
        sets["iid/at_bar" if gate == OBJECTIVE_NAME else f"limit/{gate}"] = spec
    cfg, world = design.gates, design.latency
    sets["decision"] = _divergence_at_cap(
        design,
        TrialSpec(
            tpot_ratio=bar,
            ttft_ratio=cfg.ttft_p95_max_ratio,
            canary_error_rate=world.error_rate + cfg.error_rate_max_increase,
            acceptance_length=cfg.min_acceptance_length or TrialSpec().acceptance_length,
            accuracy_drop=cfg.accuracy_margin,
            run_accuracy=True,
        ),
    )
    return {key: spec for key, spec in sets.items() if spec.run_experiment and design.experiment_enabled
            or spec.run_accuracy and design.accuracy_enabled}


# -- running them --------------------------------------------------------------------------
_WORKER_DESIGN: CalibrationDesign | None = None


def _trial_rng(seed: int, key: str, trial: int) -> np.random.Generator:
    """One independent stream per (seed, trial set, trial): the numbers do not depend on the workers."""
    return np.random.default_rng([seed, zlib.crc32(key.encode()), trial])


def _run_chunk(task: tuple[str, TrialSpec, int, int, int], design: CalibrationDesign | None = None) -> tuple[str, list[TrialOutcome]]:
    key, spec, seed, start, stop = task
    design = design or _WORKER_DESIGN
    assert design is not None
    return key, [simulate_trial(design, spec, _trial_rng(seed, key, t)) for t in range(start, stop)]


def _init_worker(design: CalibrationDesign) -> None:
    global _WORKER_DESIGN
    _WORKER_DESIGN = design


def _chunks(sets: Mapping[str, TrialSpec], trials: int, seed: int) -> list[tuple[str, TrialSpec, int, int, int]]:
    return [
        (key, spec, seed, start, min(start + CHUNK_TRIALS, trials))
        for key, spec in sets.items()
        for start in range(0, trials, CHUNK_TRIALS)
    ]


def _outcomes(
    design: CalibrationDesign, trials: int, seed: int, workers: int, progress: Callable[[int, int], None] | None,
    only: str | None = None,
) -> dict[str, list[TrialOutcome]]:
    sets = trial_sets(design)
    if only is not None:  # a subset of the trial sets (fnmatch on their keys), for a quick look at some rows
        sets = {key: spec for key, spec in sets.items() if fnmatch.fnmatch(key, only)}
    tasks = _chunks(sets, trials, seed)
    by_key: dict[str, list[TrialOutcome]] = {key: [] for key in sets}

    def collect(results: Iterator[tuple[str, list[TrialOutcome]]]) -> None:
        for done, (key, outcomes) in enumerate(results, start=1):
            by_key[key] += outcomes
            if progress is not None:
                progress(done, len(tasks))

    if workers <= 1:
        collect(_run_chunk(task, design) for task in tasks)
    else:
        with multiprocessing.get_context().Pool(workers, initializer=_init_worker, initargs=(design,)) as pool:
            collect(pool.imap_unordered(_run_chunk, tasks))
    return by_key


def _rate(outcomes: Sequence[TrialOutcome], hit: Callable[[TrialOutcome], bool]) -> float:
    return float(np.mean([hit(o) for o in outcomes])) if outcomes else float("nan")


def _other_gate_failed(outcome: TrialOutcome) -> bool:
    return any(v == "fail" for name, v in outcome.verdicts.items() if name != OBJECTIVE_NAME)


def _candidate_rows(by_key: Mapping[str, Sequence[TrialOutcome]], alpha: float, trials: int) -> list[dict[str, Any]]:
    """The several-candidates rows (see the module docstring), for the sets simulated."""
    return [
        {
            "candidates": count,
            "scenario": scenario,
            "rule": "bonferroni",
            "candidate_alpha": alpha / count,
            "false_promote_rate": _rate(by_key[f"candidates/{count}/{scenario}"], lambda o: o.decision == Decision.PROMOTE.value),
            "unadjusted_false_promote_rate": _rate(
                by_key[f"candidates/{count}/{scenario}"], lambda o: o.unadjusted_decision == Decision.PROMOTE.value
            ),
            "trials": trials,
        }
        for count, scenario in CANDIDATE_ROWS
        if f"candidates/{count}/{scenario}" in by_key
    ]


def _scenario_rows(by_key: Mapping[str, Sequence[TrialOutcome]], trials: int) -> list[dict[str, Any]]:
    """The latency scenarios' rows: the objective's false promote at its bar, a false rollback with identical arms."""
    return [
        {
            "name": name,
            "false_promote_rate": _rate(by_key[f"{name}/at_bar"], lambda o: o.verdicts.get(OBJECTIVE_NAME) == "pass"),
            "false_rollback_rate": _rate(by_key[f"{name}/aa"], _other_gate_failed),
            "trials": trials,
        }
        for name in LATENCY_SCENARIOS
    ]


def _dependence_rows(by_key: Mapping[str, Sequence[TrialOutcome]], trials: int) -> list[dict[str, Any]]:
    """The worlds built to break the looks' independence (scenarios.DEPENDENCE_SCENARIOS): the objective's false
    promote at its bar, the whole decision's P(PROMOTE) there, a false rollback with identical arms, and the
    whole decision's P(PROMOTE) of a good canary (a true 30% TPOT gain); the bursts world adds the error-rate
    guard at its limit (P(it passes): a false pass)."""
    rows = []
    for name in DEPENDENCE_SCENARIOS:
        if f"{name}/at_bar" not in by_key:
            continue
        # the experiment alone is simulated: the decision is PROMOTE when every experiment gate passes
        promoted = lambda o: bool(o.verdicts) and all(v == "pass" for v in o.verdicts.values())  # noqa: E731
        row = {
            "name": name,
            "false_promote_rate": _rate(by_key[f"{name}/at_bar"], lambda o: o.verdicts.get(OBJECTIVE_NAME) == "pass"),
            "decision_false_promote_rate": _rate(by_key[f"{name}/at_bar"], promoted),
            "false_rollback_rate": _rate(by_key[f"{name}/aa"], _other_gate_failed),
            "good_canary_promote_rate": _rate(by_key[f"{name}/good"], promoted),
            "trials": trials,
        }
        if f"{name}/error_limit" in by_key:
            row["error_guard_pass_at_limit"] = _rate(by_key[f"{name}/error_limit"], lambda o: o.verdicts.get("error_rate_guard") == "pass")
        rows.append(row)
    return rows


def run_calibration(
    design: CalibrationDesign | None = None,
    trials: int = 2000,
    seed: int = 0,
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
    only: str | None = None,
) -> dict[str, Any]:
    """Simulate ``trials`` runs per trial set; return the calibration table (see the module docstring).

    ``only``: simulate only the trial sets whose key matches this fnmatch pattern (rows of the others read NaN)."""
    if trials < 1:
        raise ValueError("trials must be >= 1")
    design = design or default_design()
    by_key: dict[str, list[TrialOutcome]] = defaultdict(list, _outcomes(design, trials, seed, workers, progress, only))
    alpha = design.gates.alpha
    scenarios = _scenario_rows(by_key, trials) if design.experiment_enabled else []
    pass_at_limit = [
        {
            "gate": gate,
            "pass_rate": _rate(by_key["iid/at_bar" if gate == OBJECTIVE_NAME else f"limit/{gate}"], lambda o, g=gate: o.verdicts.get(g) == "pass"),
            "trials": trials,
        }
        for gate in _limit_specs(design)
        if ("iid/at_bar" if gate == OBJECTIVE_NAME else f"limit/{gate}") in by_key
    ]
    power = [
        {
            "true_tpot_ratio": ratio,
            "power": _rate(by_key[f"power/{ratio:g}"], lambda o: o.verdicts.get(OBJECTIVE_NAME) == "pass"),
            "mean_requests_per_arm": float(np.mean([o.requests_per_arm for o in by_key[f"power/{ratio:g}"]])),
        }
        for ratio in POWER_TPOT_RATIOS
        if f"power/{ratio:g}" in by_key
    ]
    noise_floor = [
        {
            "name": name,
            "canary_tpot_ratio": spec.tpot_ratio,
            "twin_tpot_ratio": spec.twin_tpot_ratio,
            "objective_pass_rate": _rate(by_key[f"noise_floor/{name}"], lambda o: o.verdicts.get(OBJECTIVE_NAME) == "pass"),
            "trials": trials,
        }
        for name, spec in _noise_floor_specs(design).items()
        if f"noise_floor/{name}" in by_key
    ]
    goodput_aa = [
        {
            "scenario": name,
            "false_rollback_rate": _rate(by_key[f"{name}/aa"], lambda o: o.verdicts.get(GOODPUT_NAME) == "fail"),
            "trials": trials,
        }
        for name in LATENCY_SCENARIOS
        if design.experiment_enabled and design.gates.goodput_slo is not None and is_enabled(GOODPUT_NAME, design.gates)
    ]
    candidates = _candidate_rows(by_key, alpha, trials)
    dependence = _dependence_rows(by_key, trials)
    curve_worlds = [w for w in LOAD_CURVE_WORLDS if only is None or fnmatch.fnmatch(f"load_curve/{w.name}", only)]
    load_curve = load_curve_rows(alpha, trials, seed, curve_worlds, workers) if curve_worlds else []
    decisions = by_key["decision"]
    return {
        "alpha": alpha,
        "trials": trials,
        "seed": seed,
        "config": design.summary(),
        "simulation_se": math.sqrt(alpha * (1.0 - alpha) / trials),
        "scenarios": scenarios,
        "pass_at_limit": pass_at_limit,
        "power": power,
        "noise_floor": noise_floor,
        "goodput_aa": goodput_aa,
        "candidates": candidates,
        "dependence": dependence,
        "load_curve": load_curve,
        "decision": {
            "false_promote_rate": _rate(decisions, lambda o: o.decision == Decision.PROMOTE.value),
            "false_rollback_rate": _rate(decisions, lambda o: o.decision == Decision.ROLLBACK.value),
            "trials": trials,
        },
    }


# -- the table -------------------------------------------------------------------------------
def format_table(result: Mapping[str, Any]) -> str:
    """The calibration result as aligned text tables that say what each row means."""
    alpha, se, cfg = result["alpha"], result["simulation_se"], result["config"]
    bound = alpha + 2 * se
    lines = [
        f"Calibration of {cfg['source']}",
        f"  {result['trials']} simulated runs per row, seed {result['seed']}, alpha {alpha:g}; simulation SE at alpha "
        f"{se:.4f} (a correct rule stays <= alpha + 2 SE = {bound:.4f}); wall {result.get('wall_s', float('nan')):.1f} s",
        f"  design: a look per {cfg['requests_per_look']} completed requests per arm, {cfg['requests_per_arm']} planned "
        f"({cfg['planned_looks']} looks, min_looks {cfg['min_looks']}), {cfg['users_per_arm']} closed-loop streams per arm, "
        f"{cfg['output_tokens']} output tokens; accuracy {cfg['eval_items']} items in batches of {cfg['batch_size']}",
        "",
        "Latency scenarios: false promote = the TPOT objective passes with the canary exactly at its bar",
        "(guardrails quiet); false rollback = a gate other than the objective fails with identical arms (A/A).",
        f"  {'scenario':<20} {'false promote':>13} {'false rollback':>14}",
    ]
    for row in result["scenarios"]:
        flag = "  <-- above alpha + 2 SE" if max(row["false_promote_rate"], row["false_rollback_rate"]) > bound else ""
        lines.append(f"  {row['name']:<20} {row['false_promote_rate']:>13.4f} {row['false_rollback_rate']:>14.4f}{flag}")
    lines += ["", "Pass at the limit: one gate's true value exactly at its limit, the others passing: P(it passes).",
              f"  {'gate':<26} {'pass rate':>9}"]
    for row in result["pass_at_limit"]:
        flag = "  <-- above alpha + 2 SE" if row["pass_rate"] > bound else ""
        lines.append(f"  {row['gate']:<26} {row['pass_rate']:>9.4f}{flag}")
    if result["power"]:
        lines += ["", "Power: P(the objective passes) at a true TPOT ratio below the bar; requests per arm judged at the stop.",
                  f"  {'true TPOT ratio':>15} {'power':>7} {'mean requests/arm':>18}"]
        for row in result["power"]:
            lines.append(f"  {row['true_tpot_ratio']:>15.2f} {row['power']:>7.4f} {row['mean_requests_per_arm']:>18.1f}")
    if result.get("noise_floor"):
        lines += ["", "Noise floor (the experiment with a twin baseline): the objective cannot pass while the A/A TPOT p50",
                  "ratio twin/baseline excludes 1. aa_placement_S: canary at the bar against the twin, the baseline's cores",
                  "slower by 1/S (a pass is a false promote); twin_power_R: canary truly at R, true A/A twin (power).",
                  f"  {'row':<20} {'canary/baseline':>15} {'twin/baseline':>13} {'objective pass':>14}"]
        for row in result["noise_floor"]:
            flag = "  <-- above alpha + 2 SE" if row["name"].startswith("aa_") and row["objective_pass_rate"] > bound else ""
            lines.append(f"  {row['name']:<20} {row['canary_tpot_ratio']:>15.3f} {row['twin_tpot_ratio']:>13.3f} "
                         f"{row['objective_pass_rate']:>14.4f}{flag}")
    if result.get("goodput_aa"):
        lines += ["", "Goodput guard, A/A: P(goodput_guard FAIL) with identical arms. Its rollback side is a family of its own",
                  "at alpha, beside Holm's guardrail family (alpha familywise): together at most 2 alpha (union bound).",
                  f"  {'scenario':<20} {'false rollback':>14}"]
        for row in result["goodput_aa"]:
            flag = "  <-- above alpha + 2 SE" if row["false_rollback_rate"] > bound else ""
            lines.append(f"  {row['scenario']:<20} {row['false_rollback_rate']:>14.4f}{flag}")
    if result.get("candidates"):
        lines += ["", "Several candidates, every one exactly at the objective's bar (guardrails quiet): P(a winner is named),",
                  "each candidate judged at alpha / K (Bonferroni; rollout.judge.candidates), and the same trials judged at",
                  "the whole alpha per candidate (no split: what it would be).",
                  f"  {'K':>2} {'scenario':<20} {'false promote':>13} {'unadjusted':>10}"]
        for row in result["candidates"]:
            flag = "  <-- above alpha + 2 SE" if row["false_promote_rate"] > bound else ""
            lines.append(f"  {row['candidates']:>2} {row['scenario']:<20} {row['false_promote_rate']:>13.4f} "
                         f"{row['unadjusted_false_promote_rate']:>10.4f}{flag}")
    if result.get("dependence"):
        lines += ["", "Dependence worlds (levels that persist across looks, warm-up, bursts, feedback): the objective's",
                  "false promote at its bar, the whole decision's P(PROMOTE) there, a false rollback (A/A), and the whole",
                  f"decision's P(PROMOTE) of a canary truly {GOOD_CANARY_TPOT_RATIO:g} x the baseline's TPOT (power).",
                  f"  {'world':<24} {'false promote':>13} {'decision':>8} {'false rollback':>14} {'good canary':>11}"]
        for row in result["dependence"]:
            flag = "  <-- above alpha + 2 SE" if max(row["false_promote_rate"], row["false_rollback_rate"]) > bound else ""
            extra = f"  error guard at its limit passes {row['error_guard_pass_at_limit']:.4f}" if "error_guard_pass_at_limit" in row else ""
            lines.append(f"  {row['name']:<24} {row['false_promote_rate']:>13.4f} {row['decision_false_promote_rate']:>8.4f} "
                         f"{row['false_rollback_rate']:>14.4f} {row['good_canary_promote_rate']:>11.4f}{flag}{extra}")
    if result.get("load_curve"):
        lines += load_curve_lines(result["load_curve"], bound)
    d = result["decision"]
    lines += ["", "The whole decision with every gate at its limit at once (accuracy phase, then the experiment):",
              f"  P(PROMOTE) {d['false_promote_rate']:.4f}   P(ROLLBACK) {d['false_rollback_rate']:.4f}"]
    return "\n".join(lines)
