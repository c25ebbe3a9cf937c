"""`mtp-canary router` (rollout/commands/router.py) as a subprocess in front of stream targets
(benchmarks/stream_target.py) that already run: it routes, ejects a dead replica, caps bodies
without buffering them, stops cleanly on SIGINT and SIGTERM, and refuses bad arguments in one
line with exit code 2."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from benchmarks.stream_target import TargetProcess
from tests.conftest import REPO

PYTHON = sys.executable
LISTENING = re.compile(r"listening on (http://\S+)")


class RouterProcess:
    """`python -m rollout.commands.router ARGS` until stopped; its URL once it listens."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [PYTHON, "-m", "rollout.commands.router", *args], cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], 60)
        line = self.process.stdout.readline() if ready else ""
        found = LISTENING.search(line)
        if not found:
            self.process.kill()
            raise AssertionError(f"router did not start: {line!r} {self.process.stderr.read() if self.process.stderr else ''}")
        self.url = found.group(1)
        self.first_line = line

    def stop(self, signum: int = signal.SIGTERM) -> tuple[int, str]:
        self.process.send_signal(signum)
        out, _ = self.process.communicate(timeout=30)
        return self.process.returncode, out

    def peak_rss_kib(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))  # type: ignore[union-attr]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture(scope="module")
def target() -> Iterator[TargetProcess]:
    with TargetProcess(ttft_ms=1, tpot_ms=1, tokens_per_chunk=1) as live:
        yield live


@pytest.fixture(scope="module")
def canary_target() -> Iterator[TargetProcess]:
    with TargetProcess(ttft_ms=1, tpot_ms=1, tokens_per_chunk=1, replica="canary-0") as live:
        yield live


def _free_port_with_nothing_listening() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stream(url: str, http: requests.Session, **headers: str) -> requests.Response:
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}
    return http.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)


@pytest.mark.parametrize("signum, dead_kind", [(signal.SIGTERM, "nobody_listening"), (signal.SIGINT, "answers_500")])
def test_routes_ejects_a_dead_replica_and_stops_cleanly_on_a_signal(
    target: TargetProcess, canary_target: TargetProcess, signum: int, dead_kind: str
) -> None:
    if dead_kind == "answers_500":
        with TargetProcess(fail_status=500) as failing:
            _routes_ejects_and_stops(target, canary_target, signum, failing.url, {200, 500})
    else:
        _routes_ejects_and_stops(target, canary_target, signum, f"http://127.0.0.1:{_free_port_with_nothing_listening()}",
                                 {200, 502})


def _routes_ejects_and_stops(
    target: TargetProcess, canary_target: TargetProcess, signum: int, dead: str, statuses_seen: set[int]
) -> None:
    router = RouterProcess("--arm", f"baseline={target.url}", "--arm", f"baseline={dead}", "--arm", f"canary={canary_target.url}",
                           "--weight", "baseline=100", "--weight", "canary=0")
    try:
        with requests.Session() as http:
            statuses = [_stream(router.url, http).status_code for _ in range(40)]
            pinned = _stream(router.url, http, **{"x-mtp-canary-arm": "canary"})
            state = http.get(f"{router.url}/router/state", timeout=10).json()
    finally:
        code, out = router.stop(signum) if router.process.poll() is None else (router.process.returncode, "")
        router.kill()
    assert code == 0 and "stopped" in out
    assert statuses.count(200) == 37 and set(statuses) == statuses_seen  # the dead one: its 3 strikes, then ejected
    assert state["replica_counts"][dead]["routed"] == 3 and state["replica_counts"][dead]["ejections"] == 1
    assert pinned.status_code == 200 and pinned.headers["x-mtp-canary-arm"] == "canary"
    assert pinned.headers["x-mtp-canary-replica"] == canary_target.url
    assert "[DONE]" in pinned.text


def test_a_body_over_the_cap_gets_413_and_is_not_buffered(target: TargetProcess) -> None:
    router = RouterProcess("--arm", f"baseline={target.url}", "--max-body-mb", "1")
    try:
        before = router.peak_rss_kib()
        body_mib = 64

        def body() -> Iterator[bytes]:  # chunked: no Content-Length to refuse on, the read is capped
            block = b"x" * (1024 * 1024)
            for _ in range(body_mib):
                yield block

        try:
            status = requests.post(f"{router.url}/v1/completions", data=body(), timeout=60).status_code
        except requests.exceptions.ConnectionError:
            status = None  # closed while the client still sent: refused either way
        declared = requests.post(f"{router.url}/v1/completions", data=b"x" * (2 * 1024 * 1024), timeout=60)
        grown_mib = (router.peak_rss_kib() - before) / 1024
        state = requests.get(f"{router.url}/router/state", timeout=10).json()
    finally:
        router.stop()
        router.kill()
    assert status in (413, None) and declared.status_code == 413
    assert state["refused"]["body_too_large"] == 2 and state["arm_counts"]["baseline"]["routed"] == 0
    assert grown_mib < body_mib / 4, f"the router's peak RSS grew by {grown_mib:.1f} MiB for a {body_mib} MiB body"


def test_a_token_from_the_named_variable_is_required(target: TargetProcess) -> None:
    router = RouterProcess("--arm", f"baseline={target.url}", "--auth-token-env", "MTP_TEST_CMD_TOKEN",
                           env={"MTP_TEST_CMD_TOKEN": "cmd-t0ken"})
    try:
        with requests.Session() as http:
            refused = _stream(router.url, http)
            allowed = _stream(router.url, http, Authorization="Bearer cmd-t0ken")
    finally:
        _, out = router.stop()
        router.kill()
    assert refused.status_code == 401 and allowed.status_code == 200
    assert "MTP_TEST_CMD_TOKEN" in router.first_line
    assert "cmd-t0ken" not in router.first_line + out


@pytest.mark.parametrize(
    "args, complaint",
    [
        ([], "--arm"),
        (["--arm", "baseline"], "NAME=URL"),
        (["--arm", "baseline=127.0.0.1:8000"], "http"),
        (["--arm", "baseline=http://127.0.0.1:8000", "--weight", "canary=5"], "no --arm names arm 'canary'"),
        (["--arm", "baseline=http://127.0.0.1:8000", "--weight", "baseline=lots"], "must be a number"),
        (["--arm", "baseline=http://127.0.0.1:8000", "--weight", "baseline=0"], "positive weight"),
        (["--arm", "baseline=http://127.0.0.1:8000", "--max-body-mb", "0"], "--max-body-mb"),
        (["--arm", "baseline=http://127.0.0.1:8000", "--max-connections", "0"], "max_connections"),
        (["--arm", "baseline=http://127.0.0.1:8000", "--host", "0.0.0.0", "--auth-token-env", "MTP_TEST_NO_TOKEN"],
         "MTP_TEST_NO_TOKEN"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], complaint: str) -> None:
    env = {key: value for key, value in os.environ.items() if key != "MTP_TEST_NO_TOKEN"}
    done = subprocess.run([PYTHON, "-m", "rollout.commands.router", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and complaint in lines[0], done.stderr
    assert "listening" not in done.stdout


def test_the_state_reports_the_limits_as_json(target: TargetProcess) -> None:
    router = RouterProcess("--arm", f"baseline={target.url}", "--max-body-mb", "2")
    try:
        state = requests.get(f"{router.url}/router/state", timeout=10).json()
    finally:
        router.stop()
        router.kill()
    assert state["limits"]["max_body_bytes"] == 2 * 1024 * 1024 and state["auth_required"] is False
    json.dumps(state)  # plain JSON throughout
