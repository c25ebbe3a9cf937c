"""The Rollout tab of Locust's web UI (loadtests.console), in a real headless Chromium.

Real parts: a real Router actor, real Locust (master and worker processes, under the
progressive phase's LoadRunner actor), real SQLite, the real CLI behind the buttons, and
Chromium from the OS packages driven by Playwright. The stand-in replicas are the
benchmark stream target (as in tests/test_progressive.py).
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import sys
import threading
import time
from dataclasses import replace

import pytest
import ray
import requests

from cluster.load_runner import start_load_runner
from cluster.router import Router
from loadtests.console import TAB_KEY, console_rows, console_spec
from loadtests.options import BEARER_TOKEN_ENV, TrafficOptions
from loadtests.swarm import Swarm, SwarmSpec, free_port
from rollout.commands.cli import build_parser
from rollout.commands.run import run_config
from rollout.judge.verdicts import Decision
from rollout.run.phases.progressive_steps import run_progressive
from rollout.run.store import RunStore
from tests.conftest import REPO, wait_gone
from tests.progressive_harness import locust_processes
from tests.test_progressive import Targets, fast_config, fast_harness

sys.path.insert(0, str(REPO))
from benchmarks.stream_target import TargetProcess  # noqa: E402

# a run name comes from a config: whatever it holds is shown as text, never as markup
HOSTILE_NAME = '<img id="injected" src="x" onerror="document.title=\'owned\'">'


def chromium() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("no chromium binary on PATH (.ci/run installs the OS package)")
    return binary


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def router(local_ray):
    actor = Router.remote(initial_weights={"baseline": 100.0, "canary": 0.0}, seed=0)
    url = ray.get(actor.start.remote())
    yield actor, url
    ray.get(actor.stop.remote())
    ray.kill(actor)


@pytest.fixture
def targets(router):
    actor, _ = router
    with Targets() as t:
        ray.get(actor.set_arms.remote(t.urls()))
        ray.get(actor.set_weights.remote({"baseline": 100.0, "canary": 0.0}))
        yield t


def _rename(db, run_id: str, name: str) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE runs SET name = ? WHERE run_id = ?", (name, run_id))


def _row(page, item: str) -> list[str]:
    """The cells of the tab's row whose first cell is `item` ([] while there is none, or while the
    page reloads: a page opened before the swarm ran loads itself again once it runs)."""
    from playwright.sync_api import Error as PlaywrightError

    try:
        for row in page.locator("table tbody tr").all():
            cells = [c.strip() for c in row.locator("td").all_inner_texts()]
            if cells and cells[0] == item:
                return cells
    except PlaywrightError as exc:
        if "context was destroyed" not in str(exc):
            raise
        page.wait_for_load_state()
    return []


def _wait_for(check, timeout_s: float, what: str, seen=None):
    """check()'s first truthy value within timeout_s; on a timeout the error says what `seen()` shows then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    shown = "" if seen is None else f"; the page showed: {seen()!r}"
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{shown}")


def _shown(page) -> dict:
    """What the page shows, for a timeout's message: the tab's rows, the panel's title, the URL."""
    return {"url": page.url, "rows": page.locator("table tbody tr").all_inner_texts()[:12],
            "panel": page.locator("#mtp-console-run").all_inner_texts()}


def _open_when_up(page, url: str, timeout_s: float = 90) -> None:
    def up() -> bool:
        try:
            return requests.get(url, timeout=2).status_code == 200
        except requests.RequestException:
            return False

    _wait_for(up, timeout_s, f"the web UI at {url}")
    page.goto(f"{url}/?tab={TAB_KEY}")


def test_the_rollout_tab_shows_the_run_live_and_its_abort_rolls_the_run_back(tmp_path, router, targets):
    binary = chromium()
    h = fast_harness(tmp_path, router, targets, run_id="web")
    _rename(h.store.path, h.run_id, HOSTILE_NAME)
    h.store.update_run(h.run_id, phase="progressive")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # one long step: the tab is watched across several guard windows (looks), then aborted
    config = fast_config([{"canary_weight": 30, "bake_s": 120}])
    ctx = replace(h.context(config, "stream-target", speculative=False, n_workers=1),
                  start_load=lambda spec: start_load_runner(console_spec(spec, h.run_id, h.runs_dir, port=port)))
    errors: list[str] = []
    dialogs: list[str] = []
    failed: list[BaseException] = []

    def watch() -> None:  # the browser, while the phase runs in this test's thread (its store is this thread's)
        try:
            _watch_and_abort(binary, base, h, errors, dialogs)
        except BaseException as exc:
            failed.append(exc)
            RunStore(h.store.path).add_command(h.run_id, "abort")  # end the phase rather than bake 120 s

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    outcome = run_progressive(ctx)
    watcher.join(60)
    if failed:
        raise failed[0]
    assert "Abort run web?" in dialogs[1]
    assert outcome.decision == Decision.ROLLBACK and "aborted by command" in outcome.reason
    assert h.weight_log[-1][1] == 0.0
    assert [c["command"] for c in RunStore(h.store.path).commands(h.run_id)] == ["abort"]
    assert h.window_results()[-1]["command"] == "abort"
    assert wait_gone(lambda: locust_processes(str(tmp_path))) == []


def _watch_and_abort(binary: str, base: str, h, errors: list[str], dialogs: list[str]) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=binary, args=["--no-sandbox"])
        page = browser.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        _open_when_up(page, base)
        # it renders: the run (its hostile name as text), phase, canary weight, pending commands
        run = _wait_for(lambda: _row(page, "run"), 60, "the tab's run row", seen=lambda: _shown(page))
        assert run[1] == f"web ({HOSTILE_NAME})" and run[3] == "running"
        assert page.locator("#injected").count() == 0 and page.title() != "owned"
        assert _wait_for(lambda: _row(page, "phase"), 30, "the phase row")[1] == "progressive"
        _wait_for(lambda: _row(page, "canary weight")[1:2] == ["30%"], 60, "canary weight 30%",
                  seen=lambda: _shown(page))
        assert _wait_for(lambda: _row(page, "pending commands"), 30, "the commands row")[1] == "none"
        # running, not paused: Abort is offered, Promote is not (it continues a paused step only)
        _wait_for(lambda: page.locator("#mtp-console-abort").is_enabled(), 30, "the Abort button")
        assert page.locator("#mtp-console-promote").is_disabled()
        # it updates between looks: the look number moves on and each guard's row comes with it
        first = int(_wait_for(lambda: _look(page), 60, "a first look", seen=lambda: _shown(page)))
        later = int(_wait_for(lambda: (look := _look(page)) and int(look) > first and look, 60, "a later look",
                              seen=lambda: _shown(page)))
        guards = [c for c in page.locator("table tbody tr td:first-child").all_inner_texts()
                  if re.match(rf"progressive look {later}: guard_", c.strip())]
        assert guards, "the later look's guard rows"
        error_row = _row(page, f"progressive look {later}: guard_error_rate")
        assert error_row[3] in ("pass", "inconclusive") and re.fullmatch(r"[-0-9.e]+", error_row[1]), error_row

        # commands are POST only, from this console only: nothing is queued by these
        assert requests.get(f"{base}/mtp-console/abort", timeout=10).status_code == 405
        forged = requests.post(f"{base}/mtp-console/abort", timeout=10,
                               headers={"Origin": "http://elsewhere.example", "X-MTP-Console": "1"})
        assert forged.status_code == 403
        assert requests.post(f"{base}/mtp-console/abort", timeout=10).status_code == 403
        assert RunStore(h.store.path).commands(h.run_id) == []

        # a dismissed confirmation sends nothing
        page.once("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.click("#mtp-console-abort")
        _wait_for(lambda: dialogs, 10, "the confirmation")
        time.sleep(1.0)
        assert RunStore(h.store.path).commands(h.run_id) == []
        assert errors == [], errors
        # a confirmed Abort acts as `mtp-canary abort web`
        page.once("dialog", lambda d: (dialogs.append(d.message), d.accept()))
        page.click("#mtp-console-abort")
        said = _wait_for(lambda: (text := page.inner_text("#mtp-console-message")).startswith("mtp-canary abort")
                         and text, 60, "the command's answer")
        assert said == "mtp-canary abort: sent to run web (rolls it back at its next guard check)"
        browser.close()


def _look(page) -> str | None:
    cells = _row(page, "look")
    return cells[1] if len(cells) > 1 and cells[1].isdigit() else None




def test_a_router_token_guards_the_commands_and_page_polls_share_one_status_process(tmp_path):
    runs = tmp_path / "runs"
    store = RunStore(runs / "history.db")
    store.create_run("tok", "token run", "target", {})
    store.update_run("tok", phase="experiment")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with TargetProcess(ttft_ms=5, tpot_ms=2) as target:
        traffic = TrafficOptions(dataset="synthetic", input_tokens="8", max_tokens=8, model="target",
                                 records=str(tmp_path / "records.jsonl"), ignore_eos=True)
        spec = SwarmSpec(host=target.url, traffic=traffic, users=1, run_time_s=120, n_workers=0,
                         log_dir=tmp_path / "locust", env={BEARER_TOKEN_ENV: "s3cret-token"})
        swarm = Swarm(console_spec(spec, "tok", runs, port=port))
        runner = threading.Thread(target=swarm.run, daemon=True)
        runner.start()
        try:
            headers = {"X-MTP-Console": "1"}

            def status() -> dict | None:
                try:
                    return requests.get(f"{base}/mtp-console/status", timeout=30).json()
                except requests.RequestException:
                    return None

            first = _wait_for(status, 90, "the console")
            assert first["token_required"] is True and first["running"] is True
            assert "s3cret-token" not in json.dumps(first)
            # another site's page can read no route, Locust's own included (loadtests.console.guard)
            evil = {"Origin": "http://evil.example"}
            assert "Access-Control-Allow-Origin" not in requests.get(f"{base}/mtp-console/status", headers=evil,
                                                                     timeout=30).headers
            preflight = requests.options(f"{base}/mtp-console/abort", timeout=30, headers={
                **evil, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "X-MTP-Console"})
            assert "Access-Control-Allow-Origin" not in preflight.headers
            foreign_stats = requests.get(f"{base}/stats/requests", headers=evil, timeout=30)
            assert "Access-Control-Allow-Origin" not in foreign_stats.headers
            assert "extended_stats" not in foreign_stats.json()
            assert "extended_stats" in requests.get(f"{base}/stats/requests", timeout=30).json()
            # ten polls in a row: one `status` process answers them (a poll never forks one each)
            answers = [status() for _ in range(10)]
            assert all(a["rows"] == answers[0]["rows"] for a in answers)
            assert answers[-1]["status_fetches"] <= first["status_fetches"] + 1
            refused = requests.post(f"{base}/mtp-console/abort", headers=headers, timeout=10)
            assert refused.status_code == 401 and "router token" in refused.json()["message"]
            wrong = requests.post(f"{base}/mtp-console/abort", timeout=10,
                                  headers={**headers, "Authorization": "Bearer wrong"})
            assert wrong.status_code == 401
            assert store.commands("tok") == []
            # a Promote while the run is not paused is refused (it would approve a later pause)
            early = requests.post(f"{base}/mtp-console/promote", timeout=60,
                                  headers={**headers, "Authorization": "Bearer s3cret-token"})
            assert early.status_code == 409 and "not paused" in early.json()["message"], early.text
            assert store.commands("tok") == []
            store.add_event("tok", "progressive", "pause", "paused for approval")
            _wait_for(lambda: (status() or {}).get("paused"), 30, "the console to see the pause")
            sent = requests.post(f"{base}/mtp-console/promote", timeout=60,
                                 headers={**headers, "Authorization": "Bearer s3cret-token"})
            assert sent.status_code == 200 and sent.json()["ok"], sent.text
            assert [c["command"] for c in store.commands("tok")] == ["promote"]
            # a finished run refuses, as the CLI does
            store.update_run("tok", status="done", decision="rollback")
            late = requests.post(f"{base}/mtp-console/abort", timeout=60,
                                 headers={**headers, "Authorization": "Bearer s3cret-token"})
            assert late.status_code == 409 and "already finished" in late.json()["message"]
        finally:
            swarm.stop()
            runner.join(120)
    assert "s3cret-token" not in (tmp_path / "locust" / "master.log").read_text()


def test_the_rows_keep_their_order_and_carry_the_gate_numbers():
    from loadtests.console import ConsoleStatus

    status = ConsoleStatus.model_validate({
        "run_id": "r1", "name": "n", "status": "running", "phase": "experiment", "step": None, "canary_weight": 0.0,
        "paused": True, "pending_commands": ["promote"], "latest_gates": [
            {"phase": "accuracy", "look": 1, "name": "accuracy_noninferiority", "verdict": "pass", "detail": "d"},
            {"phase": "experiment", "look": 3, "name": "tpot_p50_improvement", "verdict": "inconclusive",
             "detail": "ratio", "estimate": 0.81234, "interval": [0.7, 0.95], "canary": 12.0},
        ]})
    rows = console_rows(status, problem=None)
    assert [r["name"] for r in rows] == sorted(r["name"] for r in rows)  # Locust sorts by it
    by_item = {r["item"]: r for r in rows}
    assert by_item["run"]["verdict"] == "running (PAUSED)"
    assert by_item["look"]["value"] == "3"  # the experiment's, not the accuracy phase's
    assert by_item["canary weight"]["value"] == "0%"
    assert by_item["pending commands"]["value"] == "promote"
    gate = by_item["experiment look 3: tpot_p50_improvement"]
    assert (gate["value"], gate["interval"], gate["verdict"]) == ("0.8123", "[0.7, 0.95]", "inconclusive")
    assert console_rows(None, "mtp-canary status failed: x")[0]["detail"] == "mtp-canary status failed: x"


def test_run_web_ui_flags_set_the_experiment_fields(tmp_path):
    args = build_parser().parse_args(["run", "configs/local-cpu.yaml", "--web-ui", "--web-port", "18089"])
    exp = run_config(args).experiment
    assert (exp.web_ui, exp.web_port, exp.web_host) == (True, 18089, "127.0.0.1")
    args = build_parser().parse_args(["run", "configs/local-cpu.yaml", "--web-host", "0.0.0.0"])
    exp = run_config(args).experiment
    assert (exp.web_ui, exp.web_host) == (False, "0.0.0.0")


def test_the_console_answers_at_one_url_from_the_experiment_through_the_progressive_phase(tmp_path, router, targets):
    """The experiment's Locust master serves the tab while its looks go; the progressive phase's load
    (another master: a detached LoadRunner) serves it again at the same URL. Between the two no
    master runs: the gap is printed, not asserted."""
    from cluster.router import RouterClient
    from rollout.config import ExperimentConfig
    from rollout.run.phases.experiment_loop import LOAD_STOP_TIMEOUT_S, ExperimentContext, ExperimentPhase
    from tests.experiment_harness import GATES

    h = fast_harness(tmp_path, router, targets, run_id="flow")
    h.store.update_run(h.run_id, phase="experiment")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    polls: list[tuple[float, float, dict | None]] = []  # (asked at, answered at, the answer)
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            asked = time.time()
            try:
                # the first answer waits for the first `status` process (seconds on a loaded machine)
                doc = requests.get(f"{base}/mtp-console/status", timeout=60).json()
            except (requests.RequestException, ValueError):
                doc = None
            polls.append((asked, time.time(), doc))
            time.sleep(0.5)

    # min_looks: the phase lasts several looks whatever the effect, so the tab is read during it
    # (a look holds 25-32 requests per arm by the 0.25 s tick, so 200 planned give at least 6)
    exp = ExperimentConfig(requests_per_look=25, requests_per_arm=200, min_looks=5, window_s=2, users_per_replica=2,
                           max_tokens=12, max_duration_s=300, workers=1, worker_placement="local")
    out = h.runs_dir / h.run_id / "experiment"
    traffic = TrafficOptions(dataset="synthetic", input_tokens="8", max_tokens=12, model="stream-target",
                             records=str(out / "records.jsonl"), ignore_eos=True, tag="experiment",
                             arm_pin="baseline,canary", seed=1)
    spec = SwarmSpec(host=h.router_url, traffic=traffic, users=4, run_time_s=420, n_workers=1,
                     stop_timeout_s=LOAD_STOP_TIMEOUT_S, log_dir=out / "locust")
    experiment = ExperimentPhase(ExperimentContext(
        run_id=h.run_id, config=exp, gates=GATES, store=h.store, swarm_spec=console_spec(spec, h.run_id, h.runs_dir, port=port),
        placement="local", scrape=lambda: {}, replica_arms={}, router=RouterClient(h.router, h.router_url),
        speculative_canary=False, say=h.say, event=lambda event, reason: None, aborted=lambda: False,
        replicas_alive=lambda: {},
    ))
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        # the small effect's setup of test_experiment's web UI test: undecided at the first look
        with TargetProcess(ttft_ms=20, tpot_ms=20, tpot_jitter=0.3, seed=7) as baseline, \
                TargetProcess(ttft_ms=20, tpot_ms=17, tpot_jitter=0.3, seed=7) as canary:
            ray.get(h.router.set_arms.remote({"baseline": [baseline.url], "canary": [canary.url]}))
            outcome = experiment.run()
        experiment_ended = time.time()
        ray.get(h.router.set_arms.remote(targets.urls()))
        h.store.update_run(h.run_id, phase="progressive")
        ctx = replace(h.context(fast_config([{"canary_weight": 50, "bake_s": 10}]), "stream-target", speculative=False,
                                n_workers=1),
                      start_load=lambda spec: start_load_runner(console_spec(spec, h.run_id, h.runs_dir, port=port)))
        progressive = run_progressive(ctx)
    finally:
        done.set()
        poller.join(10)
    assert progressive.decision == Decision.PROMOTE, progressive.reason
    looks = outcome.summary["looks"]
    assert len(looks) >= 5
    # every poll asked or answered while the looks went got an answer
    during = [doc for asked, answered, doc in polls if answered >= looks[0]["at"] and asked <= looks[-1]["at"]]
    assert during and all(doc is not None for doc in during), polls
    # the experiment's looks, each gate with its estimate and interval, as `status --json` has them
    seen = [doc for _, answered, doc in polls if answered <= experiment_ended and doc is not None]
    tpot = [row for doc in seen for row in doc["rows"] if row["item"].startswith("experiment look ")
            and row["item"].endswith(": tpot_p50_improvement")]
    experiment_rows = [row for doc in seen for row in doc["rows"] if row["item"].startswith("experiment look ")]
    assert tpot and all(re.fullmatch(r"[-0-9.e]+", r["value"]) for r in tpot), tpot
    # (a look whose rank band reaches past the sample has no interval yet: its row says so in the detail)
    assert any(r["interval"].startswith("[") for r in experiment_rows), experiment_rows
    # then the progressive phase's, at the same URL
    later = [doc for asked, _, doc in polls if asked > experiment_ended and doc is not None]
    assert any(row["item"] == "phase" and row["value"] == "progressive" for doc in later for row in doc["rows"])
    assert any(row["item"].startswith("progressive look ") for doc in later for row in doc["rows"])
    down = [(asked, answered) for asked, answered, doc in polls if doc is None and asked > looks[-1]["at"]]
    print(f"console URL unanswered by {len(down)} polls (0.5 s apart) between the experiment's master and the "
          f"progressive load's" + (f", {down[0][0]:.1f} to {down[-1][1]:.1f}" if down else ""))


def test_a_rebound_host_name_cannot_command_a_console_without_a_token():
    """DNS rebinding: evil.example resolving to 127.0.0.1 sends a matching Origin and Host; without a
    router token only a loopback Host is this console."""
    from loadtests.console import refusal

    own = {"X-MTP-Console": "1"}
    assert refusal({**own, "Origin": "http://evil.example:8089"}, "evil.example:8089", None)[0] == 403
    assert refusal({**own, "Origin": "http://127.0.0.1:8089"}, "127.0.0.1:8089", None) is None
    assert refusal(own, "localhost:8089", None) is None
    # with a token, the token is the guard whatever the name
    assert refusal({**own, "Authorization": "Bearer t0k"}, "canary.example:8089", "t0k") is None
