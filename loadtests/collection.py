"""Getting every record from the workers into one file on the master, and proving it.

Workers batch records and send them over Locust's message channel (`mtp_records`).
When a test stops, the master asks each worker to stop and flush (`mtp_flush`); the
worker answers with its last batch and a marker (`mtp_flushed`) that says how many
records and batches it sent in total. The master writes batches as they arrive, in each
worker's sequence order, and its summary compares what every worker says it sent with
what arrived: a worker that died, a lost or repeated batch, all show up as an incomplete
collection, which the Swarm turns into a failure rather than a short result.

The same pass keeps the generator honest: each worker's flush marker carries its CPU over
the test, and the master takes every open-loop record's send lag as it arrives; the
summary's `generator` (`loadtests.health`) says whether the generator limited the load.

One clock: every batch carries the worker's wall clock when it was sent, and the master
puts records of a worker whose clock is off by more than CLOCK_SKEW_TOLERANCE_S onto its
own (the controller's node, whose clock the progressive windows use): a worker on another
node with a skewed clock must not move requests out of the window they ended in.

One source: the master's port for workers binds every interface when they run on other
nodes, and Locust's channel has no authentication, so each message a worker sends carries
an HMAC of its content under the run's records key (RECORDS_KEY_ENV, which the Swarm gives
every process it starts). A message without the right MAC, or not shaped as ours, is refused:
its records are never written, and the refusal is a problem of the collection (incomplete,
never a pass).

Nothing here imports Locust or gevent; the locustfile wires these to the runner.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel, ConfigDict

from loadtests.health import GeneratorHealth, assess
from loadtests.records import RequestRecord

RECORDS_MESSAGE = "mtp_records"  # worker -> master: {"worker", "seq", "clock", "records": [...]}
# A worker clock closer than this to the master's is the same clock seen through the message
# delay (a batch may wait in the channel); beyond it, the worker's records are re-stamped.
CLOCK_SKEW_TOLERANCE_S = 0.25
FLUSH_REQUEST_MESSAGE = "mtp_flush"  # master -> workers: {"epoch"}
# worker -> master: {"worker", "epoch", "records_sent", "batches_sent", "cpu": {"cpu_s", "wall_s", "cpu_peak_pct"}}
FLUSHED_MESSAGE = "mtp_flushed"
RECORDS_KEY_ENV = "MTP_CANARY_RECORDS_KEY"  # the run's secret for the MACs of worker messages
MAC_FIELD = "mac"


def message_mac(key: str, data: Mapping[str, Any]) -> str:
    """HMAC-SHA256 of a message (every field but the MAC) in one canonical JSON form: the
    channel's msgpack gives the master back the same values the worker signed."""
    body = json.dumps({k: v for k, v in data.items() if k != MAC_FIELD}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key.encode(), body.encode(), hashlib.sha256).hexdigest()


def summary_path_for(records_path: str | Path) -> Path:
    """Where the collection summary of a records file lives (records.jsonl -> records.summary.json)."""
    return Path(records_path).with_suffix(".summary.json")


class WorkerCollection(BaseModel):
    """One worker's side of the collection."""

    model_config = ConfigDict(frozen=True)

    worker: str
    records_received: int
    batches_received: int
    records_sent: int | None  # from the worker's last flush marker; None: it never flushed
    batches_sent: int | None
    out_of_order_batches: int
    cpu_s: float | None = None  # the worker's CPU seconds (user + system) during the test
    wall_s: float | None = None  # the test's duration on the worker
    cpu_peak_pct: float | None = None  # its busiest 5 s, in % of one core
    # master clock - worker clock, estimated (least over its batches); applied to its records'
    # sent_at / scheduled_at when beyond CLOCK_SKEW_TOLERANCE_S
    clock_offset_s: float | None = None

    @property
    def complete(self) -> bool:
        return (
            self.records_sent is not None
            and self.records_sent == self.records_received
            and self.batches_sent == self.batches_received
            and self.out_of_order_batches == 0
        )


class CollectionSummary(BaseModel):
    """What the master collected; `complete` only if every worker's count adds up."""

    model_config = ConfigDict(frozen=True)

    records_path: str | None
    records_written: int
    workers: list[WorkerCollection]
    problems: list[str]
    generator: GeneratorHealth | None = None
    test_started_at: float | None = None  # epoch start of the plan: the clock of open-loop schedules and levels

    @property
    def complete(self) -> bool:
        return not self.problems and all(worker.complete for worker in self.workers)

    def describe_problems(self) -> list[str]:
        issues = list(self.problems)
        for worker in self.workers:
            if worker.records_sent is None:
                issues.append(f"worker {worker.worker} never flushed its records (died or was cut off)")
            elif not worker.complete:
                issues.append(
                    f"worker {worker.worker} sent {worker.records_sent} records in {worker.batches_sent} batches, "
                    f"master got {worker.records_received} in {worker.batches_received} "
                    f"({worker.out_of_order_batches} out of order)"
                )
        return issues

    @classmethod
    def read(cls, path: str | Path) -> CollectionSummary:
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))


class RecordShipper:
    """Worker side: buffers records and sends them in numbered batches.

    `send(message_type, data)` is the runner's `send_message` (or, in a local run, a
    direct call into the collector).
    """

    def __init__(
        self, worker: str, send: Callable[[str, dict[str, Any]], None], batch_size: int = 200,
        clock: Callable[[], float] = time.time, key: str | None = None,
    ) -> None:
        self.worker = worker
        self._key = key
        self._send_raw = send
        self._clock = clock
        self._batch_size = batch_size
        self._buffer: list[dict[str, Any]] = []
        self.records_sent = 0
        self.batches_sent = 0

    def _send(self, message_type: str, data: dict[str, Any]) -> None:
        if self._key:
            data[MAC_FIELD] = message_mac(self._key, data)
        self._send_raw(message_type, data)

    def add(self, record: RequestRecord) -> None:
        self._buffer.append(record.model_dump(mode="json"))
        if len(self._buffer) >= self._batch_size:
            self.flush()

    def flush(self) -> None:
        """Send what is buffered as one batch (nothing when empty)."""
        if not self._buffer:
            return
        # count before sending: a send may yield to another greenlet that flushes too,
        # and each batch must keep its own sequence number
        batch, self._buffer = self._buffer, []
        seq = self.batches_sent
        self.batches_sent += 1
        self.records_sent += len(batch)
        self._send(RECORDS_MESSAGE, {"worker": self.worker, "seq": seq, "clock": self._clock(), "records": batch})

    def flush_final(self, epoch: int, cpu: Mapping[str, float | None] | None = None) -> None:
        """Send the rest and the marker the master counts against (with this process's
        CPU over the test, `CpuMeter.report`)."""
        self.flush()
        self._send(
            FLUSHED_MESSAGE,
            {
                "worker": self.worker,
                "epoch": epoch,
                "records_sent": self.records_sent,
                "batches_sent": self.batches_sent,
                "cpu": dict(cpu) if cpu is not None else None,
            },
        )


class _WorkerTally:
    def __init__(self) -> None:
        self.records_received = 0
        self.batches_received = 0
        self.next_seq = 0
        self.out_of_order = 0
        self.flushed: Mapping[str, Any] | None = None
        self.send_lags: list[float] = []  # open loop: sent_at - scheduled_at, seconds
        self.clock_offset: float | None = None  # master - worker clock: the least seen over its batches


class RecordCollector:
    """Master side: writes arriving batches to one JSONL file and keeps the tally.

    With no path it only counts (a web-UI session that keeps no records). The limits
    decide when the summary calls the generator the bottleneck.
    """

    def __init__(
        self, path: str | Path | None, cpu_warn_pct: float = 85.0, lag_warn_ms: float = 50.0,
        clock: Callable[[], float] = time.time, key: str | None = None,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self._key = key
        self.refused: dict[str, int] = {}  # claimed worker -> messages refused (not ours, or not our shape)
        self._clock = clock
        self.cpu_warn_pct = cpu_warn_pct
        self.lag_warn_ms = lag_warn_ms
        self._file: TextIO | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")
        self._tallies: dict[str, _WorkerTally] = {}
        self._problems: list[str] = []
        self.records_written = 0
        self.test_started_at: float | None = None

    def expect_worker(self, worker: str) -> None:
        """A worker connected: from now on its records are owed."""
        self._tallies.setdefault(worker, _WorkerTally())

    @property
    def known_workers(self) -> list[str]:
        return list(self._tallies)

    def _refuse(self, kind: str, data: Any) -> bool:
        """Whether a message must be refused; a refusal is counted and named as a problem."""
        worker = str(data.get("worker"))[:80] if isinstance(data, Mapping) else "?"
        if not isinstance(data, Mapping) or not isinstance(data.get("worker"), str):
            why = "not shaped as a worker's message"
        elif self._key and not (isinstance(data.get(MAC_FIELD), str)
                                and hmac.compare_digest(data[MAC_FIELD], message_mac(self._key, data))):
            why = "not signed with this run's records key (a record source that is not ours)"
        elif kind == RECORDS_MESSAGE and not (isinstance(data.get("seq"), int) and isinstance(data.get("records"), list)
                                              and all(isinstance(r, dict) for r in data["records"])):
            why = "not shaped as a batch of records"
        elif kind == FLUSHED_MESSAGE and not (isinstance(data.get("epoch"), int)
                                              and isinstance(data.get("records_sent"), int)):
            why = "not shaped as a flush marker"
        else:
            return False
        count = self.refused[worker] = self.refused.get(worker, 0) + 1
        if count == 1:
            self._problems.append(f"refused a {kind} message claiming worker {worker!r}: {why}")
        return True

    def receive_batch(self, data: Mapping[str, Any]) -> None:
        if self._refuse(RECORDS_MESSAGE, data):
            return
        tally = self._tallies.setdefault(str(data["worker"]), _WorkerTally())
        if data["seq"] != tally.next_seq:
            tally.out_of_order += 1
        tally.next_seq = max(tally.next_seq, int(data["seq"]) + 1)
        records = data["records"]
        self._onto_master_clock(tally, data.get("clock"), records)
        lags = tally.send_lags
        for record in records:
            scheduled_at = record.get("scheduled_at")
            if scheduled_at is not None:
                lags.append(record["sent_at"] - scheduled_at)
        tally.batches_received += 1
        tally.records_received += len(records)
        if self._file is not None:
            self._file.write("".join(json.dumps(record, separators=(",", ":")) + "\n" for record in records))
            # a crash of the master keeps what arrived so far
            self._file.flush()
        self.records_written += len(records)

    def _onto_master_clock(self, tally: _WorkerTally, worker_clock: Any, records: list[dict[str, Any]]) -> None:
        if worker_clock is None:
            return
        seen = self._clock() - float(worker_clock)  # the offset plus this batch's delay: never below the offset
        tally.clock_offset = seen if tally.clock_offset is None else min(tally.clock_offset, seen)
        offset = tally.clock_offset
        if abs(offset) <= CLOCK_SKEW_TOLERANCE_S:
            return
        for record in records:
            for key in ("sent_at", "scheduled_at"):
                if record.get(key) is not None:
                    record[key] = record[key] + offset

    def receive_flushed(self, data: Mapping[str, Any]) -> None:
        if self._refuse(FLUSHED_MESSAGE, data):
            return
        self._tallies.setdefault(str(data["worker"]), _WorkerTally()).flushed = dict(data)

    def has_flushed(self, worker: str, epoch: int) -> bool:
        tally = self._tallies.get(worker)
        return tally is not None and tally.flushed is not None and tally.flushed["epoch"] >= epoch

    def note_problem(self, problem: str) -> None:
        self._problems.append(problem)

    def summary(self) -> CollectionSummary:
        workers = []
        for worker, tally in sorted(self._tallies.items()):
            flushed = tally.flushed or {}
            cpu = flushed.get("cpu") or {}
            workers.append(
                WorkerCollection(
                    worker=worker,
                    records_received=tally.records_received,
                    batches_received=tally.batches_received,
                    records_sent=flushed.get("records_sent"),
                    batches_sent=flushed.get("batches_sent"),
                    out_of_order_batches=tally.out_of_order,
                    cpu_s=cpu.get("cpu_s"),
                    wall_s=cpu.get("wall_s"),
                    cpu_peak_pct=cpu.get("cpu_peak_pct"),
                    clock_offset_s=tally.clock_offset,
                )
            )
        generator = assess(
            [(w, (t.flushed or {}).get("cpu"), t.send_lags) for w, t in sorted(self._tallies.items())],
            cpu_warn_pct=self.cpu_warn_pct,
            lag_warn_ms=self.lag_warn_ms,
        )
        return CollectionSummary(
            records_path=str(self.path) if self.path is not None else None,
            records_written=self.records_written,
            workers=workers,
            problems=list(self._problems),
            generator=generator,
            test_started_at=self.test_started_at,
        )

    def close(self) -> CollectionSummary:
        """Close the records file and write the summary next to it; returns the summary."""
        summary = self.summary()
        if self._file is not None:
            self._file.close()
            self._file = None
            assert self.path is not None
            summary_path_for(self.path).write_text(summary.model_dump_json(indent=2), encoding="utf-8")
        return summary
