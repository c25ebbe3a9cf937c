"""One writer of the run's decision: a phase hands back `Decided` (rollout.run.decision), the controller
records it (RunContext.record_decision, called from rollout/run/controller.py only), and the rules of
precedence hold: an abort's ROLLBACK stands over the candidates' choice and over what its phase returns,
a preflight failure over a resumed judgement, the decision phase decides only an undecided run, and the
progressive steps never promote a run that was not judged PROMOTE. Phase modules import no other phase."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rollout.config import parse_config
from rollout.judge.verdicts import Decision, GateResult, Verdict
from rollout.record.result import RunResult
from rollout.run.context import RunContext
from rollout.run.decision import UNJUDGED, Decided, after_steps, decide_now
from rollout.run.resume import Judgement, ResumePoint
from rollout.run.store import RunStore
from tests.conftest import REPO

RUN = REPO / "rollout" / "run"
WRITER = ("context.py", "record_decision")  # the one function that may assign the decision
DECISION_FIELDS = {"decision", "reason"}


# -- the rule, read from the source -------------------------------------------------------------
def _result_aliases(function: ast.AST) -> set[str]:
    """Names bound to `<something>.result` in a function (`r = ctx.result`, `ctx, result = ..., x.result`)."""
    names: set[str] = set()
    for node in ast.walk(function):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                     else [(target, node.value)])
            for name, value in pairs:
                if isinstance(name, ast.Name) and isinstance(value, ast.Attribute) and value.attr == "result":
                    names.add(name.id)
    return names


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = []
        for target in node.targets:
            found += target.elts if isinstance(target, ast.Tuple) else [target]
        return found
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def decision_writes(source: str) -> list[tuple[str, int]]:
    """(enclosing function, line) of every write of a run result's decision or reason in `source`:
    `x.result.decision = ...`, through an alias of `x.result`, or setattr(x.result, "decision", ...)."""
    tree = ast.parse(source)
    writes = []
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for function in functions or [tree]:
        aliases = _result_aliases(function)
        for node in ast.walk(function):
            for target in _targets(node):
                if not (isinstance(target, ast.Attribute) and target.attr in DECISION_FIELDS):
                    continue
                owner = target.value
                if (isinstance(owner, ast.Attribute) and owner.attr == "result") or (
                        isinstance(owner, ast.Name) and owner.id in aliases):
                    writes.append((getattr(function, "name", "<module>"), node.lineno))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in DECISION_FIELDS):
                writes.append((getattr(function, "name", "<module>"), node.lineno))
    return sorted(set(writes), key=lambda w: w[1])


def calls_of(source: str, name: str) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name]


def test_nothing_under_rollout_run_writes_the_decision_but_the_one_writer():
    found = {}
    for path in sorted(RUN.rglob("*.py")):
        writes = decision_writes(path.read_text())
        if path.name == WRITER[0]:
            writes = [w for w in writes if w[0] != WRITER[1]]
        if writes:
            found[str(path.relative_to(REPO))] = writes
    assert found == {}, f"the decision is written outside {WRITER[1]}: {found}"
    assert [w[0] for w in decision_writes((RUN / WRITER[0]).read_text())] == [WRITER[1]]


def test_only_the_controller_records_the_decision():
    callers = {str(p.relative_to(REPO)) for p in sorted((REPO / "rollout").rglob("*.py"))
               if calls_of(p.read_text(), "record_decision")}
    assert callers == {"rollout/run/controller.py"}


def test_the_rule_sees_a_write_direct_through_an_alias_and_by_setattr():
    direct = "def f(ctx):\n    ctx.result.decision = 1\n"
    aliased = "def f(ctx):\n    r = ctx.result\n    r.decision, r.reason, r.gates = 1, 2, 3\n"
    unpacked = "def f(self):\n    ctx, result = self.ctx, self.ctx.result\n    result.reason = 'x'\n"
    by_setattr = "def f(ctx):\n    setattr(ctx.result, 'reason', 'x')\n"
    assert decision_writes(direct) == [("f", 2)]
    assert decision_writes(aliased) == [("f", 3)]
    assert decision_writes(unpacked) == [("f", 3)]
    assert decision_writes(by_setattr) == [("f", 2)]
    # an outcome's own fields are not the run's decision (Abort.reason in the progressive windows)
    assert decision_writes("def f(self, reason):\n    self.reason = reason\n") == []
    assert decision_writes("def f(ctx):\n    x = ctx.result.decision\n") == []


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_phase_modules_import_no_other_phase_module():
    from rollout.run.controller import PHASES

    phase_modules = {type(phase).__module__ for phase in PHASES}
    assert "rollout.run.phases.decide" in phase_modules and len(phase_modules) >= 8
    crossing = {}
    for module in sorted(phase_modules):
        path = REPO / Path(*module.split(".")).with_suffix(".py")
        others = (_imports(path) & phase_modules) - {module}
        if others:
            crossing[module] = sorted(others)
    assert crossing == {}


# -- the rules, on a run's context -----------------------------------------------------------------
def _context(tmp_path: Path, config: str = "configs/local-cpu.yaml", point: ResumePoint | None = None,
             **changes) -> RunContext:
    data = yaml.safe_load((REPO / config).read_text())
    data.update(changes)
    cfg = parse_config(data)
    store = RunStore(tmp_path / "history.db")
    store.create_run("r", cfg.name, "tiny", cfg.model_dump(mode="json"))
    return RunContext(cfg=cfg, run_id="r", run_dir=tmp_path / "r", store=store,
                      result=RunResult(run_id="r", run_dir=tmp_path / "r", config=cfg), progress=lambda line: None,
                      cache_dir=tmp_path, point=point or ResumePoint.fresh(), namespace="test")


def _gate(name: str, verdict: Verdict) -> GateResult:
    return GateResult(name=name, metric="m", baseline=None, canary=None, threshold=None, verdict=verdict)


def test_an_abort_command_is_kept_for_the_controller_never_written_by_the_context(tmp_path):
    ctx = _context(tmp_path)
    assert not ctx.aborted("experiment") and not ctx.decided
    ctx.store.add_command("r", "abort")
    assert ctx.aborted("experiment")
    assert ctx.result.decision is None and ctx.decided
    assert ctx.standing == Decided(Decision.ROLLBACK, "aborted by command during experiment")
    # the phase then returned something else: the abort stands over it
    ctx.record_decision(Decided(Decision.INCONCLUSIVE, "not enough evidence"))
    assert (ctx.result.decision, ctx.result.reason) == (Decision.ROLLBACK, "aborted by command during experiment")


def test_an_abort_stands_over_the_candidates_choice(tmp_path):
    from rollout.run.phases.candidate_choice import choose_now

    ctx = _context(tmp_path, "configs/examples/local-candidates.yaml")
    names = [c.name for c in ctx.cfg.candidates]
    ctx.engines = {name: SimpleNamespace(num_speculative_tokens=2, speculation="mtp k=2") for name in names}
    # every candidate failed: without the abort the choice alone would decide ROLLBACK, "no candidate won"
    ctx.candidate_gates = {name: [_gate("accuracy_noninferiority", Verdict.FAIL)] for name in names}
    ctx.store.add_command("r", "abort")
    assert ctx.aborted("accuracy")
    assert choose_now(ctx) is None
    assert all(c.reason.startswith("not promoted: aborted by command during accuracy") for c in ctx.result.candidates)
    ctx.record_decision(None)
    assert ctx.result.reason == "aborted by command during accuracy"
    # the same gates without an abort: the choice decides
    fresh = _context(tmp_path / "again", "configs/examples/local-candidates.yaml")
    fresh.engines, fresh.candidate_gates = ctx.engines, ctx.candidate_gates
    decided = choose_now(fresh)
    assert decided.decision is Decision.ROLLBACK and decided.reason.startswith("no candidate won")
    assert fresh.result.decision is None  # returned, not written


def test_a_preflight_failure_stands_over_a_resumed_judgement(tmp_path):
    from rollout.run.phases.decide import RestoreJudgement
    from rollout.run.phases.preflight import Preflight

    judged = Judgement(decision=Decision.PROMOTE, reason="every gate passed", gates=[], preflight=None, accuracy=None,
                       experiment=None, spec_decode={}, engine_warnings={})
    point = ResumePoint(2, "decide", 0.0, 1.0, [], judged, None, 0)
    ctx = _context(tmp_path, point=point)
    failed = Preflight._fail_no_drafts(ctx, 0.0)
    assert failed.decision is Decision.ROLLBACK and ctx.result.decision is None  # returned, not written
    ctx.record_decision(failed)
    assert RestoreJudgement().run(ctx) is None and ctx.judged
    assert ctx.result.decision is Decision.ROLLBACK and "no drafts" in ctx.result.reason
    # without the failure the judgement is restored
    again = _context(tmp_path / "again", point=point)
    assert RestoreJudgement().run(again) == Decided(Decision.PROMOTE, "every gate passed")


def test_the_decision_phase_decides_only_an_undecided_run(tmp_path):
    from rollout.run.phases.decide import Decide
    from rollout.run.resume import JUDGED

    ctx = _context(tmp_path)
    ctx.result.gates = [_gate("tpot_p50_improvement", Verdict.PASS)]
    ctx.record_decision(Decided(Decision.ROLLBACK, "failed: accuracy_noninferiority"))
    assert Decide().run(ctx) is None
    stored = ctx.store.phase_results("r", JUDGED)[0]
    assert (stored["decision"], stored["reason"]) == ("rollback", "failed: accuracy_noninferiority")
    undecided = _context(tmp_path / "again")
    undecided.result.gates = ctx.result.gates
    made = Decide().run(undecided)
    assert made is not None and undecided.result.decision is None
    assert made == decide_now(undecided.result.gates, undecided.cfg)


@pytest.mark.parametrize("judged", [None, Decision.INCONCLUSIVE, Decision.ROLLBACK])
def test_steps_that_held_never_promote_a_run_not_judged_promote(judged):
    after = after_steps(judged, "earlier reason", Decided(Decision.PROMOTE, "every step held"))
    assert after.decision is Decision.INCONCLUSIVE
    assert after.reason == f"every step held, but {UNJUDGED}, so the run cannot promote; earlier reason"


def test_steps_keep_or_revise_a_judged_promote():
    assert after_steps(Decision.PROMOTE, "every gate passed", Decided(Decision.PROMOTE, "held")) == \
        Decided(Decision.PROMOTE, "every gate passed")
    for steps in (Decided(Decision.ROLLBACK, "guard failed"), Decided(Decision.INCONCLUSIVE, "too few requests")):
        assert after_steps(Decision.PROMOTE, "every gate passed", steps) == steps


def test_the_controller_records_an_abort_taken_by_a_phase_that_then_raised(tmp_path, monkeypatch):
    """The phase's error ends the run (exit 1) and the abort it took is still the run's decision, as before
    the controller became the one writer."""
    from rollout.config import load_config
    from rollout.run import controller as controller_module
    from rollout.run.controller import Controller

    class AbortedThenBroke:
        name = "accuracy"

        def enabled(self, ctx) -> bool:
            return True

        def run(self, ctx):
            ctx.store.add_command(ctx.run_id, "abort")
            assert ctx.aborted("accuracy")
            raise KeyError("canary")

    monkeypatch.setattr(controller_module, "PHASES", (AbortedThenBroke(),))
    result = Controller(load_config(REPO / "configs/local-cpu.yaml"), runs_dir=tmp_path, run_id="r1",
                        progress=lambda m: None).run()
    assert result.exit_code == 1 and result.error == "unexpected KeyError: 'canary'"
    assert (result.decision, result.reason) == (Decision.ROLLBACK, "aborted by command during accuracy")
    assert json.loads((tmp_path / "r1" / "decision.json").read_text())["exit_code"] == 1


def test_the_winner_takes_the_seat_without_the_config_being_rewritten(tmp_path, monkeypatch):
    """The candidates' winner sits in the canary's seat through `result.winner`: `ctx.canary_arm` is its arm
    (promoted.yaml, the sweep's replicas), while the run's config stays the one it was given."""
    from rollout.run.phases import candidate_choice

    ctx = _context(tmp_path, "configs/examples/local-candidates.yaml")
    given = ctx.cfg
    names = [c.name for c in given.candidates]
    winner = names[-1]
    assert ctx.canary_arm == given.candidates[0].arm()  # before the choice: the first candidate's, as the config says
    ctx.engines = {name: SimpleNamespace(num_speculative_tokens=2, speculation="mtp k=2") for name in names}
    ctx.result.arms = {name: {} for name in names}
    ctx.candidate_gates = {name: [_gate("accuracy_noninferiority", Verdict.PASS)] for name in names}
    handed: list[str] = []
    ctx.fleet = SimpleNamespace(hand_over=lambda name, seat: handed.append(name), urls=lambda: {"baseline": [], "canary": []},
                                upstream_keys=lambda: {}, retire=lambda losers: handed.extend(losers))
    ctx.router = SimpleNamespace(set_arms=lambda arms, keys: None)
    # the gates' rule is rollout.judge.candidates' (tested there): here the last candidate wins
    monkeypatch.setattr(candidate_choice, "choose_winner", lambda results, share: candidate_choice.CandidateChoice(
        Decision.PROMOTE, winner, {r.name: "won" if r.name == winner else "slower" for r in results}))
    assert candidate_choice.choose_now(ctx) is None  # a winner: the decision phase judges its gates
    assert ctx.result.winner == winner and handed[0] == winner
    assert ctx.cfg is given and ctx.cfg.canary == given.candidates[0].arm()
    assert ctx.canary_arm == given.candidates[-1].arm()
