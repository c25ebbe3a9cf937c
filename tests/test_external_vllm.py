"""`mtp-canary run` against two real vLLM servers the tool did not start (`endpoints:`), with a
weight hook: the judgement and the weight steps as for a fleet it starts, and the servers left
running. The servers are started here, by the test, as an operator's platform would: plain
processes, each bound to a core of its own, nothing of Ray or the run around them.

The same two servers then take a trace replay judged by the goodput and prefix-cache gates: what
that run judges (open-loop send times, the SLO, both arms' cache counters) does not depend on who
started the servers, and a vLLM start is the suite's dearest step on a slow machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import requests
import yaml

from cluster.engine_spec import CpuLimits, EngineSpec
from cluster.replica import free_port, iomp_library
from tests.conftest import REPO
from tests.test_cli_run import assert_goodput_per_arm, decision_of, run_cli

pytestmark = pytest.mark.vllm

SERVED = "tiny"


def tiny_engine(model_dir, k: int, dtype: str) -> EngineSpec:
    return EngineSpec(model=str(model_dir), served_model_name=SERVED, device="cpu", dtype=dtype, max_model_len=1024,
                      enforce_eager=True, speculative_config={"method": "mtp", "num_speculative_tokens": k},
                      cpu=CpuLimits(omp_threads=1, kv_cache_gb=1))


@pytest.fixture(scope="module")
def outside_servers(tiny_model_dir, tiny_dtype, tmp_path_factory):
    """Two vLLM servers (k=1 on core 0, k=3 on core 1) started outside the tool; their URLs."""
    logs = tmp_path_factory.mktemp("outside-logs")
    procs, urls = [], {}
    try:
        for arm, k, core in (("baseline", 1, 0), ("canary", 3, 1)):
            spec = tiny_engine(tiny_model_dir, k, tiny_dtype)
            port = free_port()
            env = {**os.environ, **spec.environment(iomp_path=iomp_library()), "PYTHONUNBUFFERED": "1"}
            log = open(logs / f"{arm}.log", "wb")
            procs.append(subprocess.Popen(spec.command(port), stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True, preexec_fn=lambda c=core: os.sched_setaffinity(0, {c})))
            urls[arm] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 900
        for arm, url in urls.items():
            while True:
                try:
                    if requests.get(url + "/health", timeout=5).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                assert all(p.poll() is None for p in procs), (logs / f"{arm}.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"{arm} not ready"
                time.sleep(1)
        yield urls
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, 15)
                p.wait(timeout=60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, 9)


# The judged experiment of the first outside run: shared-prefix groups (the prefix-cache workload) with a
# per-request SLO, reported per arm as goodput. No experiment gate is enabled (gates.enabled names the accuracy
# gates), so the phase stops at its first look: what it shows is the workload and its goodput on the outside servers.
SHARED_PREFIX_EXPERIMENT = {
    "enabled": True, "dataset": "shared_prefix", "prefix_groups": 2, "prefix_tokens": 300, "input_tokens": "8",
    "max_tokens": 16, "requests_per_look": 20, "requests_per_arm": 40, "window_s": 5, "max_duration_s": 300,
    "users_per_replica": 2,
}


def external_config(urls: dict, model_dir, hook_log, exit_code: int = 0, accuracy: bool = True,
                    experiment: dict | None = None) -> dict:
    arm = lambda name, k: {"endpoints": [urls[name]], "engine": {  # noqa: E731
        "model": str(model_dir), "served_model_name": SERVED, "device": "cpu", "max_model_len": 1024,
        "speculative_config": {"method": "mtp", "num_speculative_tokens": k}}}
    hook = ("import json, os, sys; open(sys.argv[1], 'a').write(json.dumps([os.environ['MTP_CANARY_WEIGHT'], "
            "os.environ['MTP_CANARY_PHASE']]) + '\\n'); sys.exit(int(sys.argv[2]))")
    return {
        "name": "external",
        "baseline": arm("baseline", 1),
        "canary": arm("canary", 3),
        "accuracy": {"enabled": accuracy, "kind": "golden", "path": str(model_dir / "golden.jsonl"), "limit": 64,
                     "batch_size": 32, "concurrency": 4},
        "experiment": experiment or {"enabled": False},
        "progressive": {"enabled": True, "users": 2, "steps": [
            {"canary_weight": 10, "bake_s": 10}, {"canary_weight": 50, "bake_s": 10}, {"canary_weight": 100, "bake_s": 10}],
            "guards": {"window_s": 10, "error_rate_max_increase": 0.05, "ttft_p95_max_s": 10.0, "tpot_p95_max_s": 2.0,
                       "min_acceptance_length": 1.5}},
        "gates": {"enabled": ["accuracy_noninferiority", "output_divergence"], "accuracy_margin": 0.05,
                  "slo": {"ttft_s": 30.0, "e2e_s": 120.0}},  # bounds the slowest machine meets: goodput ~1 per arm
        "weight_hook": {"command": [sys.executable, "-c", hook, str(hook_log), str(exit_code)], "timeout_s": 30},
    }


def served_requests(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def test_servers_started_elsewhere_are_judged_stepped_through_the_hook_and_left_running(outside_servers, tiny_model_dir,
                                                                                        tmp_path):
    runs, hook_log = tmp_path / "runs", tmp_path / "weights.jsonl"
    config = tmp_path / "external.yaml"
    config.write_text(yaml.safe_dump(external_config(outside_servers, tiny_model_dir, hook_log,
                                                     experiment=SHARED_PREFIX_EXPERIMENT)))
    before = {arm: served_requests(url) for arm, url in outside_servers.items()}
    proc = run_cli("run", str(config), "--runs-dir", str(runs), "--run-id", "ext")
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:]
    doc = decision_of(runs, "ext")
    assert doc["decision"] == "promote"
    assert {arm: doc["arms"][arm]["endpoints"] for arm in outside_servers} == {a: [u] for a, u in outside_servers.items()}
    assert doc["accuracy"]["items"] == 64 and doc["progressive"]["steps_completed"] == 3
    # the shared-prefix experiment: long shared prompts on both arms, their cache hits, each arm's goodput under the SLO
    assert_goodput_per_arm(doc, at_least=20)
    records = [json.loads(line) for line in (runs / "ext" / "experiment" / "records.jsonl").read_text().splitlines()]
    assert {r["arm"] for r in records} == {"baseline", "canary"}
    assert all(r["prompt_tokens"] > 300 for r in records if r["ok"])  # a ~450-token prefix before each 8-word suffix
    for arm in ("baseline", "canary"):
        # at most one cold prompt per group; every later one hits >= 2 of its ~4 blocks (see test_fleet's
        # shared-prefix test): far above 0.1 unless the outside server's prefix cache misses
        assert doc["arms"][arm]["kv"]["prefix_cache_hit_rate"] > 0.1, doc["arms"][arm]["kv"]
    assert "advisory" not in doc["progressive"]  # the hook moved the traffic the steps judged
    # the acceptance guard read the outside canary's own /metrics: it passed (k=3, perfect drafts) in a judged window
    windows = [e["reason"] for e in doc["timeline"] if e["event"] == "window"]
    assert any("guard_acceptance_length=pass" in w for w in windows), windows
    # the hook got every weight the run set, in order: each step's, then the promotion's
    calls = [json.loads(line) for line in hook_log.read_text().splitlines()]
    set_weights = [e for e in doc["timeline"] if e["event"] == "weights"]
    assert [w for w, _ in calls] == ["10", "50", "100", "100"]
    assert [float(w) for w, _ in calls] == [e["canary_weight"] for e in set_weights]
    assert [phase for _, phase in calls][:3] == ["progressive"] * 3
    # both servers took the run's traffic and still serve: the run did not stop what it did not start
    after = {arm: served_requests(url) for arm, url in outside_servers.items()}
    assert all(after[arm] > before[arm] for arm in after), (before, after)
    assert all(requests.get(url + "/health", timeout=10).status_code == 200 for url in outside_servers.values())
    assert not (runs / "ext" / "replica-logs").exists() or list((runs / "ext" / "replica-logs").iterdir()) == []

    # A hook that cannot move the traffic fails the run closed: an infrastructure error at the first
    # step (exit 1, no verdict acted on), the router's weight and the hook sent back to 0.
    failing_log = tmp_path / "failing.jsonl"
    config.write_text(yaml.safe_dump(external_config(outside_servers, tiny_model_dir, failing_log, exit_code=7,
                                                     accuracy=False) | {"gates": {"enabled": ["error_rate_guard"]}}))
    proc = run_cli("run", str(config), "--runs-dir", str(runs), "--run-id", "ext-hook-fails")
    print(proc.stdout[-4000:], proc.stderr[-2000:])
    assert proc.returncode == 1, proc.stdout[-3000:]
    doc = decision_of(runs, "ext-hook-fails")
    assert "weight_hook (python" in doc["error"] and "exited 7 for weight 10%" in doc["error"]
    assert [json.loads(line)[0] for line in failing_log.read_text().splitlines()] == ["10", "0"]
    assert doc["timeline"][-1]["canary_weight"] == 0
    assert all(requests.get(url + "/health", timeout=10).status_code == 200 for url in outside_servers.values())


def test_a_trace_replay_with_an_slo_and_the_prefix_cache_gate_reaches_a_decision(outside_servers, tiny_model_dir,
                                                                                  tmp_path):
    """The shipped sample trace (bursty; sessions whose turns extend each other; groups sharing a
    prefix) replayed at a quarter speed (~0.5 requests/s per arm: its ~300-token prompts take seconds to
    prefill on one CPU core) on both arms, judged by the guards only: every arm's goodput and
    prefix-cache hit rate in decision.json, the prefix-cache gate judged on both arms' counters (the
    servers' /metrics: deltas over the run, whatever they served before)."""
    runs = tmp_path / "runs"
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    outside = external_config(outside_servers, tiny_model_dir, tmp_path / "no-hook.jsonl")
    data["baseline"], data["canary"] = outside["baseline"], outside["canary"]
    data["accuracy"]["enabled"] = False
    data["experiment"].update(
        dataset="trace", dataset_path="loadtests/data/traces/sample.jsonl", trace_speedup=0.25, users_per_replica=4,
        requests_per_look=20, requests_per_arm=120, max_duration_s=900,
    )
    data["experiment"].pop("sweep")
    data["gates"].update(slo={"ttft_s": 30.0, "e2e_s": 120.0}, goodput_max_decrease=0.1, prefix_cache_max_drop=0.2,
                         enabled=["error_rate_guard", "goodput_guard", "prefix_cache_guard", "sample_ratio"])
    config = tmp_path / "trace.yaml"
    config.write_text(yaml.safe_dump(data))
    proc = run_cli("run", str(config), "--runs-dir", str(runs), "--run-id", "trace")
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    doc = decision_of(runs, "trace")
    assert doc["decision"] == "promote", (doc["reason"], proc.stdout[-3000:])
    gates = {g["name"]: g for g in doc["gates"]}
    prefix = gates["prefix_cache_guard"]
    assert prefix["verdict"] == "pass" and prefix["n_baseline"] > 10_000 and prefix["n_canary"] > 10_000, prefix
    for arm in ("baseline", "canary"):
        kv = doc["arms"][arm]["kv"]
        assert kv["prefix_cache_hit_rate"] > 0.05, kv  # shared prefixes and sessions: hits on both arms
        assert doc["experiment"]["goodput"][arm]["share"] > 0.9
    records = [json.loads(line) for line in (runs / "trace" / "experiment" / "records.jsonl").read_text().splitlines()]
    # open loop at the trace's times: every request had its due time, and left at or after it
    assert records and all(r["scheduled_at"] is not None and r["sent_at"] >= r["scheduled_at"] - 1e-3 for r in records)
    print(f"trace replay: prefix-cache hit rate baseline {prefix['baseline']:.3f} canary {prefix['canary']:.3f}, "
          f"send lag p99 {doc['experiment']['generator_send_lag_p99_ms']} ms")
