"""`mtp-canary compare`: two recorded runs side by side, and unreadable runs refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

from rollout.commands.compare import comparison, read_run
from tests.conftest import REPO

RUNS = REPO / "tests" / "data" / "recorded_runs"


def test_a_promote_against_a_rollback_names_every_gate_that_moved_and_the_latency_ratio():
    a, b = read_run(str(RUNS / "promote"), RUNS), read_run("bad", RUNS)  # a directory, then a run id
    c = comparison(a, b)
    assert (c["a"]["decision"], c["b"]["decision"], c["decision_changed"]) == ("promote", "rollback", True)
    gates = {g["gate"]: g for g in c["gates"]}
    assert gates["acceptance_length_floor"]["verdict_changed"]
    assert (gates["acceptance_length_floor"]["a"]["verdict"], gates["acceptance_length_floor"]["b"]["verdict"]) == ("pass", "fail")
    assert not gates["sample_ratio"]["verdict_changed"]
    tpot = next(r for r in c["latency"] if (r["arm"], r["metric"]) == ("canary", "tpot_p50"))
    assert tpot["b_over_a"] == tpot["b_ms"] / tpot["a_ms"] and tpot["b_over_a"] > 2  # the bad drafts' canary is slower
    canary = next(r for r in c["acceptance"] if r["arm"] == "canary")
    assert canary["a_mean_acceptance_length"] > canary["b_mean_acceptance_length"]


def test_a_run_compared_with_itself_changes_nothing():
    doc = read_run(str(RUNS / "promote"), RUNS)
    c = comparison(doc, doc)
    assert not c["decision_changed"] and not any(g["verdict_changed"] for g in c["gates"])
    assert all(r["b_over_a"] in (None, 1.0) for r in c["latency"])


def test_the_command_prints_json_and_refuses_a_missing_or_broken_run_in_one_line(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "rollout", "compare", str(RUNS / "promote"), str(RUNS / "broken"), "--json"],
                        capture_output=True, text=True, cwd=REPO, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["b"]["decision"] == "rollback"
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "decision.json").write_bytes(b"\x00\xff not json")
    for ref, cause in ((str(tmp_path / "nope"), "no decision.json"), (str(tmp_path / "junk"), "not a decision.json")):
        bad = subprocess.run([sys.executable, "-m", "rollout", "compare", str(RUNS / "promote"), ref],
                             capture_output=True, text=True, cwd=REPO, timeout=60)
        assert bad.returncode == 2 and bad.stdout == ""
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and cause in lines[0]
