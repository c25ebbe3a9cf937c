"""The progressive phase's verdict in the run: the steps may turn a judged PROMOTE into ROLLBACK,
never a run that judged nothing into PROMOTE (guards only raise alarms; they compare nothing).

The steps themselves (rollout.run.phases.progressive_steps, Ray and Locust) are replaced by their
outcome: what is under test is what the phase does with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rollout.config import parse_config
from rollout.judge.verdicts import Decision, GateResult, Verdict
from rollout.run.decision import Decided
from rollout.run.phases import progressive
from rollout.run.phases.decide import Decide
from rollout.run.phases.progressive import Progressive
from rollout.run.phases.progressive_context import ProgressiveOutcome
from rollout.record.result import RunResult
from rollout.run.resume import ResumePoint
from rollout.run.context import RunContext
from rollout.run.store import RunStore

REPO = Path(__file__).resolve().parents[1]


def _context(tmp_path: Path, judged: bool) -> tuple[RunContext, list[str]]:
    data = yaml.safe_load((REPO / "configs/examples/local-progressive.yaml").read_text())
    if not judged:  # the run: no accuracy, no experiment, steps 50 -> 100
        data["accuracy"]["enabled"] = False
        data["experiment"]["enabled"] = False
        data["progressive"]["steps"] = [{"canary_weight": 50, "bake_s": 30}, {"canary_weight": 100, "bake_s": 30}]
    cfg = parse_config(data)
    store = RunStore(tmp_path / "history.db")
    store.create_run("r", cfg.name, "tiny", cfg.model_dump(mode="json"))
    lines: list[str] = []
    ctx = RunContext(cfg=cfg, run_id="r", run_dir=tmp_path / "r", store=store,
                     result=RunResult(run_id="r", run_dir=tmp_path / "r", config=cfg), progress=lines.append,
                     cache_dir=tmp_path, point=ResumePoint.fresh(), namespace="test")
    return ctx, lines


def _guard(verdict: Verdict) -> GateResult:
    return GateResult(name="guard_error_rate", metric="error_rate_diff", baseline=0.0, canary=0.0, threshold=0.05,
                      verdict=verdict)


def _steps(monkeypatch, decision: Decision, verdict: Verdict) -> None:
    """The steps end with `decision` (Ray, Locust and the router are not what is under test)."""
    outcome = ProgressiveOutcome(decision=decision, reason=f"steps said {decision.value}", guards=[_guard(verdict)],
                                 steps_completed=2, observed_split=[])
    monkeypatch.setattr(progressive, "run_progressive", lambda context: outcome)
    monkeypatch.setattr(Progressive, "_context", staticmethod(lambda ctx, first_step, previous_load: None))


def _judged_promote(ctx: RunContext) -> None:
    ctx.result.gates = [GateResult(name="accuracy", metric="accuracy_diff", baseline=0.9, canary=0.9, threshold=0.05,
                                   verdict=Verdict.PASS)]
    ctx.record_decision(Decided(Decision.PROMOTE, "every gate passed: accuracy"))
    ctx.judged = True


def test_steps_that_pass_their_guards_never_promote_a_run_that_judged_nothing(tmp_path, monkeypatch):
    ctx, lines = _context(tmp_path, judged=False)
    ctx.record_decision(Decide().run(ctx))
    assert ctx.result.decision == Decision.INCONCLUSIVE
    _steps(monkeypatch, Decision.PROMOTE, Verdict.PASS)
    phase = Progressive()
    assert phase.enabled(ctx)  # the steps still run: a guard alarm rolls the canary back
    ctx.record_decision(phase.run(ctx))
    assert ctx.result.decision == Decision.INCONCLUSIVE
    assert ctx.result.exit_code == 4
    assert "cannot promote" in ctx.result.reason
    assert any("cannot promote" in line for line in lines)


def test_steps_that_alarm_roll_back_a_run_that_judged_nothing(tmp_path, monkeypatch):
    ctx, _ = _context(tmp_path, judged=False)
    ctx.record_decision(Decide().run(ctx))
    _steps(monkeypatch, Decision.ROLLBACK, Verdict.FAIL)
    ctx.record_decision(Progressive().run(ctx))
    assert ctx.result.decision == Decision.ROLLBACK
    assert ctx.result.reason == "steps said rollback"


@pytest.mark.parametrize("steps, expected", [(Decision.PROMOTE, Decision.PROMOTE), (Decision.ROLLBACK, Decision.ROLLBACK),
                                             (Decision.INCONCLUSIVE, Decision.INCONCLUSIVE)])
def test_a_judged_promote_stands_only_if_the_steps_hold(tmp_path, monkeypatch, steps, expected):
    ctx, _ = _context(tmp_path, judged=True)
    _judged_promote(ctx)
    _steps(monkeypatch, steps, Verdict.FAIL if steps == Decision.ROLLBACK else Verdict.PASS)
    ctx.record_decision(Progressive().run(ctx))
    assert ctx.result.decision == expected
    if expected == Decision.PROMOTE:
        assert ctx.result.reason == "every gate passed: accuracy"


def test_a_resumed_run_that_judged_nothing_does_not_promote_on_its_stored_steps(tmp_path, monkeypatch):
    """The verdict an earlier attempt stored is applied by the same rule."""
    from rollout.run.resume import ProgressiveVerdict
    from rollout.record.result import ProgressiveSummary

    ctx, _ = _context(tmp_path, judged=False)
    ctx.record_decision(Decide().run(ctx))
    summary = ProgressiveSummary(steps_completed=2, observed_split=[], requests_received=10, records_stored=10,
                                 attempt=1, duration_s=60.0, advisory=None)
    stored = ProgressiveVerdict(Decision.PROMOTE, "every step passed its guards", [_guard(Verdict.PASS)], summary)
    ctx.point = ResumePoint(2, "progressive", 100.0, None, [], None, stored, 2)
    ctx.record_decision(Progressive().run(ctx))
    assert ctx.result.decision == Decision.INCONCLUSIVE


def test_an_abort_before_any_gate_never_ramps_the_canary(tmp_path, monkeypatch):
    """A run that judges nothing before its steps, aborted (ROLLBACK) before its first look: the steps would ramp
    the canary's weight after the operator asked for the stable config. They do not run."""
    ctx, _ = _context(tmp_path, judged=False)
    ctx.record_decision(Decided(Decision.ROLLBACK, "aborted by command during experiment"))
    assert not ctx.result.gates
    assert not Progressive().enabled(ctx)
    # the same run undecided (INCONCLUSIVE: nothing judged) still bakes its steps, as the guards may roll it back
    fresh, _ = _context(tmp_path / "fresh", judged=False)
    fresh.record_decision(Decided(Decision.INCONCLUSIVE, "no gate was judged"))
    assert Progressive().enabled(fresh)
