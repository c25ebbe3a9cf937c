"""A supervised process: one Ray actor that runs one command on its node and watches it.

Generic (it knows nothing of Locust or vLLM): the actor starts the command with the
environment it is given, in a process group of its own, logs its output to a file,
answers status polls (alive, exit code, log tail), and stops the whole group (SIGTERM,
then SIGKILL). A watchdog (`cluster.reaper`) kills the group if the actor dies without
stopping it (`start` returns once that watchdog is in place), so nothing outlives its
actor. The command runs as a child process, never inside the Ray worker: whatever it
imports (gevent's monkey patching, say) stays out of Ray.

    actor = supervised_process_actor("worker-0", num_cpus=1, placement="spread")
    ray.get(actor.start.remote(["python", "-m", "something"], {"KEY": "value"}))
    status = ray.get(actor.status.remote())      # ProcessStatus: alive, exit_code, log_tail
    ray.get(actor.stop.remote(grace_s=10))

Placement strings (`placement_options`): "auto" (the default: when the cluster has nodes
with GPUs and nodes without, only the ones without, spread, so that load generation never
takes CPU from a GPU node's engines; otherwise "spread"), "spread" (one node after another), "pack" or
"default" (Ray's default), "node:<node id or IP>" (pinned to that node), "label:k=v[,k=v]"
(a node whose Ray labels match), "resource:NAME[=AMOUNT]" (a node offering that custom
resource, e.g. `ray start --resources '{"loadgen": 4}'`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.placement import auto_worker_options
from cluster.reaper import start_watchdog, stop_group



@dataclass
class ProcessStatus:
    """What a supervised process is doing. `exit_code` is None while it runs (and before it
    starts); a negative exit code is the signal that ended it."""

    name: str
    started: bool
    alive: bool
    exit_code: int | None
    pid: int | None
    node_ip: str
    node_id: str
    log_path: str
    log_tail: list[str] = field(default_factory=list)
    error: str | None = None  # the command could not be started


@dataclass
class NodeInfo:
    """Where the actor runs, and what its node holds."""

    node_ip: str
    node_id: str
    hostname: str
    actor_pid: int
    python: str  # the actor's interpreter (the job's environment on that node)
    cwd: str
    paths_present: dict[str, bool]


def _read_tail(path: str, lines: int) -> list[str]:
    if lines <= 0:
        return []
    try:
        with open(path, encoding="utf-8", errors="replace") as log:
            return [line.rstrip("\n") for line in deque(log, maxlen=lines)]
    except FileNotFoundError:
        return []


class SupervisedProcessServer:
    """The actor's logic; `SupervisedProcess` is the Ray actor class built from it."""

    def __init__(self, name: str, log_dir: str | None = None) -> None:
        self.name = name
        directory = Path(log_dir) if log_dir else Path(tempfile.gettempdir()) / "mtp-canary-processes"
        self.log_path = str(directory / f"{name}.log")
        self._proc: subprocess.Popen[bytes] | None = None
        self._error: str | None = None

    def _node(self) -> tuple[str, str]:
        if ray.is_initialized():
            return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
        return "127.0.0.1", ""

    def node_info(self, paths: Sequence[str] = ()) -> NodeInfo:
        """Where this actor landed, its interpreter and working directory, and which of
        `paths` exist on its node (a caller checks that a command's files are there)."""
        ip, node_id = self._node()
        return NodeInfo(
            node_ip=ip,
            node_id=node_id,
            hostname=socket.gethostname(),
            actor_pid=os.getpid(),
            python=sys.executable,
            cwd=os.getcwd(),
            paths_present={path: os.path.exists(path) for path in paths},
        )

    def start(
        self,
        command: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        cwd: str | None = None,
        unset_env_prefixes: Sequence[str] = (),
        parent_pid_env: str | None = None,
        reaper_grace_s: float = 10.0,
    ) -> ProcessStatus:
        """Start `command` once: environment = this actor's, without variables that start
        with any of `unset_env_prefixes`, plus `env`; `parent_pid_env` names a variable
        set to this actor's pid (for a child that exits when its parent is gone)."""
        if self._proc is not None or self._error is not None:
            return self.status()
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        environment = {
            key: value for key, value in os.environ.items() if not key.startswith(tuple(unset_env_prefixes))
        }
        environment.update(env or {})
        if parent_pid_env:
            environment[parent_pid_env] = str(os.getpid())
        with open(self.log_path, "wb") as log:
            log.write(f"# supervised process {self.name}: {' '.join(command)}\n".encode())
            log.flush()
            try:
                self._proc = subprocess.Popen(
                    list(command),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=environment,
                    cwd=cwd,
                    start_new_session=True,  # its own process group: stopped as a whole
                )
            except OSError as exc:
                self._error = f"could not start {command[0]!r}: {exc}"
                return self.status()
        # Returns once the watchdog has detached (see cluster.reaper.start_watchdog).
        try:
            start_watchdog(os.getpid(), self._proc.pid, grace_s=reaper_grace_s)
        except (subprocess.SubprocessError, OSError) as exc:
            self._error = f"the reaper watchdog did not start: {exc}"
        return self.status()

    def status(self, log_lines: int = 20) -> ProcessStatus:
        ip, node_id = self._node()
        code = self._proc.poll() if self._proc is not None else None
        return ProcessStatus(
            name=self.name,
            started=self._proc is not None,
            alive=self._proc is not None and code is None,
            exit_code=code,
            pid=self._proc.pid if self._proc is not None else None,
            node_ip=ip,
            node_id=node_id,
            log_path=self.log_path,
            log_tail=_read_tail(self.log_path, log_lines),
            error=self._error,
        )

    def wait(self, timeout_s: float) -> ProcessStatus:
        """Wait up to timeout_s for the process to exit (bounded: keep it short, the actor
        answers nothing else meanwhile)."""
        if self._proc is not None:
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        return self.status()

    def send_signal(self, signum: int) -> ProcessStatus:
        """Signal the process (the group leader only)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signum)
        return self.status()

    def stop(self, grace_s: float = 10.0) -> ProcessStatus:
        """SIGTERM the process group, SIGKILL what is left after grace_s; reap; idempotent."""
        if self._proc is not None:
            stop_group(self._proc, grace_s)
        # the detached reaper exits by itself now that the group is empty
        return self.status()


SupervisedProcess = ray.remote(num_cpus=1, max_restarts=0)(SupervisedProcessServer)


def placement_options(placement: str) -> dict[str, Any]:
    """Ray actor options for a placement string (see the module docstring)."""
    kind, _, value = placement.partition(":")
    kind = kind.strip().lower()
    value = value.strip()
    if kind == "auto" and not value:
        return auto_worker_options(ray.nodes())
    if kind == "spread" and not value:
        return {"scheduling_strategy": "SPREAD"}
    if kind in ("pack", "default") and not value:
        return {"scheduling_strategy": "DEFAULT"}
    if kind == "node" and value:
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=_node_id(value), soft=False)}
    if kind == "label" and value:
        selector = {}
        for pair in value.split(","):
            key, sep, wanted = pair.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"placement {placement!r}: labels are key=value pairs")
            selector[key.strip()] = wanted.strip()
        return {"label_selector": selector}
    if kind == "resource" and value:
        name, sep, amount = value.partition("=")
        try:
            quantity = float(amount) if sep else 1.0
        except ValueError:
            raise ValueError(f"placement {placement!r}: amount {amount!r} is not a number") from None
        if not name.strip() or quantity <= 0:
            raise ValueError(f"placement {placement!r}: needs a resource name and a positive amount")
        return {"resources": {name.strip(): quantity}}
    raise ValueError(
        f"unknown placement {placement!r}: auto, spread, pack, node:<id or ip>, label:key=value or resource:NAME[=N]"
    )


def _node_id(node: str) -> str:
    """A node id from an id or an IP address of a live node of the connected cluster."""
    for entry in ray.nodes():
        if entry.get("Alive") and node in (entry.get("NodeID"), entry.get("NodeManagerAddress")):
            return str(entry["NodeID"])
    raise ValueError(f"no live Ray node has id or address {node!r}")


def supervised_process_actor(
    name: str,
    *,
    num_cpus: float = 1.0,
    placement: str = "default",
    log_dir: str | None = None,
    resources: Mapping[str, float] | None = None,
) -> Any:
    """Create a SupervisedProcess actor (it starts nothing until `start`)."""
    options = placement_options(placement)
    if resources:
        options["resources"] = {**options.get("resources", {}), **resources}
    return SupervisedProcess.options(num_cpus=num_cpus, **options).remote(name, log_dir)
