"""A stored run's looks judged again, look by look: the `judge` command and report.html share it.

Each input is a records file in the format a run writes (one RequestRecord JSON per
line, ``RUNS/<id>/experiment/records.jsonl``) or a run directory (its
experiment/records.jsonl and decision.json). The records are replayed look by look
through ``rollout.judge.experiment_looks.replay_looks`` (the functions the
controller's experiment loop calls: the look boundary rule, the information
fractions, latency + acceptance + sample-ratio at every look, the stop rule), in
the order the file holds them, which is the order the controller read them.

What the replay knows, and from where:

* gates (thresholds, alpha, gates.enabled): ``--config`` (a full run config), else
  the run directory's decision.json ``gates_config``, else the defaults;
* the look plan: ``--config``'s experiment section, else decision.json's experiment
  summary (requests_per_look, requests_per_arm), else the defaults. When the plan is
  the run's own, the looks fall exactly where the run's fell (its per-look counts);
  otherwise where the boundary rule puts them on the records' clock;
* acceptance: the canary's records' own per-request counters up to each look, where
  they carry them (a run whose servers had --per-request-spec-decode-metrics: the look
  judged as the run judged it); else decision.json's canary spec-decode counters (the
  phase's final ones, at every look: server counters, on which the request-clustered
  floor cannot pass); else none, so acceptance is INCONCLUSIVE unless gates.enabled
  leaves acceptance_length_floor out;
* prefix cache: the run directory's decision.json counters at each of its looks (each
  arm's prefix-cache hits and queried prompt tokens), when the looks fall where the
  run's did; else none, so an enabled prefix_cache_guard is INCONCLUSIVE (records
  hold no server counters);
* goodput: when the gates set an SLO (``gates.slo``), the goodput gate is judged at
  every look like the others, and ``goodput`` holds each arm's share of the judged
  records meeting it;
* accuracy: eval outcomes are not request records; a run directory's stored accuracy
  gates are carried over as the run judged them. Otherwise they are enabled but not
  judged, so the input cannot PROMOTE unless gates.enabled leaves them out.

Gates that are not the run's own: for a run directory, every gate enabled or left
out, every threshold and the alpha that differ from its decision.json
``gates_config`` (and a look plan other than its own) are listed (``changed_gates``).
A PROMOTE under them is a new decision rule chosen after the data were seen, not the
run's verdict: it exits 4, not 0, unless ``--accept-changed-gates`` says so. A bare
records file has no gates of its own to compare (said in the notes).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cluster.arms import BASELINE, CANARY
from cluster.metrics import SpecDecodeStats
from loadtests.records import RequestRecord
from rollout.judge.config import GatesConfig
from rollout.judge.experiment_looks import LookPlan, Replay, replay_looks
from rollout.judge.goodput import ArmGoodput, goodput_by_arm
from rollout.judge.names import GATE_NAMES, GATE_PHASES, PREFIX_CACHE_NAME
from rollout.judge.prefix_cache import PrefixCacheLooks
from rollout.judge.request_acceptance import spec_decode_of_requests
from rollout.judge.verdicts import Decision, GateResult, Verdict, decide, is_enabled, missing_gates


__all__ = ["BadInput", "JudgeInput", "JudgeOutcome", "changed_gates", "judge_input", "load_input", "read_records"]

RECORDS = Path("experiment") / "records.jsonl"


DECISION = "decision.json"


class BadInput(ValueError):
    """An input that cannot be judged; the message is one line."""


@dataclass
class JudgeInput:
    """One input, read and resolved: the records and everything the replay needs to judge them."""

    label: str
    records: list[RequestRecord]
    gates: GatesConfig
    plan: LookPlan
    canary_spec: SpecDecodeStats | None
    speculative_canary: bool
    stored_counts: list[dict[str, int]] | None = None
    stored_prefix_cache: PrefixCacheLooks | None = None  # the run's counters at its looks (decision.json)
    carried_gates: list[GateResult] = field(default_factory=list)  # the run's accuracy gates
    notes: list[str] = field(default_factory=list)
    # what differs from the run's own gates and plan (decision.json); None: a bare records file, nothing to compare
    changed: list[str] | None = None


@dataclass
class JudgeOutcome:
    label: str
    decision: Decision
    reason: str
    gates: list[GateResult]
    replay: Replay
    notes: list[str]
    goodput: dict[str, ArmGoodput] | None = None  # per arm over the judged records, when the gates set an SLO
    changed: list[str] = field(default_factory=list)  # gates, thresholds, alpha, plan other than the run's own
    accept_changed: bool = False  # --accept-changed-gates

    @property
    def unaccepted_promote(self) -> bool:
        """A PROMOTE under gates other than the run's, not accepted: it exits as INCONCLUSIVE."""
        return self.decision is Decision.PROMOTE and bool(self.changed) and not self.accept_changed

    def document(self) -> dict[str, Any]:
        doc = {
            "input": self.label,
            "decision": self.decision.value,
            "reason": self.reason,
            "gates": [g.model_dump(mode="json") for g in self.gates],
            "looks": [
                {"look": k.look, "information": k.information, "requests": k.requests,
                 "verdicts": {g.name: g.verdict.value for g in k.gates}}
                for k in self.replay.looks
            ],
            "stopped_by": self.replay.stopped_by,
            "warmup_records": self.replay.warmup_records,
            "judged_records": self.replay.judged_records,
            "unjudged_records": self.replay.unjudged_records,
            "changed_gates": self.changed,
            "accepted_changed_gates": bool(self.changed) and self.accept_changed,
            "notes": self.notes,
        }
        if self.goodput is not None:
            doc["goodput"] = {arm: g.model_dump(mode="json") for arm, g in self.goodput.items()}
        return doc


# -- reading ------------------------------------------------------------------------------
def one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def read_records(path: Path) -> list[RequestRecord]:
    """Every record of a JSONL file; BadInput naming the file and line of the first bad one."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(f"{path}: no such records file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(one_line(f"{path}: cannot read: {exc}")) from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInput(f"{path}:{number}: not JSON ({exc.msg})") from None
        try:
            records.append(RequestRecord.model_validate(row))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "record"
            raise BadInput(one_line(f"{path}:{number}: not a request record: {where}: {first.get('msg')}")) from None
    return records


def _read_decision(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file (a run directory holds decision.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(one_line(f"{path}: not a decision document: {exc}")) from None
    if not isinstance(doc, dict):
        raise BadInput(f"{path}: not a decision document (not a JSON object)")
    return doc


def _spec_of(doc: dict[str, Any]) -> SpecDecodeStats | None:
    """The canary's spec-decode counters from decision.json's spec_decode (rates back to counts)."""
    canary = (doc.get("spec_decode") or {}).get(CANARY)
    if not isinstance(canary, dict) or canary.get("drafts") is None:
        return None
    drafts = float(canary["drafts"])
    per_position = tuple(float(rate) * drafts for rate in canary.get("per_position") or ())
    return SpecDecodeStats(drafts=drafts, draft_tokens=float(canary.get("draft_tokens") or 0.0),
                           accepted_tokens=float(canary.get("accepted_tokens") or 0.0), accepted_per_position=per_position)


def _speculative_of(doc: dict[str, Any]) -> bool:
    engine = (((doc.get("arms") or {}).get(CANARY) or {}).get("engine") or {})
    spec = engine.get("speculative_config")
    return isinstance(spec, dict) and int(spec.get("num_speculative_tokens", 1) or 0) > 0


def _stored_plan(doc: dict[str, Any], default: LookPlan) -> LookPlan:
    exp = doc.get("experiment") or {}
    if not exp.get("requests_per_look") or not exp.get("requests_per_arm_planned"):
        return default
    return LookPlan(int(exp["requests_per_look"]), int(exp["requests_per_arm_planned"]), default.min_interval_s,
                    default.min_looks, math.inf, bool(exp.get("arm_users", False)),
                    twin=exp.get("noise_floor") is not None,  # a twin run stores its A/A noise floor
                    warmup_requests_per_arm=int(exp.get("warmup_requests_per_arm") or 0))


def changed_gates(run: GatesConfig, judging: GatesConfig) -> list[str]:
    """What of ``judging`` differs from the run's own ``run``: gates judged or left out, every other field
    (thresholds, alpha, spending...) as 'name run -> judging'."""
    ran = {name for name in GATE_NAMES if is_enabled(name, run)}
    now = {name for name in GATE_NAMES if is_enabled(name, judging)}
    out = []
    if now - ran:
        out.append("gates judged that the run did not: " + ", ".join(n for n in GATE_NAMES if n in now - ran))
    if ran - now:
        out.append("gates no longer judged: " + ", ".join(n for n in GATE_NAMES if n in ran - now))
    before, after = run.model_dump(mode="json"), judging.model_dump(mode="json")
    for name in GatesConfig.model_fields:
        if name not in ("enabled", "disabled") and before.get(name) != after.get(name):
            out.append(f"{name} {_shown(before.get(name))} -> {_shown(after.get(name))}")
    return out


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def load_input(arg: str, run_config: Any | None) -> JudgeInput:
    """Read one input (records file or run dir) and resolve its gates, plan and acceptance evidence.

    ``run_config``: a loaded rollout.config.RolloutConfig (``--config``) or None.
    """
    from rollout.config import ExperimentConfig

    path = Path(arg)
    if not path.exists():
        raise BadInput(f"{arg}: no such file or run directory")
    doc: dict[str, Any] | None = None
    if path.is_dir():
        doc = _read_decision(path / DECISION)
        records = read_records(path / RECORDS)
    else:
        records = read_records(path)
    if (doc is not None and doc.get("candidates")) or (run_config is not None and run_config.candidates):
        raise BadInput(f"{arg}: a run with candidates: judge replays one canary against the baseline, not several")
    notes: list[str] = []
    default_plan = LookPlan.of(ExperimentConfig())
    if run_config is not None:
        gates, plan = run_config.gates, LookPlan.of(run_config.experiment, twin=run_config.twin_baseline)
        speculative = run_config.canary.engine.num_speculative_tokens > 0
    elif doc is not None:
        try:
            gates = GatesConfig(**(doc.get("gates_config") or {}))
        except (ValidationError, TypeError) as exc:
            raise BadInput(one_line(f"{path / DECISION}: gates_config: {exc}")) from None
        plan, speculative = _stored_plan(doc, default_plan), _speculative_of(doc)
    else:
        gates, plan, speculative = GatesConfig(), default_plan, False
        notes.append("no --config and no decision.json: default gates and look plan")
    inp = JudgeInput(label=arg, records=records, gates=gates, plan=plan, canary_spec=None,
                     speculative_canary=speculative, notes=notes)
    if doc is not None:
        try:
            inp.changed = changed_gates(GatesConfig(**(doc.get("gates_config") or {})), gates)
        except (ValidationError, TypeError):  # read above when no --config; with one, the run's own are unreadable
            inp.changed = ["the run's own gates_config cannot be read: every gate counts as changed"]
    elif run_config is not None:
        notes.append("a bare records file: the run's own gates are unknown, so what --config changes cannot be said")
    if doc is None:
        if is_enabled("acceptance_length_floor", gates) and spec_decode_of_requests(records, CANARY) is None:
            notes.append("a bare records file whose canary requests carry no per-request spec-decode counters: "
                         "acceptance_length_floor is inconclusive (judge the run directory, or leave it out of "
                         "gates.enabled)")
        return inp
    _from_run(inp, doc, path)
    return inp


def _from_run(inp: JudgeInput, doc: dict[str, Any], path: Path) -> None:
    """What a run directory adds: acceptance counters, the run's look boundaries, its accuracy gates."""
    inp.canary_spec = _spec_of(doc)
    if inp.canary_spec is None:
        inp.notes.append(f"{path / DECISION} holds no canary spec_decode: acceptance is unknown")
    exp = doc.get("experiment") or {}
    looks = exp.get("looks") or []
    same_plan = (exp.get("requests_per_look"), exp.get("requests_per_arm_planned"),
                 int(exp.get("warmup_requests_per_arm") or 0)) == (
        inp.plan.requests_per_look, inp.plan.requests_per_arm, inp.plan.warmup_requests_per_arm)
    if looks and same_plan:
        inp.stored_counts = [dict(k.get("requests") or {}) for k in looks]
        inp.stored_prefix_cache = _stored_prefix_cache(looks, path)
        if inp.stored_prefix_cache is None and is_enabled(PREFIX_CACHE_NAME, inp.gates):
            inp.notes.append(f"{path / DECISION}'s looks hold no prefix-cache counters (a run written before "
                             "they were recorded): prefix_cache_guard is inconclusive")
    elif looks:
        inp.notes.append("the look plan differs from the run's: looks by the boundary rule on the records' clock")
        if inp.changed is not None:
            inp.changed.append(f"look plan {exp.get('requests_per_look')} per look of {exp.get('requests_per_arm_planned')} "
                               f"-> {inp.plan.requests_per_look} of {inp.plan.requests_per_arm}")
    for stored in doc.get("gates") or []:
        if isinstance(stored, dict) and GATE_PHASES.get(stored.get("name")) == "accuracy":
            try:
                gate = GateResult.model_validate(stored)
            except ValidationError as exc:
                raise BadInput(one_line(f"{path / DECISION}: gate {stored.get('name')}: {exc}")) from None
            inp.carried_gates.append(gate.model_copy(update={"detail": "as the run judged it (eval outcomes are not "
                                                                     "request records): " + gate.detail}))


def _stored_prefix_cache(looks: list[Any], path: Path) -> PrefixCacheLooks | None:
    """Each arm's (hits, queries) at every look of decision.json, or None where its looks have none."""
    series: dict[str, list[tuple[float, float] | None]] = {BASELINE: [], CANARY: []}
    for number, look in enumerate(looks, start=1):
        stored = look.get("prefix_cache") if isinstance(look, dict) else None
        if not stored:
            return None
        for arm, points in series.items():
            value = stored.get(arm) if isinstance(stored, dict) else "missing"
            if value is None:
                points.append(None)
            elif (isinstance(value, list) and len(value) == 2
                  and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)):
                points.append((float(value[0]), float(value[1])))
            else:
                raise BadInput(f"{path / DECISION}: experiment.looks[{number}].prefix_cache.{arm}: not [hits, queries]")
    return PrefixCacheLooks(baseline=series[BASELINE], canary=series[CANARY])


# -- judging ---------------------------------------------------------------------------------
def judge_input(inp: JudgeInput) -> JudgeOutcome:
    """Replay the looks and decide over the replay's gates and the carried accuracy gates."""
    try:
        replay = replay_looks(inp.records, inp.plan, inp.gates, inp.canary_spec, inp.speculative_canary,
                              inp.stored_counts, inp.stored_prefix_cache)
    except ValueError as exc:  # stored look counts the records do not hold
        raise BadInput(one_line(f"{inp.label}: {exc}")) from None
    gates = [*inp.carried_gates, *replay.gates]
    decision = decide(gates, inp.gates)
    considered = [g for g in gates if is_enabled(g.name, inp.gates)]
    if decision is Decision.PROMOTE:
        reason = "every gate passed: " + ", ".join(g.name for g in considered)
    elif decision is Decision.ROLLBACK:
        reason = "failed: " + ", ".join(g.name for g in considered if g.verdict is Verdict.FAIL)
    else:
        parts = []
        if not replay.looks:
            parts.append(f"no look: {len(inp.records)} records never gave every arm "
                         f"{inp.plan.requests_per_look} completed requests")
        open_ = [g.name for g in considered if g.verdict is Verdict.INCONCLUSIVE]
        if open_:
            parts.append("not enough evidence: " + ", ".join(open_))
        missing = missing_gates(gates, inp.gates)
        if missing:
            parts.append("enabled but not judged from this input: " + ", ".join(missing)
                         + " (name them in gates.disabled)")
        reason = "; ".join(parts) or "no gate was judged"
    slo = inp.gates.goodput_slo
    judged = inp.records[replay.warmup_records: replay.warmup_records + replay.judged_records]
    goodput = goodput_by_arm(judged, slo) if slo is not None else None
    return JudgeOutcome(inp.label, decision, reason, gates, replay, inp.notes, goodput, changed=list(inp.changed or []))
