"""A Locust master and its workers as child processes: start, watch, collect, clean up.

The caller is a Ray driver or actor, so Locust and gevent are never imported here:
gevent's monkey patching must not enter a Ray process. Everything Locust runs in its own
processes, each in its own process group so that nothing outlives the Swarm, whatever
way it ends. The records arrive in one JSONL file written by the master; the Swarm
reads the collection summary next to it and fails closed: a worker that died, or
records that do not add up, raise `SwarmError` instead of returning partial numbers.

Workers are local child processes by default. A `WorkerGroup` can start them elsewhere
(`cluster.distributed_load` starts each one under a Ray actor on the cluster's nodes);
the master stays a child process of this one either way, and the run is judged the same.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loadtests.collection import RECORDS_KEY_ENV, CollectionSummary, summary_path_for
from loadtests.errors import SwarmError
from loadtests.health import GeneratorHealth
from loadtests.options import TrafficOptions

LOCUSTFILE = Path(__file__).resolve().with_name("locustfile.py")
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)
# the locustfile exits when the process named here is no longer its parent
PARENT_PID_ENV = "MTP_CANARY_PARENT_PID"
# environment variables that would silently change options the Swarm sets
LOCUST_ENV_PREFIX = "LOCUST_"

# how long a killed process may take to disappear
_KILL_WAIT_S = 10.0
# after the master exits, how long its workers get to quit before they are asked by SIGTERM
_WORKER_EXIT_GRACE_S = 3.0


class SwarmSpec(BaseModel):
    """One load test: the traffic, how many users, for how long, on how many workers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(description="base URL the users call, e.g. the router's http://127.0.0.1:8000")
    traffic: TrafficOptions = Field(description="the --mtp-* options; traffic.records is required")
    users: int = Field(
        ge=1,
        description="concurrent users: closed loop in-flight requests, open loop the cap "
        "(with a closed-loop profile the profile sets them; this only sizes the start)",
    )
    spawn_rate: float | None = Field(None, gt=0, description="users started per second (default: all within 1 s)")
    run_time_s: int | None = Field(
        None, gt=0, description="how long the load runs once all workers are connected (default: the profile's length)"
    )
    n_workers: int = Field(1, ge=0, description="worker processes; 0 runs one local (non-distributed) process")
    stop_timeout_s: float = Field(
        30.0, ge=0, description="at the end, in-flight requests get this long to finish before they are cancelled"
    )
    web_ui: bool = Field(False, description="serve Locust's web UI from the master while the run goes")
    web_host: str = "127.0.0.1"
    web_port: int = 8089
    master_bind_host: str = Field(
        "127.0.0.1", description="interface the master listens on for workers (0.0.0.0 when they run on other nodes)"
    )
    master_advertise_host: str | None = Field(
        None,
        description="address workers connect to (default: the bind host; 127.0.0.1 locally or this node's "
        "cluster IP under Ray when binding every interface)",
    )
    master_port: int | None = Field(None, description="master's port for workers (default: a free one)")
    startup_timeout_s: float = Field(60.0, gt=0, description="how long the workers get to connect")
    # repr=False: it may carry the router's bearer token; a logged spec must not show it
    env: dict[str, str] = Field(default_factory=dict, repr=False, description="extra environment for every Locust process")
    locustfile: Path = LOCUSTFILE
    log_dir: Path | None = Field(None, description="where master.log and worker-N.log go (default: next to records)")
    python: str = Field(default_factory=lambda: sys.executable)

    @model_validator(mode="after")
    def _consistent(self) -> SwarmSpec:
        if not self.traffic.records:
            raise ValueError("SwarmSpec.traffic.records must name the JSONL file the master writes")
        if self.users < self.n_workers:
            # a worker without users would leave its share of the prompts and the rate unsent
            raise ValueError(f"{self.users} users cannot keep {self.n_workers} workers busy")
        profile = self.traffic.profile
        if profile is None and self.run_time_s is None:
            raise ValueError("SwarmSpec.run_time_s is required unless the traffic has a load profile")
        if profile is not None and self.run_time_s is not None and self.run_time_s < profile.duration_s:
            raise ValueError(
                f"run_time_s {self.run_time_s} would cut the load profile ({profile.describe()}, "
                f"{profile.duration_s:g} s) short"
            )
        return self

    @property
    def duration_s(self) -> float:
        """How long the load runs: run_time_s, or the profile's length."""
        if self.run_time_s is not None:
            return float(self.run_time_s)
        profile = self.traffic.profile
        assert profile is not None
        return profile.duration_s

    @property
    def records_path(self) -> Path:
        assert self.traffic.records is not None
        return Path(self.traffic.records)

    @property
    def logs(self) -> Path:
        if self.log_dir is not None:
            return self.log_dir
        return self.records_path.with_name(self.records_path.stem + "-locust-logs")


class SwarmProgress(BaseModel):
    """A progress report while the swarm runs.

    phase: "starting" until the first record reaches the master's file, "running" while
    records arrive, "stopping" once the master has exited.
    """

    model_config = ConfigDict(frozen=True)

    phase: Literal["starting", "running", "stopping"]
    elapsed_s: float
    requests_done: int
    requests_failed: int
    workers_alive: int


class SwarmResult(BaseModel):
    """A finished, complete run: every worker flushed and every record is in the file.

    `generator` tells whether the load generator kept up: each worker's CPU, the open-loop
    send lag, and `generator_limited` with its `warnings` when it, not the server, limited
    the load (a complete run can still be a generator-limited one: judge it with that).
    """

    model_config = ConfigDict(frozen=True)

    records_path: Path
    n_records: int
    summary: CollectionSummary
    master_exit_code: int
    worker_exit_codes: list[int]
    duration_s: float
    log_dir: Path
    generator: GeneratorHealth

    @property
    def generator_limited(self) -> bool:
        return self.generator.generator_limited

    @property
    def warnings(self) -> list[str]:
        return list(self.generator.warnings)




# Ports a server is told to bind seconds after free_port() saw them free (Locust's master, a vLLM
# replica) come from below the kernel's ephemeral range: bind(0) and every outgoing connection
# (thousands per run: Locust -> router -> replicas) take their ports from that range, so a port
# picked there can be taken before the server binds it. Below it only another explicit bind can.
_FIXED_PORTS_FROM = 10000
_PORT_TRIES = 64


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, outside the ephemeral range where the system has room for one."""
    address = "0.0.0.0" if host == "*" else host
    low, _ = _ephemeral_range()
    if low - _FIXED_PORTS_FROM >= 1000:
        rng = random.SystemRandom()
        for _ in range(_PORT_TRIES):
            port = rng.randrange(_FIXED_PORTS_FROM, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind((address, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def _locust(python: str, locustfile: Path) -> list[str]:
    return [python, "-m", "locust", "-f", str(locustfile)]


def worker_command(
    master_host: str,
    master_port: int,
    *,
    locustfile: Path = LOCUSTFILE,
    python: str = sys.executable,
) -> list[str]:
    """The command line of one Locust worker (e.g. for a Ray actor on another node).

    A worker needs no traffic flags: the master sends its own with every spawn message.
    Request failures are data in the records, so they never change the exit code; any
    non-zero exit means the worker itself failed.
    """
    return _locust(python, locustfile) + [
        "--worker",
        "--master-host", master_host,
        "--master-port", str(master_port),
        "--exit-code-on-error", "0",
    ]


def master_command(spec: SwarmSpec, master_port: int) -> list[str]:
    """The command line of the master (or, with n_workers = 0, of the single local process)."""
    command = _locust(spec.python, spec.locustfile) + [
        "--host", spec.host,
        "--users", str(spec.users),
        "--spawn-rate", f"{spec.spawn_rate if spec.spawn_rate is not None else spec.users:g}",
    ]
    if spec.run_time_s is not None:  # with a profile and no run time, the profile ends the test
        command += ["--run-time", f"{spec.run_time_s}s"]
    command += [
        "--stop-timeout", f"{spec.stop_timeout_s:g}",
        "--exit-code-on-error", "0",
        "--only-summary",
    ]
    if spec.web_ui:
        # the run starts and ends by itself; the UI only watches (and may steer)
        command += ["--autostart", "--autoquit", "0", "--web-host", spec.web_host, "--web-port", str(spec.web_port)]
    else:
        command += ["--headless"]
    if spec.n_workers > 0:
        command += [
            "--master",
            "--master-bind-host", spec.master_bind_host,
            "--master-bind-port", str(master_port),
            "--expect-workers", str(spec.n_workers),
            "--expect-workers-max-wait", f"{spec.startup_timeout_s:g}",
        ]
    return command + spec.traffic.to_cli_args()


def locust_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a Locust process started from this process (also for a worker
    that a Ray actor starts with `worker_command`)."""
    # LOCUST_* variables would silently change options the Swarm sets
    env = {key: value for key, value in os.environ.items() if not key.startswith(LOCUST_ENV_PREFIX)}
    # the locustfile exits when this process is gone (its own session shields it from our signals)
    env[PARENT_PID_ENV] = str(os.getpid())
    # the locustfile imports `loadtests` from this checkout whatever the working directory
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class _RecordsTail:
    """Counts records (and failed ones) as the master appends them, reading only new bytes."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = 0
        self._partial = b""
        self.done = 0
        self.failed = 0

    def poll(self) -> None:
        try:
            with open(self._path, "rb") as records:
                records.seek(self._offset)
                data = records.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            self.done += 1
            try:
                if not json.loads(line).get("ok", False):
                    self.failed += 1
            except ValueError:
                self.failed += 1


class WorkerGroup(Protocol):
    """Where and how the Locust workers of a Swarm run.

    The Swarm calls `prepare` before it starts the master (a group that cannot place its
    workers fails there, before any load), `start` once the master listens, `poll` while
    the run goes, `finish` after the master exited, and `kill` when the run fails.
    """

    def prepare(self, spec: SwarmSpec) -> None: ...

    def start(self, spec: SwarmSpec, master_port: int) -> None:
        """Start spec.n_workers workers connecting to the master on master_port."""
        ...

    def poll(self) -> list[int | None]:
        """Each worker's exit code, None while it runs (a worker that cannot be asked is dead: non-zero)."""
        ...

    def describe(self, index: int) -> str:
        """Where worker `index` logs, and the tail of its log, for an error message."""
        ...

    @property
    def pids(self) -> list[int]: ...

    def finish(self, grace_s: float) -> list[int]:
        """After the master exited: give the workers grace_s to quit, then SIGTERM; their exit codes."""
        ...

    def kill(self) -> None:
        """Kill every worker at once (the run failed); raise SwarmError if one survives."""
        ...


class LocalWorkers:
    """Workers as child processes of this one, each in its own process group."""

    def __init__(self) -> None:
        self._spec: SwarmSpec | None = None
        self._processes: list[subprocess.Popen[bytes]] = []

    def prepare(self, spec: SwarmSpec) -> None:
        self._spec = spec

    def start(self, spec: SwarmSpec, master_port: int) -> None:
        self._spec = spec
        host = spec.master_advertise_host or (
            "127.0.0.1" if spec.master_bind_host in ("0.0.0.0", "*") else spec.master_bind_host
        )
        for index in range(spec.n_workers):
            command = worker_command(host, master_port, locustfile=spec.locustfile, python=spec.python)
            self._processes.append(_spawn(spec, command, f"worker-{index}.log"))

    def poll(self) -> list[int | None]:
        return [process.poll() for process in self._processes]

    def describe(self, index: int) -> str:
        assert self._spec is not None
        log = self._spec.logs / f"worker-{index}.log"
        return f"log {log}:\n{_tail(log)}"

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def finish(self, grace_s: float) -> list[int]:
        """A worker normally exits right after the master's quit message, but after a
        web-UI style stop Locust's worker sleeps out --stop-timeout before it reads that
        message; SIGTERM takes it through Locust's own clean shutdown instead."""
        codes = []
        deadline = time.monotonic() + grace_s
        for index, worker in enumerate(self._processes):
            try:
                codes.append(worker.wait(timeout=max(0.0, deadline - time.monotonic())))
                continue
            except subprocess.TimeoutExpired:
                _signal_group(worker, signal.SIGTERM)
            try:
                codes.append(worker.wait(timeout=_KILL_WAIT_S))
            except subprocess.TimeoutExpired:
                raise SwarmError(f"locust worker {index} did not quit after the master ended; {self.describe(index)}")
        return codes

    def kill(self) -> None:
        _kill_processes(self._processes)


def _spawn(spec: SwarmSpec, command: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
    with open(spec.logs / log_name, "wb") as log:
        return subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=locust_environment(spec.env),
            start_new_session=True,  # its own process group: killed as a whole
        )


def _kill_processes(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        _signal_group(process, signal.SIGKILL)
    for process in processes:
        try:
            process.wait(timeout=_KILL_WAIT_S)
        except subprocess.TimeoutExpired:  # unkillable (stuck in the kernel): say so
            raise SwarmError(f"locust process {process.pid} survived SIGKILL") from None


class Swarm:
    """Runs one `SwarmSpec` to completion: `Swarm(spec, on_progress=print).run()`."""

    # set by stop() from any thread; read by the thread inside run()
    _stop_requested = False
    _stop_sent = False

    def __init__(
        self,
        spec: SwarmSpec,
        on_progress: Callable[[SwarmProgress], None] | None = None,
        progress_interval_s: float = 1.0,
        workers: WorkerGroup | None = None,
    ) -> None:
        # the workers sign their record messages with the run's key; the master refuses any other source
        self.spec = spec if spec.env.get(RECORDS_KEY_ENV) else spec.model_copy(
            update={"env": {**spec.env, RECORDS_KEY_ENV: secrets.token_hex(32)}})
        self._on_progress = on_progress
        self._progress_interval_s = progress_interval_s
        self._master: subprocess.Popen[bytes] | None = None
        self._workers: WorkerGroup = workers if workers is not None else LocalWorkers()
        self._started = False

    @property
    def pids(self) -> list[int]:
        """Process ids of the master and workers started so far."""
        return ([self._master.pid] if self._master else []) + self._workers.pids

    @property
    def worker_pids(self) -> list[int]:
        return self._workers.pids

    def run(self, timeout_s: float | None = None) -> SwarmResult:
        """Start master and workers, wait for the end, and return the checked result.

        `timeout_s` bounds the whole run (default: startup + run time + stop timeout +
        the flush timeout + a margin). On timeout, error or interrupt every Locust
        process is killed before the exception propagates.
        """
        if self._started:
            raise RuntimeError("a Swarm runs once; make a new one for the next run")
        self._started = True
        spec = self.spec
        limit = timeout_s if timeout_s is not None else (
            spec.startup_timeout_s + spec.duration_s + spec.stop_timeout_s + spec.traffic.flush_timeout_s + 60.0
        )
        spec.logs.mkdir(parents=True, exist_ok=True)
        spec.records_path.parent.mkdir(parents=True, exist_ok=True)
        for stale in (spec.records_path, summary_path_for(spec.records_path)):
            stale.unlink(missing_ok=True)  # a summary left from an earlier run must not pass for this one
        started = time.monotonic()
        try:
            self._workers.prepare(spec)
            self._start()
            master_code = self._wait(started, limit)
            worker_codes = self._workers.finish(_WORKER_EXIT_GRACE_S)
        except BaseException:
            self.kill()
            raise
        return self._result(master_code, worker_codes, time.monotonic() - started)

    def stop(self) -> None:
        """End a running swarm early and gracefully; `run()` then returns as if its time was up.

        Thread-safe (the usual caller is not the thread inside `run()`): the master gets
        SIGTERM, Locust's own shutdown path, which stops the users (in-flight requests get
        stop_timeout_s, then become cancelled records), collects every worker's records
        and writes the summary. Locust installs its SIGTERM handler only once the test has
        started (after the workers connected), so the signal waits for the first record
        in the file (or for startup_timeout_s, when none ever comes).
        """
        self._stop_requested = True

    def _send_stop_when_ready(self, started: float) -> None:
        if not self._stop_requested or self._stop_sent or self._master is None:
            return
        try:
            has_records = self.spec.records_path.stat().st_size > 0
        except FileNotFoundError:
            has_records = False
        if not has_records and time.monotonic() - started < self.spec.startup_timeout_s:
            return
        self._stop_sent = True
        _signal_group(self._master, signal.SIGTERM)

    def kill(self) -> None:
        """Kill every process group this Swarm started and reap them.

        SIGKILL at once: this only runs when the run has already failed or been
        interrupted, the records so far are on disk (the master flushes every batch), and
        a graceful master would wait for workers that may be dead.
        """
        try:
            self._workers.kill()
        finally:
            _kill_processes([self._master] if self._master else [])

    def _start(self) -> None:
        spec = self.spec
        port = spec.master_port or free_port(spec.master_bind_host)
        self._master = _spawn(spec, master_command(spec, port), "master.log")
        if spec.n_workers:
            self._workers.start(spec, port)

    def _report(self, started: float, tail: _RecordsTail, master_exited: bool = False) -> None:
        if self._on_progress is None:
            return
        tail.poll()
        phase: Literal["starting", "running", "stopping"] = (
            "stopping" if master_exited else "running" if tail.done else "starting"
        )
        self._on_progress(
            SwarmProgress(
                phase=phase,
                elapsed_s=time.monotonic() - started,
                requests_done=tail.done,
                requests_failed=tail.failed,
                workers_alive=sum(1 for code in self._workers.poll() if code is None),
            )
        )

    def _wait(self, started: float, limit_s: float) -> int:
        assert self._master is not None
        tail = _RecordsTail(self.spec.records_path)
        next_report = started
        while True:
            code = self._master.poll()
            if code is not None:
                self._report(started, tail, master_exited=True)
                return code
            for index, worker_code in enumerate(self._workers.poll()):
                # a worker exits 0 only after the master told it to quit; anything else is a death
                if worker_code is not None and worker_code != 0:
                    raise SwarmError(
                        f"locust worker {index} died with exit code {worker_code} during the run; "
                        f"{self._workers.describe(index)}"
                    )
            now = time.monotonic()
            if now - started > limit_s:
                raise SwarmError(f"the load test did not finish within {limit_s:.0f}s; logs in {self.spec.logs}")
            if now >= next_report:
                self._report(started, tail)
                next_report = now + self._progress_interval_s
            self._send_stop_when_ready(started)
            time.sleep(0.1)

    def _result(self, master_code: int, worker_codes: list[int], duration_s: float) -> SwarmResult:
        spec = self.spec
        master_log = spec.logs / "master.log"
        if master_code != 0:
            raise SwarmError(f"locust master exited with code {master_code}; log {master_log}:\n{_tail(master_log)}")
        for index, code in enumerate(worker_codes):
            if code != 0:
                raise SwarmError(f"locust worker {index} exited with code {code}; {self._workers.describe(index)}")
        summary_path = summary_path_for(spec.records_path)
        if not summary_path.exists():
            raise SwarmError(f"the master wrote no collection summary ({summary_path}); log {master_log}")
        summary = CollectionSummary.read(summary_path)
        problems = summary.describe_problems()
        if spec.n_workers and len(summary.workers) != spec.n_workers:
            problems.append(f"{len(summary.workers)} workers reported records, {spec.n_workers} were started")
        with open(spec.records_path, "rb") as records:
            lines = sum(1 for line in records if line.strip())
        if lines != summary.records_written:
            problems.append(f"the records file holds {lines} records, the master counted {summary.records_written}")
        if summary.generator is None:
            problems.append("the collection summary has no generator health")
        if problems:
            raise SwarmError("records incomplete: " + "; ".join(problems) + f"; logs in {spec.logs}")
        assert summary.generator is not None
        return SwarmResult(
            records_path=spec.records_path,
            n_records=summary.records_written,
            summary=summary,
            master_exit_code=master_code,
            worker_exit_codes=worker_codes,
            duration_s=duration_s,
            log_dir=spec.logs,
            generator=summary.generator,
        )


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    # only while the leader lives: the group id is then certainly still this process's
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
