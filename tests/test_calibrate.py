"""Tests of rollout/judge/calibrate.py: the claimed error rates hold in simulation (issue 6 targets).

A fast calibration (1500 simulated runs per scenario, a few seconds): every
error rate must be <= alpha within 3 binomial standard errors, and the
sequential judges must beat the fixed-horizon ones as issue 6 asks.
"""

from __future__ import annotations

import json
import math

import pytest

from rollout.judge.calibrate import format_table, main, run_calibration, verify_against_judges
from rollout.judge.config import GatesConfig

TRIALS = 1500


@pytest.fixture(scope="module")
def calibration() -> dict:
    return run_calibration(trials=TRIALS, seed=20240611)


def slack(rate: float) -> float:
    return 3 * math.sqrt(rate * (1 - rate) / TRIALS)


def test_simulation_uses_the_same_verdicts_as_the_judges():
    assert verify_against_judges(trials=3, seed=2) == 0


def test_result_has_the_published_keys_and_is_json(calibration):
    assert calibration["alpha"] == 0.05
    assert {"false_promote_rate", "false_rollback_rate"} <= set(calibration["aa"])
    assert "false_promote_rate" in calibration["boundary"]
    assert [row["effect"] for row in calibration["latency"]] == [0.05, 0.10, 0.20]
    for row in calibration["latency"]:
        assert {"effect", "power", "mean_samples", "fixed_power", "fixed_samples", "kayenta_power"} <= set(row)
    assert [row["drop_points"] for row in calibration["accuracy"]] == [1.0, 2.0, 3.0]
    for row in calibration["accuracy"]:
        assert {"drop_points", "power", "mean_items", "unpaired_power", "unpaired_items"} <= set(row)
    json.loads(json.dumps(calibration))


def test_aa_false_rollback_and_false_promote_within_alpha(calibration):
    alpha = calibration["alpha"]
    assert calibration["aa"]["false_rollback_rate"] <= alpha + slack(alpha)
    assert calibration["aa"]["false_promote_rate"] <= alpha + slack(alpha)


def test_boundary_false_promote_within_alpha(calibration):
    alpha = calibration["alpha"]
    assert calibration["boundary"]["false_promote_rate"] <= alpha + slack(alpha)


def test_guardrails_at_their_limits_keep_familywise_false_rollback_within_alpha(calibration):
    alpha = calibration["alpha"]
    assert calibration["guardrail_boundary"]["false_rollback_rate"] <= alpha + slack(alpha)


def test_accuracy_drop_at_the_margin_neither_passes_nor_fails_beyond_alpha(calibration):
    alpha = calibration["alpha"]
    assert calibration["accuracy_boundary"]["false_promote_rate"] <= alpha + slack(alpha)
    assert calibration["accuracy_boundary"]["false_rollback_rate"] <= alpha + slack(alpha)


def test_sequential_latency_judge_matches_fixed_horizon_power_with_at_most_60_percent_of_samples(calibration):
    row = next(r for r in calibration["latency"] if r["effect"] == 0.10)
    fixed = max(row["fixed_power"], row["kayenta_power"])
    assert row["power"] >= fixed - slack(max(min(fixed, 0.99), 0.01))
    assert row["mean_samples"] <= 0.6 * row["fixed_samples"]
    powers = [r["power"] for r in calibration["latency"]]
    assert powers == sorted(powers)  # bigger effects are easier to see


def test_paired_accuracy_beats_the_unpaired_test_at_two_points(calibration):
    row = next(r for r in calibration["accuracy"] if r["drop_points"] == 2.0)
    assert row["power"] > row["unpaired_power"]
    assert row["mean_items"] < row["unpaired_items"]


def test_broken_config_is_caught_within_a_few_dozen_items(calibration):
    broken = calibration["broken_config"]
    assert broken["caught_rate"] == 1.0
    assert broken["max_items_to_fail"] <= 40


def test_same_seed_same_result_and_a_readable_table():
    first = run_calibration(trials=60, seed=5)
    assert first == run_calibration(trials=60, seed=5)
    table = format_table(first)
    assert "A/A false rollback" in table and "Kayenta" in table and "unpaired" in table


def test_calibration_respects_a_custom_config():
    looks, n = 3, 100  # n: the default design's requests per arm per window
    strict = run_calibration(trials=60, seed=1, cfg=GatesConfig(max_looks=looks, alpha=0.05))
    loose = run_calibration(trials=60, seed=1, cfg=GatesConfig(max_looks=looks, alpha=0.1))
    # three looks: the fixed-horizon comparison pools three windows, and no judge uses more
    assert all(row["fixed_samples"] == looks * n for row in loose["latency"])
    assert all(n <= row["mean_samples"] <= looks * n for row in loose["latency"])
    assert n <= loose["aa"]["mean_samples_to_final"] <= looks * n
    default = run_calibration(trials=60, seed=1)
    assert all(row["fixed_samples"] == 5 * n for row in default["latency"])
    # the same simulated runs (same seed and looks) judged at a larger alpha: intervals no
    # wider, so the objective passes at least as often and is decided no later, at every
    # effect; the 5% one (60 runs: seed-determined) passes visibly more often
    for strict_row, loose_row in zip(strict["latency"], loose["latency"]):
        assert loose_row["power"] >= strict_row["power"], (strict_row, loose_row)
        assert loose_row["mean_samples"] <= strict_row["mean_samples"], (strict_row, loose_row)
    assert loose["latency"][0]["power"] > strict["latency"][0]["power"]
    assert loose["simulation_se"] == pytest.approx(math.sqrt(0.1 * 0.9 / 60))


def test_main_prints_json(capsys):
    assert main(["--trials", "40", "--seed", "3", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    # what the CLI prints is what the calibration computes for those trials and that seed
    assert printed == json.loads(json.dumps(run_calibration(trials=40, seed=3)))
    assert printed != json.loads(json.dumps(run_calibration(trials=40, seed=4)))
