"""A hostile replica through the whole controller: `mtp-canary run` whose canary is an `endpoints:`
server (tests/hostile_server.py, a named fault target) that answers every read in time but never
finishes its body, a byte every 0.2 s. Each per-read timeout is met; only a phase's total deadline
ends the wait. The run must end as an infrastructure error (exit 1) naming the phase and its
deadline in one line, in decision.json and the store, the weight hook back at 0, nothing left.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.stream_target import TargetProcess
from tests.faults.endpoint_run import CliRun, run_config
from tests.faults.test_controller_faults import assert_ended
from tests.hostile_server import HostileServer

# slow in CI's serial pass (Ray and Locust start per run); no vLLM server
pytestmark = pytest.mark.vllm


def test_a_replica_trickling_its_smoke_answer_ends_the_run_at_the_preflight_deadline(tmp_path):
    with TargetProcess(ttft_ms=20, tpot_ms=10) as base, HostileServer() as hostile:
        config = run_config(tmp_path, base.url, hostile.url + "/trickle", preflight_timeout_s=5)
        run = CliRun(tmp_path, config)
        try:
            assert_ended(run, 1, "preflight: replica canary-0 did not answer within preflight_timeout_s (5 s)", tmp_path,
                         hook=["0"])
        finally:
            run.kill()


def test_a_replica_trickling_its_eval_answers_ends_the_run_at_the_accuracy_deadline(tmp_path):
    golden = tmp_path / "golden.jsonl"
    golden.write_text("".join(json.dumps({"id": f"g{i}", "prompt_token_ids": [1, 2, i], "expected_token_ids": [7]}) + "\n"
                              for i in range(4)))
    with TargetProcess(ttft_ms=20, tpot_ms=10) as base, HostileServer() as hostile:
        config = run_config(tmp_path, base.url, hostile.url + "/evals-trickle", accuracy={
            "enabled": True, "kind": "golden", "path": str(golden), "batch_size": 4, "max_duration_s": 5})
        run = CliRun(tmp_path, config)
        try:
            assert_ended(run, 1, "accuracy: not done within accuracy.max_duration_s (5 s)", tmp_path, hook=["0"])
        finally:
            run.kill()
    assert "canary" in run.decision()["error"]  # the arm still waited for is named
