"""Streaming LLM traffic for Locust: users who ask, read the streamed answer, and ask again.

Runs on its own (`locust -f loadtests/locustfile.py --host http://ROUTER:PORT`, web UI
or headless) and as the master and workers a `loadtests.swarm.Swarm` starts. Traffic
options are the `--mtp-*` flags (listed by `python -m loadtests.options --help`; Locust's
own --help runs before this file is imported).

Closed loop (default): each user keeps one request in flight; concurrency = users.
Open loop (`--mtp-rate R`): requests leave on a global schedule of R/s shared by all
workers; users are the most requests that can be in flight at once, and a request that
finds every user busy leaves late (its record's `send_lag_s` says how late). A trace
(`--mtp-dataset trace`) is open loop at the trace's own times (`--mtp-trace-speedup`).
Multi-turn sessions (`--mtp-dataset multi_turn`): each user keeps one session, turn after turn.

Load profiles (`--mtp-steps 1,4,16 --mtp-step-s 30`, `--mtp-ramp 1:16 --mtp-ramp-s 60`)
play as a Locust load shape: closed loop, level x --mtp-level-users users; open loop,
level x --mtp-rate requests/s on the global schedule. Each record carries its level.

Every request becomes a `RequestRecord`; the master (or the single local process)
writes them all to `--mtp-records`. Locust's statistics get one row per arm
("[baseline] /v1/completions") for watching, never for judging. Each process measures
its CPU over the test and the master the open-loop send lag; when the generator, not the
server, limits the load, the master logs it and the records summary says so. With a web
UI and a run named in its environment (loadtests.console.console_spec), the master's UI
has a Rollout tab: the run's phase, look, gates and canary weight, and Promote / Abort.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
import uuid
from pathlib import Path

# `locust -f path/to/loadtests/locustfile.py` imports this file as a plain module: make
# the package it belongs to importable from any working directory.
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)
if _PACKAGE_PARENT not in sys.path:
    sys.path.insert(0, _PACKAGE_PARENT)

import gevent  # noqa: E402
import psutil  # noqa: E402
from locust import User, events, task  # noqa: E402
from locust.env import Environment  # noqa: E402
from locust.exception import StopUser  # noqa: E402
from locust.runners import (  # noqa: E402
    STATE_MISSING,
    STATE_RUNNING,
    STATE_SPAWNING,
    LocalRunner,
    MasterRunner,
    WorkerRunner,
)

from loadtests import console, shapes  # noqa: E402  (the module: a shape class here would always run)
from loadtests.collection import (  # noqa: E402
    FLUSH_REQUEST_MESSAGE,
    FLUSHED_MESSAGE,
    RECORDS_KEY_ENV,
    RECORDS_MESSAGE,
    RecordCollector,
    RecordShipper,
)
from loadtests.openai_stream import OpenAIStreamClient, RecordLabels  # noqa: E402
from loadtests.health import PEAK_WINDOW_S, CpuMeter  # noqa: E402
from loadtests.options import TrafficOptions, cli_arguments  # noqa: E402
from loadtests.records import RequestRecord  # noqa: E402
from loadtests.traffic import SlotPlan, TrafficShare  # noqa: E402

logger = logging.getLogger("mtp_canary.loadtests")

# set by whoever starts this process (the Swarm): when that process is gone, so is the
# reason to run; its own session keeps this process away from its parent's signals
PARENT_PID_ENV = "MTP_CANARY_PARENT_PID"
PLAN_MESSAGE = "mtp_plan"  # master -> workers at each test start: {"slots", "n_slots", "start_at"}
SHIP_INTERVAL_S = 1.0  # how often a worker sends what it has, so the master's file grows live
# open loop: the schedule starts this long after the test does, so that the workers have
# their plan and their first users before the first request is due (else the first
# requests leave late and the lag says the generator could not keep up)
OPEN_LOOP_LEAD_S = 0.5
# a user whose next open-loop request is never due (a profile that ends at level 0) waits in
# slices this long; the test's end interrupts the wait
_LONGEST_WAIT_S = 3600.0


class StreamFailure(Exception):
    """A failed request as Locust's failure table shows it (the record holds the details)."""


class _Process:
    """This Locust process's part in the collection and the traffic."""

    def __init__(self) -> None:
        self.worker_id = "local"
        self.collector: RecordCollector | None = None  # master or local run
        self.shipper: RecordShipper | None = None  # worker or local run
        self.plan: SlotPlan | None = None  # worker: from the master's plan message
        self.traffic: TrafficShare | None = None  # worker or local run, rebuilt per test
        self.flush_epoch = 0
        self.flush_timeout_s = TrafficOptions.model_fields["flush_timeout_s"].default
        self.cpu = CpuMeter()  # worker or local run: this process's CPU during the test
        self.cpu_warned = False  # warned (once per test) that this process is near a full core
        self.started_at: float | None = None  # master or local run: epoch start of the plan (profile clock)

    def cpu_report(self) -> dict[str, float | None]:
        return self.cpu.report(_cpu_seconds(), time.monotonic())


_process = _Process()


@events.init_command_line_parser.add_listener
def _add_traffic_flags(parser, **_kwargs) -> None:
    for argument in cli_arguments():
        parser.add_argument(argument.flag, include_in_web_ui=argument.in_web_ui, **argument.kwargs)


def _cpu_seconds() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


def _ship_periodically() -> None:
    while True:
        gevent.sleep(SHIP_INTERVAL_S)
        _warn_when_busy(_process.cpu.sample(_cpu_seconds(), time.monotonic()))
        if _process.shipper is not None:
            try:
                _process.shipper.flush()
            except Exception:  # a lost batch shows in the summary's counts; keep shipping the rest
                logger.exception("sending a batch of records to the master failed")


def _warn_when_busy(share: float | None) -> None:
    """Say it while the test runs (the summary says it again at the end): this process is
    near a full core, so it, not the server, may be what limits the load."""
    traffic = _process.traffic
    if share is None or traffic is None or _process.cpu_warned:
        return
    if 100.0 * share > traffic.options.cpu_warn_pct:
        _process.cpu_warned = True
        logger.warning(
            "generator limited: this load generator process (%s) used %.0f%% of one core over the last %.0f s "
            "(limit %g%%): it, not the server, may limit the load; add workers or lower the load per worker",
            _process.worker_id, 100.0 * share, PEAK_WINDOW_S, traffic.options.cpu_warn_pct,
        )


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        gevent.sleep(1.0)
        if os.getppid() != parent_pid:
            # records so far are on disk (the master flushes every batch); nobody waits for more
            logger.error("the process that started this Locust (pid %d) is gone; exiting", parent_pid)
            logging.shutdown()
            os._exit(3)


@events.init.add_listener
def _on_init(environment: Environment, **_kwargs) -> None:
    runner = environment.runner
    # everything imported so far lives for the whole run: a full garbage collection in the
    # middle of a test must not walk it (a pause that would bend the timestamps)
    gc.collect()
    gc.freeze()
    if os.environ.get(PARENT_PID_ENV):
        gevent.spawn(_exit_with_parent, int(os.environ[PARENT_PID_ENV]))
    if isinstance(runner, WorkerRunner):
        # a worker's own flags are defaults; the master's arrive with each spawn message
        _process.worker_id = runner.client_id
        _process.shipper = RecordShipper(runner.client_id, runner.send_message, key=os.environ.get(RECORDS_KEY_ENV))
        runner.register_message(PLAN_MESSAGE, _on_plan)
        # concurrent: stopping may wait for users (--stop-timeout); the message loop must go on
        runner.register_message(FLUSH_REQUEST_MESSAGE, _on_flush_request, concurrent=True)
        gevent.spawn(_ship_periodically)
        return

    try:
        options = TrafficOptions.from_namespace(environment.parsed_options)
        # open the dataset once here so a bad path stops the run before any load is sent
        TrafficShare(options, SlotPlan(0, 1, time.time()))
    except ValueError as exc:
        logger.error("invalid load test options: %s", exc)
        sys.exit(2)
    if console.guard(environment):  # any web UI: Locust's own routes steer the load and answer every origin
        logger.info("web UI: cross-origin and (under mtp-canary) all load-changing requests are refused")
    if console.install(environment):  # only with a web UI and a run to show (console_spec)
        logger.info("rollout console: the %r tab of the web UI", console.TAB_TITLE)
    collector = RecordCollector(options.records, cpu_warn_pct=options.cpu_warn_pct, lag_warn_ms=options.lag_warn_ms,
                                key=os.environ.get(RECORDS_KEY_ENV))
    _process.collector = collector
    _process.flush_timeout_s = options.flush_timeout_s
    profile = options.profile
    if profile is not None:
        # the profile decides the users (closed loop) and when the test ends
        shape = shapes.ProfileShape(
            profile,
            level_users=None if options.open_loop else options.level_users,
            cap_users=environment.parsed_options.num_users or 1,
            origin=lambda: _process.started_at,
        )
        shape.runner = runner
        environment.shape_class = shape
        logger.info("load profile: %s (%s)", profile.describe(),
                    "x --mtp-rate requests/s" if options.open_loop else f"x {options.level_users:g} users")
    if isinstance(runner, MasterRunner):
        runner.register_message(RECORDS_MESSAGE, lambda msg, **_: _receive(environment, collector, msg.data))
        runner.register_message(FLUSHED_MESSAGE, lambda msg, **_: collector.receive_flushed(msg.data))
        environment.events.worker_connect.add_listener(lambda client_id, **_: collector.expect_worker(client_id))
    elif isinstance(runner, LocalRunner):
        # a single process: records go straight into the collector, through the same
        # batching and counting as a worker's, so the summary means the same thing
        def deliver_locally(message_type: str, data: dict) -> None:
            if message_type == RECORDS_MESSAGE:
                _receive(environment, collector, data)
            elif message_type == FLUSHED_MESSAGE:
                collector.receive_flushed(data)

        _process.shipper = RecordShipper("local", deliver_locally, key=os.environ.get(RECORDS_KEY_ENV))
        collector.expect_worker("local")
        gevent.spawn(_ship_periodically)


def _receive(environment: Environment, collector, data) -> None:
    """A batch of records into the records file; a file that cannot be written (a full disk) ends the
    load with a non-zero exit: records lost quietly would stall the experiment until its time cap."""
    try:
        collector.receive_batch(data)
    except OSError as exc:
        if environment.process_exit_code != 1:
            logger.error("request records not written: %s: the load stops", exc)
            collector.note_problem(f"request records not written: {exc}")
            environment.process_exit_code = 1
            gevent.spawn(environment.runner.quit)


def _on_plan(environment: Environment, msg, **_kwargs) -> None:
    runner = environment.runner
    slots = msg.data["slots"]
    if runner.client_id not in slots:
        logger.warning("the master's plan has no slot for this worker; it will not send")
        _process.plan = None
        return
    _process.plan = SlotPlan(slots[runner.client_id], msg.data["n_slots"], msg.data["start_at"])


@events.test_start.add_listener
def _on_test_start(environment: Environment, **_kwargs) -> None:
    runner = environment.runner
    if isinstance(runner, MasterRunner):
        # partition the global sequence and rate among the workers that will get users,
        # in worker-index order; sent before the spawn messages on the same channel
        workers = sorted(
            (node.id for node in runner.clients.ready + runner.clients.spawning + runner.clients.running),
            key=runner.get_worker_index,
        )
        _process.started_at = time.time() + _schedule_lead_s(environment)
        if _process.collector is not None:
            _process.collector.test_started_at = _process.started_at
        plan = {"slots": {worker: slot for slot, worker in enumerate(workers)}, "n_slots": len(workers),
                "start_at": _process.started_at}
        runner.send_message(PLAN_MESSAGE, plan)
        return

    _process.cpu.start(_cpu_seconds(), time.monotonic())
    _process.cpu_warned = False
    if isinstance(runner, LocalRunner):
        _process.started_at = time.time() + _schedule_lead_s(environment)
        if _process.collector is not None:
            _process.collector.test_started_at = _process.started_at
        plan = SlotPlan(0, 1, _process.started_at)
    else:
        plan = _process.plan
    try:
        options = TrafficOptions.from_namespace(environment.parsed_options)
        _process.traffic = TrafficShare(options, plan) if plan is not None else None
    except ValueError as exc:
        # fail the process rather than send nothing quietly; the Swarm sees the exit code
        logger.error("invalid load test options: %s", exc)
        _process.traffic = None
        environment.process_exit_code = 2
        gevent.spawn(runner.quit)


@events.test_stopping.add_listener
def _on_test_stopping(environment: Environment, **_kwargs) -> None:
    """Master: before the workers are told to stop or quit, collect everything they hold."""
    runner = environment.runner
    if not isinstance(runner, MasterRunner) or _process.collector is None:
        return
    collector = _process.collector
    _process.flush_epoch += 1
    epoch = _process.flush_epoch
    waiting = {node.id for node in runner.clients.all if node.state != STATE_MISSING}
    for worker in collector.known_workers:
        # it flushed when it left, but its share of the test was cut short
        if worker not in waiting and not collector.has_flushed(worker, epoch):
            collector.note_problem(f"worker {worker} left before the test stopped")
    if not waiting:
        return
    runner.send_message(FLUSH_REQUEST_MESSAGE, {"epoch": epoch})
    deadline = time.monotonic() + _process.flush_timeout_s + (environment.stop_timeout or 0)
    while waiting and time.monotonic() < deadline:
        gevent.sleep(0.05)
        # a worker that quit or went missing will never answer; the summary will say so
        waiting = {w for w in waiting if w in runner.clients and not collector.has_flushed(w, epoch)}
    if waiting:
        message = f"no final records from worker(s) {sorted(waiting)} within {_process.flush_timeout_s:g}s"
        logger.error(message)
        collector.note_problem(message)


def _schedule_lead_s(environment: Environment) -> float:
    options = environment.parsed_options
    open_loop = getattr(options, "mtp_rate", None) or getattr(options, "mtp_dataset", None) == "trace"
    return OPEN_LOOP_LEAD_S if open_loop else 0.0


def _on_flush_request(environment: Environment, msg, **_kwargs) -> None:
    """Worker: stop the users (their in-flight requests become records), then flush."""
    _process.flush_epoch = max(_process.flush_epoch, msg.data["epoch"])
    runner = environment.runner
    if runner.state in (STATE_RUNNING, STATE_SPAWNING):
        runner.stop()  # fires test_stop, which flushes
    elif _process.shipper is not None:
        _process.shipper.flush_final(_process.flush_epoch, _process.cpu_report())


@events.test_stop.add_listener
def _on_test_stop(environment: Environment, **_kwargs) -> None:
    # users are stopped by now: every record of this test is in the shipper's buffer
    if _process.shipper is not None:
        _process.shipper.flush_final(_process.flush_epoch, _process.cpu_report())


@events.quitting.add_listener
def _on_quitting(environment: Environment, **_kwargs) -> None:
    runner = environment.runner
    if _process.collector is None:
        return
    # a SIGTERM or Ctrl-C mid-test: stop properly first so the workers' records arrive
    if runner is not None and runner.state in (STATE_RUNNING, STATE_SPAWNING):
        if isinstance(runner, MasterRunner):
            runner.quit()
        else:
            runner.stop()
    summary = _process.collector.close()
    if summary.records_path is not None:
        logger.info("wrote %d request records to %s", summary.records_written, summary.records_path)
    for problem in summary.describe_problems():
        logger.error("record collection incomplete: %s", problem)
    if summary.generator is not None:
        for warning in summary.generator.warnings:
            logger.warning("generator limited: %s", warning)


class LLMStreamUser(User):
    """A client of an LLM service: it asks, reads the streamed answer to its end, and asks again."""

    def on_start(self) -> None:
        traffic = _process.traffic
        if traffic is None:
            raise StopUser()
        if self.host is None:
            raise ValueError("no host: pass --host http://ROUTER:PORT")
        self.client = OpenAIStreamClient(self.host, timeout_s=traffic.options.timeout_s,
                                         deadline_s=traffic.options.deadline_s)
        if traffic.model is None:
            try:
                traffic.model = self.client.first_model()
            except Exception as exc:  # the requests themselves will show what is wrong
                logger.warning("could not read the model name from %s/v1/models: %s", self.host, exc)
        self._due_at: float | None = None
        self._arm = traffic.join()
        self._conversation = traffic.conversation()  # multi-turn: the session this user keeps

    def on_stop(self) -> None:
        traffic = _process.traffic
        if traffic is not None:
            traffic.leave(getattr(self, "_arm", None))
        client = getattr(self, "client", None)
        if client is not None:
            client.close()

    def wait_time(self) -> float:
        """Open loop: the time until the request this user holds is due; closed loop: none."""
        if self._due_at is None:
            return 0.0
        return min(_LONGEST_WAIT_S, max(0.0, self._due_at - time.time()))

    @task
    def ask_and_read_the_streamed_answer(self) -> None:
        traffic = _process.traffic
        if traffic is None:
            raise StopUser()
        ends_at = traffic.ends_at
        if ends_at is not None and time.time() >= ends_at:
            raise StopUser()  # the profile is over: the shape stops the test at its next tick
        ticket = traffic.next_ticket(getattr(self, "_arm", None), getattr(self, "_conversation", None))
        if ends_at is not None and ticket.scheduled_at is not None and ticket.scheduled_at >= ends_at:
            raise StopUser()
        if ticket.scheduled_at is not None:
            # Locust's wait() lets a stopping test end this sleep, unlike a plain sleep
            self._due_at = ticket.scheduled_at
            while self._due_at > time.time():
                self.wait()
            self._due_at = None
        labels = RecordLabels(
            request_id=uuid.uuid4().hex,
            tag=traffic.options.tag,
            worker=_process.worker_id,
            dataset_index=ticket.prompt.index,
            session=ticket.prompt.session,
            turn=ticket.prompt.turn,
            scheduled_at=ticket.scheduled_at,
            level=traffic.level_at(ticket.scheduled_at if ticket.scheduled_at is not None else time.time()),
        )
        result = self.client.stream(ticket.request, labels, on_cancelled=self._keep)
        self._keep(result.record)
        self._report_to_locust_stats(result.record, ticket.request.path, result.response_bytes)

    def _keep(self, record: RequestRecord) -> None:
        if _process.shipper is not None:
            _process.shipper.add(record)

    def _report_to_locust_stats(self, record: RequestRecord, path: str, response_bytes: int) -> None:
        label = f"[{record.arm}] " if record.arm else ""
        fire = self.environment.events.request.fire
        fire(
            request_type="POST",
            name=f"{label}{path}",
            response_time=record.e2e_s * 1000.0,
            response_length=response_bytes,
            exception=None if record.ok else StreamFailure(record.error),
            context={},
        )
        if _process.traffic is not None and _process.traffic.options.ui_latency_rows and record.ok:
            if record.ttft_s is not None:
                fire(request_type="TTFT", name=label.strip() or "all", response_time=record.ttft_s * 1000.0,
                     response_length=0, exception=None, context={})
            if record.tpot_s is not None:
                fire(request_type="TPOT", name=label.strip() or "all", response_time=record.tpot_s * 1000.0,
                     response_length=0, exception=None, context={})
