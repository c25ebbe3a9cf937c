"""Accuracy: identical items (greedy, or sampled at accuracy.temperature) to every arm in
batches, judged after each batch (paired non-inferiority and output divergence,
rollout.judge.accuracy); stops early on a clear regression of a judged gate or an abort
command, and a canary that already lost accuracy gets no load (the phase then decides the run)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from cluster.arms import BASELINE, CANARY
from rollout.config import TWIN
from rollout.evals import EvalDeadlineError, EvalItem, EvalSpec, ItemOutcome, evaluate_batch, load_items, outputs_differ
from rollout.judge.accuracy import judge_accuracy, judge_divergence
from rollout.judge.candidates import candidate_gates
from rollout.judge.config import GatesConfig
from rollout.judge.verdicts import GateResult, Verdict, is_enabled
from rollout.run.phases.candidate_choice import choose_now, lost_candidates
from rollout.run.phases.replica_watch import ReplicaWatch
from rollout.record.result import AccuracySummary
from rollout.run.context import InfrastructureError, RunContext
from rollout.run.decision import Decided, candidates_reason, decide_now


def eval_spec(ctx: RunContext) -> EvalSpec:
    """The configured items; a golden set defaults to the tiny checkpoint's golden.jsonl."""
    spec = ctx.cfg.accuracy
    if spec.kind == "golden" and not spec.path:
        spec = spec.model_copy(update={"path": str(Path(ctx.engines[BASELINE].model) / "golden.jsonl")})
    return spec


def judge_outcomes(ctx: RunContext, outcomes: dict[str, list[ItemOutcome]], interim: bool,
                   gates_cfg: GatesConfig | None = None, canary_arm: str = CANARY) -> tuple[GateResult, GateResult]:
    """Both accuracy gates on the outcomes so far. Items whose baseline (or twin) request
    failed are left out of the pairs (rollout.judge.accuracy); a canary error is the
    canary being wrong. Several candidates: `canary_arm` is the one judged, at `gates_cfg`
    (its share of alpha)."""
    gates_cfg = gates_cfg or ctx.cfg.gates
    base, canary = outcomes[BASELINE], outcomes[canary_arm]
    baseline_errored = [o.error is not None for o in base]
    accuracy_gate = judge_accuracy(
        [o.correct for o in base], [o.correct for o in canary], gates_cfg, look=1, max_looks=1, interim=interim,
        baseline_errored=baseline_errored,
    )
    twin = outcomes.get(TWIN)
    reference_errored = (
        baseline_errored if twin is None else [b or t.error is not None for b, t in zip(baseline_errored, twin)]
    )
    divergence_gate = judge_divergence(
        [outputs_differ(b, c) for b, c in zip(base, canary)],
        [outputs_differ(b, t) for b, t in zip(base, twin)] if twin is not None else None,
        gates_cfg,
        look=1,
        max_looks=1,
        interim=interim,
        reference_errored=reference_errored,
    )
    return accuracy_gate, divergence_gate


class Accuracy:
    name = "accuracy"

    def enabled(self, ctx: RunContext) -> bool:
        return not ctx.judged and not ctx.decided and ctx.cfg.accuracy.enabled

    def run(self, ctx: RunContext) -> Decided | None:
        cfg = ctx.cfg
        spec = eval_spec(ctx)
        items: list[EvalItem] = load_items(spec)
        arms = list(ctx.cfg.experiment_arms)
        how = "greedy" if spec.temperature == 0 else f"sampled at temperature {spec.temperature:g}, seed {spec.seed}"
        ctx.say(f"accuracy: {len(items)} {spec.kind} items to {', '.join(arms)} ({how}), batches of {cfg.accuracy.batch_size}")
        ctx.event("accuracy", "start", f"{len(items)} {spec.kind} items")
        t0 = time.monotonic()
        outcomes: dict[str, list[ItemOutcome]] = {arm: [] for arm in arms}
        judged_gates = self._batches(ctx, spec, items, arms, outcomes)
        errors = {arm: sum(o.error is not None for o in outcomes[arm]) for arm in arms}
        ctx.result.accuracy = AccuracySummary(
            kind=spec.kind,
            items=len(outcomes[BASELINE]),
            planned_items=len(items),
            accuracy={arm: float(np.mean([o.correct for o in outcomes[arm]])) if outcomes[arm] else None for arm in arms},
            divergence_vs_baseline={
                arm: float(np.mean([outputs_differ(a, b) for a, b in zip(outcomes[BASELINE], outcomes[arm])]))
                for arm in arms
                if arm != BASELINE and outcomes[arm]
            },
            request_errors=errors,
            duration_s=time.monotonic() - t0,
        )
        # a gate the config does not judge (gates.enabled / gates.disabled) is no verdict of the run; its
        # figure stays in the summary above (divergence_vs_baseline)
        for seat, pair in judged_gates.items():
            kept = [g for g in pair if g is not None and is_enabled(g.name, cfg.gates)]
            if ctx.cfg.candidates:
                ctx.candidate_gates.setdefault(seat, []).extend(kept)
            else:
                ctx.result.gates += kept
        ctx.event("accuracy", "done", "; ".join(f"{seat}: {a.verdict.value} / {d.verdict.value}"
                                                  for seat, (a, d) in judged_gates.items()))
        if sum(errors.values()) and all(o.error for o in outcomes[BASELINE]):
            raise InfrastructureError(f"accuracy: every baseline request failed: {outcomes[BASELINE][0].error}")
        if ctx.cfg.candidates:
            if lost_candidates(ctx) >= {c.name for c in ctx.cfg.candidates}:
                ctx.say("accuracy: every candidate failed a gate; skipping the experiment")
                ctx.event("accuracy", "abort", "every candidate failed")
                return choose_now(ctx)
            return None
        # an abort taken between the batches stands (the controller records it)
        if not ctx.decided and any(
            g.verdict == Verdict.FAIL for g in ctx.result.gates if is_enabled(g.name, cfg.gates)
        ):
            # Fail fast: a canary that already lost accuracy gets no load.
            ctx.say("accuracy: a gate failed; skipping the experiment")
            ctx.event("accuracy", "abort", "accuracy gate failed")
            r = ctx.result
            return decide_now(r.gates, cfg, ctx.experiment_capped, candidates_reason(r.winner, r.candidates))
        return None

    @staticmethod
    def _batches(ctx: RunContext, spec: EvalSpec, items: list[EvalItem], arms: list[str],
                 outcomes: dict[str, list[ItemOutcome]]) -> dict[str, tuple[GateResult, GateResult]]:
        """Batch after batch to every arm through the router, each judged and committed before the next.
        Returns the accuracy and divergence gates of the canary (several candidates: of each, at alpha / K)."""
        batch_size = ctx.cfg.accuracy.batch_size
        look = 0
        seats = [c.name for c in ctx.cfg.candidates] or [CANARY]
        share = candidate_gates(ctx.cfg.gates, len(seats))
        judged_gates: dict[str, tuple[GateResult, GateResult]] = {}
        # several candidates: a candidate's judged FAIL stands from its batch on, as it would stop a
        # one-canary run there (the batches go on for the others)
        regressed: dict[str, tuple[GateResult, GateResult]] = {}
        watch = ReplicaWatch("accuracy", ctx.replicas_alive, where=ctx.replica_node)
        limit_s = ctx.cfg.accuracy.max_duration_s
        deadline = time.monotonic() + limit_s  # the whole phase: each request's own timeout is no bound on it
        for start in range(0, len(items), batch_size):
            batch = items[start : start + batch_size]
            try:
                got = evaluate_batch(ctx.router.url, ctx.served_model, batch, arms, spec, token=ctx.router.token,
                                     deadline=deadline)
            except EvalDeadlineError as exc:
                raise InfrastructureError(f"accuracy: not done within accuracy.max_duration_s ({limit_s:g} s): {exc}") from None
            for arm in arms:
                outcomes[arm].extend(got[arm])
                ctx.store.add_eval_outcomes(ctx.run_id, got[arm])
            watch.confirm()  # a batch answered by the survivors of a dead replica is not judged
            look += 1
            last = start + len(batch) >= len(items)
            judged_gates = {seat: regressed.get(seat) or judge_outcomes(ctx, outcomes, interim=not last, gates_cfg=share,
                                                                        canary_arm=seat) for seat in seats}
            for seat, pair in judged_gates.items():
                if any(g.verdict == Verdict.FAIL and is_enabled(g.name, ctx.cfg.gates) for g in pair):
                    regressed.setdefault(seat, pair)
            if ctx.cfg.candidates:
                ctx.store.put_phase_result(ctx.run_id, "accuracy_candidates", look, {
                    seat: [g.model_dump(mode="json") for g in pair] for seat, pair in judged_gates.items()})
            else:
                accuracy_gate, divergence_gate = judged_gates[CANARY]
                ctx.store.put_phase_result(
                    ctx.run_id, "accuracy", look, [accuracy_gate.model_dump(mode="json"), divergence_gate.model_dump(mode="json")]
                )
            done = len(outcomes[BASELINE])
            ctx.tick("accuracy items", done, len(items))
            acc = {arm: np.mean([o.correct for o in outcomes[arm]]) for arm in arms}
            judged = {seat: [g for g in pair if is_enabled(g.name, ctx.cfg.gates)] for seat, pair in judged_gates.items()}
            ctx.say(
                f"accuracy: {done}/{len(items)} items | "
                + " ".join(f"{arm} {acc[arm]:.3f}" for arm in arms)
                + "".join(f" | {'' if seat == CANARY else seat + ' '}{g.name}: {g.verdict.value}"
                          for seat, gates in judged.items() for g in gates)
            )
            if not last and ctx.aborted("accuracy"):
                break
            # only a judged gate stops the phase: sampled outputs (accuracy.temperature > 0) differ by
            # chance, and a divergence the config does not judge must not cut the accuracy evidence short;
            # with several candidates, only when every one has regressed (the others still need the items)
            if not last and all(any(g.verdict == Verdict.FAIL for g in gates) for gates in judged.values()):
                ctx.say("accuracy: clear regression, stopping early")
                ctx.event("accuracy", "early_stop", f"after {done} items")
                break
        return judged_gates
