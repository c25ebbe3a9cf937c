"""Several candidates against one baseline: each candidate's error budget, and the winner (pure).

A run with K candidate configs (say MTP k=2, k=3, k=4 beside a k=1 baseline) asks one
question: which candidate, if any, to promote. A false promote is a winner that is no
better than the objective's bar. Each candidate is judged against the baseline by the
one-candidate procedure (every gate, every look, `verdicts.decide`); what changes is
the level: every candidate is judged at ``alpha / K`` (`candidate_gates`).

Why Bonferroni and not Holm's step-down or a gatekeeping order
--------------------------------------------------------------
With every candidate at the bar (the case the issue's calibration asks for), a false
promote is "some candidate passes"; Holm's first step *is* Bonferroni, so the two
give the same familywise rate there, and both hold it at alpha under any dependence
between the candidates (they share the baseline's requests, so their estimates are
positively correlated). Holm's later steps only add power once one candidate has
already passed, and carrying that recycled alpha across looks is valid only when
every hypothesis uses the same information fractions (group-sequential Holm), which
candidates that stop at different looks do not. A gatekeeping order (k=2 before k=3)
spends nothing on later candidates once an early one fails, the opposite of what a
depth sweep needs (a too-shallow k can fail the bar while a deeper one passes).
calibrate's ``candidates`` rows measure the rate with every candidate at the bar, and
the same trials judged at the unadjusted alpha show why the split is needed.

The winner
----------
Among the candidates whose own decision is PROMOTE, the lowest TPOT p50 ratio
(candidate / baseline) wins; ratios within ``tie_tolerance`` (relative) of the best
are a tie, and a tie goes to the cheaper candidate (fewer draft tokens per step: less
draft compute and KV for the same speed; an arm without speculation drafts none).

Candidates may differ in the whole speculative config (method, k, drafter, verification),
and "no speculation" is a candidate too. For a candidate that does not speculate the
acceptance-length floor does not apply (there are no drafts to accept): its result says
"not applicable" and counts as met (`not_applicable_acceptance`), as the progressive
step's acceptance guard does for a canary without speculation (rollout.judge.guards). Every other candidate gets the reason it
lost: the gates that failed, the gates still undecided, or the winner that beat it.
The run's decision: PROMOTE with a winner; ROLLBACK when every candidate rolled back;
INCONCLUSIVE otherwise (a candidate that might still pass was not decided).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from cluster.arms import BASELINE, CANARY
from cluster.metrics import SpecDecodeStats
from loadtests.records import RequestRecord
from rollout.judge.config import GatesConfig
from rollout.judge.experiment_looks import LookPlan, judge_look_with_floor, stop_after
from rollout.judge.names import ACCEPTANCE_NAME, OBJECTIVE_NAME
from rollout.judge.prefix_cache import PrefixCacheLooks
from rollout.judge.verdicts import Decision, GateResult, Verdict, counted_gates, decide, missing_gates

__all__ = ["TIE_TOLERANCE", "NOT_APPLICABLE", "CandidateLooks", "CandidateResult", "CandidateChoice", "candidate_gates",
           "candidate_view", "choose_winner", "not_applicable_acceptance"]

# Two candidates whose TPOT ratios differ by less than 2% are a tie: on shared CPU cores a
# run's per-look TPOT swings by more than that (configs/local-cpu.yaml), and on a GPU 2% of
# TPOT is worth less than the draft compute and KV a deeper speculation costs.
TIE_TOLERANCE = 0.02


def candidate_gates(cfg: GatesConfig, candidates: int) -> GatesConfig:
    """The gates config each of ``candidates`` candidates is judged with: alpha split evenly (Bonferroni)."""
    if candidates < 1:
        raise ValueError(f"candidates must be >= 1, got {candidates}")
    if candidates == 1:
        return cfg
    return cfg.model_copy(update={"alpha": cfg.alpha / candidates})


def candidate_view(records: Sequence[RequestRecord], looks_of: Sequence[int],
                   candidate: str) -> tuple[list[RequestRecord], list[int]]:
    """The baseline's records and ``candidate``'s, the candidate's relabelled as the canary, each with
    its look: the one-candidate judge's input for that candidate (the other candidates' records
    are left out; their requests shared the baseline's prompts, never its samples)."""
    out: list[RequestRecord] = []
    looks: list[int] = []
    for record, look in zip(records, looks_of):
        served = record.served_arm
        if served == BASELINE:
            out.append(record)
        elif served == candidate:
            out.append(record.model_copy(update={
                "arm": CANARY if record.arm is not None else None,
                "pinned_arm": CANARY if record.pinned_arm == candidate else record.pinned_arm,
            }))
        else:
            continue
        looks.append(look)
    return out, looks


NOT_APPLICABLE = "not applicable: "


def not_applicable_acceptance(gates: Sequence[GateResult], candidate: str) -> list[GateResult]:
    """``gates`` of a candidate that does not speculate, its acceptance-length floor marked as not applicable.

    Judged as for a speculating arm it could never pass (no drafts: INCONCLUSIVE), so the arm
    "no speculation" could never win. The gate stays in the record, its verdict met, its detail
    saying why and with what numbers (none)."""
    return [
        g.model_copy(update={
            "verdict": Verdict.PASS,
            "detail": f"{NOT_APPLICABLE}{candidate} does not speculate (no speculative_config): no drafts, no "
                      "acceptance length to floor; counted as met",
        }) if g.name == ACCEPTANCE_NAME else g
        for g in gates
    ]


@dataclass
class CandidateLooks:
    """Every candidate's gates through the looks of one experiment (the live loop and calibrate's
    candidates rows both judge with it, so the simulated design is the run's).

    The looks are the whole experiment's (each waits for every arm; the information fraction is
    the least-served arm's). At each look every candidate whose gates are not yet final is judged
    on its view of the records (`candidate_view`) at ``cfg`` (its share of alpha) under ``plan``
    (the one-candidate plan); gates that are final after ``min_looks`` stand from that look on.
    """

    candidates: tuple[str, ...]
    cfg: GatesConfig
    plan: LookPlan
    gates: dict[str, list[GateResult]] = field(default_factory=dict)
    settled_at: dict[str, int] = field(default_factory=dict)  # candidate -> the look its gates became final

    def look(
        self,
        look: int,
        records: Sequence[RequestRecord],
        looks_of: Sequence[int],
        fractions: Sequence[float],
        spec_of: Callable[[str], SpecDecodeStats | None],
        speculative: Mapping[str, bool],
        prefix_cache_of: Callable[[str], PrefixCacheLooks | None] = lambda name: None,
    ) -> str | None:
        """Judge look ``look`` (all records so far); why the phase stops ('information': the plan is
        reached; 'evidence': every candidate's gates are final) or None to go on."""
        stops: dict[str, str | None] = {}
        for name in self.candidates:
            if name in self.settled_at:
                stops[name] = "evidence"
                continue
            view, view_looks = candidate_view(records, looks_of, name)
            gates, _ = judge_look_with_floor(view, view_looks, fractions, self.cfg, self.plan, spec_of(name),
                                             speculative.get(name, False), prefix_cache=prefix_cache_of(name))
            self.gates[name] = gates if speculative.get(name, False) else not_applicable_acceptance(gates, name)
            stops[name] = stop_after(look, fractions, self.plan, self.gates[name], self.cfg)
            if stops[name] == "evidence":
                self.settled_at[name] = look
        if "information" in stops.values():
            return "information"
        return "evidence" if all(reason == "evidence" for reason in stops.values()) else None


@dataclass(frozen=True)
class CandidateResult:
    """One candidate's gates, judged against the baseline at its share of alpha."""

    name: str
    speculative_tokens: int  # draft tokens per step (0: no speculation): the tie-break's cost
    gates: Sequence[GateResult]
    speculation: str = ""  # how the report names its config: 'mtp k=2' (cluster.speculation.speculative_label)

    @property
    def title(self) -> str:
        """The name, with its speculative config when given: 'ng (ngram k=3)'."""
        return f"{self.name} ({self.speculation})" if self.speculation else self.name

    def decision(self, cfg: GatesConfig) -> Decision:
        return decide(self.gates, cfg)

    def tpot_ratio(self) -> float | None:
        objective = next((g for g in self.gates if g.name == OBJECTIVE_NAME), None)
        return None if objective is None else objective.estimate


@dataclass(frozen=True)
class CandidateChoice:
    """The run's decision over all candidates, the winner (None unless PROMOTE) and each candidate's reason."""

    decision: Decision
    winner: str | None
    reasons: dict[str, str]  # candidate name -> why it won or lost, in the candidates' order


def _why_not_promoted(result: CandidateResult, cfg: GatesConfig) -> str:
    gates = counted_gates(result.gates, cfg)
    failed = [g.name for g in gates if g.verdict is Verdict.FAIL]
    if failed:
        return "rolled back: " + ", ".join(failed) + " failed"
    undecided = [g.name for g in gates if g.verdict is Verdict.INCONCLUSIVE]
    missing = missing_gates(result.gates, cfg)
    return "inconclusive: " + ", ".join(undecided + [f"{name} not judged" for name in missing] or ["no gate judged"])


def choose_winner(results: Sequence[CandidateResult], cfg: GatesConfig, tie_tolerance: float = TIE_TOLERANCE) -> CandidateChoice:
    """The winner among ``results`` (each judged with ``candidate_gates(cfg, len(results))``; see the module docstring)."""
    if not results:
        raise ValueError("no candidates to choose from")
    if len({r.name for r in results}) != len(results):
        raise ValueError("candidate names must be unique")
    decisions = {r.name: r.decision(cfg) for r in results}
    passing = [r for r in results if decisions[r.name] is Decision.PROMOTE and r.tpot_ratio() is not None]
    reasons = {r.name: _why_not_promoted(r, cfg) for r in results if decisions[r.name] is not Decision.PROMOTE}
    # A PROMOTE without an objective estimate (the objective gate left out of gates.enabled) still passes, but
    # cannot be ranked by speed: among such candidates only cost ranks them.
    unranked = [r for r in results if decisions[r.name] is Decision.PROMOTE and r.tpot_ratio() is None]
    tied: list[CandidateResult] = []
    if passing:
        best = min(r.tpot_ratio() for r in passing)  # type: ignore[type-var]
        tied = [r for r in passing if r.tpot_ratio() <= best * (1.0 + tie_tolerance)]  # type: ignore[operator]
        winner = min(tied, key=lambda r: (r.speculative_tokens, r.tpot_ratio(), r.name))
    elif unranked:
        winner = min(unranked, key=lambda r: (r.speculative_tokens, r.name))
    else:
        winner = None
    if winner is None:
        every_rolled_back = all(d is Decision.ROLLBACK for d in decisions.values())
        decision = Decision.ROLLBACK if every_rolled_back else Decision.INCONCLUSIVE
        return CandidateChoice(decision, None, {r.name: reasons[r.name] for r in results})
    ratio = winner.tpot_ratio()
    won = "promoted" if ratio is None else f"promoted: TPOT p50 ratio {ratio:.3f}"
    won += f" ({winner.speculation})" if winner.speculation else ""
    for r in results:
        if r.name == winner.name:
            reasons[r.name] = won
        elif r.name not in reasons:
            mine = r.tpot_ratio()
            if r.name in {t.name for t in tied} and r.speculative_tokens > winner.speculative_tokens:
                reasons[r.name] = (f"passed, tied with {winner.title} (TPOT p50 ratio {mine:.3f} vs {ratio:.3f}, within "
                                   f"{tie_tolerance:.0%}), which drafts fewer tokens ({winner.speculative_tokens} vs "
                                   f"{r.speculative_tokens})")
            elif mine is not None and ratio is not None:
                reasons[r.name] = f"passed, but {winner.title} is faster (TPOT p50 ratio {ratio:.3f} vs {mine:.3f})"
            else:
                reasons[r.name] = f"passed, but {winner.title} was chosen (no TPOT estimate to rank by: fewer draft tokens first)"
    return CandidateChoice(Decision.PROMOTE, winner.name, {r.name: reasons[r.name] for r in results})
