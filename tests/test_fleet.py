"""Real vLLM (CPU build) replicas started through Fleet on local Ray."""

from __future__ import annotations

import json
import time

import psutil
import pytest
import ray
import requests

from cluster.engine_spec import CpuLimits, EngineSpec
from cluster.fleet import ArmSpec, Fleet, FleetStartError
from rollout.evals import EvalSpec, evaluate_batch, load_items, outputs_differ
from tests.conftest import wait_no_server_processes

pytestmark = pytest.mark.vllm


def engine(model_dir, k: int, dtype: str, **kw) -> EngineSpec:
    return EngineSpec(
        model=str(model_dir),
        served_model_name="tiny",
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


def test_baseline_and_canary_serve_the_golden_outputs_and_the_canary_speculates(local_ray, tiny_model_dir, tiny_dtype, tmp_path):
    fleet = Fleet(
        [ArmSpec(name="baseline", engine=engine(tiny_model_dir, 1, tiny_dtype)), ArmSpec(name="canary", engine=engine(tiny_model_dir, 3, tiny_dtype))],
        log_dir=str(tmp_path / "logs"),
        progress=print,
    )
    with fleet:
        urls = fleet.start(timeout_s=600)
        # Parallel start: every replica was launched before any was ready (a serial start
        # launches the next one only after the previous one is up).
        spans = [(h.status.launched_at, h.status.launched_at + h.status.elapsed_s) for h in fleet.replicas]
        assert max(start for start, _ in spans) < min(ready for _, ready in spans), spans
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

        # An actor killed without stopping its server: the reaper stops the server.
        victim = fleet.handles("canary")[0]
        server_pid = victim.status.pid
        ray.kill(victim.actor)
        deadline = time.monotonic() + 40
        while psutil.pid_exists(server_pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not psutil.pid_exists(server_pid) or psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE
        assert requests.get(f"{urls['baseline'][0]}/health", timeout=5).status_code == 200
    assert wait_no_server_processes() == []


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
    assert "canary-0 failed to start" in message
    assert "no-such-engine-flag" in message  # the log tail shows the cause
    assert fleet.replicas == []
    assert wait_no_server_processes() == []
