"""Run history in SQLite: one file per runs directory (`RUNS_DIR/history.db`).

Every phase result, event and sample is committed as soon as it exists, so a
run can be inspected while it goes and resumed after the controller dies.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id      TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    model       TEXT NOT NULL,
    config_json TEXT NOT NULL,
    status      TEXT NOT NULL,          -- running | done | error
    phase       TEXT,
    decision    TEXT,                   -- promote | rollback | inconclusive | NULL
    exit_code   INTEGER,
    reason      TEXT,
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    run_id        TEXT NOT NULL REFERENCES runs(run_id),
    seq           INTEGER NOT NULL,
    time          REAL NOT NULL,
    phase         TEXT NOT NULL,
    canary_weight REAL,
    event         TEXT NOT NULL,
    reason        TEXT,
    PRIMARY KEY (run_id, seq)
);
CREATE TABLE IF NOT EXISTS phase_results (
    run_id      TEXT NOT NULL REFERENCES runs(run_id),
    phase       TEXT NOT NULL,
    look        INTEGER NOT NULL,
    result_json TEXT NOT NULL,
    time        REAL NOT NULL,
    PRIMARY KEY (run_id, phase, look)
);
CREATE TABLE IF NOT EXISTS request_samples (
    run_id      TEXT NOT NULL REFERENCES runs(run_id),
    phase       TEXT NOT NULL,
    window      INTEGER NOT NULL,
    request_id  TEXT NOT NULL,
    arm         TEXT,
    record_json TEXT NOT NULL,
    PRIMARY KEY (run_id, request_id)
);
CREATE TABLE IF NOT EXISTS eval_outcomes (
    run_id       TEXT NOT NULL REFERENCES runs(run_id),
    item_id      TEXT NOT NULL,
    arm          TEXT NOT NULL,
    correct      INTEGER NOT NULL,
    outcome_json TEXT NOT NULL,
    PRIMARY KEY (run_id, item_id, arm)
);
CREATE TABLE IF NOT EXISTS commands (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id      TEXT NOT NULL,
    command     TEXT NOT NULL,          -- promote | abort
    time        REAL NOT NULL,
    consumed    REAL                    -- when the run took it; NULL while pending
);
CREATE INDEX IF NOT EXISTS commands_pending ON commands (run_id, consumed);
CREATE TABLE IF NOT EXISTS stable (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    model       TEXT NOT NULL,
    run_id      TEXT NOT NULL,
    engine_json TEXT NOT NULL,
    time        REAL NOT NULL
);
"""

# Columns added after the first schema: (table, column, type). A database written by
# an older version gets them on open (ALTER TABLE ADD COLUMN; existing rows read NULL).
ADDED_COLUMNS = (
    ("runs", "step", "INTEGER"),  # progressive phase: index of the current step (0-based)
    ("runs", "canary_weight", "REAL"),  # the canary's traffic weight (percent) as last set
    ("runs", "controller", "TEXT"),  # host:pid of the process controlling the run (resume checks it is gone)
    ("runs", "heartbeat_at", "REAL"),  # the controller's last sign of life (time.time()): seen from any host
    ("runs", "beats", "INTEGER"),  # heartbeats so far: a reader on another host watches it move on its own clock
)

# the controller beats at least this often (rollout.run.context.LeaseKeeper); a reader that doubts the
# wall clocks watches `beats` for two of these on its own monotonic clock
HEARTBEAT_S = 5.0


def wall_clock() -> float:
    """time.time(), as the liveness checks read it (a test steps it forward: never the machine's clock)."""
    return time.time()

COMMANDS = ("promote", "abort")


class CommandRefused(ValueError):
    """A command the run cannot take now (a promote while it is not paused)."""


def controller_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def run_controller_alive(run: dict[str, Any], store: RunStore | None = None) -> bool | None:
    """controller_alive for a run row: its heartbeat goes stale after one lease (`lease_s` of its
    config), when the run's actors have stopped themselves anyway.

    With `store` (a reader about to take the run over: `resume`), a controller on another host whose
    heartbeat looks stale by the wall clocks is not yet called gone: the clocks of two hosts may be
    skewed, or this one stepped forward, by more than a lease. Its beat counter is watched for two
    beats on this process's monotonic clock instead: alive if it moves."""
    try:
        lease_s = float(json.loads(run.get("config_json") or "{}").get("lease_s", 300))
    except (ValueError, TypeError, AttributeError):
        lease_s = 300.0
    alive = controller_alive(run.get("controller"), run.get("heartbeat_at"), stale_after_s=lease_s)
    if alive is False and store is not None and _on_another_host(run.get("controller")):
        return beats_move(store, run["run_id"], within_s=2 * HEARTBEAT_S + 1)
    return alive


def beats_move(store: RunStore, run_id: str, within_s: float, poll_s: float = 0.5) -> bool:
    """Whether the run's beat counter moves within `within_s` of this process's monotonic clock."""
    def beats() -> int | None:
        return (store.run(run_id) or {}).get("beats")

    first = beats()
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        if beats() != first:
            return True
    return False


def _on_another_host(identity: str | None) -> bool:
    return bool(identity) and ":" in identity and identity.rpartition(":")[0] != socket.gethostname()


def controller_alive(
    identity: str | None, heartbeat_at: float | None = None, stale_after_s: float | None = None
) -> bool | None:
    """Whether the process named by `controller_identity()` still runs.

    On this host the pid answers. On another host only the heartbeat can: alive while it is
    fresher than `stale_after_s`, gone once older; None (cannot tell) without one. A caller
    must treat None as alive: two controllers on one fleet tear each other's fleet down.
    """
    if not identity or ":" not in identity:
        return None
    host, _, pid = identity.rpartition(":")
    if host != socket.gethostname():
        if heartbeat_at is None or stale_after_s is None:
            return None
        return wall_clock() - heartbeat_at < stale_after_s
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    try:  # a zombie (killed, not yet reaped by its parent) controls nothing
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class RunStore:
    """The history database of one runs directory."""

    def __init__(self, path: str | Path, read_only: bool = False):
        """The store at `path`, created with its schema if missing. read_only: opened as it is (no
        schema set up, no WAL switch, nothing created), for a scrape or a page that only reads while
        the controller writes; sqlite3.OperationalError when there is no database at `path`."""
        self.path = Path(path)
        if read_only:
            target, uri = f"{self.path.resolve().as_uri()}?mode=ro", True
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            target, uri = str(self.path), False
        self._db = sqlite3.connect(target, uri=uri, timeout=30, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        if read_only:
            return
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)
        self._add_missing_columns()

    def _add_missing_columns(self) -> None:
        for table, column, kind in ADDED_COLUMNS:
            have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                try:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
                except sqlite3.OperationalError as exc:  # another process added it first
                    if "duplicate column" not in str(exc):
                        raise

    def close(self) -> None:
        self._db.close()

    def _tx(self, sql: str, rows: Iterable[tuple] | tuple = ()) -> None:
        with self._db:  # one transaction, committed on exit
            if isinstance(rows, tuple):
                self._db.execute("BEGIN")
                self._db.execute(sql, rows)
            else:
                self._db.execute("BEGIN")
                self._db.executemany(sql, rows)
            self._db.execute("COMMIT")

    # -- runs --------------------------------------------------------------------
    def create_run(self, run_id: str, name: str, model: str, config: dict[str, Any]) -> None:
        now = time.time()
        try:
            self._tx(
                "INSERT INTO runs (run_id, name, model, config_json, status, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, 'running', ?, ?)",
                (run_id, name, model, json.dumps(config), now, now),
            )
        except sqlite3.IntegrityError:
            raise ValueError(f"run id {run_id!r} already exists in {self.path}") from None

    def update_run(self, run_id: str, **fields: Any) -> None:
        allowed = {"status", "phase", "decision", "exit_code", "reason", "step", "canary_weight", "controller",
                   "heartbeat_at"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"unknown run fields {sorted(unknown)}")
        assignments = ", ".join(f"{k} = ?" for k in fields)
        self._tx(
            f"UPDATE runs SET {assignments}, updated_at = ? WHERE run_id = ?",
            (*fields.values(), time.time(), run_id),
        )

    def claim(self, run_id: str, identity: str, previous: str | None) -> bool:
        """Make `identity` the run's controller if `previous` still is and the run has not ended
        (compare and set on both).

        Two `resume`s started at once both see the dead controller; only one may take the run, and
        the caller must pass the controller it found gone, not one read again later (that one may be
        the other resume). A run that ended (done or error) in the meantime is never reopened."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            cursor = self._db.execute(
                "UPDATE runs SET controller = ?, status = 'running', heartbeat_at = ?, updated_at = ?"
                " WHERE run_id = ? AND controller IS ? AND status = 'running'",
                (identity, time.time(), time.time(), run_id, previous),
            )
            self._db.execute("COMMIT")
        return cursor.rowcount == 1

    def heartbeat(self, run_id: str) -> None:
        """The controller is alive (what `resume` and `status` on another host go by): the time by its
        clock, and one more beat (a count, for readers whose clock disagrees)."""
        self._tx("UPDATE runs SET heartbeat_at = ?, beats = COALESCE(beats, 0) + 1 WHERE run_id = ?",
                 (time.time(), run_id))

    def finish_run(self, run_id: str, status: str, decision: str | None, exit_code: int, reason: str,
                   stable: tuple[str, dict[str, Any]] | None = None) -> None:
        """The run's end in one transaction: its status and, for a promotion, the new stable config.

        Together or not at all: a crash between them would leave a stable canary on a run that
        `resume` decides again, or a decided run whose promotion was never recorded. A run that ends
        as an error is never the stable one (a promotion whose decision.json could not be written)."""
        now = time.time()
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                "UPDATE runs SET status = ?, decision = ?, exit_code = ?, reason = ?, updated_at = ? WHERE run_id = ?",
                (status, decision, exit_code, reason, now, run_id),
            )
            if status == "error":
                self._db.execute("DELETE FROM stable WHERE run_id = ?", (run_id,))
            if stable is not None:
                model, engine = stable
                self._db.execute(
                    "INSERT INTO stable (model, run_id, engine_json, time) VALUES (?, ?, ?, ?)",
                    (model, run_id, json.dumps(engine), now),
                )
            self._db.execute("COMMIT")

    def run(self, run_id: str) -> dict[str, Any] | None:
        row = self._db.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return dict(row) if row else None

    def runs(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._db.execute("SELECT * FROM runs ORDER BY created_at")]

    # -- events ------------------------------------------------------------------
    def add_event(self, run_id: str, phase: str, event: str, reason: str = "", canary_weight: float | None = None) -> dict:
        entry = {"time": time.time(), "phase": phase, "canary_weight": canary_weight, "event": event, "reason": reason}
        # the next seq is taken inside the INSERT: two writers (a controller and a CLI command,
        # or two processes on one run) never read the same MAX(seq) and collide
        self._tx(
            "INSERT INTO events (run_id, seq, time, phase, canary_weight, event, reason)"
            " SELECT ?, COALESCE(MAX(seq), 0) + 1, ?, ?, ?, ?, ? FROM events WHERE run_id = ?",
            (run_id, entry["time"], phase, canary_weight, event, reason, run_id),
        )
        return entry

    def events(self, run_id: str) -> list[dict[str, Any]]:
        return [
            dict(r)
            for r in self._db.execute(
                "SELECT time, phase, canary_weight, event, reason FROM events WHERE run_id = ? ORDER BY seq", (run_id,)
            )
        ]

    # -- results and samples -----------------------------------------------------
    def put_phase_result(self, run_id: str, phase: str, look: int, result: Any) -> None:
        self._tx(
            "INSERT OR REPLACE INTO phase_results (run_id, phase, look, result_json, time) VALUES (?, ?, ?, ?, ?)",
            (run_id, phase, look, json.dumps(result), time.time()),
        )

    def phase_results(self, run_id: str, phase: str) -> list[Any]:
        return [
            json.loads(r[0])
            for r in self._db.execute(
                "SELECT result_json FROM phase_results WHERE run_id = ? AND phase = ? ORDER BY look", (run_id, phase)
            )
        ]

    def add_request_samples(self, run_id: str, phase: str, window: int, records: Iterable[Any]) -> int:
        """Store request records (pydantic models); a record already stored is not counted twice."""
        rows = [(run_id, phase, window, r.request_id, r.arm, r.model_dump_json()) for r in records]
        before = self.count_request_samples(run_id)
        self._tx(
            "INSERT OR IGNORE INTO request_samples (run_id, phase, window, request_id, arm, record_json)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            rows,
        )
        return self.count_request_samples(run_id) - before

    def count_request_samples(self, run_id: str, phase: str | None = None) -> int:
        if phase is None:
            row = self._db.execute("SELECT COUNT(*) FROM request_samples WHERE run_id = ?", (run_id,)).fetchone()
        else:
            row = self._db.execute(
                "SELECT COUNT(*) FROM request_samples WHERE run_id = ? AND phase = ?", (run_id, phase)
            ).fetchone()
        return int(row[0])

    def request_samples(self, run_id: str, phase: str) -> list[tuple[int, str]]:
        """(window, record JSON) in insertion order."""
        return [
            (r[0], r[1])
            for r in self._db.execute(
                "SELECT window, record_json FROM request_samples WHERE run_id = ? AND phase = ? ORDER BY rowid",
                (run_id, phase),
            )
        ]

    def add_eval_outcomes(self, run_id: str, outcomes: Iterable[Any]) -> None:
        rows = [(run_id, o.item_id, o.arm, int(o.correct), o.model_dump_json()) for o in outcomes]
        self._tx(
            "INSERT OR REPLACE INTO eval_outcomes (run_id, item_id, arm, correct, outcome_json) VALUES (?, ?, ?, ?, ?)",
            rows,
        )

    def supersede(self, run_id: str, phases: Iterable[str], attempt: int) -> int:
        """Mark an interrupted attempt's data of `phases` as superseded (kept, never judged again).

        Phases become `PHASE@attempt-N`, eval items `ITEM@attempt-N`, so the rerun of
        those phases starts clean while no committed row is lost. Returns rows moved.
        """
        phases = tuple(phases)
        tag = f"@attempt-{attempt}"
        marks = ", ".join("?" for _ in phases)
        moved = 0
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            for table in ("request_samples", "phase_results"):
                cursor = self._db.execute(
                    f"UPDATE {table} SET phase = phase || ? WHERE run_id = ? AND phase IN ({marks})",
                    (tag, run_id, *phases),
                )
                moved += cursor.rowcount
            if "accuracy" in phases:
                cursor = self._db.execute(
                    "UPDATE eval_outcomes SET item_id = item_id || ? WHERE run_id = ? AND item_id NOT LIKE '%@attempt-%'",
                    (tag, run_id),
                )
                moved += cursor.rowcount
            self._db.execute("COMMIT")
        return moved

    def count_eval_outcomes(self, run_id: str) -> int:
        row = self._db.execute("SELECT COUNT(*) FROM eval_outcomes WHERE run_id = ?", (run_id,)).fetchone()
        return int(row[0])

    # -- commands (`mtp-canary promote|abort RUN_ID`, from any process) ----------
    def add_command(self, run_id: str, command: str) -> None:
        """Queue `promote` or `abort` for a run; the run takes it with `take_command`.

        A `promote` answers the pause the run is in now (Flagger's confirm-promotion, Argo's promote):
        sent while it is not paused it is refused (CommandRefused), never queued for a later pause."""
        if command not in COMMANDS:
            raise ValueError(f"unknown command {command!r}; known: {', '.join(COMMANDS)}")
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")  # the pause checked and the command written at one moment
            try:
                if command == "promote" and self._paused_since(run_id) is None:
                    raise CommandRefused(f"run {run_id} is not paused: promote continues a paused step only "
                                         "(sent now it would approve a later pause)")
                self._db.execute("INSERT INTO commands (run_id, command, time) VALUES (?, ?, ?)",
                                 (run_id, command, time.time()))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _paused_since(self, run_id: str) -> float | None:
        """When the run's current pause began (its last progressive pause/resume event is a pause and
        the run still runs), or None when it is not paused."""
        run = self._db.execute("SELECT status FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        last = self._db.execute(
            "SELECT time, event FROM events WHERE run_id = ? AND phase = 'progressive'"
            " AND event IN ('pause', 'resume', 'pause_timeout', 'abort', 'done') ORDER BY seq DESC LIMIT 1",
            (run_id,),
        ).fetchone()
        if run is None or run["status"] != "running" or last is None or last["event"] != "pause":
            return None
        return float(last["time"])

    def take_command(self, run_id: str, accept: Iterable[str] | None = None) -> str | None:
        """The oldest pending command of the run (marked consumed), or None.

        With `accept`, only those commands are taken; others stay pending (the
        progressive phase takes `abort` at any time, `promote` only at a pause).
        Taking is atomic: two readers never get the same command. A `promote` sent before the
        current pause began (or while none was) answers nothing: it is marked consumed, never taken.
        """
        wanted = tuple(accept) if accept is not None else COMMANDS
        if not wanted:
            return None
        marks = ", ".join("?" for _ in wanted)
        query = (
            f"SELECT seq, command FROM commands WHERE run_id = ? AND consumed IS NULL AND command IN ({marks})"
            " ORDER BY seq LIMIT 1"
        )
        # the progressive phase asks several times a second: look before taking the write lock
        if self._db.execute(query, (run_id, *wanted)).fetchone() is None:
            return None
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if "promote" in wanted:
                    since = self._paused_since(run_id)
                    self._db.execute(
                        "UPDATE commands SET consumed = ? WHERE run_id = ? AND command = 'promote'"
                        " AND consumed IS NULL AND (? IS NULL OR time < ?)",
                        (time.time(), run_id, since, since),
                    )
                row = self._db.execute(query, (run_id, *wanted)).fetchone()
                if row is not None:
                    self._db.execute("UPDATE commands SET consumed = ? WHERE seq = ?", (time.time(), row["seq"]))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return row["command"] if row is not None else None

    def commands(self, run_id: str) -> list[dict[str, Any]]:
        """Every command sent to the run, oldest first (`consumed` is None while pending)."""
        return [
            dict(r)
            for r in self._db.execute(
                "SELECT command, time, consumed FROM commands WHERE run_id = ? ORDER BY seq", (run_id,)
            )
        ]

    # -- the stable engine config per model ---------------------------------------
    def mark_stable(self, model: str, run_id: str, engine: dict[str, Any]) -> None:
        """Record that `run_id` promoted `engine` for `model`: it is the stable config from now on."""
        self._tx(
            "INSERT INTO stable (model, run_id, engine_json, time) VALUES (?, ?, ?, ?)",
            (model, run_id, json.dumps(engine), time.time()),
        )

    def stable(self, model: str) -> dict[str, Any] | None:
        """The latest stable mark of `model`: {model, run_id, engine, time}, or None if never promoted."""
        row = self._db.execute(
            "SELECT model, run_id, engine_json, time FROM stable WHERE model = ? ORDER BY seq DESC LIMIT 1", (model,)
        ).fetchone()
        if row is None:
            return None
        return {"model": row["model"], "run_id": row["run_id"], "engine": json.loads(row["engine_json"]), "time": row["time"]}

    def stable_run_ids(self) -> set[str]:
        """Run ids that are the current stable config of their model."""
        rows = self._db.execute(
            "SELECT run_id FROM stable s WHERE seq = (SELECT MAX(seq) FROM stable WHERE model = s.model)"
        )
        return {r[0] for r in rows}

    def last_look(self, run_id: str, phase: str) -> int:
        """The highest look stored for a phase (0 if none): where a resumed phase continues."""
        sql = "SELECT COALESCE(MAX(look), 0) FROM phase_results WHERE run_id = ? AND phase = ?"
        return int(self._db.execute(sql, (run_id, phase)).fetchone()[0])

    def last_sample_window(self, run_id: str, phase: str) -> int:
        """The highest window index of a phase's stored request samples (0 if none)."""
        sql = "SELECT COALESCE(MAX(window), 0) FROM request_samples WHERE run_id = ? AND phase = ?"
        return int(self._db.execute(sql, (run_id, phase)).fetchone()[0])

    def all_phase_results(self, run_id: str) -> list[dict[str, Any]]:
        """Every phase result of a run in commit order: {phase, look, time, result}."""
        return [
            {"phase": r["phase"], "look": r["look"], "time": r["time"], "result": json.loads(r["result_json"])}
            for r in self._db.execute(
                "SELECT phase, look, time, result_json FROM phase_results WHERE run_id = ? ORDER BY time, rowid",
                (run_id,),
            )
        ]


def same_question_runs(store: RunStore, run_id: str) -> list[dict[str, Any]]:
    """The runs of ``store`` that compared the same arms as ``run_id`` (its own row included), oldest first;
    [] when the store has no such run. Read-only.

    The question a run asks is its arms: the baseline's and the canary's (or the candidates') engine,
    tiny model and endpoints; a retry that changes only the plan or the gates asks it again, and spends
    alpha again. Each row is the runs row plus ``comparison`` (a short hash of that question) and
    ``alpha`` (its gates.alpha)."""
    import hashlib

    def question(config_json: str | None) -> tuple[str, float]:
        config = json.loads(config_json or "{}")
        arms = [config.get("baseline"), config.get("canary"), *(config.get("candidates") or [])]
        asked = [
            {"engine": {k: v for k, v in (arm.get("engine") or {}).items() if k != "startup_timeout_s"},
             "tiny_model": arm.get("tiny_model"), "endpoints": arm.get("endpoints")}
            for arm in arms if isinstance(arm, dict)
        ]
        digest = hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()[:12]
        return digest, float((config.get("gates") or {}).get("alpha", 0.05))

    rows = []
    for row in store.runs():
        comparison, alpha = question(row.get("config_json"))
        rows.append({**row, "comparison": comparison, "alpha": alpha})
    mine = next((r for r in rows if r["run_id"] == run_id), None)
    return [] if mine is None else [r for r in rows if r["comparison"] == mine["comparison"]]
