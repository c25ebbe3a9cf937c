"""One simulated canary run pushed through the controller's own judging path.

The experiment: records in completion order -> looks by `LookPlan.look_due` on the
records' clock -> at every look `experiment_looks.judge_look` (latency + acceptance, on
everything so far, with the canary's spec-decode counters up to that look) -> stop as
`experiment_looks.stop_after` says. The accuracy phase: paired items in the
controller's batches, `judge_accuracy` / `judge_divergence` after each batch (interim
looks before the last), an early stop on a FAIL; a failed accuracy gate skips the
experiment. The decision: `verdicts.decide` over all gates. Nothing here re-implements
a statistic: the numbers follow whatever those functions compute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from cluster.arms import CANARY
from cluster.metrics import SpecDecodeStats
from loadtests.records import RequestRecord
from rollout.judge import experiment_looks
from rollout.judge.accuracy import judge_accuracy, judge_divergence
from rollout.judge.config import GatesConfig
from rollout.judge.experiment_looks import LookPlan, record_arm
from rollout.judge.request_acceptance import spec_decode_of_counts
from rollout.judge.verdicts import Decision, GateResult, Verdict, decide, is_enabled

__all__ = ["ExperimentRun", "AccuracyRun", "look_ends", "run_experiment_looks", "run_accuracy_batches", "decide_trial", "cumulative_canary_spec", "accuracy_skips_experiment"]


@dataclass(frozen=True)
class ExperimentRun:
    """What the experiment phase judged: the gates at every look, and why it stopped."""

    looks: list[list[GateResult]] = field(default_factory=list)
    information: list[float] = field(default_factory=list)
    requests: dict[str, int] = field(default_factory=dict)  # completed requests per arm judged at the last look
    stopped_by: str = "end of records"

    @property
    def gates(self) -> list[GateResult]:
        return self.looks[-1] if self.looks else []


@dataclass(frozen=True)
class AccuracyRun:
    """The accuracy phase's verdicts after every batch, and the items they saw."""

    looks: list[list[GateResult]]
    items: int
    stopped_early: bool

    @property
    def gates(self) -> list[GateResult]:
        return self.looks[-1] if self.looks else []


def look_ends(records: Sequence[RequestRecord], plan: LookPlan) -> list[int]:
    """End index (exclusive) of every look the controller's rule makes, on the records' completion clock.

    The rule is `LookPlan.look_due` (every arm has ``requests_per_look`` more, or the
    plan is reached, and ``min_interval_s`` passed); a simulated controller looks the
    moment the rule holds (a live one at its next 0.25 s tick, a few records later).
    """
    return experiment_looks.look_ends_by_rule(records, plan)


def run_experiment_looks(
    records: Sequence[RequestRecord],
    ends: Sequence[int],
    plan: LookPlan,
    cfg: GatesConfig,
    canary_spec_at: Callable[[int], SpecDecodeStats | None],
    speculative_canary: bool = True,
) -> ExperimentRun:
    """Judge ``records`` look by look as the controller does, the looks ending at ``ends``.

    ``canary_spec_at(end)``: the canary's spec-decode counters since the phase began,
    over the records before ``end`` (None: not scraped).
    """
    looks: list[list[GateResult]] = []
    looks_of: list[int] = []
    fractions: list[float] = []
    start, stopped_by = 0, "end of records"
    # the records read once; each look slices them (the same samples and counts as reading them again)
    columns = experiment_looks.RecordColumns.of(records, plan.arms)
    for look, end in enumerate(ends, start=1):
        looks_of += [look] * (end - start)
        fractions.append(experiment_looks.next_information(fractions, plan.information(columns.counts(end, plan.arms))))
        gates = experiment_looks.judge_look(records[:end], looks_of, fractions, cfg, plan, canary_spec_at(end),
                                            speculative_canary, columns=columns)
        looks.append(gates)
        start = end
        reason = experiment_looks.stop_after(look, fractions, plan, gates, cfg)
        if reason is not None:
            stopped_by = reason
            break
    return ExperimentRun(
        looks=looks,
        information=fractions,
        requests=columns.counts(start, plan.arms),
        stopped_by=stopped_by,
    )


def cumulative_canary_spec(
    records: Sequence[RequestRecord], request_ids: Sequence[str], drafts: np.ndarray, accepted_per_position: np.ndarray
) -> Callable[[int], SpecDecodeStats]:
    """``canary_spec_at(end)``: the counters a /metrics scrape would show at a look ending at ``end``,
    summed over the canary's ok requests completed before it (``drafts[i]`` and
    ``accepted_per_position[i]`` are request ``request_ids[i]``'s)."""
    row = {rid: i for i, rid in enumerate(request_ids)}
    k = accepted_per_position.shape[1] if accepted_per_position.ndim == 2 else 0
    # the canary requests' rows in completion order, and how many of them end before each record index
    order = [row[r.request_id] for r in records
             if record_arm(r) == CANARY and r.ok and r.request_id in row]
    done_before = np.cumsum([0] + [record_arm(r) == CANARY and r.ok and r.request_id in row for r in records])

    def at(end: int) -> SpecDecodeStats:
        # per request, as the controller's own counters (the acceptance floor is clustered by request)
        rows = order[: int(done_before[end])]
        counted = spec_decode_of_counts(drafts[rows], accepted_per_position[rows].reshape(len(rows), k)) if rows and k else None
        if counted is None:
            return SpecDecodeStats(drafts=0.0, draft_tokens=0.0, accepted_tokens=0.0, accepted_per_position=(0.0,) * k)
        return counted

    return at


def run_accuracy_batches(
    baseline_correct: np.ndarray,
    canary_correct: np.ndarray,
    canary_diverged: np.ndarray,
    twin_diverged: np.ndarray | None,
    cfg: GatesConfig,
    batch_size: int,
) -> AccuracyRun:
    """The accuracy phase's loop (rollout.run.phases.accuracy): judge after every batch, stop on a clear regression.

    The calls are the controller's (``judge_outcomes``): one analysis of all items so
    far (look 1 of 1), ``interim`` before the last batch, failed baseline requests
    flagged (none here).
    """
    items = baseline_correct.size
    looks: list[list[GateResult]] = []
    done = 0
    for start in range(0, items, batch_size):
        done = min(start + batch_size, items)
        last = done >= items
        # The simulated requests never fail, so no pair is left out (the flags are the controller's arguments).
        errored = [False] * done
        accuracy = judge_accuracy(
            baseline_correct[:done], canary_correct[:done], cfg, look=1, max_looks=1, interim=not last,
            baseline_errored=errored,
        )
        divergence = judge_divergence(
            canary_diverged[:done], None if twin_diverged is None else twin_diverged[:done], cfg,
            look=1, max_looks=1, interim=not last, reference_errored=errored,
        )
        looks.append([accuracy, divergence])
        if not last and (accuracy.verdict is Verdict.FAIL or divergence.verdict is Verdict.FAIL):
            return AccuracyRun(looks=looks, items=done, stopped_early=True)
    return AccuracyRun(looks=looks, items=done, stopped_early=False)


def accuracy_skips_experiment(accuracy: AccuracyRun | None, cfg: GatesConfig) -> bool:
    """A canary that already lost accuracy gets no load (the controller decides at once)."""
    return accuracy is not None and any(g.verdict is Verdict.FAIL for g in accuracy.gates if is_enabled(g.name, cfg))


def decide_trial(accuracy: AccuracyRun | None, experiment: ExperimentRun | None, cfg: GatesConfig) -> Decision:
    """The run's decision over every gate judged (``verdicts.decide``)."""
    gates = (accuracy.gates if accuracy else []) + (experiment.gates if experiment else [])
    return decide(gates, cfg)
