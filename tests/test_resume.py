"""Resume after the controller dies, and leases that end an abandoned run.

- fast: a Lease ends its process after running the clean-up; an unrenewed Router and
  LoadRunner (real Locust against the benchmark stream target) stop themselves, the
  load first collecting every request's record;
- `vllm`: a progressive run on a Ray cluster started outside the controller
  (`ray start --head`), the controller killed with SIGKILL during step 2, then
  `mtp-canary resume`: reattaches to the replicas and router, stops the old load
  gracefully, continues from step 2, promotes; the records in SQLite equal the
  requests the router received in the phase, none twice.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import ray
import yaml

from loadtests.options import TrafficOptions
from loadtests.records import read_records
from loadtests.swarm import SwarmSpec
from tests.conftest import REPO, server_processes, wait_no_server_processes

sys.path.insert(0, str(REPO))
from benchmarks.stream_target import TargetProcess  # noqa: E402


def test_a_lapsed_lease_runs_the_clean_up_and_ends_the_process(tmp_path):
    marker = tmp_path / "cleaned"
    # times on the child's own monotonic clock: its start-up (seconds on a slow machine) counts for nothing
    code = textwrap.dedent(f"""
        import time
        from cluster.lease import Lease
        lease = Lease("test", on_lapse=lambda: open({str(marker)!r}, "w").write(repr(time.monotonic())))
        lease.renew(3.0)
        time.sleep(1.5)
        print(time.monotonic(), flush=True)
        lease.renew(2.0)  # renewed: the first deadline passes harmlessly
        time.sleep(60)
        raise SystemExit(7)  # never reached: the lease ends the process first
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr  # ended by the lease, long before the 60 s sleep was over
    renewed_at, lapsed_at = float(proc.stdout.split()[-1]), float(marker.read_text())
    # the clean-up ran at the second deadline (2 s after the renewal), not at the first (1.5 s after it)
    assert lapsed_at - renewed_at >= 2.0, lapsed_at - renewed_at
    assert "lease of test lapsed" in proc.stderr


def test_a_lease_needs_a_positive_time():
    from cluster.lease import Lease

    with pytest.raises(ValueError, match="positive"):
        Lease("x").renew(0)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="test-resume")
    yield
    ray.shutdown()


def _named(name: str):
    from cluster.ray_cluster import find_actor

    return find_actor(name)


def test_an_unrenewed_router_and_load_stop_themselves_keeping_every_record(local_ray, tmp_path):
    from cluster.router import Router
    from cluster.load_runner import start_load_runner

    with TargetProcess(ttft_ms=10, tpot_ms=4, replica="t") as target:
        router = Router.options(name="router", lifetime="detached").remote(initial_weights={"baseline": 100.0}, seed=0)
        url = ray.get(router.start.remote())
        ray.get(router.set_arms.remote({"baseline": [target.url]}))
        records = tmp_path / "records.jsonl"
        spec = SwarmSpec(host=url, users=2, run_time_s=600, n_workers=1, stop_timeout_s=5,
                         traffic=TrafficOptions(records=str(records), max_tokens=16, model="m"),
                         log_dir=tmp_path / "locust")
        load = start_load_runner(spec, name="load")
        # leases long enough for Locust to start on a slow machine; shortened once the load flows
        ray.get([router.renew_lease.remote(300.0), load.renew_lease.remote(300.0)])
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (records.exists() and records.stat().st_size):
            time.sleep(0.5)
        assert records.stat().st_size > 0, "the load never sent a request"
        # the router outlives the load: requests sent while the load stops still reach the target
        ray.get([router.renew_lease.remote(20.0), load.renew_lease.remote(6.0)])
        locust = [p.pid for p in server_processes() if str(tmp_path) in " ".join(p.cmdline())]
        assert locust, "no Locust process found for this load"
        # Nobody renews any more: both actors end themselves once their lease lapses.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _named("load"):
            time.sleep(0.5)
        assert _named("load") is None
        served = target.stats()["started"]
        assert _named("router") is not None  # its lease has not lapsed yet
        while time.monotonic() < deadline and _named("router"):
            time.sleep(1)
        assert _named("router") is None
    assert [p for p in locust if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE] == []
    # The load stopped gracefully: every request the target saw has its record.
    assert len(read_records(records)) == served > 0


# ======================================================================================
# Real vLLM: kill -9 of the controller mid-rollout, then `mtp-canary resume`
# ======================================================================================
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


@pytest.fixture
def external_ray(tmp_path):
    """A Ray head started outside any controller: it outlives a killed controller, as a real cluster does."""
    port = _free_port()
    # token auth (on by default for `ray start` in Ray 2.60) off: the test drivers carry no token
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    temp = Path("/tmp") / f"ray-resume-{port}"
    subprocess.run([_ray_cli(), "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                    f"--temp-dir={temp}", "--disable-usage-stats"],
                   check=True, capture_output=True, timeout=120, env=env)
    try:
        yield f"{ray.util.get_node_ip_address()}:{port}"
    finally:
        # only this cluster: `ray stop` would stop every Ray cluster on the machine
        from tests.conftest import stop_ray_cluster

        stop_ray_cluster(temp)


def _config(tmp_path: Path, address: str) -> Path:
    config = yaml.safe_load((REPO / "configs/examples/local-progressive.yaml").read_text())
    config["name"] = "resume"
    config["ray"] = {"address": address}
    # The replicas must outlive the killed controller until `resume` adopts them. CI saw 40-80 s
    # between the kill and the resumed controller's first line (a cold `status` and `resume`
    # start) lapse a 60 s lease; at a quarter of this machine's speed that gap is longer still.
    config["lease_s"] = 240
    # nothing judged before the steps: the test is about the rollout (the steps can roll back, not promote)
    config["accuracy"]["enabled"] = False
    config["experiment"]["enabled"] = False
    config["progressive"]["steps"] = [{"canary_weight": 10, "bake_s": 20}, {"canary_weight": 50, "bake_s": 20},
                                      {"canary_weight": 100, "bake_s": 20}]
    # SLOs loose enough for two replicas, Locust and pytest sharing 2 CPU cores
    config["progressive"]["guards"].update(ttft_p95_max_s=15.0, tpot_p95_max_s=2.0)
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _run_row(db: Path, run_id: str) -> dict | None:
    if not db.exists():
        return None
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        try:
            row = conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        except sqlite3.OperationalError:
            # polled between the run creating the file and its schema (seen in CI): no row yet
            return None
    return dict(row) if row else None


def _windows_of_step(db: Path, run_id: str, step: int) -> list[dict]:
    """Committed guard windows of a progressive step (0-based, as the phase stores it)."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT result_json FROM phase_results WHERE run_id = ? AND phase = 'progressive'",
                            (run_id,)).fetchall()
    return [w for w in (json.loads(r[0]) for r in rows) if isinstance(w, dict) and w.get("step") == step]


@pytest.mark.vllm
def test_kill_9_mid_rollout_then_resume_reaches_a_decision_with_every_record_once(tmp_path, external_ray):
    runs = tmp_path / "runs"
    config = _config(tmp_path, external_ray)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen([sys.executable, "-m", "rollout", "run", str(config), "--runs-dir", str(runs),
                              "--run-id", "crash"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    db = runs / "history.db"
    deadline = time.monotonic() + 600
    row = None
    while time.monotonic() < deadline and first.poll() is None:
        row = _run_row(db, "crash")
        if row and row["phase"] == "progressive" and (row["step"] or 0) >= 2:
            break
        time.sleep(0.5)
    assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    assert row and row["step"] == 2, row
    # mid-step, whatever the machine's speed: once a window of step 2 is judged and committed
    # (some of its records stored, later ones only in flight), not after a fixed sleep
    while time.monotonic() < deadline and first.poll() is None and not _windows_of_step(db, "crash", 1):
        time.sleep(0.5)
    assert _windows_of_step(db, "crash", 1), (tmp_path / "first.log").read_text()[-3000:]
    time.sleep(1)
    first.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    first.wait(30)
    log.close()

    # The rollout's actors outlive the controller: the replicas still serve through the router.
    status = subprocess.run([sys.executable, "-m", "rollout", "status", "crash", "--runs-dir", str(runs), "--json"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    doc = json.loads(status.stdout)
    assert doc["status"] == "running" and doc["controller_alive"] is False and doc["step"] == 2
    assert len([p for p in server_processes() if "api_server" in " ".join(p.cmdline())]) == 2

    resume_after_s = time.monotonic() - killed_at
    resumed = subprocess.run([sys.executable, "-m", "rollout", "resume", "crash", "--runs-dir", str(runs)],
                             cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    print(resumed.stdout[-6000:], resumed.stderr[-3000:])
    assert resumed.returncode == 4, resumed.stdout[-3000:] + resumed.stderr[-2000:]
    gap = f"resume started {resume_after_s:.0f} s after the kill (lease 240 s)"
    assert "fleet: reattached 2 running replica(s)" in resumed.stdout, gap
    assert "router: reattached" in resumed.stdout
    assert "resuming after step 1 of 3" in resumed.stdout

    decision = json.loads((runs / "crash" / "decision.json").read_text())
    # every step held its guards, but guards alone never promote
    assert decision["decision"] == "inconclusive" and "every step passed its guards" in decision["reason"]
    assert not (runs / "crash" / "promoted.yaml").exists()
    progressive = decision["progressive"]
    # Every request the router received during the phase has exactly one stored record.
    with sqlite3.connect(db) as conn:
        stored = conn.execute("SELECT COUNT(*), COUNT(DISTINCT request_id) FROM request_samples "
                              "WHERE run_id = 'crash' AND phase = 'progressive'").fetchone()
    # (how many depends on the machine's speed; every step judged windows with records)
    assert stored[0] == stored[1] == progressive["records_stored"] == progressive["requests_received"] > 0
    events = [(e["phase"], e["event"], e["reason"]) for e in decision["timeline"]]
    assert [r for _, e, r in events if e == "step_done"] == ["step 1/3 done", "step 2/3 done", "step 3/3 done"]
    assert any(e == "controller_resume" for _, e, _ in events)
    assert any(e == "recovered" for _, e, _ in events), "the crashed attempt's uncommitted records were not stored"
    weights = [r.split(":")[0] for p, e, r in events if e == "weights" and p == "progressive"]
    assert weights == ["canary 10%", "canary 50%", "canary 50%", "canary 100%"]
    assert wait_no_server_processes(60) == []
