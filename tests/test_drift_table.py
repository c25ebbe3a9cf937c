"""The precomputed critical-value laws (rollout.judge.drift_table) are the simulation's, and the judge reads them."""

import numpy as np
import pytest

from rollout.calibration.drift_table import TABLE_CORRELATIONS, TABLE_LOOKS
from rollout.judge import stats
from rollout.judge.drift_table import DRIFT_QUANTILES


def test_the_table_holds_every_law_of_its_grid_at_every_level():
    assert set(DRIFT_QUANTILES) == {(g, rho) for g in TABLE_LOOKS for rho in TABLE_CORRELATIONS}
    assert all(len(q) == len(stats._DRIFT_LEVELS) for q in DRIFT_QUANTILES.values())
    # upper quantiles at decreasing levels rise; a larger correlation needs larger critical values
    assert all(np.all(np.diff(q) > 0) for q in DRIFT_QUANTILES.values())
    assert DRIFT_QUANTILES[(15, 0.9)][4] > DRIFT_QUANTILES[(15, 0.5)][4] > DRIFT_QUANTILES[(15, 0.0)][4]


@pytest.mark.parametrize("law", [(2, 0.0), (6, 0.5), (15, 0.25), (15, 0.75), (40, 0.9)])
def test_table_entries_are_what_the_seeded_simulation_gives(law):
    g, rho = law
    assert np.array_equal(np.array(DRIFT_QUANTILES[law]), stats.simulate_drift_null_quantiles(g, rho))


def test_the_judge_reads_the_table_and_simulates_a_law_outside_it(monkeypatch):
    stats._drift_null_quantiles.cache_clear()
    simulated: list[tuple[int, float]] = []
    real = stats.simulate_drift_null_quantiles
    monkeypatch.setattr(stats, "simulate_drift_null_quantiles", lambda g, rho: simulated.append((g, rho)) or real(g, rho))
    try:
        assert np.array_equal(stats._drift_null_quantiles(15, 0.5), np.array(DRIFT_QUANTILES[(15, 0.5)]))
        assert simulated == []
        outside = stats._drift_null_quantiles(3, 0.3)  # a look_correlation_max of 0.3 asks for this law
        assert simulated == [(3, 0.3)] and np.all(np.diff(outside) > 0)
    finally:
        stats._drift_null_quantiles.cache_clear()
