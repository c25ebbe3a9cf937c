"""metrics.prom beside decision.json: a decided run in Prometheus' text format.

For node-exporter's textfile collector (or any scraper pointed at the file): the decision,
each gate's verdict and numbers, the arms' request counts, latency percentiles and the
canary/baseline ratio of each, acceptance per draft position, and the exit code. Built with
prometheus_client's registry and exposition (it escapes label values, so a run id or name
from the config cannot break the format); one file per run, replaced whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from rollout.record.atomic_file import write_atomically

METRICS_FILE = "metrics.prom"
DECISIONS = ("promote", "rollback", "inconclusive", "error")
VERDICTS = ("pass", "fail", "inconclusive")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def registry_for(doc: dict[str, Any]) -> CollectorRegistry:
    """A registry holding one decision.json's gauges (every series labelled with run_id)."""
    registry = CollectorRegistry()
    run_id = str(doc.get("run_id") or "unknown")

    def gauge(name: str, text: str, *labels: str) -> Gauge:
        return Gauge(f"mtp_canary_{name}", text, ("run_id", *labels), registry=registry)

    decided = doc.get("decision") if not doc.get("error") else None
    decision = gauge("decision", "1 for the run's decision, 0 for the others (error: no decision)", "decision")
    for value in DECISIONS:
        decision.labels(run_id, value).set(1 if (decided or "error") == value else 0)
    gauge("exit_code", "the run's exit code: 0 promote, 3 rollback, 4 inconclusive, 1 error").labels(run_id).set(
        _number(doc.get("exit_code")) if _number(doc.get("exit_code")) is not None else 1
    )
    if _number(doc.get("started_at")) is not None:
        gauge("started_timestamp_seconds", "when the run started").labels(run_id).set(doc["started_at"])

    candidates = doc.get("candidates") or []
    if candidates:  # a run with several candidates: each one's own verdict (at alpha / K), and the winner
        own = gauge("candidate_decision", "1 for the candidate's own decision, 0 for the others", "candidate", "decision")
        winner = gauge("candidate_winner", "1 for the candidate the run promoted, 0 for the others", "candidate")
        for candidate in candidates:
            name = str(candidate.get("name"))
            for value in DECISIONS:
                own.labels(run_id, name, value).set(1 if candidate.get("decision") == value else 0)
            winner.labels(run_id, name).set(1 if doc.get("winner") == name else 0)

    status = gauge("gate_status", "1 for the gate's verdict, 0 for the others", "gate", "status")
    estimate = gauge("gate_estimate", "the gate's point estimate", "gate", "metric")
    bound = gauge("gate_interval", "the gate's interval bound", "gate", "metric", "bound")
    threshold = gauge("gate_threshold", "the gate's threshold (margin, cap or floor)", "gate", "metric")
    for gate in doc.get("gates") or []:
        name, metric = str(gate.get("name")), str(gate.get("metric") or "")
        for verdict in VERDICTS:
            status.labels(run_id, name, verdict).set(1 if gate.get("verdict") == verdict else 0)
        if _number(gate.get("estimate")) is not None:
            estimate.labels(run_id, name, metric).set(gate["estimate"])
        if _number(gate.get("threshold")) is not None:
            threshold.labels(run_id, name, metric).set(gate["threshold"])
        interval = gate.get("interval") or []
        for which, value in zip(("lower", "upper"), interval):
            if _number(value) is not None:
                bound.labels(run_id, name, metric, which).set(value)

    experiment = doc.get("experiment") or {}
    requests = gauge("requests", "requests the experiment sent per arm", "arm")
    for arm, count in (experiment.get("requests") or {}).items():
        if _number(count) is not None:
            requests.labels(run_id, arm).set(count)
    latency = gauge("latency_ms", "the experiment's latency percentile per arm", "arm", "metric")
    ratio = gauge("latency_ratio", "canary / baseline of a latency percentile (below 1: canary faster)", "metric")
    per_arm = experiment.get("latency_ms") or {}
    for arm, metrics in per_arm.items():
        for metric, value in (metrics or {}).items():
            if _number(value) is not None:
                latency.labels(run_id, arm, metric).set(value)
    # with candidates the experiment's canary is the winner's arm (its records carry the candidate's name)
    base, canary = per_arm.get("baseline") or {}, per_arm.get("canary") or per_arm.get(str(doc.get("winner"))) or {}
    for metric in sorted(set(base) & set(canary)):
        if _number(base[metric]) and _number(canary[metric]) is not None:
            ratio.labels(run_id, metric).set(canary[metric] / base[metric])

    acceptance = gauge("acceptance_rate", "drafted tokens accepted at each position, per arm", "arm", "position")
    length = gauge("mean_acceptance_length", "tokens per verification step, per arm", "arm")
    for arm, spec in (doc.get("spec_decode") or {}).items():
        for position, rate in enumerate((spec or {}).get("per_position") or [], start=1):
            if _number(rate) is not None:
                acceptance.labels(run_id, arm, str(position)).set(rate)
        if _number((spec or {}).get("mean_acceptance_length")) is not None:
            length.labels(run_id, arm).set(spec["mean_acceptance_length"])
    return registry


def metrics_text(doc: dict[str, Any]) -> str:
    """decision.json in Prometheus' text exposition format."""
    return generate_latest(registry_for(doc)).decode("utf-8")


def write_metrics(doc: dict[str, Any], run_dir: Path) -> Path:
    """run_dir/metrics.prom, whole or absent (the textfile collector reads *.prom files)."""
    path = Path(run_dir) / METRICS_FILE
    write_atomically(path, metrics_text(doc))
    return path
