"""Where speculation stops paying: per-level ratio intervals, the crossover load, the adaptive planner (pure).

The synthetic sweeps draw request records whose true canary/baseline TPOT median ratio is
r(load) = A + B log(load), so the true crossover of a bar is exp((bar - A) / B). Within a level
the records are correlated as a real sweep's are: a shock both arms share (a busy core, an
AR(1) with rho 0.9), an arm's own slow stretches (AR(1), rho 0.8) and per-request noise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from loadtests.records import RequestRecord
from rollout.config import ConfigError, parse_config
from rollout.analysis.crossover import AdaptivePolicy, LevelResult, crossing, next_level, ratio_interval
from rollout.analysis.load_sweep import crossover_line, level_results
from rollout.calibration.load_curve import level_records as sweep_level_records
from rollout.record.markdown import markdown_report
from rollout.record.result import RunResult, SweepCrossover, decision_document
from tests.test_config import minimal
from tests.test_result import RECORDED, config_of

A, B = 0.6, 0.15  # r(load) = 0.6 + 0.15 log(load): bar 0.9 at e^2 = 7.39, ratio 1.0 at e^(8/3) = 14.39
ARMS = ("baseline", "canary")


def true_crossover(bar: float) -> float:
    return math.exp((bar - A) / B)


def level_records(rng: np.random.Generator, level: float, *, noise: float = 1.0, step_s: float = 10.0,
                  drop: float = 0.0) -> list[RequestRecord]:
    """One level of a sweep whose true ratio is A + B log(load) (the calibration's correlated records)."""
    return sweep_level_records(rng, level, A + B * math.log(level), noise=noise, step_s=step_s, drop=drop)


def policy(**overrides) -> AdaptivePolicy:
    values = dict(start=1, max_level=64, min_step=1.0, max_levels=10, bars=(0.9, 1.0), resolution=0.5)
    return AdaptivePolicy(**{**values, **overrides})


def adaptive_sweep(seed: int, the_policy: AdaptivePolicy, noise: float = 1.0) -> list[LevelResult]:
    """The planner steering a synthetic sweep, level after level, as the phase does."""
    rng = np.random.default_rng(seed)
    done: list[LevelResult] = []
    while (level := next_level(done, the_policy)) is not None:
        done += level_results(level_records(rng, level, noise=noise), ARMS, step_s=10.0, replicas=1, seed=seed)
    return done


def at(level: float, ratio: float | None, low: float | None = None, high: float | None = None) -> LevelResult:
    return LevelResult(level=level, ratio=ratio, ratio_low=low, ratio_high=high, pairs=50, block=7,
                       tokens_per_s=10.0 * level)


# -- the interval of one level -------------------------------------------------------------------
def test_the_ratio_of_medians_and_its_interval_from_paired_prompts():
    """Independent prompts, true median ratio 0.8: the interval covers it in >= 90% of 100 samples
    (measured at 400 samples: 0.98 at 200 prompts, 0.97 at 30)."""
    covered = 0
    for seed in range(100):
        rng = np.random.default_rng(seed)
        base = 0.03 * np.exp(rng.normal(0, 0.1, 100))
        got = ratio_interval(base, base * 0.8 * np.exp(rng.normal(0, 0.05, 100)), seed=seed)
        assert got.ratio == pytest.approx(0.8, abs=0.03) and got.block == 10  # sqrt(100) prompts per block
        covered += got.low <= 0.8 <= got.high
    assert covered >= 90
    assert ratio_interval(base, base * 0.8) == ratio_interval(base, base * 0.8)  # seeded: same records, same interval


def test_pairing_cancels_what_both_arms_share():
    """A shock that hits a prompt on both arms (a busy core) leaves the paired interval narrow."""
    rng = np.random.default_rng(2)
    shared = np.exp(rng.normal(0, 0.3, 120))
    paired = ratio_interval(0.03 * shared, 0.024 * shared * np.exp(rng.normal(0, 0.02, 120)))
    unpaired = ratio_interval(0.03 * shared, 0.024 * rng.permutation(shared))
    assert paired.high / paired.low < 1.05 < unpaired.high / unpaired.low


def test_a_prompt_with_one_arm_keeps_it_and_too_few_samples_give_no_interval():
    b = np.array([0.03, 0.031, np.nan, 0.029, 0.030, 0.032, 0.028, 0.03])
    c = np.array([0.015, np.nan, 0.016, 0.015, 0.014, 0.016, 0.015, np.nan])
    got = ratio_interval(b, c)
    assert got.ratio == pytest.approx(0.015 / 0.030) and got.low is not None
    few = ratio_interval(b[:4], c[:4])
    assert few.ratio is not None and few.low is None and few.high is None
    assert ratio_interval(b, np.full(8, np.nan)).ratio is None
    with pytest.raises(ValueError, match="aligned"):
        ratio_interval(b, c[:3])


def test_level_results_pair_records_by_prompt_and_count_tokens_per_replica():
    rng = np.random.default_rng(3)
    records = level_records(rng, 4.0, drop=0.1)
    (got,) = level_results(records, ARMS, step_s=10.0, replicas=2)
    ok = [r for r in records if r.ok]
    both = {r.dataset_index for r in ok if r.arm == "baseline"} & {r.dataset_index for r in ok if r.arm == "canary"}
    assert got.level == 4.0 and got.pairs == len(both) < len(records) // 2
    medians = {arm: np.median([r.tpot_s for r in ok if r.arm == arm]) for arm in ARMS}
    assert got.ratio == pytest.approx(medians["canary"] / medians["baseline"], abs=1e-4)
    assert got.tokens_per_s == pytest.approx(sum(r.output_tokens for r in ok) / 2 / 10.0 / 2, abs=0.01)
    assert got.ratio_low < got.ratio < got.ratio_high


# -- the crossover ---------------------------------------------------------------------------------
def test_the_crossing_is_interpolated_in_log_load_between_the_levels_that_bracket_it():
    levels = [at(1, 0.60, 0.55, 0.65), at(2, 0.70, 0.65, 0.76), at(4, 0.80, 0.74, 0.86), at(8, 1.10, 1.02, 1.18)]
    got = crossing(levels, 1.0)
    # 0.8 at 4 and 1.1 at 8: 1.0 two thirds of the way on the log scale, 4 * 2^(2/3)
    assert got.level == pytest.approx(4 * 2 ** (2 / 3), abs=1e-3)
    assert got.offered_tokens_per_s == pytest.approx(10 * 4 * 2 ** (2 / 3), abs=0.01)
    # upper edge 0.86 -> 1.18 reaches 1.0 first; lower edge 0.74 -> 1.02 leaves it last
    assert got.level_low == pytest.approx(4 * 2 ** (0.14 / 0.32), abs=1e-3)
    assert got.level_high == pytest.approx(4 * 2 ** (0.26 / 0.28), abs=1e-3)
    assert got.level_low < got.level < got.level_high
    assert "between 4 (0.800) and 8 (1.100)" in got.reason


def test_a_sweep_that_never_crosses_says_why_and_where_the_interval_can_still_reach():
    paying = [at(1, 0.5, 0.45, 0.55), at(4, 0.6, 0.5, 0.7), at(16, 0.8, 0.7, 1.05)]
    got = crossing(paying, 1.0)
    assert got.level is None and got.offered_tokens_per_s is None
    assert got.reason == "still paying at the top level 16 (ratio 0.800 < 1)"
    assert got.level_low is not None and 4 < got.level_low < 16 and got.level_high is None
    sure = crossing([at(1, 0.5, 0.45, 0.55), at(4, 0.6, 0.5, 0.7)], 1.0)
    assert sure.level is None and sure.level_low == 4 and sure.level_high is None  # above the range, with confidence
    losing = crossing([at(1, 1.05, 0.98, 1.12), at(2, 1.2, 1.1, 1.3)], 0.9)
    assert losing.level is None and losing.reason == "not paying at the lowest level 1 (ratio 1.050 >= 0.9)"
    assert losing.level_low is None and losing.level_high == 1  # below the range, with confidence


def test_levels_without_a_ratio_or_an_interval_never_narrow_the_crossing():
    levels = [at(1, 0.6, 0.5, 0.7), at(2, None), at(4, 0.9), at(8, 1.2, 1.1, 1.3)]
    got = crossing(levels, 1.0)
    assert got.level is not None and "levels without a TPOT ratio left out: 2" in got.reason
    # level 4 has no interval: its band is everything, so the interval reaches to 1 and 8
    assert got.level_low == 1 and got.level_high == 8
    none = crossing([at(1, None)], 1.0)
    assert none.level is None and none.reason.startswith("no level has a TPOT ratio")


# -- the planner -------------------------------------------------------------------------------------
def test_the_planner_doubles_from_the_start_until_the_highest_bar_is_reached():
    p = policy()
    assert next_level([], p) == 1
    assert next_level([at(1, 0.6)], p) == 2
    assert next_level([at(1, 0.6), at(2, 0.7), at(4, 0.95)], p) == 8  # past the bar 0.9, not yet 1.0: doubling on
    assert next_level([at(1, 0.6), at(2, 0.95)], policy(bars=(0.9,), min_step=0.25)) == 1.5  # then bisection
    assert next_level([at(16, 0.6)], policy(max_level=20)) == 20  # doubling is clamped at max_level
    assert next_level([at(16, 0.6), at(20, 0.7)], policy(max_level=20)) is None  # never crosses: done


def test_the_planner_bisects_each_bar_s_bracket_geometrically_on_the_user_grid():
    p = policy()
    done = [at(1, 0.6), at(2, 0.7), at(4, 0.8), at(8, 0.92), at(16, 1.02)]
    assert next_level(done, p) == 5.5  # the objective's bracket 4..8 first: sqrt(32) = 5.66 -> 5.5
    done.append(at(5.5, 0.86))
    assert next_level(done, p) == 6.5  # 5.5..8: sqrt(44) = 6.63 -> 6.5
    done += [at(6.5, 0.88), at(7.5, 0.91)]
    assert next_level(done, p) == 11.5  # 6.5..7.5 is within min_step: on to the 1.0 bracket 8..16, sqrt(128) = 11.3
    assert next_level(done, policy(max_levels=len(done))) is None  # the level budget is spent


def test_the_planner_stops_when_nothing_is_left_to_bisect():
    assert next_level([at(1, 1.1)], policy()) is None  # not paying at the lowest level: nothing below to try
    assert next_level([at(1, 0.6), at(2, 1.1)], policy()) is None  # 1..2 is within min_step 1
    assert next_level([at(1, 0.6), at(1.5, 1.1)], policy(min_step=0.1)) is None  # no grid point between
    assert next_level([at(1, 0.6), at(2, None)], policy()) is None  # a level without a ratio cannot steer
    assert next_level([], policy(start=0.3)) == 0.5  # the start lands on the user grid


# -- synthetic sweeps with a known crossover ---------------------------------------------------------
def test_the_bisection_finds_a_known_crossover_within_the_min_step():
    p = policy(min_step=1.0, max_levels=16)
    done = adaptive_sweep(seed=11, the_policy=p, noise=0.01)
    ordered = sorted(done, key=lambda r: r.level)
    for bar in p.bars:
        first = next(j for j, r in enumerate(ordered) if r.ratio >= bar)
        low, high = ordered[first - 1].level, ordered[first].level
        assert low < true_crossover(bar) < high and high - low <= p.min_step, (bar, low, high)
        got = crossing(done, bar)
        assert got.level == pytest.approx(true_crossover(bar), abs=p.min_step / 2)


def test_the_crossing_interval_covers_the_true_crossover_in_correlated_sweeps():
    """60 adaptive sweeps (at most 8 levels) of correlated records: coverage >= 0.9 for both bars. Measured
    with 400 such sweeps: 0.983 (bar 0.9) and 0.985 (1.0), SE 0.007; the per-level 95% intervals covered 0.916
    of 3,192 levels (the AR(1) rho 0.8 of an arm's own slow stretches is longer than the blocks hold)."""
    p = policy(max_levels=8)
    covered = {bar: 0 for bar in p.bars}
    runs = 60
    for seed in range(runs):
        done = adaptive_sweep(seed=seed, the_policy=p)
        for bar in p.bars:
            got = crossing(done, bar)
            low = 0.0 if got.level_low is None else got.level_low
            high = math.inf if got.level_high is None else got.level_high
            covered[bar] += low <= true_crossover(bar) <= high
    for bar in p.bars:
        assert covered[bar] / runs >= 0.9, (bar, covered[bar])


def test_a_never_crossing_synthetic_sweep_reports_none_with_its_reason():
    done = adaptive_sweep(seed=5, the_policy=policy(max_level=4))  # the true crossings lie at 7.4 and 14.4
    assert sorted(r.level for r in done) == [1, 2, 4]
    got = crossing(done, 0.9)
    assert got.level is None and got.reason.startswith("still paying at the top level 4")


# -- decision.json and the report ----------------------------------------------------------------
def test_the_crossover_is_a_typed_part_of_the_experiment_and_one_report_line():
    levels = [at(1, 0.60, 0.55, 0.65), at(4, 0.80, 0.74, 0.86), at(8, 1.10, 1.02, 1.18)]
    found = SweepCrossover(ratio_1=crossing(levels, 1.0), objective_bar=crossing(levels, 0.9), levels=levels,
                           adaptive=True)
    doc = found.document()
    assert SweepCrossover.model_validate(doc) == found
    line = crossover_line(doc)
    assert line.startswith("\nCrossover load (adaptive levels): the TPOT ratio reaches the objective's bar 0.9 at ")
    assert "; reaches 1.0 at " in line and "95% interval" in line and "\n" not in line[1:]
    still = crossover_line(SweepCrossover(ratio_1=crossing(levels[:2], 1.0), objective_bar=crossing(levels[:2], 1.0),
                                          levels=levels[:2], adaptive=False).document())
    assert "still paying at the top level 4" in still and "reaches 1.0" not in still  # one bar when they are equal
    assert "above 4" in still


def test_the_report_shows_the_crossover_under_the_sweep_table():
    doc = json.loads((RECORDED / "promote" / "decision.json").read_text())
    levels = [at(1, 0.63, 0.5, 0.8), at(2, 0.8, 0.6, 1.0), at(4, 0.58, 0.5, 0.7)]
    doc["experiment"]["sweep_crossover"] = SweepCrossover(
        ratio_1=crossing(levels, 1.0), objective_bar=crossing(levels, 1.0), levels=levels, adaptive=False).document()
    result = RunResult.from_document(doc, config_of(doc), Path("/tmp/promote"))
    again = decision_document(result)
    assert again["experiment"]["sweep_crossover"] == doc["experiment"]["sweep_crossover"]
    report = markdown_report(again)
    table_end = report.index("tokens/chunk is the client's view")
    assert "Crossover load (the levels above)" in report[table_end:]
    assert "still paying at the top level 4" in report


# -- config ----------------------------------------------------------------------------------------
def test_the_adaptive_sweep_is_off_by_default_and_validated():
    cfg = parse_config(minimal())
    assert not cfg.experiment.sweep.adaptive.enabled and not cfg.experiment.sweep.enabled
    on = parse_config(minimal(experiment={"sweep": {"step_s": 20, "adaptive": {"enabled": True, "max_levels": 6}}}))
    assert on.experiment.sweep.enabled and on.experiment.sweep.planned_s == 120


@pytest.mark.parametrize(
    "sweep, names",
    [
        ({"levels": [1, 2], "adaptive": {"enabled": True}}, "experiment.sweep: levels and adaptive.enabled exclude"),
        ({"adaptive": {"enabled": True, "start_level": 8, "max_level": 4}}, "experiment.sweep.adaptive: max_level 4"),
        ({"adaptive": {"min_step": 0}}, "experiment.sweep.adaptive.min_step"),
        ({"adaptive": {"max_levels": 1}}, "experiment.sweep.adaptive.max_levels"),
        ({"adaptive": {"start_level": 0}}, "experiment.sweep.adaptive.start_level"),
        ({"adaptive": {"bisect": True}}, "experiment.sweep.adaptive.bisect"),
    ],
)
def test_bad_adaptive_sweep_configs_get_one_line_naming_the_field(sweep, names):
    with pytest.raises(ConfigError) as err:
        parse_config(minimal(experiment={"sweep": sweep}))
    assert names in str(err.value) and "\n" not in str(err.value)


def test_a_sweep_s_crossover_has_the_key_paths_the_recorded_demo_expectation_adds():
    """tests/test_cli_run.py compares a demo run's key paths with the recorded run's plus this field."""
    from tests.test_result import key_paths, sweep_crossover_of

    rng = np.random.default_rng(7)
    levels = level_results(level_records(rng, 1.0) + level_records(rng, 4.0), ARMS, step_s=10.0, replicas=1)
    measured = SweepCrossover(ratio_1=crossing(levels, 1.0), objective_bar=crossing(levels, 1.0), levels=levels,
                              adaptive=False).document()
    recorded = sweep_crossover_of([{"level": 1.0, "tpot_ratio": 0.63}, {"level": 4.0, "tpot_ratio": 0.58}])
    assert key_paths(measured) == key_paths(recorded)


# -- the phase, with a synthetic load in place of the swarm ----------------------------------------
def test_the_adaptive_sweep_phase_runs_level_after_level_and_records_the_crossover(tmp_path, monkeypatch):
    from loadtests.records import read_records
    from rollout.run.phases.sweep import Sweep
    from rollout.run.resume import ResumePoint
    from rollout.record.result import ExperimentSummary
    from rollout.run.context import RunContext
    from rollout.run.store import RunStore

    data = minimal(experiment={"sweep": {"step_s": 10, "adaptive": {
        "enabled": True, "start_level": 1, "max_level": 64, "min_step": 1.0, "max_levels": 9}}},
        gates={"tpot_p50_min_improvement": 0.1})
    cfg = parse_config(data)
    store = RunStore(tmp_path / "history.db")
    store.create_run("r", cfg.name, "tiny", cfg.model_dump(mode="json"))
    lines: list[str] = []
    ctx = RunContext(cfg=cfg, run_id="r", run_dir=tmp_path / "r", store=store,
                     result=RunResult(run_id="r", run_dir=tmp_path / "r", config=cfg), progress=lines.append,
                     cache_dir=tmp_path, point=ResumePoint.fresh(), namespace="test")
    recorded = json.loads((RECORDED / "promote" / "decision.json").read_text())["experiment"]
    ctx.result.experiment = ExperimentSummary.model_validate({**recorded, "sweep": None})
    rng = np.random.default_rng(4)
    asked: list[tuple[str, float]] = []

    def load(self, ctx, steps, top_level, path, log_dir):  # the swarm's records, drawn instead of measured
        asked.append((steps, top_level))
        return level_records(rng, top_level, noise=0.2)

    monkeypatch.setattr(Sweep, "_load", load)
    assert Sweep().enabled(ctx)
    Sweep().run(ctx)
    levels = [level for _, level in asked]
    assert levels[:5] == [1, 2, 4, 8, 16] and len(levels) == 9  # doubling to past 1.0, then bisection to the budget
    exp = ctx.result.experiment
    assert [row.level for row in exp.sweep] == sorted(levels)
    found = exp.sweep_crossover
    assert found.adaptive and [r.level for r in found.levels] == levels
    assert found.objective_bar.bar == 0.9 and found.ratio_1.bar == 1.0
    assert abs(found.objective_bar.level - true_crossover(0.9)) < 1.0
    assert store.count_request_samples("r", "sweep") == len(read_records(tmp_path / "r" / "sweep" / "records.jsonl"))
    assert sum(1 for line in lines if "sweep: level " in line) == 9
    doc = decision_document(ctx.result)
    assert doc["experiment"]["sweep_crossover"]["objective_bar"]["level"] == found.objective_bar.level
    assert "Crossover load (adaptive levels)" in markdown_report(doc)
