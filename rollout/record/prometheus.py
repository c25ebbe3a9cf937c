"""metrics.prom beside decision.json: a decided run in Prometheus' text format.

For node-exporter's textfile collector (or any scraper pointed at the file): the decision,
each gate's verdict and numbers, the arms' request counts, latency percentiles and the
canary/baseline ratio of each, acceptance per draft position, the exit code, and (a run with a load
sweep) the load up to which the candidate is shown to pay (0: not even the lowest level swept). Built with
prometheus_client's registry and exposition (it escapes label values, so a run id or name
from the config cannot break the format); one file per run, replaced whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from rollout.record.atomic_file import write_atomically
from rollout.record.document import DecisionDocument

METRICS_FILE = "metrics.prom"
DECISIONS = ("promote", "rollback", "inconclusive", "error")
VERDICTS = ("pass", "fail", "inconclusive")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def registry_for(doc: DecisionDocument | Mapping[str, Any]) -> CollectorRegistry:
    """A registry holding one decision.json's gauges (every series labelled with run_id); a mapping is
    read as decision.json first (rollout.record.document)."""
    doc = DecisionDocument.of(doc)
    registry = CollectorRegistry()
    run_id = str(doc.run_id or "unknown")

    def gauge(name: str, text: str, *labels: str) -> Gauge:
        return Gauge(f"mtp_canary_{name}", text, ("run_id", *labels), registry=registry)

    decision = gauge("decision", "1 for the run's decision, 0 for the others (error: no decision)", "decision")
    for value in DECISIONS:
        decision.labels(run_id, value).set(1 if (doc.decided() or "error") == value else 0)
    gauge("exit_code", "the run's exit code: 0 promote, 3 rollback, 4 inconclusive, 1 error").labels(run_id).set(
        doc.exit_code if doc.exit_code is not None else 1
    )
    if doc.started_at is not None:
        gauge("started_timestamp_seconds", "when the run started").labels(run_id).set(doc.started_at)
    _candidates(doc, run_id, gauge)
    _gates(doc, run_id, gauge)
    _experiment(doc, run_id, gauge)
    if doc.promote_up_to is not None:
        claim = doc.promote_up_to.streams_per_replica
        gauge("promote_up_to_streams_per_replica", "the candidate is shown to beat the objective's bar at every swept "
              "load up to this many streams per replica (0: not even the lowest level swept)").labels(run_id).set(
            claim if claim is not None else 0)

    acceptance = gauge("acceptance_rate", "drafted tokens accepted at each position, per arm", "arm", "position")
    length = gauge("mean_acceptance_length", "tokens per verification step, per arm", "arm")
    for arm, spec in doc.spec_decode.items():
        for position, rate in enumerate(spec.per_position or [], start=1):
            if _number(rate) is not None:
                acceptance.labels(run_id, arm, str(position)).set(rate)
        if _number(spec.mean_acceptance_length) is not None:
            length.labels(run_id, arm).set(spec.mean_acceptance_length)
    return registry


def _candidates(doc: DecisionDocument, run_id: str, gauge: Callable[..., Gauge]) -> None:
    """A run with several candidates: each one's own verdict (at alpha / K), and the winner."""
    if not doc.candidates:
        return
    own = gauge("candidate_decision", "1 for the candidate's own decision, 0 for the others", "candidate", "decision")
    winner = gauge("candidate_winner", "1 for the candidate the run promoted, 0 for the others", "candidate")
    for candidate in doc.candidates:
        name = str(candidate.name)
        for value in DECISIONS:
            own.labels(run_id, name, value).set(1 if candidate.decision == value else 0)
        winner.labels(run_id, name).set(1 if doc.winner == name else 0)


def _gates(doc: DecisionDocument, run_id: str, gauge: Callable[..., Gauge]) -> None:
    status = gauge("gate_status", "1 for the gate's verdict, 0 for the others", "gate", "status")
    estimate = gauge("gate_estimate", "the gate's point estimate", "gate", "metric")
    bound = gauge("gate_interval", "the gate's interval bound", "gate", "metric", "bound")
    threshold = gauge("gate_threshold", "the gate's threshold (margin, cap or floor)", "gate", "metric")
    for gate in doc.gates:
        name, metric = str(gate.name), str(gate.metric or "")
        for verdict in VERDICTS:
            status.labels(run_id, name, verdict).set(1 if gate.verdict == verdict else 0)
        if _number(gate.estimate) is not None:
            estimate.labels(run_id, name, metric).set(gate.estimate)
        if _number(gate.threshold) is not None:
            threshold.labels(run_id, name, metric).set(gate.threshold)
        for which, value in zip(("lower", "upper"), gate.interval or []):
            if _number(value) is not None:
                bound.labels(run_id, name, metric, which).set(value)


def _experiment(doc: DecisionDocument, run_id: str, gauge: Callable[..., Gauge]) -> None:
    """The arms' request counts and latency percentiles, and canary / baseline of each percentile."""
    exp = doc.experiment
    requests = gauge("requests", "requests the experiment sent per arm", "arm")
    for arm, count in (exp.requests if exp else {}).items():
        if _number(count) is not None:
            requests.labels(run_id, arm).set(count)
    latency = gauge("latency_ms", "the experiment's latency percentile per arm", "arm", "metric")
    ratio = gauge("latency_ratio", "canary / baseline of a latency percentile (below 1: canary faster)", "metric")
    per_arm = exp.latency_ms if exp else {}
    for arm, metrics in per_arm.items():
        for metric, value in (metrics or {}).items():
            if _number(value) is not None:
                latency.labels(run_id, arm, metric).set(value)
    # with candidates the experiment's canary is the winner's arm (its records carry the candidate's name)
    base, canary = per_arm.get("baseline") or {}, per_arm.get("canary") or per_arm.get(str(doc.winner)) or {}
    for metric in sorted(set(base) & set(canary)):
        if _number(base[metric]) and _number(canary[metric]) is not None:
            ratio.labels(run_id, metric).set(canary[metric] / base[metric])


def metrics_text(doc: DecisionDocument | Mapping[str, Any]) -> str:
    """decision.json in Prometheus' text exposition format."""
    return generate_latest(registry_for(doc)).decode("utf-8")


def write_metrics(doc: DecisionDocument | Mapping[str, Any], run_dir: Path) -> Path:
    """run_dir/metrics.prom, whole or absent (the textfile collector reads *.prom files)."""
    path = Path(run_dir) / METRICS_FILE
    write_atomically(path, metrics_text(doc))
    return path
