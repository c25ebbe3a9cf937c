"""The decision counts every check the config cannot name (preflight's, the experiment's other-traffic check)
whatever `gates.enabled` lists: a list of gates names what is judged, never what may be ignored."""

from __future__ import annotations

import yaml

from rollout.config import parse_config
from rollout.judge.verdicts import Decision, GateResult, Verdict
from rollout.run.phases.decide import Decide
from rollout.record.result import RunResult
from rollout.run.resume import ResumePoint
from rollout.run.context import RunContext
from rollout.run.store import RunStore
from tests.conftest import REPO


def _gate(name: str, verdict: Verdict) -> GateResult:
    return GateResult(name=name, metric="m", baseline=None, canary=None, threshold=None, verdict=verdict)


def test_an_other_traffic_check_blocks_promote_under_an_explicit_list_of_gates(tmp_path):
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    data["gates"]["enabled"] = ["tpot_p50_improvement"]
    cfg = parse_config(data)
    store = RunStore(tmp_path / "history.db")
    store.create_run("r", cfg.name, "tiny", cfg.model_dump(mode="json"))
    ctx = RunContext(cfg=cfg, run_id="r", run_dir=tmp_path / "r", store=store,
                     result=RunResult(run_id="r", run_dir=tmp_path / "r", config=cfg), progress=lambda line: None,
                     cache_dir=tmp_path, point=ResumePoint.fresh(), namespace="test")
    ctx.result.gates = [_gate("tpot_p50_improvement", Verdict.PASS), _gate("experiment_other_traffic", Verdict.INCONCLUSIVE)]
    ctx.record_decision(Decide().run(ctx))
    assert ctx.result.decision is Decision.INCONCLUSIVE, ctx.result.reason
    assert "experiment_other_traffic" in ctx.result.reason
