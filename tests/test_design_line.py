"""The run's first lines say what the experiment's design cancels and what it only bounds."""

from __future__ import annotations

from rollout.config import load_config
from rollout.run.phases.setup import design_line
from tests.conftest import REPO


def test_the_design_line_names_the_warm_up_and_whether_a_twin_cancels_drift():
    demo = design_line(load_config(REPO / "configs" / "local-cpu.yaml"))
    assert "warm-up 40 requests per arm" in demo and "15 planned looks" in demo
    assert "no twin baseline" in demo and "look-to-look correlation <= 0.5" in demo
    gpu = design_line(load_config(REPO / "configs" / "mimo-v2.5-mtp.yaml"))
    assert "a twin baseline measures the A/A floor" in gpu and "no twin" not in gpu
