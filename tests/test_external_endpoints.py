"""Arms that already run elsewhere (`baseline.endpoints`) and the weight hook, without vLLM.

The external replica is checked against the stream target (benchmarks/stream_target.py) as a
fault target: a server that answers, one that is gone, one whose /metrics fails. The whole
run against two real vLLM servers started outside the run is in tests/test_fleet.py.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import ray

from benchmarks.stream_target import TargetProcess
from cluster.engine_spec import EngineSpec
from cluster.external_replica import ExternalReplicaServer
from cluster.fleet import ArmSpec, Fleet, FleetStartError
from cluster.replica import ReplicaState
from rollout.config import ConfigError, WeightHookConfig, parse_config
from rollout.run.weight_hook import WeightHookError, call_weight_hook, hook_argv


def closed_port_url() -> str:
    """A URL nothing listens on (a port taken and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# -- the external replica ----------------------------------------------------------------------
def test_an_answering_server_is_ready_at_its_url_and_stopping_it_leaves_it_running():
    with TargetProcess(ttft_ms=5, tpot_ms=1) as target:
        replica = ExternalReplicaServer("baseline-0", "baseline", target.url + "/", startup_timeout_s=10)
        status = replica.launch()
        assert status.state == ReplicaState.READY and status.url == target.url
        assert replica.liveness() is True and replica.alive()
        assert replica.metrics_text().startswith("# stream target")
        assert replica.engine_warnings() == [] and replica.log_lines_with(("vLLM",)) == []
        assert replica.stop().state == ReplicaState.STOPPED
        # the server is someone else's: still serving after the run forgot it
        assert ExternalReplicaServer("again", "baseline", target.url).launch().state == ReplicaState.READY


def test_a_server_that_never_answers_fails_its_start_naming_its_url():
    url = closed_port_url()
    replica = ExternalReplicaServer("canary-0", "canary", url, startup_timeout_s=0.5)
    assert replica.launch().state == ReplicaState.STARTING
    status = replica.wait_ready(poll_s=0.2)
    assert status.state == ReplicaState.FAILED
    assert url in status.error and "/health did not answer 200 within 0.5 s" in status.error
    assert replica.liveness() is False


def test_a_server_that_dies_reads_as_down_and_a_failing_metrics_page_raises():
    with TargetProcess(ttft_ms=5, tpot_ms=1, metrics_status=500) as target:
        replica = ExternalReplicaServer("canary-0", "canary", target.url, startup_timeout_s=10)
        assert replica.launch().state == ReplicaState.READY
        with pytest.raises(Exception, match="500"):
            replica.metrics()  # never an empty snapshot: missing data stays missing
    assert replica.liveness() is False and not replica.alive()


def test_a_fleet_of_external_arms_reserves_nothing_binds_nothing_and_tears_nothing_down(tmp_path):
    engine = EngineSpec(model="served-elsewhere", device="cpu")
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        with TargetProcess(ttft_ms=5, tpot_ms=1) as base, TargetProcess(ttft_ms=5, tpot_ms=1) as cand:
            fleet = Fleet([ArmSpec(name="baseline", engine=engine, endpoints=[base.url]),
                           ArmSpec(name="canary", engine=engine, endpoints=[cand.url],
                                   metrics_urls=[cand.url + "/metrics"])],
                          log_dir=str(tmp_path / "logs"), progress=print, logs_back_to=str(tmp_path / "back"))
            assert fleet.start(timeout_s=30) == {"baseline": [base.url], "canary": [cand.url]}
            assert fleet.cpu_cores == {"baseline-0": None, "canary-0": None} and fleet.core_sharing is None
            assert set(fleet.metrics()) == {"baseline-0", "canary-0"}
            assert fleet.log_lines_with(("vLLM",)) == {"baseline-0": [], "canary-0": []}
            fleet.teardown()
            assert not (tmp_path / "back").exists() or list((tmp_path / "back").iterdir()) == []
            assert base.stats()["completed"] >= 0 and cand.stats()["completed"] >= 0  # both still serving
            # all or nothing: one endpoint that never answers fails the start, naming it
            gone = closed_port_url()
            slow = engine.model_copy(update={"startup_timeout_s": 1})
            fleet = Fleet([ArmSpec(name="baseline", engine=slow, endpoints=[base.url]),
                           ArmSpec(name="canary", engine=slow, endpoints=[gone])],
                          log_dir=str(tmp_path / "logs2"), progress=print)
            with pytest.raises(FleetStartError, match=f"external endpoint {gone}"):
                fleet.start(timeout_s=30)
            assert fleet.replicas == []
    finally:
        ray.shutdown()


# -- the config --------------------------------------------------------------------------------
def external_config(**arms) -> dict:
    base = {"name": "ext", "accuracy": {"enabled": False},
            "baseline": {"endpoints": ["http://10.0.0.5:8000"], "engine": {"model": "m", "device": "gpu"}},
            "canary": {"endpoints": ["http://10.0.0.6:8000"], "engine": {"model": "m", "device": "gpu"}}}
    for arm, update in arms.items():
        base[arm] = {**base[arm], **update}
    return base


def test_endpoints_set_the_replicas_and_the_config_refuses_what_would_leak_or_mislead():
    cfg = parse_config(external_config(baseline={"endpoints": ["http://10.0.0.5:8000/", "https://b.example/v"]},
                                       canary={"endpoints": ["http://10.0.0.6:8000", "http://10.0.0.7:8000"]}))
    assert cfg.baseline.replicas == 2 and cfg.baseline.endpoints == ["http://10.0.0.5:8000", "https://b.example/v"]
    bad = {
        "baseline.endpoints: 'grpc://x:1' is not an http(s) URL with a host": {"baseline": {"endpoints": ["grpc://x:1"]}},
        "baseline.endpoints: h: credentials in the URL would be recorded": {"baseline": {"endpoints": ["http://u:sk-1@h:1"]}},
        "canary.endpoints: h: no query or fragment": {"canary": {"endpoints": ["http://h:1/?key=sk-1"]}},
        "baseline.endpoints: lists one server twice": {"baseline": {"endpoints": ["http://h:1", "http://h:1/"]}},
        "canary: replicas: 2 for 1 endpoints": {"canary": {"endpoints": ["http://h:1"], "replicas": 2}},
        "canary: endpoints and tiny_model": {"canary": {"endpoints": ["http://h:1"], "tiny_model": {}}},
        "baseline: metrics_urls: 2 for 1 endpoints": {"baseline": {"metrics_urls": ["http://h:9/m", "http://h:8/m"]}},
    }
    for message, arms in bad.items():
        with pytest.raises(ConfigError) as err:
            parse_config(external_config(**arms), "c.yaml")
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
        assert "sk-1" not in str(err.value)


# -- the weight hook ---------------------------------------------------------------------------
def hook_writing_to(path: Path, exit_code: int = 0, sleep_s: float = 0.0) -> WeightHookConfig:
    script = ("import json, os, sys, time; time.sleep(float(sys.argv[3])); "
              "open(sys.argv[2], 'a').write(json.dumps([sys.argv[1], os.environ['MTP_CANARY_WEIGHT'], "
              "os.environ['MTP_CANARY_PHASE'], os.environ['MTP_CANARY_RUN_ID']]) + '\\n'); sys.exit(int(sys.argv[4]))")
    return WeightHookConfig(command=[sys.executable, "-c", script, "{weight}", str(path), str(sleep_s), str(exit_code)],
                            timeout_s=5)


def test_the_hook_gets_the_weight_in_its_argv_and_environment(tmp_path):
    calls = tmp_path / "calls.jsonl"
    for weight in (10.0, 12.5, 100.0):
        call_weight_hook(hook_writing_to(calls), weight, "run-1", "progressive", "step")
    got = [json.loads(line) for line in calls.read_text().splitlines()]
    assert got == [["10", "10", "progressive", "run-1"], ["12.5", "12.5", "progressive", "run-1"],
                   ["100", "100", "progressive", "run-1"]]
    # braces that are not a placeholder stay as written (a JSON patch)
    hook = WeightHookConfig(command=["kubectl", "patch", '{"spec": {"weight": {weight}}}', "--run={run_id}"])
    assert hook_argv(hook, 50, "r", "decide")[2:] == ['{"spec": {"weight": 50}}', "--run=r"]


def test_a_hook_that_fails_or_overruns_or_cannot_start_raises_naming_the_weight(tmp_path):
    with pytest.raises(WeightHookError, match=r"weight_hook \(python\S*\) exited 3 for weight 50%"):
        call_weight_hook(hook_writing_to(tmp_path / "c", exit_code=3), 50, "r", "progressive", "step")
    slow = hook_writing_to(tmp_path / "c", sleep_s=10).model_copy(update={"timeout_s": 0.5})
    with pytest.raises(WeightHookError, match=r"did not finish within 0.5 s \(weight_hook.timeout_s\) for weight 10%"):
        call_weight_hook(slow, 10, "r", "progressive", "step")
    with pytest.raises(WeightHookError, match="could not start"):
        call_weight_hook(WeightHookConfig(command=[str(tmp_path / "no-such-hook")]), 0, "r", "error", "x")


def test_a_hook_argv_never_reaches_a_stored_config():
    from rollout.record.redact import REDACTED, redact_config

    data = external_config()
    data["weight_hook"] = {"command": ["curl", "-H", "Authorization: Bearer sk-hook-0123456789", "https://gw/{weight}"]}
    stored = redact_config(parse_config(data).model_dump(mode="json"))
    assert stored["weight_hook"]["command"] == ["curl", REDACTED, REDACTED, REDACTED]
    assert "sk-hook" not in json.dumps(stored)
    assert stored["baseline"]["endpoints"] == ["http://10.0.0.5:8000"]  # what was judged stays on record


# -- the progressive steps without a hook ------------------------------------------------------
def test_steps_over_servers_that_run_elsewhere_are_advisory_without_a_hook_and_the_record_says_so():
    from rollout.run.phases.progressive import advisory_reason
    from rollout.record.markdown import markdown_report
    from rollout.record.result import ProgressiveSummary

    def advisory(config: dict) -> str | None:
        cfg = parse_config(config)
        return advisory_reason(cfg, cfg.canary)

    reason = advisory(external_config(canary={"endpoints": [], "engine": {"model": "m"}}))
    assert reason.startswith("advisory: baseline run elsewhere (endpoints) and no weight_hook")
    hooked = external_config() | {"weight_hook": {"command": ["true"]}}
    assert advisory(hooked) is None
    launched = external_config(baseline={"endpoints": [], "engine": {"model": "m"}},
                               canary={"endpoints": [], "engine": {"model": "m"}})
    assert advisory(launched) is None
    # decision.json carries the key only when the steps were advisory (a launched run's shape is unchanged)
    summary = dict(steps_completed=1, observed_split=[], requests_received=1, records_stored=1, attempt=1, duration_s=1)
    assert "advisory" not in ProgressiveSummary(**summary).document()
    doc = ProgressiveSummary(**summary, advisory=reason).document()
    assert doc["advisory"] == reason
    recorded = json.loads((Path(__file__).parent / "data" / "recorded_runs" / "crash" / "decision.json").read_text())
    assert recorded["progressive"]["observed_split"]
    report = markdown_report(recorded | {"progressive": recorded["progressive"] | {"advisory": reason}})
    assert "The steps are advisory: baseline run elsewhere" in report
