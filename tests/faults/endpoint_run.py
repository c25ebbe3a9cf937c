"""A whole `mtp-canary run` without vLLM: both arms are stream targets (benchmarks/stream_target.py)
reached as `endpoints:`, so the real controller, Ray, router, Locust, SQLite and weight hook run
end to end in seconds. For faults of the controller itself (signals, a dead router, a full disk,
two resumes), where what a vLLM server does is not what is under test.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO

# a weight hook that appends each weight to a file; a gateway slow to answer the way back to 0
# (MTP_CANARY_TEST_HOOK_SLEEP_AT_0 seconds, after the weight is written)
HOOK = """\
import os, sys, time
with open(sys.argv[2], "a") as f:
    f.write(sys.argv[1] + "\\n")
if sys.argv[1] == "0":
    time.sleep(float(os.environ.get("MTP_CANARY_TEST_HOOK_SLEEP_AT_0", "0")))
"""
# the last line of every run's log (rollout.commands.cli): what `mtp-canary submit` and a pipeline read
FINAL_LINE = "mtp-canary: exit_code="


def run_config(tmp_path: Path, baseline_url: str, canary_url: str, *, hook: bool = True, progressive: bool = False,
               requests_per_arm: int = 400, engine_startup_s: float = 30, **extra: Any) -> Path:
    """A run config over two servers that already run; a weight hook appending each weight to hook.log."""
    data: dict[str, Any] = {
        "name": "fault",
        "accuracy": {"enabled": False},
        "baseline": {"endpoints": [baseline_url], "engine": {"model": "stream-target", "startup_timeout_s": engine_startup_s}},
        "canary": {"endpoints": [canary_url], "engine": {"model": "stream-target", "startup_timeout_s": engine_startup_s}},
        "experiment": {"requests_per_look": 40, "requests_per_arm": requests_per_arm, "window_s": 1, "min_looks": 1,
                       "max_duration_s": 600, "users_per_replica": 2, "max_tokens": 8, "input_tokens": "8",
                       "workers": 1, "worker_placement": "local"},
        "gates": {"min_requests_per_arm": 20, "tpot_p50_min_improvement": 0.0},
        "lease_s": 30,
    }
    if hook:
        script = tmp_path / "hook.py"
        script.write_text(HOOK)
        data["weight_hook"] = {"command": [sys.executable, str(script), "{weight}", str(tmp_path / "hook.log")],
                               "timeout_s": 30}
    if progressive:
        data["progressive"] = {"enabled": True, "users": 2, "steps": [{"canary_weight": 10, "bake_s": 600}]}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def hook_weights(tmp_path: Path) -> list[str]:
    log = tmp_path / "hook.log"
    return log.read_text().split() if log.exists() else []


class CliRun:
    """`mtp-canary run CONFIG` in a session of its own, its output in a file."""

    def __init__(self, tmp_path: Path, config: Path | None, run_id: str = "f1", args: tuple[str, ...] = (),
                 runs_dir: Path | None = None, env: dict[str, str] | None = None, command: str = "run",
                 log_name: str | None = None) -> None:
        self.runs = runs_dir or tmp_path / "runs"
        self.run_id = run_id
        self.log = tmp_path / f"{log_name or f'{run_id}-{command}'}.log"
        argv = ([sys.executable, "-m", "rollout", "run", str(config), "--runs-dir", str(self.runs), "--run-id", run_id,
                 "--ray-address", "local", *args] if command == "run" else
                [sys.executable, "-m", "rollout", command, run_id, "--runs-dir", str(self.runs), *args])
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, marker: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while marker not in self.text():
            assert self.proc.poll() is None, f"ended (exit {self.proc.returncode}) before {marker!r}:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, f"no {marker!r} within {timeout_s:g} s:\n{self.text()[-4000:]}"
            time.sleep(0.3)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        os.kill(self.proc.pid, sig)  # the run's process alone, as `ray job stop` and a pod deletion send it

    def wait(self, timeout_s: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"still running after {timeout_s:g} s:\n{self.text()[-4000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def final_line(self) -> str:
        lines = [line for line in self.text().splitlines() if line.startswith(FINAL_LINE)]
        assert lines, f"no final {FINAL_LINE!r} line:\n{self.text()[-4000:]}"
        assert self.text().rstrip().splitlines()[-1] == lines[-1], "the final line is not the log's last"
        return lines[-1]

    def decision(self) -> dict:
        return json.loads((self.runs / self.run_id / "decision.json").read_text())

    def row(self) -> dict:
        db = sqlite3.connect(self.runs / "history.db")
        db.row_factory = sqlite3.Row
        try:
            return dict(db.execute("SELECT * FROM runs WHERE run_id = ?", (self.run_id,)).fetchone())
        finally:
            db.close()

    def temp_files(self) -> list[Path]:
        """Temporary files of atomic writes left in the run directory (there must be none)."""
        return sorted((self.runs / self.run_id).rglob(".*.tmp-*")) if (self.runs / self.run_id).exists() else []
