"""Only the run's own workers' records are judged, and a record that cannot be read fails closed.

The master's port for workers binds every interface when they run on other nodes, and
Locust's channel has no authentication: a rogue worker could inject records of either arm.
The collector refuses every message not signed with the run's records key (and every one not
shaped as ours) and counts the refusal as a problem of the collection; the records tail
refuses a line that is not a record (loadtests.collection, loadtests.records). The live test
connects a rogue Locust worker (the real locustfile, without the key) to a Swarm's master.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from loadtests.collection import MAC_FIELD, RECORDS_KEY_ENV, RECORDS_MESSAGE, RecordCollector, RecordShipper
from loadtests.options import TrafficOptions
from loadtests.records import RecordsError, RecordsTail, RequestRecord
from loadtests.swarm import Swarm, SwarmError, SwarmSpec, free_port, locust_environment, worker_command
from tests.conftest import REPO

sys.path.insert(0, str(REPO))
from benchmarks.stream_target import TargetProcess  # noqa: E402

KEY = "k" * 64


def _record(arm: str = "baseline", e2e_s: float = 0.5) -> RequestRecord:
    return RequestRecord(request_id=f"r-{arm}-{e2e_s}", tag="experiment", worker="w0", arm=arm, sent_at=1.0,
                         ttft_s=0.1, e2e_s=e2e_s, output_tokens=8, chunks=8, ok=True, status=200)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_runs_own_signed_records_are_collected(tmp_path):
    collector = RecordCollector(tmp_path / "r.jsonl", key=KEY)
    shipper = RecordShipper("w0", lambda kind, data: getattr(collector, "receive_batch" if kind == RECORDS_MESSAGE
                                                             else "receive_flushed")(data), batch_size=2, key=KEY)
    collector.expect_worker("w0")
    for e2e in (0.5, 0.6, 0.7):
        shipper.add(_record(e2e_s=e2e))
    shipper.flush_final(epoch=1)
    summary = collector.close()
    assert summary.complete, summary.describe_problems()
    assert len(_lines(tmp_path / "r.jsonl")) == 3 and collector.refused == {}


def test_a_rogue_source_is_refused_and_the_collection_fails_closed(tmp_path):
    collector = RecordCollector(tmp_path / "r.jsonl", key=KEY)
    collector.expect_worker("w0")
    signed: list[dict] = []
    RecordShipper("w0", lambda kind, data: signed.append(data), batch_size=1, key=KEY).add(_record())
    rogue = {"worker": "w0", "seq": 1, "clock": time.time(),
             "records": [_record("canary", 0.01).model_dump(mode="json")]}
    collector.receive_batch(rogue)  # no MAC: not ours
    collector.receive_batch({**rogue, MAC_FIELD: "0" * 64})  # a forged MAC
    tampered = json.loads(json.dumps(signed[0]))
    tampered["records"][0]["arm"] = "canary"  # a genuine batch, one field changed in flight
    collector.receive_batch(tampered)
    collector.receive_batch(["not", "a", "mapping"])  # never raises in the master's message loop
    collector.receive_flushed({"worker": "w0", "epoch": 1, "records_sent": 1, "batches_sent": 1})
    assert _lines(tmp_path / "r.jsonl") == []
    summary = collector.close()
    assert not summary.complete
    problems = " ".join(summary.describe_problems())
    assert "a record source that is not ours" in problems
    assert collector.refused["w0"] == 4


def test_a_malformed_message_from_our_own_key_is_refused_too(tmp_path):
    collector = RecordCollector(tmp_path / "r.jsonl", key=KEY)
    sent: list[dict] = []
    shipper = RecordShipper("w0", lambda kind, data: sent.append(data), key=KEY)
    shipper._send(RECORDS_MESSAGE, {"worker": "w0", "seq": "x", "records": "nope"})
    collector.receive_batch(sent[0])
    assert "not shaped as a batch of records" in " ".join(collector.close().describe_problems())


def test_a_line_that_is_not_a_record_fails_the_tail_not_silently_shrinks_it(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(_record().model_dump_json() + "\n" + '{"arm": "canary", "e2e_s": \n')
    tail = RecordsTail(path)
    with pytest.raises(RecordsError, match="not a request record"):
        tail.read()
    assert tail.bad_lines == 1
    # SwarmError: the controller's infrastructure failure (exit 1), never a verdict on the rest
    assert issubclass(RecordsError, SwarmError)


def test_a_swarm_gives_its_processes_a_records_key_and_keeps_one_given():
    traffic = TrafficOptions(dataset="synthetic", input_tokens="8", max_tokens=8, records="/tmp/x.jsonl")
    spec = SwarmSpec(host="http://127.0.0.1:9", traffic=traffic, users=1, run_time_s=1, n_workers=0)
    key = Swarm(spec).spec.env[RECORDS_KEY_ENV]
    assert len(key) == 64 and key != Swarm(spec).spec.env[RECORDS_KEY_ENV]
    assert RECORDS_KEY_ENV not in spec.env and key not in repr(Swarm(spec).spec)
    given = spec.model_copy(update={"env": {RECORDS_KEY_ENV: "given"}})
    assert Swarm(given).spec.env[RECORDS_KEY_ENV] == "given"


def test_a_rogue_locust_worker_on_the_masters_port_is_refused(tmp_path):
    """A Locust worker that is not the run's (the real locustfile, no key) connects to the master's
    port: none of its records reach the file, and the run fails naming it."""
    port = free_port()
    records = tmp_path / "records.jsonl"
    rogue_env = {k: v for k, v in locust_environment().items() if k != RECORDS_KEY_ENV}
    with TargetProcess(ttft_ms=5, tpot_ms=2) as target:
        traffic = TrafficOptions(dataset="synthetic", input_tokens="8", max_tokens=8, model="target",
                                 records=str(records), ignore_eos=True, flush_timeout_s=10)
        spec = SwarmSpec(host=target.url, traffic=traffic, users=2, run_time_s=8, n_workers=1, master_port=port, stop_timeout_s=2,
                         log_dir=tmp_path / "locust")
        swarm = Swarm(spec)
        outcome: list[object] = []
        runner = threading.Thread(target=lambda: outcome.append(_run(swarm)), daemon=True)
        runner.start()
        rogue_log = open(tmp_path / "rogue.log", "wb")
        # it connects before the run's own worker (Locust's worker retries until the master listens)
        rogue = subprocess.Popen(worker_command("127.0.0.1", port, python=sys.executable), env=rogue_env,
                                 stdout=rogue_log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
        try:
            runner.join(240)
        finally:
            rogue.kill()
            rogue.wait(30)
            rogue_log.close()
    assert outcome and isinstance(outcome[0], SwarmError), outcome
    assert "a record source that is not ours" in str(outcome[0]), outcome[0]
    # two sources had users; the file holds one's records: the run's own worker
    workers = {line["worker"] for line in _lines(records)} if records.exists() else set()
    assert len(workers) == 1, workers
    summary = json.loads(records.with_suffix(".summary.json").read_text())
    assert any("not ours" in problem for problem in summary["problems"]), summary


def _run(swarm: Swarm) -> object:
    try:
        return swarm.run()
    except SwarmError as exc:
        return exc
