"""The controller's live Prometheus endpoint, scraped with prometheus_client's parser during a run.

The run is the real controller with the real experiment, decide and finish phases: a real Router
actor on local Ray, a real Locust swarm and a real SQLite store. Only the fleet is a stand-in: two
named benchmark targets (benchmarks/stream_target.py) instead of vLLM replicas, a canary with a
lower TPOT, so the run promotes (the vLLM tests judge real engines).
"""

from __future__ import annotations

import logging
import re
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.stream_target import TargetProcess
from cluster.router import Router, RouterClient
from rollout.run import controller as controller_module
from rollout.config import ConfigError, load_config, parse_config
from rollout.run.controller import Controller
from rollout.run.live_metrics import gate_families, router_families
from rollout.run.phases.decide import Decide, Finish
from rollout.run.phases.experiment import Experiment
from tests.conftest import REPO

URL_LINE = re.compile(r"metrics: live Prometheus metrics at (http://\S+/metrics)")


class StandInFleet:
    """The fleet phase over two stream targets behind a real Router actor (the controller stops it)."""

    name = "fleet"

    def __init__(self, baseline_url: str, canary_url: str) -> None:
        self.urls = {"baseline": baseline_url, "canary": canary_url}

    def enabled(self, ctx) -> bool:
        return True

    def run(self, ctx) -> None:
        router = Router.remote(initial_weights={"baseline": 100.0, "canary": 0.0}, seed=0)
        url = ray.get(router.start.remote())
        ray.get(router.set_arms.remote({arm: [u] for arm, u in self.urls.items()}))
        ctx.router = RouterClient(router, url)
        ctx.fleet = SimpleNamespace(replicas=[], metrics=lambda: {}, teardown=lambda: None)
        ctx.engines = {arm: SimpleNamespace(served_model_name="target", num_speculative_tokens=k)
                       for arm, k in (("baseline", 0), ("canary", 0))}
        ctx.result.arms = {arm: {"replicas": 1, "engine": {"model": "target", "url": u}} for arm, u in self.urls.items()}
        ctx.set_canary_weight(10.0, "fleet", "stand-in fleet up")


def config(tmp_path, **metrics):
    data = load_config(REPO / "configs/local-cpu.yaml").model_dump(mode="json")
    data["accuracy"]["enabled"] = False
    data["experiment"].update(requests_per_look=30, requests_per_arm=120, min_looks=2, window_s=1, users_per_replica=3,
                              max_tokens=12, max_duration_s=120, workers=1, worker_placement="local", input_tokens="8")
    # only the objective and a lenient error guard: this machine's CPU contention is not under test
    data["gates"].update(enabled=["tpot_p50_improvement", "error_rate_guard"], min_acceptance_length=None,
                         error_rate_max_increase=0.5, min_requests_per_arm=20)
    data["metrics"] = {"port": 0, **metrics}
    return parse_config(data)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    yield
    ray.shutdown()


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(samples: dict[str, list], name: str, **labels) -> float | None:
    found = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def test_the_endpoint_follows_the_run_look_by_look_and_serves_the_decision(local_ray, tmp_path, monkeypatch):
    cfg = config(tmp_path, linger_s=10)
    lines: list[str] = []
    scrapes: list[dict] = []
    done = threading.Event()
    with TargetProcess(ttft_ms=20, tpot_ms=20, tpot_jitter=0.3, seed=1) as baseline, \
            TargetProcess(ttft_ms=20, tpot_ms=8, tpot_jitter=0.3, seed=2) as canary:
        monkeypatch.setattr(controller_module, "PHASES", (StandInFleet(baseline.url, canary.url), Experiment(), Decide(),
                                                          Finish()))
        results = []

        def drive() -> None:  # the controller in a thread of its own (its store connection is that thread's)
            try:
                results.append(Controller(cfg, runs_dir=tmp_path, run_id="live", progress=lines.append).run())
            finally:
                done.set()

        runner = threading.Thread(target=drive, daemon=True)
        runner.start()
        deadline = time.monotonic() + 60
        while not any(URL_LINE.search(line) for line in lines):
            assert time.monotonic() < deadline and runner.is_alive(), lines
            time.sleep(0.05)
        url = next(URL_LINE.search(line).group(1) for line in lines if URL_LINE.search(line))
        assert url.startswith("http://127.0.0.1:")  # loopback unless configured
        while not done.is_set():
            try:
                scrapes.append(scrape(url))
            except (urllib.error.URLError, ConnectionError):
                pass  # the port closed after linger_s, before `done` was set
            time.sleep(0.2)
        runner.join(10)
    result = results[0]
    assert result.decision is not None and result.decision.value == "promote" and result.error is None, (result.error, result.reason, lines[-10:])

    during = [s for s in scrapes if value(s, "mtp_canary_phase", phase="experiment") == 1]
    assert during, "no scrape while the experiment ran"
    assert all(value(s, "mtp_canary_running") == 1 for s in during)
    assert all(value(s, "mtp_canary_canary_weight") == 10 for s in during)
    assert max(value(s, "mtp_canary_router_requests", arm="baseline") or 0 for s in during) > 0
    assert max(value(s, "mtp_canary_router_requests", arm="canary") or 0 for s in during) > 0
    looks = sorted({value(s, "mtp_canary_look", phase="experiment") for s in during} - {None})
    assert len(looks) >= 2, f"the endpoint did not move between looks: {looks}"  # it updates while the run goes
    stored = len(result.experiment.looks)
    assert looks[-1] <= stored
    judged = [s for s in during if value(s, "mtp_canary_look", phase="experiment")]
    assert value(judged[0], "mtp_canary_gate_status", phase="experiment", gate="tpot_p50_improvement",
                 status="inconclusive") is not None
    # the decision, while the endpoint lingers: the same series as metrics.prom, with the live ones
    final = [s for s in scrapes if value(s, "mtp_canary_decision", decision="promote") is not None]
    assert final, "the decision was never served"
    last = final[-1]
    assert value(last, "mtp_canary_decision", decision="promote") == 1
    assert value(last, "mtp_canary_exit_code") == 0 and value(last, "mtp_canary_running") == 0
    assert value(last, "mtp_canary_canary_weight") == 100
    gate = next(g for g in result.gates if g.name == "tpot_p50_improvement")
    assert value(last, "mtp_canary_gate_estimate", phase="experiment", gate=gate.name) == pytest.approx(gate.estimate)
    assert value(last, "mtp_canary_gate_status", phase="experiment", gate=gate.name, status="pass") == 1
    assert any("metrics: live Prometheus metrics at" in line for line in lines)
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        scrape(url)  # the port is closed once the controller is done


def test_off_by_default_and_a_taken_port_is_an_infrastructure_error(tmp_path, monkeypatch):
    assert load_config(REPO / "configs/local-cpu.yaml").metrics.port is None
    with pytest.raises(ConfigError, match="metrics.port"):
        data = load_config(REPO / "configs/local-cpu.yaml").model_dump(mode="json")
        data["metrics"] = {"port": 70000}
        parse_config(data)
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setattr(controller_module, "PHASES", ())
        result = Controller(config(tmp_path, port=port), runs_dir=tmp_path, run_id="taken", progress=lambda m: None).run()
    assert result.exit_code == 1 and result.error.startswith(f"metrics.port {port} on 127.0.0.1:")


def test_label_values_from_the_run_cannot_inject_series():
    """A gate name or arm from a config is one label value, whatever it holds (the exposition escapes it)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.registry import Collector

    hostile = 'x"} 1\nmtp_canary_decision{decision="promote'
    gate = {"name": hostile, "metric": "m", "baseline": None, "canary": None, "threshold": 1.0, "verdict": "fail",
            "estimate": 2.0, "interval": [1.5, 2.5]}
    families = gate_families("r", [{"phase": "experiment", "look": 3, "result": [gate]}])
    families += router_families("r", {"arm_counts": {hostile: {"routed": 5, "errors": 1, "rejected": 0, "in_flight": 2}}})

    class Fixed(Collector):
        def collect(self):
            return families

    registry = CollectorRegistry()
    registry.register(Fixed())
    parsed = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert "mtp_canary_decision" not in parsed
    assert {s.labels["gate"] for s in parsed["mtp_canary_gate_status"].samples} == {hostile}
    assert [s.value for s in parsed["mtp_canary_router_errors"].samples] == [1]
    assert [s.value for s in parsed["mtp_canary_look"].samples] == [3]


def test_a_scrape_only_reads_the_store_and_an_interrupted_run_does_not_linger(tmp_path):
    import sqlite3

    from rollout.run.live_metrics import LiveMetrics
    from rollout.run.store import RunStore

    missing = tmp_path / "not-yet" / "history.db"
    live = LiveMetrics(missing, "r1", router_state=lambda: None, linger_s=60)
    try:
        assert "mtp_canary_running" not in scrape(live.url)  # no store yet: an empty page, not an error
        assert not missing.parent.exists()  # and a scrape created nothing
        store = RunStore(tmp_path / "history.db")
        store.create_run("r1", "read-only", "tiny", {})
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            RunStore(store.path, read_only=True).create_run("r2", "x", "tiny", {})
        live.collector.store_path = store.path
        assert [(s.labels["run_id"], s.value) for s in scrape(live.url)["mtp_canary_running"]] == [("r1", 1)]
        live.finish({"run_id": "r1", "decision": None, "gates": []})
        started = time.monotonic()
        live.stop(linger=False)  # Ctrl-C: the 60 s of linger_s are not waited
        assert time.monotonic() - started < 10
    finally:
        live.stop(linger=False)


def test_the_runs_row_never_shows_a_new_weight_under_the_phase_before_it(tmp_path, monkeypatch):
    """The finish's 100% and the phase it belongs to land in one write (a scrape of the live endpoint
    saw phase=experiment with canary_weight 100 when the weight was written first)."""
    from rollout.judge.verdicts import Decision
    from rollout.record.result import RunResult
    from rollout.run.resume import ResumePoint
    from rollout.run.context import RunContext
    from rollout.run.store import RunStore

    cfg = config(tmp_path)
    store = RunStore(tmp_path / "history.db")
    store.create_run("r", cfg.name, "tiny", cfg.model_dump(mode="json"))
    ctx = RunContext(cfg=cfg, run_id="r", run_dir=tmp_path / "r", store=store,
                     result=RunResult(run_id="r", run_dir=tmp_path / "r", config=cfg), progress=lambda line: None,
                     cache_dir=tmp_path, point=ResumePoint.fresh(), namespace="test")
    ctx.router = SimpleNamespace(set_canary_weight=lambda weight: None)
    ctx.set_canary_weight(10.0, "fleet", "up")
    ctx.event("experiment", "look", "look 1")
    rows: list[tuple[str, float]] = []
    write = store.update_run

    def every_write(run_id, **fields):
        write(run_id, **fields)
        row = store.run(run_id)
        rows.append((row["phase"], row["canary_weight"]))

    monkeypatch.setattr(store, "update_run", every_write)
    ctx.result.decision, ctx.result.reason = Decision.PROMOTE, "every gate passed"
    Finish().run(ctx)
    assert rows and rows[-1] == ("decide", 100.0)
    assert all(weight == 10.0 for phase, weight in rows if phase == "experiment"), rows
