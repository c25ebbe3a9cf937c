"""`mtp-canary status | promote | abort | history` against a history the test writes, and the store they read."""

from __future__ import annotations

import json
import re
import time
import sqlite3
import subprocess
import sys
import threading

import pytest

from rollout.commands.cli import main
from rollout.run.store import CommandRefused, RunStore
from tests.conftest import REPO

# The runs table as the first version of the store created it (no step / canary_weight).
OLD_SCHEMA = """
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY, name TEXT NOT NULL, model TEXT NOT NULL, config_json TEXT NOT NULL,
    status TEXT NOT NULL, phase TEXT, decision TEXT, exit_code INTEGER, reason TEXT,
    created_at REAL NOT NULL, updated_at REAL NOT NULL
);
CREATE TABLE events (
    run_id TEXT NOT NULL, seq INTEGER NOT NULL, time REAL NOT NULL, phase TEXT NOT NULL,
    canary_weight REAL, event TEXT NOT NULL, reason TEXT, PRIMARY KEY (run_id, seq)
);
"""


def config(k_baseline: int, k_canary: int, replicas: int = 1) -> dict:
    def arm(k: int) -> dict:
        engine = {"model": "m", "served_model_name": "tiny"}
        if k:
            engine["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
        return {"replicas": replicas, "engine": engine}

    return {"name": "demo", "baseline": arm(k_baseline), "canary": arm(k_canary)}


def gate(name: str, verdict: str) -> dict:
    return {"name": name, "metric": "m", "baseline": None, "canary": 1.0, "threshold": 0.5, "verdict": verdict,
            "detail": f"{name} said {verdict}"}


@pytest.fixture
def runs(tmp_path):
    """A history with a finished promoted run, a finished rollback, and one running in its progressive phase."""
    store = RunStore(tmp_path / "history.db")
    store.create_run("r-promoted", "demo", "tiny-mimo-v2", config(1, 3))
    store.update_run("r-promoted", status="done", decision="promote", exit_code=0, reason="every gate passed")
    store.mark_stable("tiny-mimo-v2", "r-promoted", {"speculative_config": {"num_speculative_tokens": 3}})
    store.create_run("r-rolled-back", "demo", "tiny-mimo-v2", config(1, 3, replicas=2))
    store.update_run("r-rolled-back", status="done", decision="rollback", exit_code=3,
                     reason="guard_error_rate failed in window 3\n(step 2)")
    store.create_run("r-live", "demo", "tiny-mimo-v2", config(0, 3))
    store.put_phase_result("r-live", "preflight", 1, {"canary_drafts": 12})
    store.put_phase_result("r-live", "experiment", 1, [gate("tpot_p50_improvement", "inconclusive")])
    store.put_phase_result("r-live", "experiment", 2, [gate("tpot_p50_improvement", "pass")])
    store.put_phase_result("r-live", "progressive", 1, {"step": 0, "canary_weight": 10.0,
                                                        "gates": [gate("guard_error_rate", "pass")]})
    store.add_event("r-live", "progressive", "step", "step 2/3", canary_weight=50.0)
    store.add_event("r-live", "progressive", "pause", "after step 2", canary_weight=50.0)
    store.update_run("r-live", phase="progressive", step=2, canary_weight=50.0)
    store.close()
    return tmp_path


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_status_json_of_a_running_rollout(runs, capsys):
    code, out, _ = cli(capsys, "status", "r-live", "--runs-dir", str(runs), "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["run_id"] == "r-live" and doc["phase"] == "progressive"
    assert doc["step"] == 2 and doc["canary_weight"] == 50.0
    assert doc["decision"] is None and doc["status"] == "running" and doc["paused"] is True
    verdicts = [(g["phase"], g["look"], g["name"], g["verdict"]) for g in doc["gates"]]
    assert verdicts == [
        ("experiment", 1, "tpot_p50_improvement", "inconclusive"),
        ("experiment", 2, "tpot_p50_improvement", "pass"),
        ("progressive", 1, "guard_error_rate", "pass"),
    ]
    latest = {(g["phase"], g["name"]): g["verdict"] for g in doc["latest_gates"]}
    assert latest == {("experiment", "tpot_p50_improvement"): "pass", ("progressive", "guard_error_rate"): "pass"}


def test_status_json_of_a_finished_run_has_its_decision(runs, capsys):
    code, out, _ = cli(capsys, "status", "r-rolled-back", "--runs-dir", str(runs), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["decision"] == "rollback" and doc["paused"] is False and doc["gates"] == []


def test_status_text(runs, capsys):
    code, out, _ = cli(capsys, "status", "r-live", "--runs-dir", str(runs))
    assert code == 0
    assert "PAUSED" in out and "step 2, canary weight 50%" in out and "guard_error_rate" in out


def test_status_watch_prints_each_change_until_the_run_ends_and_exits_as_run_did(runs, capsys, monkeypatch):
    # Each change waits for a read of the state before it (not a fixed sleep): the watch's first read
    # comes after its first import of rollout.run.status (0.8 s here, more on a slow machine; a sleep of
    # 0.6 s let the first change land before it when the test ran alone).
    import rollout.run.status

    reads = threading.Semaphore(0)
    read_status = rollout.run.status.run_status

    def counted(store, run_id):
        doc = read_status(store, run_id)
        reads.release()
        return doc

    monkeypatch.setattr(rollout.run.status, "run_status", counted)

    def a_read_since() -> None:
        while reads.acquire(blocking=False):  # reads before this moment do not count
            pass
        # the first read to end now may have begun before it: the second began after
        assert reads.acquire(timeout=60) and reads.acquire(timeout=60), "the watch stopped reading"

    def the_run_goes_on():
        assert reads.acquire(timeout=60), "the watch never read"
        store = RunStore(runs / "history.db")
        store.put_phase_result("r-live", "progressive", 2, {"step": 1, "canary_weight": 50.0,
                                                            "gates": [gate("guard_error_rate", "fail")]})
        a_read_since()
        store.update_run("r-live", status="done", decision="rollback", exit_code=3, reason="guard_error_rate failed")
        store.close()

    writer = threading.Thread(target=the_run_goes_on)
    writer.start()
    try:
        code, out, _ = cli(capsys, "status", "r-live", "--runs-dir", str(runs), "--watch", "--interval-s", "0.1")
    finally:
        writer.join()
    assert code == 3
    blocks = out.split("--- ")[1:]
    assert len(blocks) == 3, out  # the first read, the new gate, the decision: no repeats in between
    assert re.search(r"guard_error_rate +fail", blocks[1]) and "rollback" in blocks[2]


def test_status_watch_of_a_decided_run_prints_once_with_its_code(runs, capsys):
    code, out, _ = cli(capsys, "status", "r-promoted", "--runs-dir", str(runs), "--watch")
    assert code == 0 and out.count("--- ") == 1 and "promote" in out


@pytest.mark.parametrize("flag", ["--junit", "--decision-out"])
def test_run_refuses_a_pipeline_file_in_a_directory_that_does_not_exist_before_starting(tmp_path, capsys, flag):
    runs = tmp_path / "runs"
    code, _, err = cli(capsys, "run", str(REPO / "configs/local-cpu.yaml"), "--runs-dir", str(runs),
                       flag, str(tmp_path / "missing" / "out"))
    assert code == 2
    assert err.count("\n") == 1 and flag in err and "not a directory" in err
    assert not runs.exists()  # nothing started


def test_promote_and_abort_queue_a_command_the_run_takes_once(runs, capsys):
    code, out, _ = cli(capsys, "promote", "r-live", "--runs-dir", str(runs))
    assert code == 0 and "sent to run r-live" in out
    code, _, _ = cli(capsys, "abort", "r-live", "--runs-dir", str(runs))
    assert code == 0
    code, out, _ = cli(capsys, "status", "r-live", "--runs-dir", str(runs), "--json")
    assert json.loads(out)["pending_commands"] == ["promote", "abort"]
    store = RunStore(runs / "history.db")
    assert store.take_command("r-live", accept=("abort",)) == "abort"  # abort acts at any time
    assert store.take_command("r-live") == "promote"
    assert store.take_command("r-live") is None
    assert [c["command"] for c in store.commands("r-live")] == ["promote", "abort"]


@pytest.mark.parametrize("command", ["promote", "abort", "status"])
def test_unknown_run_exits_2_with_one_line(runs, capsys, command):
    code, out, err = cli(capsys, command, "no-such-run", "--runs-dir", str(runs))
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0 and "no run 'no-such-run'" in err


@pytest.mark.parametrize("command", ["promote", "abort"])
def test_a_finished_run_takes_no_command(runs, capsys, command):
    code, _, err = cli(capsys, command, "r-promoted", "--runs-dir", str(runs))
    assert code == 2 and "already finished (promote)" in err and err.strip().count("\n") == 0
    assert RunStore(runs / "history.db").commands("r-promoted") == []


def test_no_history_at_all_exits_2(tmp_path, capsys):
    for args in (["history"], ["status", "x"], ["promote", "x"]):
        code, _, err = cli(capsys, *args, "--runs-dir", str(tmp_path / "empty"))
        assert code == 2 and "no runs in" in err


def test_history_one_line_per_run(runs, capsys):
    code, out, _ = cli(capsys, "history", "--runs-dir", str(runs))
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3
    promoted, rolled_back, live = lines
    assert promoted.startswith("r-promoted  tiny-mimo-v2  [baseline k=1 x1, canary k=3 x1]  promote (stable)")
    assert promoted.endswith("every gate passed")
    assert "[baseline k=1 x2, canary k=3 x2]  rollback  " in rolled_back
    assert rolled_back.endswith("guard_error_rate failed in window 3 (step 2)")  # one line, whatever the reason
    assert "[baseline k=0 x1, canary k=3 x1]  running  " in live


def test_promote_from_another_process(runs):
    proc = subprocess.run(
        [sys.executable, "-m", "rollout", "promote", "r-live", "--runs-dir", str(runs)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert RunStore(runs / "history.db").take_command("r-live") == "promote"


# -- the store underneath ---------------------------------------------------------------
def test_an_old_database_gains_the_new_columns_and_tables(tmp_path):
    db = tmp_path / "history.db"
    with sqlite3.connect(db) as old:
        old.executescript(OLD_SCHEMA)
        old.execute(
            "INSERT INTO runs (run_id, name, model, config_json, status, created_at, updated_at)"
            " VALUES ('old', 'n', 'm', '{}', 'done', 1, 1)"
        )
    store = RunStore(db)
    assert store.run("old")["step"] is None and store.run("old")["canary_weight"] is None
    store.update_run("old", step=2, canary_weight=100.0)
    assert store.run("old")["step"] == 2 and store.run("old")["canary_weight"] == 100.0
    store.add_command("old", "abort")
    assert store.take_command("old") == "abort"
    RunStore(db)  # opening again changes nothing


def test_update_run_still_rejects_unknown_fields(tmp_path):
    store = RunStore(tmp_path / "history.db")
    store.create_run("r", "n", "m", {})
    with pytest.raises(ValueError):
        store.update_run("r", weight=3)
    with pytest.raises(ValueError):
        store.add_command("r", "rollback")


def test_stable_is_the_latest_promotion_per_model(tmp_path):
    store = RunStore(tmp_path / "history.db")
    assert store.stable("m") is None
    store.mark_stable("m", "r1", {"k": 1})
    store.mark_stable("other", "r9", {"k": 9})
    store.mark_stable("m", "r2", {"k": 3})
    got = store.stable("m")
    assert got["run_id"] == "r2" and got["engine"] == {"k": 3} and got["model"] == "m"
    assert store.stable_run_ids() == {"r2", "r9"}


def test_each_command_is_taken_exactly_once_by_concurrent_readers(tmp_path):
    db = tmp_path / "history.db"
    RunStore(db).create_run("r", "n", "m", {})
    writer = RunStore(db)
    writer.add_event("r", "progressive", "pause", "after step 1")  # a promote answers a pause only
    for _ in range(40):
        writer.add_command("r", "promote")
    taken: list[str] = []
    lock = threading.Lock()

    def reader() -> None:
        store = RunStore(db)
        while (got := store.take_command("r")) is not None:
            with lock:
                taken.append(got)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(taken) == 40
    assert all(c["consumed"] is not None for c in writer.commands("r"))


def test_last_look_is_where_a_resumed_phase_continues(tmp_path):
    store = RunStore(tmp_path / "history.db")
    assert store.last_look("r", "progressive") == 0
    store.put_phase_result("r", "progressive", 3, {})
    store.put_phase_result("r", "progressive", 1, {})
    assert store.last_look("r", "progressive") == 3


def test_resume_refuses_unknown_finished_and_still_controlled_runs(runs, capsys):
    import os

    from rollout.run.store import controller_identity

    assert main(["resume", "nope", "--runs-dir", str(runs)]) == 2
    assert "no run 'nope'" in capsys.readouterr().err
    assert main(["resume", "r-promoted", "--runs-dir", str(runs)]) == 2
    assert "already decided (promote)" in capsys.readouterr().err
    store = RunStore(runs / "history.db")
    store.update_run("r-live", controller=controller_identity())  # this test process: alive
    assert main(["resume", "r-live", "--runs-dir", str(runs)]) == 2
    err = capsys.readouterr().err
    assert f"still controlled by {controller_identity()}" in err and len(err.strip().splitlines()) == 1
    # a controller that is gone is reported by status
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store.update_run("r-live", controller=f"{controller_identity().rpartition(':')[0]}:{dead.pid}")
    assert main(["status", "r-live", "--runs-dir", str(runs), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["controller_alive"] is False and os.getpid() != dead.pid
    assert main(["status", "r-live", "--runs-dir", str(runs)]) == 0
    assert "`mtp-canary resume r-live` continues the run" in capsys.readouterr().out


def test_supersede_keeps_an_interrupted_attempt_apart(tmp_path):
    from loadtests.records import RequestRecord

    store = RunStore(tmp_path / "history.db")
    store.create_run("r", "demo", "m", config(1, 3))
    record = RequestRecord(request_id="a", tag="t", worker="w", sent_at=1.0, e2e_s=0.1, ok=True, status=200)
    store.add_request_samples("r", "experiment", 1, [record])
    store.put_phase_result("r", "experiment", 1, [gate("tpot_p50_improvement", "inconclusive")])
    store.put_phase_result("r", "progressive", 1, {"kept": True})
    assert store.supersede("r", ("preflight", "accuracy", "experiment"), attempt=1) == 2
    assert store.count_request_samples("r", "experiment") == 0
    assert store.count_request_samples("r", "experiment@attempt-1") == 1  # kept, not judged again
    assert store.phase_results("r", "experiment") == [] and store.phase_results("r", "progressive") == [{"kept": True}]


def test_resume_takes_over_from_another_host_only_when_its_heartbeat_is_stale_or_forced(runs, capsys, monkeypatch):
    from rollout.commands import run as run_command

    started: list = []
    monkeypatch.setattr(run_command, "drive", lambda controller, *_, **__: started.append(controller) or 0)
    monkeypatch.setattr("rollout.run.store.HEARTBEAT_S", 0.2)  # a stale heartbeat's beats are watched for two beats
    from rollout.config import load_config

    store = RunStore(runs / "history.db")
    store.create_run("r-away", "demo", "m", load_config(REPO / "configs" / "local-cpu.yaml").model_dump(mode="json"))
    store.update_run("r-away", controller="other-host.invalid:77", heartbeat_at=time.time())
    assert main(["resume", "r-away", "--runs-dir", str(runs)]) == 2  # fresh heartbeat: alive over there
    assert "still controlled by other-host.invalid:77 (alive)" in capsys.readouterr().err
    store.update_run("r-away", heartbeat_at=None)  # an old controller that never beat: cannot tell
    assert main(["resume", "r-away", "--runs-dir", str(runs)]) == 2
    assert "--force if it is gone" in capsys.readouterr().err
    assert not started
    store.update_run("r-away", heartbeat_at=time.time() - 3600)  # silent for longer than a lease: gone
    assert main(["resume", "r-away", "--runs-dir", str(runs)]) == 0 and len(started) == 1
    assert store.run("r-away")["controller"] != "other-host.invalid:77"  # claimed before the controller started
    store.update_run("r-away", controller="other-host.invalid:77", heartbeat_at=None)
    assert main(["resume", "r-away", "--runs-dir", str(runs), "--force"]) == 0 and len(started) == 2


def test_a_promote_answers_the_pause_of_that_moment_never_a_later_one(runs, capsys):
    store = RunStore(runs / "history.db")
    store.add_event("r-live", "progressive", "resume", "promote command: continuing after step 2")
    code, _, err = cli(capsys, "promote", "r-live", "--runs-dir", str(runs))  # running, not paused
    assert code == 2 and err.strip().count("\n") == 0 and "r-live is not paused: promote continues a paused step" in err
    assert store.commands("r-live") == []
    with pytest.raises(CommandRefused):
        store.add_command("r-live", "promote")
    # one queued at a pause and left there (the pause ended by its timeout) approves nothing later
    store.add_event("r-live", "progressive", "pause", "after step 3")
    store.add_command("r-live", "promote")
    store.add_event("r-live", "progressive", "pause_timeout", "no answer: promote")
    time.sleep(0.01)
    store.add_event("r-live", "progressive", "pause", "after step 4")
    assert store.take_command("r-live", accept=("promote",)) is None
    assert [c["consumed"] is not None for c in store.commands("r-live")] == [True]
    code, _, _ = cli(capsys, "promote", "r-live", "--runs-dir", str(runs))  # sent during this pause: taken
    assert code == 0 and store.take_command("r-live", accept=("promote",)) == "promote"


def test_resume_refuses_a_run_that_already_ended_in_error(runs, capsys, monkeypatch):
    from rollout.commands import run as run_command

    started: list = []
    monkeypatch.setattr(run_command, "drive", lambda controller, *_, **__: started.append(controller) or 0)
    store = RunStore(runs / "history.db")
    store.update_run("r-live", status="error", exit_code=130, reason="interrupted by SIGTERM")
    code, _, err = cli(capsys, "resume", "r-live", "--runs-dir", str(runs))
    assert code == 2 and started == []
    assert err.strip() == "mtp-canary resume: run r-live already ended in error (interrupted by SIGTERM): start it again"
    assert not store.claim("r-live", "host:1", previous=None)  # nor can anything else reopen it
