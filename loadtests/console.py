"""The rollout console: an extra tab in Locust's web UI that shows a run live and answers it.

Owns the "Rollout" tab of the master's web UI (Locust's own extension points: the
`extendedTabs` / `extendedTables` template arguments, and `extendedStats` rows added to
the `/stats/requests` answer the UI polls every 2 s), the Promote / Abort panel shown on
that tab, the `/mtp-console/*` routes behind them, and the guard of every route of the master's
web UI, Locust's own included (`guard`: no route readable by another site's page, no request from
one that changes the load, and none of Locust's controls while mtp-canary drives the load).

`loadtests` never imports `rollout` (and Locust never runs next to Ray), so the master
learns the run from its environment (`console_spec` puts it there) and asks the CLI in a
subprocess: one `python -m rollout status RUN_ID --watch --json` for the live document,
running only while a page shows the Rollout tab (it reads the store every CACHE_S in that one
process; page polls never fork one), and
`python -m rollout promote|abort RUN_ID` for the buttons, which therefore act exactly as
those commands do (a command queued in the run's SQLite store).

Importing this module imports neither Locust, Flask nor gevent: the controller builds
`console_spec` in a Ray driver; `install` imports Flask inside the Locust master only.
"""

from __future__ import annotations

import hmac
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError

from loadtests.options import BEARER_TOKEN_ENV

PARENT_PID_ENV = "MTP_CANARY_PARENT_PID"  # set by the Swarm that starts a Locust (loadtests.swarm)

if TYPE_CHECKING:
    from loadtests.swarm import SwarmSpec

RUN_ID_ENV = "MTP_CANARY_CONSOLE_RUN_ID"
RUNS_DIR_ENV = "MTP_CANARY_CONSOLE_RUNS_DIR"
TAB_KEY = "mtp-console"
TAB_TITLE = "Rollout"
ROUTE = "/mtp-console"
CACHE_S = 2.0  # the UI polls every 2 s: the watching `status` process reads the store as often
IDLE_S = 10.0  # no Rollout tab polled this long: the watching process is stopped
STATUS_TIMEOUT_S = 30.0
COMMANDS = ("promote", "abort")
# the columns of the tab's table (Locust renders each cell as text: React escapes it). Locust
# sorts the rows by their "name" at first, so "name" holds the row's order and is not shown.
COLUMNS = [
    {"key": "item", "title": "Run / gate"},
    {"key": "value", "title": "Value / estimate"},
    {"key": "interval", "title": "Interval"},
    {"key": "verdict", "title": "Verdict"},
    {"key": "detail", "title": "Detail"},
]


def console_spec(spec: SwarmSpec, run_id: str, runs_dir: Path, host: str = "127.0.0.1", port: int = 8089) -> SwarmSpec:
    """`spec` with the web UI on at host:port and the console told which run it shows."""
    env = {**spec.env, RUN_ID_ENV: run_id, RUNS_DIR_ENV: str(Path(runs_dir).resolve())}
    return spec.model_copy(update={"web_ui": True, "web_host": host, "web_port": port, "env": env})


class ConsoleGate(BaseModel):
    """One gate of `status --json`'s latest_gates (estimate and interval where the document has them)."""

    model_config = ConfigDict(extra="ignore")

    phase: str
    look: int | None = None
    name: str
    verdict: str
    detail: str = ""
    canary: float | None = None
    threshold: float | None = None
    estimate: float | None = None
    interval: tuple[float, float] | None = None


class ConsoleStatus(BaseModel):
    """What the console reads of `mtp-canary status RUN_ID --json`."""

    model_config = ConfigDict(extra="ignore")

    run_id: str
    name: str | None = None
    status: str
    phase: str | None = None
    step: int | None = None
    canary_weight: float | None = None
    paused: bool = False
    pending_commands: list[str] = []
    decision: str | None = None
    reason: str | None = None
    latest_gates: list[ConsoleGate] = []
    controller_alive: bool | None = None

    @property
    def look(self) -> int | None:
        """The latest look of the phase the run is in (of any phase before its first look)."""
        current = [g.look for g in self.latest_gates if g.look is not None and g.phase == self.phase]
        every = [g.look for g in self.latest_gates if g.look is not None]
        return max(current or every) if (current or every) else None

    @property
    def state(self) -> str:
        shown = self.decision or self.status
        return f"{shown} (PAUSED)" if self.paused else shown


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def console_rows(status: ConsoleStatus | None, problem: str | None = None) -> list[dict[str, str]]:
    """The tab's rows: the run, its phase, look, canary weight and commands, then each gate's latest."""
    rows: list[dict[str, str]] = []
    if problem:
        rows.append({"item": "console", "value": "status unavailable", "interval": "", "verdict": "", "detail": problem})
    if status is not None:
        rows += _run_rows(status)
    return [{"name": f"{index:04d}", **row} for index, row in enumerate(rows)]


def _run_rows(status: ConsoleStatus) -> list[dict[str, str]]:
    title = status.run_id + (f" ({status.name})" if status.name else "")
    rows = [
        {"item": "run", "value": title, "interval": "", "verdict": status.state, "detail": status.reason or ""},
        {"item": "phase", "value": status.phase or "-", "interval": "", "verdict": "",
         "detail": "" if status.step is None else f"step {status.step}"},
        {"item": "look", "value": "-" if status.look is None else str(status.look), "interval": "", "verdict": "",
         "detail": "the latest look of the phase's gates"},
        {"item": "canary weight", "value": "-" if status.canary_weight is None else f"{status.canary_weight:g}%",
         "interval": "", "verdict": "", "detail": ""},
        {"item": "pending commands", "value": ", ".join(status.pending_commands) or "none", "interval": "",
         "verdict": "", "detail": "" if status.controller_alive is not False else "the controller is gone"},
    ]
    for gate in status.latest_gates:
        # a gate without a comparison (a progressive guard) has the canary's own value
        value = _number(gate.estimate) if gate.estimate is not None else (
            "-" if gate.canary is None else f"canary {_number(gate.canary)}")
        interval = "" if gate.interval is None else f"[{_number(gate.interval[0])}, {_number(gate.interval[1])}]"
        rows.append({
            "item": f"{gate.phase} look {gate.look}: {gate.name}" if gate.look is not None else f"{gate.phase}: {gate.name}",
            "value": value, "interval": interval, "verdict": gate.verdict, "detail": gate.detail,
        })
    return rows


@dataclass(frozen=True)
class ConsoleSettings:
    """Which run the console shows, where its store is, and the token a command needs (if any)."""

    run_id: str
    runs_dir: str
    python: str = sys.executable
    token: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ConsoleSettings | None:
        env = dict(os.environ) if env is None else env
        if not env.get(RUN_ID_ENV) or not env.get(RUNS_DIR_ENV):
            return None
        return cls(run_id=env[RUN_ID_ENV], runs_dir=env[RUNS_DIR_ENV], token=env.get(BEARER_TOKEN_ENV) or None)

    def cli(self, *args: str) -> list[str]:
        return [self.python, "-m", "rollout", *args, "--runs-dir", self.runs_dir]


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


class StatusSource:
    """The run's status document, kept fresh by one `status --watch --json` process while a page
    shows the Rollout tab (its panel polls `/mtp-console/status`), and by nothing otherwise.

    That process reads the store every CACHE_S and prints the document when it changes, so a
    shown tab costs one sleeping process, not a process started every poll; Locust's own 2 s
    polls of `/stats/requests` (every open page, whatever tab) only read the cached document.
    Without a tab polling for IDLE_S the process is stopped."""

    def __init__(self, settings: ConsoleSettings, idle_s: float = IDLE_S,
                 popen: Callable[..., subprocess.Popen] = subprocess.Popen) -> None:
        self.settings = settings
        self.idle_s = idle_s
        self._popen = popen
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._started_at = float("-inf")
        self._asked_at = float("-inf")
        self._first = threading.Event()  # set once a document (or the reason there is none) is known
        self.status: ConsoleStatus | None = None
        self.problem: str | None = None
        self.fetches = 0  # `status` processes started so far

    def cached(self) -> tuple[ConsoleStatus | None, str | None]:
        """What is known now; starts nothing (for Locust's own polls of every page)."""
        return self.status, self.problem

    def current(self) -> tuple[ConsoleStatus | None, str | None]:
        """The tab is shown: keep the watching process running; the first call waits for a document."""
        with self._lock:
            now = time.monotonic()
            self._asked_at = now
            gone = self._proc is None or self._proc.poll() is not None
            if gone and now - self._started_at > CACHE_S:  # an ended run's watch is not restarted every poll
                self._start()
        if not self._first.is_set():
            self._first.wait(STATUS_TIMEOUT_S)
        return self.status, self.problem

    def invalidate(self) -> None:
        """After a command: the watching process shows its effect at its next read (CACHE_S)."""

    def stop(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()

    def _start(self) -> None:
        self.fetches += 1
        self._started_at = time.monotonic()
        command = self.settings.cli("status", self.settings.run_id, "--watch", "--json", "--interval-s", f"{CACHE_S:g}")
        try:
            proc = self._popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        except OSError as exc:
            self.problem = f"mtp-canary status could not run: {exc}"
            self._first.set()
            return
        self._proc = proc
        threading.Thread(target=self._read, args=(proc,), name="console-status", daemon=True).start()
        threading.Thread(target=self._stop_when_idle, args=(proc,), name="console-idle", daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        lines: list[str] = []
        read_any = False
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("--- "):  # --watch: a time line before each document
                lines = []
                continue
            lines.append(line)
            if line.rstrip() == "}":  # the document's last line (indented JSON): take it now, not at the next change
                read_any |= self._take(lines)
                lines = []
        read_any |= self._take(lines)
        code = proc.wait()
        stderr = proc.stderr.read() if proc.stderr is not None else ""
        if not read_any and code != 0:
            # (with a document, the exit code is the run's own: `status --watch` exits as `run` did)
            self.problem = f"mtp-canary status failed: {_first_line(stderr) or f'exit code {code}'}"
        self._first.set()

    def _take(self, lines: list[str]) -> bool:
        text = "".join(lines).strip()
        if not text:
            return False
        try:
            self.status, self.problem = ConsoleStatus.model_validate(json.loads(text)), None
        except (ValueError, ValidationError) as exc:
            # keep the last good document on screen; say why it is not fresh
            self.problem = f"mtp-canary status failed: {_first_line(str(exc)) or type(exc).__name__}"
        self._first.set()
        return True

    def _stop_when_idle(self, proc: subprocess.Popen) -> None:
        while proc.poll() is None:
            time.sleep(1.0)
            if time.monotonic() - self._asked_at > self.idle_s:
                with self._lock:
                    if self._proc is proc:
                        self._proc = None
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                return


def _die_with_parent() -> None:
    """In the `status` child: end with the Locust master (Linux), never outlive it."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def send_command(settings: ConsoleSettings, command: str,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> tuple[bool, str]:
    """`mtp-canary promote|abort RUN_ID`: (accepted, what the command said)."""
    if command not in COMMANDS:
        raise ValueError(f"unknown console command {command!r}")
    try:
        done = run(settings.cli(command, settings.run_id), capture_output=True, text=True, timeout=STATUS_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"mtp-canary {command} could not run: {exc}"
    said = _first_line(done.stdout if done.returncode == 0 else done.stderr)
    return done.returncode == 0, said or f"mtp-canary {command} exited with code {done.returncode}"


LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def cross_origin(headers: Any, host: str) -> bool:
    """A browser's request from another site's page (its Origin is not this UI)."""
    origin = headers.get("Origin")
    return bool(origin) and urlsplit(origin).netloc != host


def refusal(headers: Any, host: str, token: str | None) -> tuple[int, str] | None:
    """Why a command request must be refused (status, message), or None.

    Another site's page can make the browser POST here (Locust's app allows every origin),
    so a request whose Origin is not this UI, or without the console's own header, is
    refused; with a router token, the command needs it as a bearer token."""
    origin = headers.get("Origin")
    # DNS rebinding: a page at evil.example resolving to 127.0.0.1 sends a matching Origin and
    # Host, so without a token only a loopback Host is this console
    if not token and (urlsplit(f"//{host}").hostname or "") not in LOOPBACK_HOSTS:
        return 403, f"without a router token, commands are accepted through a loopback address only (Host {host})"
    if cross_origin(headers, host):
        return 403, f"commands are accepted from this console only (Origin {origin})"
    if headers.get("X-MTP-Console") != "1":
        return 403, "commands need the console's X-MTP-Console header"
    if token:
        given = headers.get("Authorization", "")
        if not (given.startswith("Bearer ") and hmac.compare_digest(given[len("Bearer "):].encode(), token.encode())):
            return 401, "this run's router token is required (Authorization: Bearer TOKEN)"
    return None


# methods a browser sends without asking (a form's POST) or only after a preflight; either
# way they change the load, so they are judged here, never left to CORS
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def control_refusal(method: str, headers: Any, host: str, managed: bool, web_login: bool = False,
                    locust_route: bool = True) -> tuple[int, str] | None:
    """Why a request to the web UI must be refused (status, message), or None.

    Locust serves `POST /swarm` (host, users, any parsed option), `/stop`, `/stats/reset` and
    `/user` with no auth, so every state-changing request from another site's page is refused;
    while mtp-canary drives the load (`managed`), Locust's own controls are refused outright (the
    run's offered load is part of the measurement: Abort is the operator's way out); standalone,
    they are this UI's own page's on a loopback Host (a DNS-rebinding page cannot), or behind
    Locust's --web-login."""
    if method.upper() in SAFE_METHODS:
        return None
    origin = headers.get("Origin")
    if cross_origin(headers, host) or headers.get("Sec-Fetch-Site") in ("cross-site", "same-site"):
        return 403, f"requests that change the load are accepted from this UI only (Origin {origin})"
    if not locust_route:
        return None  # the console's commands: `refusal` judges them
    if managed:
        return 403, ("mtp-canary drives this load: Locust's controls are off for the run "
                     "(stop it with the Rollout tab's Abort or `mtp-canary abort RUN_ID`)")
    if not web_login and (urlsplit(f"//{host}").hostname or "") not in LOOPBACK_HOSTS:
        return 403, f"without --web-login, the load is controlled through a loopback address only (Host {host})"
    return None


def managed_by_run(env: dict[str, str] | None = None) -> bool:
    """This Locust runs for mtp-canary (a run named, or a Swarm that started it), not for a person."""
    env = dict(os.environ) if env is None else env
    return bool(env.get(RUN_ID_ENV) or env.get(PARENT_PID_ENV))


def guard(environment: Any, managed: bool | None = None) -> bool:
    """Guard the master's web UI (every route, Locust's included); False when there is no UI.

    No route is readable by another site's page (Locust's app turns CORS on for every route),
    and `control_refusal` judges every request that could change the load."""
    web_ui = getattr(environment, "web_ui", None)
    if web_ui is None:
        return False
    from flask import Response, jsonify, request
    from flask_cors.core import FLASK_CORS_EVALUATED

    if getattr(web_ui, "_mtp_guarded", False):
        return True
    web_ui._mtp_guarded = True
    managed = managed_by_run() if managed is None else managed
    app = web_ui.app

    @app.before_request
    def _refuse() -> tuple[Response, int] | None:
        endpoint = request.endpoint or ""
        refused = control_refusal(request.method, request.headers, request.host, managed,
                                  web_login=bool(getattr(web_ui, "web_login", False)),
                                  locust_route=not endpoint.startswith("_console"))
        if refused is None:
            return None
        return jsonify({"success": False, "ok": False, "message": refused[1]}), refused[0]

    @app.after_request
    def _same_origin_only(response: Response) -> Response:
        # flask-cors's hook runs after this one (registered first) and skips a response marked evaluated
        setattr(response, FLASK_CORS_EVALUATED, True)
        return response

    return True


def install(environment: Any, settings: ConsoleSettings | None = None) -> bool:
    """Add the Rollout tab and its routes to the master's web UI; False when there is no UI or no run."""
    settings = settings or ConsoleSettings.from_env()
    web_ui = getattr(environment, "web_ui", None)
    if settings is None or web_ui is None:
        return False
    from flask import Response, jsonify, request

    guard(environment)  # once per UI: the locustfile guards every master's UI, with or without a run
    source = StatusSource(settings)
    environment.events.quitting.add_listener(lambda **_kwargs: source.stop())
    web_ui.template_args["extendedTabs"] = [{"title": TAB_TITLE, "key": TAB_KEY}]
    web_ui.template_args["extendedTables"] = [{"key": TAB_KEY, "structure": COLUMNS}]
    app = web_ui.app
    guarded = web_ui.auth_required_if_enabled  # Locust's --web-login, when it is on

    @app.after_request
    def _extend(response: Response) -> Response:
        if request.endpoint == "locust.request_stats" and response.status_code == 200 and response.is_json \
                and not cross_origin(request.headers, request.host):  # Locust's own stats stay open as Locust makes them; the Rollout rows do not
            body = response.get_json()
            status, problem = source.cached()  # every page polls this: it starts nothing
            body["extended_stats"] = [{"key": TAB_KEY, "data": console_rows(status, problem)}]
            response.set_data(json.dumps(body))
        elif request.endpoint == "locust.index" and response.status_code == 200 and response.mimetype == "text/html":
            page = response.get_data(as_text=True)
            script = f'<script src=".{ROUTE}/console.js" defer></script>'
            response.set_data(page.replace("</body>", script + "</body>", 1))
        return response

    @app.route(f"{ROUTE}/console.js")
    @guarded
    def _console_js() -> Response:
        return Response(CONSOLE_JS.replace("__TAB__", TAB_KEY), mimetype="application/javascript")

    @app.route(f"{ROUTE}/status")
    @guarded
    def _console_status() -> Response:
        status, problem = source.current()
        return jsonify({
            "run_id": settings.run_id,
            "state": status.state if status else None,
            "running": bool(status and status.status == "running"),
            "paused": bool(status and status.paused),
            "problem": problem,
            "token_required": bool(settings.token),
            "status_fetches": source.fetches,  # `status` processes started so far (one watches while shown)
            "rows": console_rows(status, problem),
        })

    @app.route(f"{ROUTE}/<command>", methods=["POST"])
    @guarded
    def _console_command(command: str) -> tuple[Response, int]:
        if command not in COMMANDS:
            return jsonify({"ok": False, "message": f"no command {command!r}"}), 404
        refused = refusal(request.headers, request.host, settings.token)
        if refused is not None:
            return jsonify({"ok": False, "message": refused[1]}), refused[0]
        if command == "promote":
            # a Promote continues a step paused now; sent while running it would approve a later pause
            status, _ = source.current()
            if status is None or not status.paused or status.status != "running":
                return jsonify({"ok": False, "message": "the run is not paused: Promote continues a paused step "
                                                        "only"}), 409
        ok, message = send_command(settings, command)
        source.invalidate()
        return jsonify({"ok": ok, "message": message}), 200 if ok else 409

    return True


# The Promote / Abort panel of the Rollout tab. Locust's extension points render a tab as a
# table of text cells, which cannot hold a button, so the panel is its own element outside
# Locust's React root, shown while the tab is selected; every value goes in as textContent.
CONSOLE_JS = r"""
(function () {
  "use strict";
  var TAB = "__TAB__";
  var panel = document.createElement("div");
  panel.id = "mtp-console-actions";
  panel.setAttribute("role", "region");
  panel.setAttribute("aria-label", "Rollout commands");
  panel.style.cssText = "position:fixed;right:16px;bottom:16px;z-index:2000;display:none;max-width:32em;" +
    "padding:10px 14px;border:1px solid #888;border-radius:6px;background:#fff;color:#111;font:14px sans-serif;" +
    "box-shadow:0 2px 8px rgba(0,0,0,.3)";
  var title = document.createElement("div");
  title.id = "mtp-console-run";
  title.style.marginBottom = "6px";
  var token = document.createElement("input");
  token.type = "password";
  token.id = "mtp-console-token";
  token.placeholder = "router token";
  token.style.cssText = "display:none;margin-bottom:6px;width:100%";
  var buttons = document.createElement("div");
  function button(command, label, color) {
    var b = document.createElement("button");
    b.type = "button";
    b.id = "mtp-console-" + command;
    b.textContent = label;
    b.disabled = true;
    b.style.cssText = "margin-right:8px;padding:4px 12px;color:#fff;border:0;border-radius:4px;background:" + color;
    b.addEventListener("click", function () { act(command); });
    buttons.appendChild(b);
    return b;
  }
  var promote = button("promote", "Promote", "#2e7d32");
  var abort = button("abort", "Abort", "#c62828");
  var message = document.createElement("div");
  message.id = "mtp-console-message";
  message.setAttribute("role", "status");
  message.style.marginTop = "6px";
  panel.appendChild(title); panel.appendChild(token); panel.appendChild(buttons); panel.appendChild(message);
  var runId = null;

  function onTab() {
    return new URLSearchParams(window.location.search).get("tab") === TAB;
  }
  function refresh() {
    fetch("./mtp-console/status", {credentials: "same-origin"}).then(function (r) { return r.json(); })
      .then(function (doc) {
        runId = doc.run_id;
        title.textContent = "run " + doc.run_id + ": " + (doc.state || "unknown") + (doc.problem ? " (" + doc.problem + ")" : "");
        token.style.display = doc.token_required ? "block" : "none";
        abort.disabled = !doc.running;
        promote.disabled = !(doc.running && doc.paused);  // Promote continues a paused step only
      })
      .catch(function (e) { title.textContent = "console unavailable: " + e; });
  }
  function act(command) {
    if (!runId) { return; }
    var text = command === "abort"
      ? "Abort run " + runId + "? Its canary goes to weight 0 and the run ends as rollback (as `mtp-canary abort " + runId + "`)."
      : "Promote run " + runId + "? A paused step continues (as `mtp-canary promote " + runId + "`).";
    if (!window.confirm(text)) { return; }
    var headers = {"Content-Type": "application/json", "X-MTP-Console": "1"};
    if (token.value) { headers["Authorization"] = "Bearer " + token.value; }
    message.textContent = "sending " + command + "...";
    fetch("./mtp-console/" + command, {method: "POST", headers: headers, body: "{}", credentials: "same-origin"})
      .then(function (r) { return r.json(); })
      .then(function (doc) { message.textContent = (doc.ok ? "" : "refused: ") + doc.message; refresh(); })
      .catch(function (e) { message.textContent = "failed: " + e; });
  }
  // A page loaded before the swarm started (templateArgs.state "ready") shows Locust's start
  // form and polls nothing, so it never leaves that form by itself (seen: a tab opened in the
  // second between the web UI coming up and the users spawning stayed empty). Once the run's
  // load is running, the page is loaded again and its tabs, this one included, follow the run.
  var loadedReady = !!(window.templateArgs && window.templateArgs.state === "ready");
  function reloadOnceRunning() {
    fetch("./stats/requests", {credentials: "same-origin"}).then(function (r) { return r.json(); })
      .then(function (doc) { if (doc.state === "spawning" || doc.state === "running") { window.location.reload(); } })
      .catch(function () {});
  }
  var last = 0;
  function tick() {
    var show = onTab();
    panel.style.display = show ? "block" : "none";
    if (Date.now() - last > 2000) {
      last = Date.now();
      if (loadedReady) { reloadOnceRunning(); }
      if (show) { refresh(); }
    }
  }
  function start() { document.body.appendChild(panel); tick(); window.setInterval(tick, 500); }
  if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", start); } else { start(); }
})();
"""
