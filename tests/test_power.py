"""Power you read before you run (rollout.judge.power): each gate's detectable effect, checked against a
simulation of the gate's own statistic at that effect (pure numpy, no engine).

Each check asserts the simulated rate within 3 standard errors of its trial count of the power the
module claims (80%): the figures are normal approximations (accuracy, acceptance), exact sums (error
rate) or quantiles of simulated bounds (TPOT), and a trial count of 400 cannot tell 0.8 from 0.78."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rollout.config import load_config
from rollout.judge import power, stats
from rollout.judge.accuracy import judge_accuracy
from rollout.judge.acceptance import judge_acceptance
from rollout.judge.config import GatesConfig
from rollout.judge.latency import LatencySamples, judge_latency
from rollout.judge.power import PowerAssumptions, PowerPlan, detectable_effects
from rollout.judge.request_acceptance import spec_decode_of_counts
from rollout.judge.verdicts import Verdict
from tests.test_acceptance_clustered import draw_requests

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def within(rate: float, claimed: float, trials: int) -> bool:
    return abs(rate - claimed) <= 3 * math.sqrt(claimed * (1 - claimed) / trials)


def effect(plan: PowerPlan, gate: str, assumptions: PowerAssumptions | None = None) -> power.DetectableEffect:
    return next(e for e in detectable_effects(plan, assumptions) if e.gate == gate)


# -- accuracy ---------------------------------------------------------------------------------------
def paired(rng, items: int, discordance: float, drop: float, accuracy: float = 0.95):
    """The calibration's cells: the arms disagree on `discordance` of the items, a drop moves items to 'only baseline right'."""
    only_canary, only_baseline = discordance / 2, discordance / 2 + drop
    u = rng.random(items)
    baseline = u < accuracy
    canary = (u < accuracy - only_baseline) | ((u >= accuracy) & (u < accuracy + only_canary))
    return baseline, canary


@pytest.mark.parametrize("margin", [0.01, 0.02])
def test_accuracy_drops_are_failed_and_passed_as_often_as_claimed(margin):
    """The GPU plan's 1,319 gsm8k items: at margin 0.01 a 2.7-point drop fails 80% of runs and an unchanged canary
    passes only ~67% (the margin is below what the plan decides: warned); at 0.02 both sides are decidable."""
    cfg = GatesConfig(accuracy_margin=margin, enabled=["accuracy_noninferiority"])
    found = effect(PowerPlan(gates=cfg, eval_items=1319), "accuracy_noninferiority")
    assert found.decidable == (margin == 0.02) and (found.warning is None) == found.decidable
    rng, trials = np.random.default_rng(1), 400
    checks = [(found.failed_at, Verdict.FAIL, 0.8)]
    if found.decidable:
        checks.append((found.passed_at, Verdict.PASS, 0.8))
    else:
        checks.append((0.0, Verdict.PASS, power.accuracy_pass_probability(0.0, 1319, margin, 0.03, power._z(0.05))))
    for drop, verdict, claimed in checks:
        rate = np.mean([judge_accuracy(*paired(rng, 1319, 0.03, drop), cfg, look=1, max_looks=1).verdict is verdict
                        for _ in range(trials)])
        assert within(rate, claimed, trials), (margin, drop, verdict, rate, claimed)


# -- the TPOT objective ---------------------------------------------------------------------------------
def test_the_median_formula_is_the_simulated_spread_of_the_log_ratio():
    """The formula the design effect is stated against: sd(log ratio of medians) = sqrt(pi/2 sigma^2 2/n)."""
    rng = np.random.default_rng(2)
    n, sigma = 400, 0.25
    logs = np.log(np.median(np.exp(rng.normal(0, sigma, (4000, n))), axis=1) /
                  np.median(np.exp(rng.normal(0, sigma, (4000, n))), axis=1))
    assert logs.std() == pytest.approx(power._tpot_se(n, PowerAssumptions(tpot_log_sd=sigma)), rel=0.05)


def test_the_objective_passes_its_detectable_ratio_as_often_as_claimed():
    """The demo plan (10 looks x 40 per arm, bar 0.9): the ratio the module derives from the gate's own bounds on
    A/A runs is passed by the gate, on fresh runs at that ratio, about 80% of the time."""
    cfg = GatesConfig(tpot_p50_min_improvement=0.1)
    looks, per_look = 10, 40
    found = effect(PowerPlan(gates=cfg, requests_per_arm=looks * per_look, planned_looks=looks), "tpot_p50_improvement",
                   PowerAssumptions(objective_trials=400))
    assert found.passed_at < 0.9 < found.failed_at
    only = cfg.model_copy(update={"enabled": ["tpot_p50_improvement"]})
    window = np.repeat(np.arange(1, looks + 1), per_look)
    rng, trials, passed = np.random.default_rng(12), 300, 0
    for _ in range(trials):
        arms = [LatencySamples(ttft_s=np.ones(window.size), tpot_s=scale * np.exp(rng.normal(0, 0.25, window.size)),
                               e2e_s=np.ones(window.size), n_errors=0, n_total=window.size, window=window)
                for scale in (1.0, found.passed_at)]
        gate = judge_latency(*arms, only, look=looks, max_looks=looks, information=[(i + 1) / looks for i in range(looks)])[0]
        passed += gate.verdict is Verdict.PASS
    # the claimed 80% is itself a quantile of 400 simulated runs: its own SE adds to the check's
    assert abs(passed / trials - 0.8) <= 3 * math.sqrt(0.8 * 0.2 * (1 / trials + 1 / 400)), passed / trials


# -- the error-rate guard ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n, looks, margin", [(400, 10, 0.05), (2400, 6, 0.01)])
def test_error_increases_are_passed_and_failed_as_often_as_claimed(n, looks, margin):
    cfg = GatesConfig(error_rate_max_increase=margin, enabled=["error_rate_guard", "ttft_p95_guard"])
    found = effect(PowerPlan(gates=cfg, requests_per_arm=n, planned_looks=looks), "error_rate_guard")
    z_pass = stats.critical_value(0.05, looks, looks, "obrien_fleming")
    z_fail = stats.critical_value(0.05 / 2, looks, looks, "obrien_fleming")  # Holm's first step over 2 guardrails
    rng, trials, p0 = np.random.default_rng(3), 2000, 0.002
    for increase, z_value, side in ((found.passed_at, z_pass, "pass"), (found.failed_at, z_fail, "fail")):
        kb, kc = rng.binomial(n, p0, trials), rng.binomial(n, p0 + increase, trials)
        _, lower, upper = stats.newcombe_difference_interval(kb, n, kc, n, z_value, z_value)
        rate = float(np.mean(upper < margin) if side == "pass" else np.mean(lower > margin))
        assert within(rate, 0.8, trials), (side, increase, rate)


# -- the acceptance floor ----------------------------------------------------------------------------
def test_the_acceptance_variance_is_the_simulated_one():
    """The exact per-request moments under the per-prompt Beta model match many simulated requests."""
    rng = np.random.default_rng(4)
    length, steps_mean, sd = power.acceptance_moments(0.3, 4.0, 3, 15)
    steps, histogram = draw_requests(rng, 100_000, 15, 3, 4 * 0.3, 4 * 0.7)
    accepted = histogram @ np.arange(4)
    ratio = accepted.sum() / steps.sum()
    assert 1 + ratio == pytest.approx(length, abs=0.005)
    assert steps.mean() == pytest.approx(steps_mean, rel=0.01)
    assert (accepted - (length - 1) * steps).std() == pytest.approx(sd, rel=0.02)


def test_the_acceptance_floor_passes_its_detectable_length_as_often_as_claimed():
    """The demo plan's canary (400 requests of 16 tokens, k=3, floor 1.5): at the lengths the module says are passed
    and failed with 80% power, the request-clustered gate passes (fails) about 80% of runs at the last look."""
    cfg = GatesConfig(min_acceptance_length=1.5, enabled=["acceptance_length_floor"])
    looks = 10
    found = effect(PowerPlan(gates=cfg, requests_per_arm=400, planned_looks=looks, output_tokens=16,
                             speculative_tokens=3), "acceptance_length_floor")
    rng, trials = np.random.default_rng(5), 400
    for length, expected in ((found.passed_at, Verdict.PASS), (found.failed_at, Verdict.FAIL)):
        rate, hits = power._rate_for_length(length, 4.0, 3, 15), 0
        for _ in range(trials):
            steps, histogram = draw_requests(rng, 400, 15, 3, 4 * rate, 4 * (1 - rate))
            per_position = np.stack([histogram[:, j:].sum(axis=1) for j in range(1, 4)], axis=1)
            verdict = judge_acceptance(spec_decode_of_counts(steps, per_position), cfg, look=looks, max_looks=looks,
                                       information=[(i + 1) / looks for i in range(looks)]).verdict
            hits += verdict is expected
        assert within(hits / trials, 0.8, trials), (expected, hits / trials)


# -- the plan as the run reads it -----------------------------------------------------------------
def test_the_gpu_config_is_warned_that_its_accuracy_margin_is_below_what_it_can_decide():
    from rollout.run.plan_power import power_plan

    cfg = load_config(REPO / "configs" / "mimo-v2.5-mtp.yaml")
    plan = power_plan(cfg)
    assert plan.eval_items == 1319 and plan.requests_per_arm == 2400 and plan.planned_looks == 6
    effects = detectable_effects(plan, PowerAssumptions(objective_trials=50))
    accuracy = next(e for e in effects if e.gate == "accuracy_noninferiority")
    assert 0.02 < accuracy.failed_at < 0.03 and not accuracy.decidable
    assert "accuracy_margin 0.01 is below what 1,319 items can decide" in accuracy.warning
    # what the warning says would decide it: at that margin an unchanged canary passes about 80% of runs
    needed = float(accuracy.warning.split("needs a margin >= ")[1].split()[0])
    cfg_needed = GatesConfig(accuracy_margin=needed, enabled=["accuracy_noninferiority"])
    rng, trials = np.random.default_rng(9), 400
    rate = np.mean([judge_accuracy(*paired(rng, 1319, 0.03, 0.0), cfg_needed, look=1, max_looks=1).verdict is Verdict.PASS
                    for _ in range(trials)])
    assert within(rate, 0.8, trials), (needed, rate)
    # a golden set's arms agree unless the canary breaks them: the demo's 64 items decide its 0.05 margin
    demo = detectable_effects(power_plan(load_config(REPO / "configs" / "local-cpu.yaml")),
                              PowerAssumptions(objective_trials=0))
    assert next(e for e in demo if e.gate == "accuracy_noninferiority").decidable
    lines = power.render(effects)
    assert any(line.startswith("power: WARNING: accuracy_margin 0.01") for line in lines)
    assert {e.gate for e in effects} == {"accuracy_noninferiority", "tpot_p50_improvement", "error_rate_guard",
                                         "acceptance_length_floor"}


def test_plan_and_the_run_say_what_the_plan_can_decide(tmp_path, capsys, monkeypatch):
    """`mtp-canary plan CONFIG` prints a line per gate and the warning (the cluster part stubbed out); the run's
    prepare phase says the same lines first and keeps them for decision.json's detectable_effect."""
    from types import SimpleNamespace

    from rollout.commands import plan as plan_command
    from rollout.run import cluster_plan
    from rollout.run.phases.setup import Prepare
    from rollout.record.result import RunResult, decision_document

    monkeypatch.setattr("cluster.ray_cluster.connect", lambda address: "ray: stub")
    monkeypatch.setattr(cluster_plan, "make_plan", lambda cfg, modules, placement_wait_s: cluster_plan.Plan(
        replicas=[], nodes=[], timeouts={"placement_timeout_s": 1, "engine_startup_timeout_s": {"baseline": 1},
                                         "startup_timeout_s": 2, "fits": True}, gpu_hours={"gpu_hours": 0, "gpus": 0,
                                         "planned_s": 0, "estimate": ""}, failures=[], notes=[]))
    config = REPO / "configs" / "mimo-v2.5-mtp.yaml"
    assert plan_command.main([str(config)]) == 0
    out = capsys.readouterr().out
    assert "note: power: accuracy: a drop of >=" in out and "note: power: TPOT p50: a ratio" in out
    assert "note: power: WARNING: accuracy_margin 0.01 is below what 1,319 items can decide" in out

    cfg = load_config(config)
    lines: list[str] = []
    ctx = SimpleNamespace(cfg=cfg, result=RunResult(run_id="r", run_dir=tmp_path, config=cfg), say=lines.append)
    Prepare._power(ctx, say=True)
    assert lines[0].startswith("power: accuracy:") and any("WARNING" in line for line in lines)
    doc = decision_document(ctx.result)
    assert doc["detectable_effect"]["accuracy_noninferiority"]["decidable"] is False
    assert set(doc["detectable_effect"]) == {"accuracy_noninferiority", "tpot_p50_improvement", "error_rate_guard",
                                             "acceptance_length_floor"}
    again = RunResult.from_document(doc, cfg, tmp_path)
    assert again.detectable_effect == ctx.result.detectable_effect


def test_the_reports_say_what_the_plan_could_decide_and_the_attempts(tmp_path):
    from rollout.record.markdown import markdown_report
    from rollout.record.html import html_report

    effect = power.DetectableEffect(gate="accuracy_noninferiority", metric="accuracy_diff", threshold=0.01, sample=1319,
                                    passed_at=None, failed_at=0.027, power=0.8, decidable=False, assumptions="a",
                                    text="accuracy: a drop of >= 2.7 points is failed", warning="accuracy_margin 0.01 is below")
    doc = json.loads((REPO / "tests" / "data" / "recorded_runs" / "promote" / "decision.json").read_text())
    assert "What the plan could decide" not in markdown_report(doc)
    doc["detectable_effect"] = {effect.gate: effect.model_dump(mode="json")}
    doc["attempts"] = {"comparison": "abc", "number": 2, "alpha_spent_together": 0.1, "judged_before": {"a1": "inconclusive"},
                       "inconclusive_before": ["a1"]}
    text = markdown_report(doc)
    assert "## What the plan could decide" in text and "a drop of >= 2.7 points" in text
    assert "**Warning**: accuracy_margin 0.01 is below" in text and "judged INCONCLUSIVE before in a1" in text
    page = html_report(doc, tmp_path)
    assert 'id="plan"' in page and "a drop of &gt;= 2.7 points" in page
