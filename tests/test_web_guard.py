"""Nobody but the operator steers a run's load through the web UI (loadtests.console.guard).

Locust serves `POST /swarm` (host, users, any parsed option), `/stop`, `/stats/reset` and
`/user` with no auth and turns CORS on for every route. The rule is judged in-process on a
plain Flask app (Locust's own construction: `Flask` + `CORS(app)`, no gevent), then against
real Locust masters: one a Swarm starts for a run (cross-origin and same-origin controls both
refused, the load goes on), one started by hand (its own page's Stop works, another site's
does not), the page in headless Chromium.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import requests

from loadtests.console import console_spec, control_refusal, guard
from loadtests.options import TrafficOptions
from loadtests.swarm import Swarm, SwarmSpec, free_port, locust_environment
from tests.conftest import REPO

sys.path.insert(0, str(REPO))
from benchmarks.stream_target import TargetProcess  # noqa: E402

EVIL = {"Origin": "http://evil.example"}


def test_the_rule_refuses_other_sites_and_a_managed_runs_controls():
    own = {"Origin": "http://127.0.0.1:8089"}
    # reads are never judged here (CORS is off: another site cannot read them)
    assert control_refusal("GET", EVIL, "127.0.0.1:8089", managed=True) is None
    # another site's page: refused, managed or not, loopback or not, logged in or not
    for managed in (True, False):
        assert control_refusal("POST", EVIL, "127.0.0.1:8089", managed)[0] == 403
        assert control_refusal("POST", {"Origin": "null"}, "127.0.0.1:8089", managed)[0] == 403
        assert control_refusal("POST", {"Sec-Fetch-Site": "cross-site"}, "127.0.0.1:8089", managed)[0] == 403
        assert control_refusal("POST", EVIL, "127.0.0.1:8089", managed, locust_route=False)[0] == 403
    # a run's load: Locust's controls are off even for the operator's own page
    refused = control_refusal("POST", own, "127.0.0.1:8089", managed=True)
    assert refused[0] == 403 and "mtp-canary abort" in refused[1]
    # ...but the console's commands are the console's (its own `refusal` judges them)
    assert control_refusal("POST", own, "127.0.0.1:8089", managed=True, locust_route=False) is None
    # standalone: this UI's page on a loopback Host; a rebound name needs --web-login
    assert control_refusal("POST", own, "127.0.0.1:8089", managed=False) is None
    rebound = {"Origin": "http://evil.example:8089"}
    assert control_refusal("POST", rebound, "evil.example:8089", managed=False)[0] == 403
    assert control_refusal("POST", rebound, "evil.example:8089", managed=False, web_login=True) is None


def _locust_like_app():
    from flask import Flask, jsonify
    from flask_cors import CORS

    app = Flask(__name__)
    CORS(app)  # as locust.web.WebUI does
    stopped: list[str] = []

    @app.route("/stop", methods=["POST"])
    def stop():  # endpoint "stop", as Locust's "locust.stop"
        stopped.append("stop")
        return jsonify({"success": True})

    @app.route("/stats/requests")
    def request_stats():
        return jsonify({"state": "running"})

    return app, SimpleNamespace(app=app, web_login=False), stopped


def test_on_a_locust_like_app_no_route_answers_another_site_and_managed_controls_are_off():
    app, web_ui, stopped = _locust_like_app()
    assert guard(SimpleNamespace(web_ui=web_ui), managed=True)
    assert guard(SimpleNamespace(web_ui=web_ui), managed=True)  # once per UI
    assert guard(SimpleNamespace(web_ui=None)) is False
    client = app.test_client()
    read = client.get("/stats/requests", headers=EVIL)
    assert read.status_code == 200 and "Access-Control-Allow-Origin" not in read.headers
    preflight = client.options("/stop", headers={**EVIL, "Access-Control-Request-Method": "POST"})
    assert "Access-Control-Allow-Origin" not in preflight.headers
    assert client.post("/stop", headers=EVIL).status_code == 403
    assert client.post("/stop", headers={"Origin": "http://localhost"}).status_code == 403
    assert stopped == []
    app, web_ui, stopped = _locust_like_app()
    guard(SimpleNamespace(web_ui=web_ui), managed=False)
    client = app.test_client()
    assert client.post("/stop", headers=EVIL).status_code == 403
    assert client.post("/stop", headers={"Origin": "http://localhost"}).status_code == 200
    assert stopped == ["stop"]


def _chromium() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("no chromium binary on PATH (.ci/run installs the OS package)")
    return binary


@contextmanager
def _other_site():
    """Another site's page: an empty page served from another origin (another port)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EmptyPage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _EmptyPage(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b"<!doctype html><title>elsewhere</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args) -> None:
        pass


def _wait(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = check()
        except requests.RequestException:
            value = None
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def _records(path) -> int:
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def test_a_live_runs_locust_controls_change_nothing_from_another_site_or_its_own_page(tmp_path):
    """The attack of issue: a page POSTs /swarm (its own host) and /stop with Origin evil.example.
    Both are refused, the load keeps its host and keeps going; the operator's page still shows
    the run, and its own Stop (Locust's button) is refused too: the run, not the page, owns the load."""
    binary = _chromium()
    runs = tmp_path / "runs"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    records = tmp_path / "records.jsonl"
    with TargetProcess(ttft_ms=5, tpot_ms=2) as target:
        traffic = TrafficOptions(dataset="synthetic", input_tokens="8", max_tokens=8, model="target",
                                 records=str(records), ignore_eos=True)
        spec = SwarmSpec(host=target.url, traffic=traffic, users=1, run_time_s=300, n_workers=0,
                         log_dir=tmp_path / "locust")
        swarm = Swarm(console_spec(spec, "guarded", runs, port=port))
        runner = threading.Thread(target=swarm.run, daemon=True)
        runner.start()
        try:
            _wait(lambda: requests.get(f"{base}/stats/requests", timeout=10).json()["state"] == "running", 120,
                  "the load to run")
            swarm_form = {"user_count": "50", "spawn_rate": "50", "host": "http://127.0.0.1:9"}
            forged = requests.post(f"{base}/swarm", data=swarm_form, headers=EVIL, timeout=10)
            assert forged.status_code == 403, forged.text
            assert "Access-Control-Allow-Origin" not in forged.headers
            assert requests.post(f"{base}/stop", headers=EVIL, timeout=10).status_code == 403
            assert requests.post(f"{base}/stats/reset", headers=EVIL, timeout=10).status_code == 403
            assert requests.post(f"{base}/user", headers=EVIL, json={}, timeout=10).status_code == 403
            # the run's own page (same origin, loopback) cannot steer the measured load either
            assert requests.post(f"{base}/stop", headers={"Origin": base}, timeout=10).status_code == 403
            read = requests.get(f"{base}/stats/requests", headers=EVIL, timeout=10)
            assert "Access-Control-Allow-Origin" not in read.headers
            # nothing changed: still running, the host is the run's, requests still arrive
            stats = read.json()
            assert stats["state"] == "running" and stats["user_count"] == 1, stats
            before = _records(records)
            _wait(lambda: _records(records) > before, 60, "more records after the refused requests")

            from playwright.sync_api import sync_playwright

            errors: list[str] = []
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=binary, args=["--no-sandbox"])
                page = browser.new_page()
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(f"{base}/")
                host_shown = page.evaluate("() => window.templateArgs.host")
                assert host_shown == target.url
                # the operator's page itself: its reads work, its Stop is refused
                state = page.evaluate("async () => (await (await fetch('./stats/requests')).json()).state")
                assert state == "running"
                status = page.evaluate("async () => (await fetch('./stop', {method: 'POST'})).status")
                assert status == 403
                # another site's page, as a browser sends it (a form post needs no preflight)
                other = browser.new_page()
                with _other_site() as elsewhere:
                    other.goto(elsewhere)
                    sent = other.evaluate(
                        "async (url) => { const body = new URLSearchParams({user_count: '9', spawn_rate: '9',"
                        " host: 'http://127.0.0.1:9'}); try { await fetch(url + '/swarm', {method: 'POST', body,"
                        " mode: 'no-cors'}); await fetch(url + '/stop', {method: 'POST', mode: 'no-cors'});"
                        " return 'sent'; } catch (e) { return String(e); } }", base)
                    assert sent == "sent"
                browser.close()
            assert errors == [], errors
            stats = requests.get(f"{base}/stats/requests", timeout=10).json()
            assert stats["state"] == "running" and stats["user_count"] == 1, stats
        finally:
            swarm.stop()
            runner.join(120)


def test_a_hand_started_locusts_own_page_stops_it_and_another_site_cannot(tmp_path):
    binary = _chromium()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in locust_environment().items() if k != "MTP_CANARY_PARENT_PID"}
    with TargetProcess(ttft_ms=5, tpot_ms=2) as target:
        command = [sys.executable, "-m", "locust", "-f", str(REPO / "loadtests" / "locustfile.py"),
                   "--host", target.url, "--users", "1", "--spawn-rate", "1", "--autostart",
                   "--web-host", "127.0.0.1", "--web-port", str(port), "--mtp-dataset", "synthetic",
                   "--mtp-input-tokens", "8", "--mtp-max-tokens", "8", "--mtp-model", "target",
                   "--mtp-records", str(tmp_path / "records.jsonl")]
        log = open(tmp_path / "locust.log", "w")
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            _wait(lambda: requests.get(f"{base}/stats/requests", timeout=10).json()["state"] == "running", 120,
                  "the load to run")
            assert requests.post(f"{base}/stop", headers=EVIL, timeout=10).status_code == 403
            assert requests.get(f"{base}/stats/requests", timeout=10).json()["state"] == "running"
            from playwright.sync_api import sync_playwright

            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=binary, args=["--no-sandbox"])
                page = browser.new_page()
                page.goto(f"{base}/")
                status = page.evaluate("async () => (await fetch('./stop', {method: 'POST'})).status")
                assert status == 200
                browser.close()
            _wait(lambda: requests.get(f"{base}/stats/requests", timeout=10).json()["state"] == "stopped", 60,
                  "the load to stop")
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            log.close()
