"""What the router costs: the latency it adds, and the concurrent streams one router core carries.

Both measured through `python -m rollout.commands.router` (the RouterServer a run starts as a Ray
actor, here without Ray) in front of benchmarks/stream_target.py, a zero-work streaming server:

1. Added latency. The same short streaming request (8 tokens, no delays at the target), one at a
   time on kept-alive connections, alternately straight to the target and through the router.
   router.added_p50_ms / router.added_p99_ms: the router's TTFB percentile (request sent -> first
   body bytes) minus the direct one; router.added_total_* the same of the whole stream.
2. Streams per core. The router pinned to one core (os.sched_setaffinity), the targets and the
   client processes on the others. N concurrent streams, each one SSE event every
   --event-interval-ms, are held through a window; N ramps up until the router's CPU saturates
   (>= 90% of its core), a stream fails, or events arrive late: an event's lag is its arrival
   minus when it was due (the stream's first event's arrival + k intervals), and a level whose
   p99 lag exceeds max(100 ms, 2.5 intervals) is not sustained (a level that fails is run once
   more, and judged by that second run: one stall of a shared machine fails a window). (Counting events would not do:
   a saturated proxy reads several queued events at once and keeps the count up while they lag.)
   router.max_streams_per_core: the largest N sustained. router.limited_by says what ended the
   ramp: router_cpu, errors, late_events, load_generator (the targets or clients saturated first,
   or the same level straight to the targets, the control run when the router's CPU is not
   saturated, is late or fails too: the router's own limit was not reached, see
   router.streams_per_core_extrapolated), or ceiling (the last level passed). The figure depends on the event rate: it is reported with it.

On a machine with few cores the load generator shares them with everything else; the load
average at the start is reported with the results, read them with it.

Usage:  python benchmarks/router.py [--quick] [--json] [--event-interval-ms 40]

3. Beside a peer: `--peer vllm-router` puts vLLM's own router (its PyPI wheel's binary, pinned,
   installed into a venv of its own under benchmarks/peers.py's cache) and ours in front of the
   same target: the added TTFB p50/p99 of each (direct and both routers in turns), and each
   router's CPU per stream (router pinned to one core, CPU ms per stream-second at fixed loads).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import select
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.stream_target import TargetProcess  # noqa: E402

SATURATED_CPU = 0.90  # of one core
MIN_LAG_BOUND_MS = 100.0  # p99 event lag allowed: this, or 2.5 event intervals if longer
LAG_BUCKET_MS = 1.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
LISTENING = re.compile(r"listening on (http://\S+)")


@dataclass
class Level:
    """One step of the streams ramp."""

    streams: int
    ok: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    events: int = 0  # received in the window
    events_due: float = 0.0
    lag_p50_ms: float = 0.0
    lag_p99_ms: float = 0.0
    lag_bound_ms: float = 0.0
    router_cpu: float = 0.0  # fraction of one core over the window
    router_preempted_per_s: float = 0.0  # involuntary context switches: other processes took its core
    generator_cpu: float = 0.0  # targets + clients, fraction of the cores they have
    sustained: bool = False
    verdict: str = ""
    retried: bool = False  # failed once and was run again (one stall of a shared machine fails a window)
    direct_lag_p99_ms: float | None = None  # the control run straight to the targets, when one ran
    direct_errors: int | None = None

    @property
    def delivered(self) -> float:
        return self.events / self.events_due if self.events_due else 0.0


# --------------------------------------------------------------------------
# Processes and cores
# --------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def preemptions(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            return int(line.split()[1])
    return 0


def pin(pid: int | None, cores: set[int]) -> None:
    if pid is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(pid, cores)


class RouterProcess:
    """The standalone router in front of `targets`, pinned to `core`."""

    def __init__(self, targets: Sequence[str], core: int | None, max_connections: int) -> None:
        arms = [arg for url in targets for arg in ("--arm", f"baseline={url}")]
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rollout.commands.router", *arms, "--max-connections", str(max_connections)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=self.log, text=True,
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], 60)
        line = self.process.stdout.readline() if ready else ""
        found = LISTENING.search(line)
        if not found:
            self.stop()
            raise RuntimeError(f"router did not start: {line!r}")
        self.url = found.group(1)
        if core is not None:
            pin(self.process.pid, {core})

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class VllmRouterProcess:
    """vLLM's own router (the `vllm-router` binary from its PyPI wheel, in a venv of its own) in front of
    `targets`, pinned to `core`: run_level's and the latency comparison's view of it, like RouterProcess."""

    def __init__(self, binary: Path, targets: Sequence[str], core: int | None) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [str(binary), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *targets,
             "--policy", "round_robin", "--log-level", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT, text=True,
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                tail = self.log.read()[-1500:]
                self.stop()
                raise RuntimeError(f"vllm-router did not start: {tail}")
            time.sleep(0.5)
        if core is not None:
            pin(self.process.pid, {core})

    def _ready(self) -> bool:
        body = json.dumps({"model": "stream-target", "prompt": "hi", "max_tokens": 1}).encode()
        request = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return response.status == 200
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        RouterProcess.stop(self)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# 1. Added latency
# --------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


async def _timed_stream(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, float]:
    started = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
        first = await response.content.readany()
        ttfb = time.perf_counter() - started
        if response.status != 200 or not first:
            raise RuntimeError(f"{url}: HTTP {response.status}")
        while await response.content.readany():
            pass
    return ttfb, time.perf_counter() - started


async def added_latency(direct: str, routed: str, pairs: int, warmup: int) -> dict[str, float]:
    body = json.dumps({"model": "stream-target", "prompt": "hi", "max_tokens": 8, "stream": True}).encode()
    times: dict[str, list[tuple[float, float]]] = {"direct": [], "routed": []}
    # One kept-alive connection per path, as a client's pool keeps them.
    async with aiohttp.ClientSession() as to_target, aiohttp.ClientSession() as to_router:
        paths = {"direct": (to_target, f"{direct}/v1/completions"), "routed": (to_router, f"{routed}/v1/completions")}
        for i in range(warmup + pairs):
            # Alternate which goes first: drift (other load, frequency) falls on both alike.
            for name in ("direct", "routed") if i % 2 == 0 else ("routed", "direct"):
                session, url = paths[name]
                measured = await _timed_stream(session, url, body)
                if i >= warmup:
                    times[name].append(measured)
    result: dict[str, float] = {}
    for index, metric in ((0, "ttfb"), (1, "total")):
        for q in (50, 99):
            d = percentile([t[index] for t in times["direct"]], q) * 1000
            r = percentile([t[index] for t in times["routed"]], q) * 1000
            result[f"direct_{metric}_p{q}_ms"], result[f"routed_{metric}_p{q}_ms"] = d, r
            result[f"added_{metric}_p{q}_ms"] = r - d
    return result


async def added_latency_each(direct: str, routed: dict[str, str], pairs: int, warmup: int) -> dict[str, float]:
    """added_latency for several routers at once: direct and every router in turns, the order rotating."""
    body = json.dumps({"model": "stream-target", "prompt": "hi", "max_tokens": 8, "stream": True}).encode()
    names = ["direct", *routed]
    urls = {"direct": direct, **routed}
    times: dict[str, list[float]] = {name: [] for name in names}
    sessions = {name: aiohttp.ClientSession() for name in names}  # one kept-alive connection per path
    try:
        for i in range(warmup + pairs):
            for name in names[i % len(names):] + names[:i % len(names)]:
                ttfb, _ = await _timed_stream(sessions[name], f"{urls[name]}/v1/completions", body)
                if i >= warmup:
                    times[name].append(ttfb)
    finally:
        for session in sessions.values():
            await session.close()
    result: dict[str, float] = {}
    for q in (50, 99):
        d = percentile(times["direct"], q) * 1000
        result[f"direct_ttfb_p{q}_ms"] = d
        for name in routed:
            result[f"{name}.added_ttfb_p{q}_ms"] = percentile(times[name], q) * 1000 - d
    return result


def peer_comparison(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    """Our router and vllm-router in front of the same target: added TTFB, and router CPU per stream."""
    from benchmarks.peers import ROUTER_PEERS, ensure_peer

    peer = ROUTER_PEERS[args.peer]
    binary = ensure_peer(peer, say) / "bin" / "vllm-router"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("router benchmark --peer: needs two cores (the router on one, target and clients on the other)")
    router_core, generator_cores = cores[-1], set(cores[:-1])
    pairs, warmup = (300, 30) if args.quick else (1000, 100)
    streams = [200] if args.quick else [250, 500]
    window_s = 2.0 if args.quick else 4.0
    interval_s = args.event_interval_ms / 1000
    result: dict[str, Any] = {"cpu_model": cpu_model(), "cores": len(cores), "quick": args.quick,
                              "load_average_1m": round(os.getloadavg()[0], 2), "peer": f"{peer.name} {peer.version}",
                              "router.event_interval_ms": args.event_interval_ms}
    with TargetProcess(ttft_ms=0, tpot_ms=0, tokens_per_chunk=1) as target:
        pin(target.pid, generator_cores)
        ours = RouterProcess([target.url], router_core, max_connections=64)
        theirs = VllmRouterProcess(binary, [target.url], router_core)
        try:
            say(f"added TTFB: {pairs} requests on each path (direct, ours, {peer.name}), in turns ...")
            latency = asyncio.run(added_latency_each(target.url, {"ours": ours.url, peer.name: theirs.url}, pairs, warmup))
        finally:
            ours.stop()
            theirs.stop()
    result.update({f"router.{key}": round(value, 3) for key, value in latency.items()})
    with TargetProcess(ttft_ms=5, tpot_ms=args.event_interval_ms, tokens_per_chunk=1) as target:
        pin(target.pid, generator_cores)
        for name in ("ours", peer.name):
            for n in streams:
                router = (RouterProcess([target.url], router_core, max_connections=2 * n + 100) if name == "ours"
                          else VllmRouterProcess(binary, [target.url], router_core))
                try:
                    level = run_level(n, router, [target.pid] if target.pid else [], generator_cores, 1,
                                      interval_s, window_s)
                finally:
                    router.stop()
                key = f"router.{name}.streams{n}"
                result[f"{key}.cpu_ms_per_stream_s"] = round(1000 * level.router_cpu / n, 4)
                result[f"{key}.router_cpu"] = round(level.router_cpu, 3)
                result[f"{key}.lag_p99_ms"] = level.lag_p99_ms
                result[f"{key}.errors"] = level.errors
                result[f"{key}.verdict"] = level.verdict
                say(f"  {name} at {n} streams: router CPU {level.router_cpu:.0%} -> "
                    f"{1000 * level.router_cpu / n:.3f} ms CPU per stream-second; lag p99 {level.lag_p99_ms:.0f} ms, "
                    f"errors {level.errors}: {level.verdict}")
    result["router.streams"] = streams
    return result


def peer_table(result: dict[str, Any]) -> str:
    peer = result["peer"].split()[0]
    lines = [f"router vs {result['peer']}: {result['cpu_model']}, {result['cores']} cores, load average "
             f"{result['load_average_1m']}{' (quick)' if result['quick'] else ''}", "",
             f"direct TTFB p50 {result['router.direct_ttfb_p50_ms']:.3f} ms, p99 {result['router.direct_ttfb_p99_ms']:.3f} ms",
             "| router | added TTFB p50 (ms) | added TTFB p99 (ms) | "
             + " | ".join(f"CPU ms per stream-second at {n}" for n in result["router.streams"]) + " |",
             "|---|---|---|" + "---|" * len(result["router.streams"])]
    for name in ("ours", peer):
        cpu = " | ".join(f"{result[f'router.{name}.streams{n}.cpu_ms_per_stream_s']:.3f} "
                         f"({result[f'router.{name}.streams{n}.verdict']})" for n in result["router.streams"])
        lines.append(f"| {name} | {result[f'router.{name}.added_ttfb_p50_ms']:.3f} | "
                     f"{result[f'router.{name}.added_ttfb_p99_ms']:.3f} | {cpu} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# 2. Streams per core
# --------------------------------------------------------------------------


async def _client(url: str, streams: int, plan: dict[str, float]) -> dict[str, Any]:
    """`streams` concurrent streams started over the ramp; events and their lags counted in [window_start, window_end)."""
    body = json.dumps(
        {"model": "stream-target", "prompt": "hi", "max_tokens": int(plan["max_tokens"]), "stream": True}
    ).encode()
    w0, w1, interval = plan["window_start"], plan["window_end"], plan["interval_s"]
    totals: dict[str, Any] = {"ok": 0, "errors": 0, "events": 0, "error_kinds": {}}
    lags: dict[int, int] = {}  # lag bucket (ms) -> events
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, plan["start_at"] + plan["ramp_s"] * i / streams - time.time()))
            events = seen = 0
            first_at = 0.0
            try:
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}")
                    async for data in response.content.iter_any():
                        now = time.time()
                        if not seen:
                            first_at = now
                        if w0 <= now < w1:
                            n = data.count(b"data: ")
                            events += n
                            # the earliest-due event of the chunk lagged the most
                            bucket = int(max(0.0, now - (first_at + seen * interval)) * 1000 / LAG_BUCKET_MS)
                            lags[bucket] = lags.get(bucket, 0) + n
                        seen += data.count(b"data: ")
                totals["ok"] += 1
            except Exception as exc:  # every failure is counted, by kind
                kind = type(exc).__name__ if not isinstance(exc, RuntimeError) else str(exc)
                totals["errors"] += 1
                totals["error_kinds"][kind] = totals["error_kinds"].get(kind, 0) + 1
            totals["events"] += events

        await asyncio.gather(*(one(i) for i in range(streams)))
    totals["lags"] = lags
    return totals


def lag_percentile(histogram: dict[int, int], q: float) -> float:
    total = sum(histogram.values())
    if not total:
        return 0.0
    rank, seen = math.ceil(q / 100 * total), 0
    for bucket in sorted(histogram):
        seen += histogram[bucket]
        if seen >= rank:
            return (bucket + 1) * LAG_BUCKET_MS
    return (max(histogram) + 1) * LAG_BUCKET_MS


def client_main(url: str, streams: int) -> None:
    """A client process: READY, then the plan as one JSON line on stdin, then its totals on stdout."""
    print("READY", flush=True)
    plan = json.loads(sys.stdin.readline())
    print(json.dumps(asyncio.run(_client(f"{url}/v1/completions", streams, plan))), flush=True)


def run_level(streams: int, router: RouterProcess | _Direct, target_pids: list[int], generator_cores: set[int],
              n_clients: int, interval_s: float, window_s: float) -> Level:
    per_client = [streams // n_clients + (1 if i < streams % n_clients else 0) for i in range(n_clients)]
    clients = [
        subprocess.Popen([sys.executable, __file__, "--client", router.url, "--streams", str(n)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for n in per_client if n > 0
    ]
    try:
        for client in clients:
            pin(client.pid, generator_cores)
            assert client.stdout is not None and client.stdout.readline().strip() == "READY"
        ramp_s = max(0.5, streams / 1000)
        start_at = time.time() + 0.3
        window_start = start_at + ramp_s + 1.0
        window_end = window_start + window_s
        plan = {"start_at": start_at, "ramp_s": ramp_s, "window_start": window_start, "window_end": window_end,
                "interval_s": interval_s, "max_tokens": math.ceil((window_end + 1.0 - start_at) / interval_s) + 1}
        for client in clients:
            assert client.stdin is not None
            client.stdin.write(json.dumps(plan) + "\n")
            client.stdin.flush()
        generator_pids = target_pids + [client.pid for client in clients]
        time.sleep(max(0.0, window_start - time.time()))
        pid = router.process.pid
        router_before, generator_before, at_start = cpu_seconds(pid), sum(map(cpu_seconds, generator_pids)), time.time()
        preempted_before = preemptions(pid)
        time.sleep(max(0.0, window_end - time.time()))
        router_after, generator_after, at_end = cpu_seconds(pid), sum(map(cpu_seconds, generator_pids)), time.time()
        preempted_after = preemptions(pid)
        level = Level(streams=streams, events_due=streams * window_s / interval_s,
                      lag_bound_ms=max(MIN_LAG_BOUND_MS, 2.5 * interval_s * 1000))
        lags: dict[int, int] = {}
        for client in clients:
            out, _ = client.communicate(timeout=120)
            totals = json.loads(out.strip().splitlines()[-1])
            level.ok += totals["ok"]
            level.errors += totals["errors"]
            level.events += totals["events"]
            for kind, n in totals["error_kinds"].items():
                level.error_kinds[kind] = level.error_kinds.get(kind, 0) + n
            for bucket, n in totals["lags"].items():
                lags[int(bucket)] = lags.get(int(bucket), 0) + n
        level.lag_p50_ms, level.lag_p99_ms = lag_percentile(lags, 50), lag_percentile(lags, 99)
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
                client.wait()
    elapsed = at_end - at_start
    level.router_cpu = (router_after - router_before) / elapsed
    level.router_preempted_per_s = (preempted_after - preempted_before) / elapsed
    level.generator_cpu = (generator_after - generator_before) / elapsed / max(1, len(generator_cores))
    return judge_level(level)


class _Direct:
    """run_level's view of 'no router': the clients go straight to a target (the router idles)."""

    def __init__(self, url: str, router: RouterProcess) -> None:
        self.url = url
        self.process = router.process  # its CPU is read, and is ~0


def judge_level(level: Level) -> Level:
    generator_saturated = level.generator_cpu >= SATURATED_CPU
    if level.errors or level.lag_p99_ms > level.lag_bound_ms or not level.events:
        level.sustained = False
        if level.router_cpu < SATURATED_CPU and generator_saturated:
            level.verdict = "load_generator"
        else:
            level.verdict = "errors" if level.errors or not level.events else "late_events"
    else:
        level.sustained = True
        if level.router_cpu >= SATURATED_CPU:
            level.verdict = "router_cpu"
        elif generator_saturated:
            level.verdict = "load_generator"
        else:
            level.verdict = "ok"
    return level


def streams_per_core(levels_wanted: Sequence[int], interval_s: float, window_s: float, cores: list[int],
                     say: Any) -> dict[str, Any]:
    router_core = cores[-1] if len(cores) > 1 else None
    generator_cores = set(cores[:-1]) if len(cores) > 1 else set(cores)
    n_targets = 1 if len(generator_cores) < 4 else 2
    n_clients = max(1, min(4, len(generator_cores) - n_targets))
    targets = [TargetProcess(ttft_ms=5, tpot_ms=interval_s * 1000, tokens_per_chunk=1) for _ in range(n_targets)]
    levels: list[Level] = []
    router: RouterProcess | None = None
    try:
        for target in targets:
            target.__enter__()
            pin(target.pid, generator_cores)
        router = RouterProcess([t.url for t in targets], router_core, max_connections=2 * max(levels_wanted) + 100)
        for streams in levels_wanted:
            level = run_level(streams, router, [t.pid for t in targets if t.pid], generator_cores, n_clients,
                              interval_s, window_s)
            if not level.sustained:
                level = run_level(streams, router, [t.pid for t in targets if t.pid], generator_cores, n_clients,
                                  interval_s, window_s)
                level.retried = True
            if not level.sustained and level.verdict != "load_generator" and level.router_cpu < SATURATED_CPU:
                # The router is not saturated: is the lag the router's, or the load generator's and the machine's?
                control = run_level(streams, _Direct(targets[0].url, router), [t.pid for t in targets if t.pid],
                                    generator_cores, n_clients, interval_s, window_s)
                level.direct_lag_p99_ms, level.direct_errors = control.lag_p99_ms, control.errors
                if not control.sustained:
                    level.verdict = "load_generator"
            levels.append(level)
            control = "" if level.direct_lag_p99_ms is None else (
                f" (straight to the target: lag p99 {level.direct_lag_p99_ms:.0f} ms, errors {level.direct_errors})")
            say(f"  {streams:>5} streams: router CPU {level.router_cpu:5.0%} (preempted {level.router_preempted_per_s:.0f}/s), "
                f"generator CPU {level.generator_cpu:5.0%}, "
                f"event lag p50 {level.lag_p50_ms:.0f} p99 {level.lag_p99_ms:.0f} ms, delivered {level.delivered:6.1%}, "
                f"errors {level.errors}: {level.verdict}{' (2nd try)' if level.retried else ''}{control}")
            if level.verdict != "ok":
                break
    finally:
        if router is not None:
            router.stop()
        for target in targets:
            target.__exit__(None, None, None)
    sustained = [level for level in levels if level.sustained]
    best = sustained[-1] if sustained else None
    limited_by = levels[-1].verdict if levels and levels[-1].verdict != "ok" else "ceiling"
    return {
        "max_streams_per_core": best.streams if best else 0,
        "cpu_at_max": round(best.router_cpu, 3) if best else None,
        "events_per_s_at_max": round(best.streams / interval_s) if best else 0,
        "streams_per_core_extrapolated": round(best.streams / best.router_cpu) if best and best.router_cpu > 0.05 else None,
        "limited_by": limited_by,
        "router_core": router_core,
        "generator_cores": sorted(generator_cores),
        "targets": n_targets,
        "clients": n_clients,
        "levels": [{**asdict(level), "delivered": round(level.delivered, 4)} for level in levels],
    }


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def measure(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    interval_s = args.event_interval_ms / 1000
    pairs, warmup = (300, 30) if args.quick else (2000, 100)
    levels = [100, 300, 600, 1000] if args.quick else [100, 250, 500, 750, 1000, 1250, 1500, 2000, 2500, 3000, 4000]
    window_s = 2.0 if args.quick else 5.0
    result: dict[str, Any] = {
        "cpu_model": cpu_model(), "cores": len(cores), "load_average_1m": round(os.getloadavg()[0], 2),
        "quick": args.quick, "router.event_interval_ms": args.event_interval_ms,
    }
    say(f"router benchmark on {result['cpu_model']} ({len(cores)} cores, load average {result['load_average_1m']})")
    started = time.monotonic()
    with TargetProcess(ttft_ms=0, tpot_ms=0, tokens_per_chunk=1) as target:
        router = RouterProcess([target.url], cores[-1] if len(cores) > 1 else None, max_connections=64)
        try:
            pin(target.pid, set(cores[:-1]) or set(cores))
            say(f"added latency: {pairs} requests each way, alternating ...")
            latency = asyncio.run(added_latency(target.url, router.url, pairs, warmup))
        finally:
            router.stop()
    result.update({f"router.{key}": round(value, 3) for key, value in latency.items()})
    result["router.added_p50_ms"] = result["router.added_ttfb_p50_ms"]
    result["router.added_p99_ms"] = result["router.added_ttfb_p99_ms"]
    say(f"streams per router core, one event per {args.event_interval_ms:g} ms per stream:")
    streams = streams_per_core(levels, interval_s, window_s, cores, say)
    result.update({f"router.{key}": value for key, value in streams.items() if key != "levels"})
    result["levels"] = streams["levels"]
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    return result


def table(result: dict[str, Any]) -> str:
    lines = [
        f"router benchmark: {result['cpu_model']}, {result['cores']} cores, load average {result['load_average_1m']}"
        f"{' (quick)' if result['quick'] else ''}",
        "",
        f"{'latency (ms)':<22}{'direct':>10}{'routed':>10}{'added':>10}",
    ]
    for metric in ("ttfb", "total"):
        for q in (50, 99):
            lines.append(f"{metric + ' p' + str(q):<22}{result[f'router.direct_{metric}_p{q}_ms']:>10.3f}"
                         f"{result[f'router.routed_{metric}_p{q}_ms']:>10.3f}{result[f'router.added_{metric}_p{q}_ms']:>10.3f}")
    lines += ["", f"streams (one event per {result['router.event_interval_ms']:g} ms each), router on core "
              f"{result['router.router_core']}, {result['router.targets']} target(s) and {result['router.clients']} "
              f"client(s) on cores {result['router.generator_cores']}:",
              f"{'streams':>8}{'router CPU':>12}{'gen. CPU':>10}{'lag p50':>9}{'lag p99':>9}{'delivered':>11}"
              f"{'errors':>8}  verdict"]
    for level in result["levels"]:
        control = "" if level["direct_lag_p99_ms"] is None else (
            f" (direct: lag p99 {level['direct_lag_p99_ms']:.0f} ms, errors {level['direct_errors']})")
        lines.append(f"{level['streams']:>8}{level['router_cpu']:>12.0%}{level['generator_cpu']:>10.0%}"
                     f"{level['lag_p50_ms']:>9.0f}{level['lag_p99_ms']:>9.0f}{level['delivered']:>11.1%}"
                     f"{level['errors']:>8}  {level['verdict']}{control}")
    lines += [
        "",
        f"router.added_p50_ms            {result['router.added_p50_ms']:.3f}   (TTFB, target <= 1 ms)",
        f"router.added_p99_ms            {result['router.added_p99_ms']:.3f}",
        f"router.max_streams_per_core    {result['router.max_streams_per_core']}   (target >= 1000; limited by "
        f"{result['router.limited_by']}, router CPU {result['router.cpu_at_max']} at it)",
        f"streams/core extrapolated      {result['router.streams_per_core_extrapolated']}   (linear in the router's CPU)",
        f"elapsed                        {result['elapsed_s']} s",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, fewer and shorter levels (< 60 s)")
    parser.add_argument("--json", action="store_true", help="one JSON object (flat router.* keys) instead of a table")
    parser.add_argument("--event-interval-ms", type=float, default=40.0,
                        help="each stream's SSE event interval (default 40: 10 ms TPOT in 4-token MTP steps)")
    parser.add_argument("--peer", choices=["vllm-router"], default=None,
                        help="instead: our router beside this peer (installed into its own venv on first use)")
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)  # internal: a client process
    parser.add_argument("--streams", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client:
        client_main(args.client, args.streams)
        return 0
    if args.event_interval_ms <= 0:
        print("router benchmark: --event-interval-ms must be > 0", file=sys.stderr)
        return 2
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else (lambda line: print(line, flush=True))
    if args.peer:
        result = peer_comparison(args, say)
        print(json.dumps(result, indent=2) if args.json else "\n" + peer_table(result))
        return 0
    result = measure(args, say)
    print(json.dumps(result, indent=2) if args.json else "\n" + table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
