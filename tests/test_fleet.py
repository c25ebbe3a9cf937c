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
from tests.conftest import wait_no_server_processes

pytestmark = pytest.mark.vllm


def engine(model_dir, k: int, **kw) -> EngineSpec:
    return EngineSpec(
        model=str(model_dir),
        served_model_name="tiny",
        device="cpu",
        dtype="bfloat16",
        max_model_len=1024,
        enforce_eager=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
        cpu=CpuLimits(omp_threads=1, kv_cache_gb=1),
        startup_timeout_s=300,
        **kw,
    )


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
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


def test_baseline_and_canary_serve_the_golden_outputs_and_the_canary_speculates(local_ray, tiny_model_dir, tmp_path):
    fleet = Fleet(
        [ArmSpec(name="baseline", engine=engine(tiny_model_dir, 1)), ArmSpec(name="canary", engine=engine(tiny_model_dir, 3))],
        log_dir=str(tmp_path / "logs"),
        progress=print,
    )
    with fleet:
        started = time.monotonic()
        urls = fleet.start(timeout_s=300)
        wall = time.monotonic() - started
        ready_after = [h.status.elapsed_s for h in fleet.replicas]
        # Parallel start: the fleet takes about as long as its slowest replica, not the sum.
        assert wall < sum(ready_after) * 0.9 + 10, (wall, ready_after)
        golden = [json.loads(line) for line in (tiny_model_dir / "golden.jsonl").read_text().splitlines()[:8]]
        for item in golden:
            want = item["expected_token_ids"]
            assert greedy_ids(urls["baseline"][0], item["prompt_token_ids"], len(want)) == want
            assert greedy_ids(urls["canary"][0], item["prompt_token_ids"], len(want)) == want
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


def test_a_bad_engine_arg_fails_fast_with_its_log_and_tears_down_the_others(local_ray, tiny_model_dir, tmp_path):
    fleet = Fleet(
        [
            ArmSpec(name="baseline", engine=engine(tiny_model_dir, 1)),
            ArmSpec(name="canary", engine=engine(tiny_model_dir, 3, extra_args=["--no-such-engine-flag", "1"])),
        ],
        log_dir=str(tmp_path / "logs"),
        progress=print,
    )
    started = time.monotonic()
    with pytest.raises(FleetStartError) as err:
        fleet.start(timeout_s=300)
    assert time.monotonic() - started < 120
    message = str(err.value)
    assert "canary-0 failed to start" in message
    assert "no-such-engine-flag" in message  # the log tail shows the cause
    assert fleet.replicas == []
    assert wait_no_server_processes() == []
