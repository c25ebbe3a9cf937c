"""The controller's live Prometheus endpoint: what a run is doing while it goes (config `metrics`).

Owns the scrape-time view of one running run. Each scrape reads the run's committed state from
the store (a connection of its own: the HTTP server's thread is not the controller's) and the
router's counters from its actor, so what a dashboard sees is exactly what `mtp-canary status`
would print and nothing the controller has not committed. Names follow rollout.record.prometheus
(`mtp_canary_` prefix, every series labelled `run_id`; the gate families keep its names and
add `phase`, since a guard is judged again in every progressive window):

    mtp_canary_running                       1 while the controller runs, 0 once decided
    mtp_canary_phase{phase}                  1 for the phase the run is in
    mtp_canary_look{phase}                   the latest look (window) committed in that phase
    mtp_canary_step                          the progressive step (absent before the first)
    mtp_canary_canary_weight                 percent of the router's weighted traffic to the canary
    mtp_canary_paused                        1 while a progressive step waits for promote/abort
    mtp_canary_router_requests{arm}          requests routed (counts restart each phase: gauges)
    mtp_canary_router_errors{arm}            upstream errors, failed streams, ejected-arm 503s
    mtp_canary_router_rejected{arm}          503s for an arm with no replica
    mtp_canary_router_in_flight{arm}         requests in flight
    mtp_canary_gate_status{phase,gate,status} 1 for the latest verdict of each gate in each phase
    mtp_canary_gate_estimate / _threshold {phase,gate,metric}, _interval {phase,gate,metric,bound}

At the end (`finish`), decision.json's own families from rollout.record.prometheus join them
(mtp_canary_decision, _exit_code, _requests, _latency_ms, _latency_ratio, _acceptance_rate,
_mean_acceptance_length): the same series metrics.prom holds.

Binding 127.0.0.1 by default, and off by default: a run opens no port it was not asked for, and
a fixed port would collide between two runs on one head (port 0 takes a free one and the log
says which). Beyond loopback (`metrics.host: 0.0.0.0`) the series tell anyone on the network the
run's gates and traffic as they are judged: the endpoint then needs a bearer token, taken from
$MTP_CANARY_METRICS_TOKEN (Prometheus: `authorization: {credentials: ...}`), or it does not start.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import sqlite3
import threading
from wsgiref.simple_server import make_server
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rollout.record.prometheus import VERDICTS, registry_for
from rollout.run.status import committed_gates
from rollout.run.store import RunStore

PHASES = ("prepare", "fleet", "preflight", "restore", "accuracy", "experiment", "sweep", "decide", "progressive",
          "finish", "error")
# the document's families that the live gate families (with `phase`) stand for
LIVE_GATE_FAMILIES = {"mtp_canary_gate_status", "mtp_canary_gate_estimate", "mtp_canary_gate_interval",
                      "mtp_canary_gate_threshold"}
ROUTER_TIMEOUT_S = 2.0  # a scrape must answer even while the router actor is busy or gone
METRICS_TOKEN_ENV = "MTP_CANARY_METRICS_TOKEN"  # the bearer token scrapes need beyond loopback


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bearer_only(app, token: str):
    """`app` answering only requests that carry `Authorization: Bearer token` (401 otherwise)."""
    expected = f"Bearer {token}".encode()

    def guarded(environ, start_response):
        given = environ.get("HTTP_AUTHORIZATION", "").encode()
        if not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"a bearer token is required\n"]
        return app(environ, start_response)

    return guarded


def _gauge(name: str, text: str, *labels: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"mtp_canary_{name}", text, labels=["run_id", *labels])


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def run_families(run_id: str, run: dict[str, Any], results: list[dict[str, Any]], paused: bool) -> list[GaugeMetricFamily]:
    """The run's own state as gauge families: its row in the store and its committed phase results."""
    running = _gauge("running", "1 while the run's controller runs, 0 once it ended")
    running.add_metric([run_id], 1 if run["status"] == "running" else 0)
    phase = _gauge("phase", "1 for the phase the run is in", "phase")
    current = (run.get("phase") or "").split("@")[0]
    for name in sorted(set(PHASES) | ({current} if current else set())):
        phase.add_metric([run_id, name], 1 if name == current else 0)
    families = [running, phase]
    if _number(run.get("canary_weight")) is not None:
        weight = _gauge("canary_weight", "percent of the router's weighted traffic sent to the canary")
        weight.add_metric([run_id], run["canary_weight"])
        families.append(weight)
    if _number(run.get("step")) is not None:
        step = _gauge("step", "the progressive step the run is at")
        step.add_metric([run_id], run["step"])
        families.append(step)
    held = _gauge("paused", "1 while a progressive step waits for `mtp-canary promote|abort`")
    held.add_metric([run_id], 1 if paused else 0)
    return families + [held] + gate_families(run_id, results)


def gate_families(run_id: str, results: list[dict[str, Any]]) -> list[GaugeMetricFamily]:
    """The latest look of each phase and the latest verdict and numbers of each gate in each phase."""
    look = _gauge("look", "the latest look (or window) committed in the phase", "phase")
    status = _gauge("gate_status", "1 for the gate's latest verdict in the phase, 0 for the others", "phase", "gate", "status")
    estimate = _gauge("gate_estimate", "the gate's latest point estimate", "phase", "gate", "metric")
    bound = _gauge("gate_interval", "the gate's latest interval bound", "phase", "gate", "metric", "bound")
    threshold = _gauge("gate_threshold", "the gate's threshold (margin, cap or floor)", "phase", "gate", "metric")
    looks: dict[str, int] = {}
    latest: dict[tuple[str, str], Any] = {}
    for entry in results:
        if "@" in entry["phase"]:
            continue  # a superseded attempt (resume): its looks no longer stand
        gates, _ = committed_gates(entry["phase"], entry["result"])
        if gates:
            looks[entry["phase"]] = max(looks.get(entry["phase"], 0), int(entry["look"]))
        for gate in gates:
            latest[(entry["phase"], gate.name)] = gate
    for name, value in looks.items():
        look.add_metric([run_id, name], value)
    for (phase, name), gate in latest.items():
        verdict = gate.verdict.value
        for each in VERDICTS:
            status.add_metric([run_id, phase, name, each], 1 if verdict == each else 0)
        labels = [run_id, phase, name, gate.metric]
        if _number(gate.estimate) is not None:
            estimate.add_metric(labels, gate.estimate)
        if _number(gate.threshold) is not None:
            threshold.add_metric(labels, gate.threshold)
        for which, value in zip(("lower", "upper"), gate.interval or ()):
            if _number(value) is not None:
                bound.add_metric([*labels, which], value)
    return [look, status, estimate, bound, threshold]


def router_families(run_id: str, state: dict[str, Any] | None) -> list[GaugeMetricFamily]:
    """The router's per-arm counters (since its last reset, which each phase makes) as gauges."""
    if not state:
        return []
    texts = {"requests": "requests the router routed to the arm since the phase began",
             "errors": "upstream errors, broken streams and ejected-arm 503s of the arm since the phase began",
             "rejected": "requests answered 503 because the arm had no replica, since the phase began",
             "in_flight": "requests in flight to the arm"}
    keys = {"requests": "routed", "errors": "errors", "rejected": "rejected", "in_flight": "in_flight"}
    out = []
    for name, text in texts.items():
        family = _gauge(f"router_{name}", text, "arm")
        for arm, counts in sorted((state.get("arm_counts") or {}).items()):
            if _number(counts.get(keys[name])) is not None:
                family.add_metric([run_id, arm], counts[keys[name]])
        out.append(family)
    return out


class RunCollector(Collector):
    """prometheus_client's custom-collector hook: the families above, read at each scrape."""

    def __init__(self, store_path: Path, run_id: str, router_state: Callable[[], dict[str, Any] | None]) -> None:
        self.store_path, self.run_id, self.router_state = Path(store_path), run_id, router_state
        self.final: dict[str, Any] | None = None  # decision.json once the run ended

    def collect(self):
        from rollout.run.status import run_status

        try:  # read-only: a scrape never writes to the store the controller writes
            store = RunStore(self.store_path, read_only=True)
        except sqlite3.OperationalError:  # no store yet (or gone): nothing of the run to serve
            return
        try:
            run = store.run(self.run_id)
            if run is None:
                return
            results = store.all_phase_results(self.run_id)
            status = run_status(store, self.run_id)
            paused = status is not None and status.paused
        finally:
            store.close()
        yield from run_families(self.run_id, run, results, paused)
        try:
            state = self.router_state()
        except Exception:  # the router is gone or slow: the scrape still answers, without its rows
            state = None
        yield from router_families(self.run_id, state)
        if self.final is not None:
            for family in registry_for(self.final).collect():
                if family.name not in LIVE_GATE_FAMILIES:
                    yield family


class LiveMetrics:
    """The endpoint of one run: started before its first phase, given decision.json at the end."""

    def __init__(self, store_path: Path, run_id: str, router_state: Callable[[], dict[str, Any] | None],
                 host: str = "127.0.0.1", port: int = 0, linger_s: float = 0.0) -> None:
        token = os.environ.get(METRICS_TOKEN_ENV) or None
        if token is None and not _loopback(host):
            raise OSError(f"metrics.host {host} is beyond loopback and ${METRICS_TOKEN_ENV} is not set: set it "
                          "(scrapes then need it as a bearer token) or serve the metrics on 127.0.0.1")
        self.collector = RunCollector(store_path, run_id, router_state)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        app = make_wsgi_app(registry)
        try:
            family, addr = _get_best_family(host, port)
            server_class = type("LiveMetricsServer", (ThreadingWSGIServer,), {"address_family": family})
            self._server = make_server(addr, port, _bearer_only(app, token) if token else app, server_class,
                                       handler_class=_SilentHandler)
        except OSError as exc:
            raise OSError(f"metrics.port {port} on {host}: {exc.strerror or exc}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.linger_s = linger_s
        self._stopped = threading.Event()
        bound_host, bound_port = self._server.server_address[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.url = f"http://{shown}:{bound_port}/metrics"

    def finish(self, doc: dict[str, Any]) -> None:
        """The run ended: serve its decision too (the families metrics.prom holds)."""
        self.collector.final = doc

    def stop(self, linger: bool = True) -> None:
        """After linger_s (a scrape sees the decision), stop serving; at once with linger=False
        (an interrupted run: the person pressing Ctrl-C waits for nothing); idempotent."""
        if self._stopped.is_set():
            return
        if linger and self.collector.final is not None and self.linger_s:
            self._stopped.wait(self.linger_s)
        self._stopped.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
