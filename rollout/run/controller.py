"""The rollout controller: one run from config to decision, as an ordered list of phases.

    prepare      tiny checkpoints written and sized for this machine; run row in SQLite
    fleet        baseline, canary (and twin) replicas started in parallel by Ray; the
                 router over them, canary weight 0 until judged
    preflight    every replica answers; a speculative canary really drafts
    restore      (a resumed run) the judgement committed before the crash stands
    accuracy     identical greedy items to every arm in batches, judged after each
    experiment   one continuous Locust load, both arms pinned alternately, looks by evidence
    candidates   (config candidates) the winner takes the canary's place, the losers stop
    sweep        both arms at several load levels (reported, no gate)
    decide       PROMOTE | ROLLBACK | INCONCLUSIVE, committed before it is acted on
    progressive  canary weight steps with guard windows (when configured)
    finish       the router sends 100% to the winner

Each phase is an object in rollout/run/phases/ over one RunContext (rollout.run.context);
every phase's result is committed to the store before the controller acts on it.

One writer of the decision (Argo Rollouts' shape: one reconcile writes one typed status). A phase
that decides returns `Decided` (rollout.run.decision); the controller records what each phase
returned, and an abort command taken during it, through RunContext.record_decision, called here
only. Later phases read the decision (`ctx.decided`, `ctx.standing`) and do not write it.

Resume. The run's actors (replicas, router, the progressive load) are named in a Ray
namespace of their own and detached, each on a lease the controller renews. If the
controller dies (kill -9), `Controller(..., resume=True)` (`mtp-canary resume RUN_ID`)
reads where the run stands (rollout.run.resume), reattaches to the actors or restarts what is
gone, and continues: a judged run continues its progressive phase after the last
step_done; a run that died before its judgement reruns preflight, accuracy and experiment
from their start (the interrupted attempt's rows are kept, marked superseded: the
sequential tests need one unbroken sequence of looks).
"""

from __future__ import annotations

import json
import time
import traceback
import uuid
from pathlib import Path

import yaml

from cluster.arms import CANARY
from cluster.fleet import FleetStartError
from cluster.ray_cluster import kill_quietly
from loadtests.swarm import SwarmError
from rollout.record.atomic_file import stage as stage_file
from rollout.record.atomic_file import write_atomically
from rollout.config import RolloutConfig
from rollout.judge.verdicts import Decision
from rollout.run.live_metrics import ROUTER_TIMEOUT_S, LiveMetrics
from rollout.run.phases.accuracy import Accuracy
from rollout.run.phases.candidates import ChooseCandidate
from rollout.run.phases.decide import Decide, Finish, RestoreJudgement
from rollout.run.phases.experiment import Experiment
from rollout.run.phases.phase import Phase
from rollout.run.phases.preflight import Preflight
from rollout.run.phases.progressive import Progressive
from rollout.run.phases.setup import Prepare, StartFleet
from rollout.run.phases.sweep import Sweep
from rollout.record.redact import REDACTED, known_secrets, redact_config, redact_url, scrub
from rollout.run.interrupts import INTERRUPTS, Interrupted
from rollout.record.markdown import regenerate_reports
from rollout.record.result import RunResult, UsageSummary, decision_document, wholly_ejected_line
from rollout.run.resume import CONTROLLER_RESUME, ResumePoint, load_resume_point
from rollout.run.context import InfrastructureError, LeaseKeeper, Progress, RunContext, run_namespace
from rollout.run.run_id import run_id_error
from rollout.run.store import RunStore, controller_identity
from rollout.record.webhook import post_decision
from rollout.run.weight_hook import call_weight_hook
from tinymodel.checkpoint import DEFAULT_CACHE

PHASES: tuple[Phase, ...] = (
    Prepare(), StartFleet(), Preflight(), RestoreJudgement(), Accuracy(), Experiment(), ChooseCandidate(), Sweep(),
    Decide(), Progressive(), Finish(),
)


def new_run_id(name: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{uuid.uuid4().hex[:6]}"


class Controller:
    """Runs one rollout. `run()` never raises for a judged outcome; see RunResult.exit_code."""

    def __init__(
        self,
        config: RolloutConfig,
        runs_dir: str | Path = "runs",
        run_id: str | None = None,
        progress: Progress = print,
        cache_dir: Path = DEFAULT_CACHE,
        resume: bool = False,
        claimed: bool = False,
    ):
        """claimed: (resume) the caller already made this process the run's controller (RunStore.claim
        against the controller it found gone), so two `resume`s never both take the run."""
        runs_dir = Path(runs_dir)
        run_id = run_id or new_run_id(config.name)
        problem = run_id_error(run_id, "run_id")
        if problem:  # a path component and a Ray namespace: never `../x`
            raise ValueError(problem)
        store = RunStore(runs_dir / "history.db")
        if resume and config.candidates:
            # the canary's seat (which candidate won, the losers stopped) is not part of the resume point yet
            raise ValueError("resume: a run with candidates cannot be resumed; start it again")
        point = load_resume_point(store, run_id) if resume else ResumePoint.fresh()
        result = RunResult(run_id=run_id, run_dir=runs_dir / run_id, config=config)
        self.ctx = RunContext(
            cfg=config, run_id=run_id, run_dir=runs_dir / run_id, store=store, result=result, progress=progress,
            cache_dir=cache_dir, point=point, namespace=run_namespace(run_id),
        )
        self.ctx.leases = LeaseKeeper(config.lease_s, self.ctx.leased_actors, heartbeat=self._heartbeat)
        self._secrets: set[str] | None = None  # the config's secret strings, found once when an error needs them
        self._back_on_stable = False  # _back_to_stable ran (once is enough)
        self._claimed = claimed

    @property
    def run_id(self) -> str:
        return self.ctx.run_id

    @property
    def result(self) -> RunResult:
        return self.ctx.result

    def run(self) -> RunResult:
        ctx = self.ctx
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        if not self._open():
            # another `resume` took the run first: its fleet and files are not ours to touch
            ctx.result.error = "another controller resumed this run first"
            ctx.say(f"run {ctx.run_id}: {ctx.result.error}; nothing done")
            return ctx.result
        completed = False
        live = None
        try:
            try:
                live = self._live_metrics()
                for phase in PHASES:
                    if phase.enabled(ctx):
                        self._run_phase(phase)
                completed = True
            except KeyboardInterrupt:
                raise
            except (InfrastructureError, FleetStartError, SwarmError) as exc:
                self._fail(str(exc))
            except Exception as exc:
                # Fail closed: whatever else broke (a Ray actor that died, a bug) is an error of the
                # run, never a verdict, even after a committed PROMOTE (its later phases did not run).
                ctx.say("unexpected error:\n" + self._scrub("".join(traceback.format_exception(exc)).rstrip()))
                self._fail(f"unexpected {type(exc).__name__}: {exc}")
        except KeyboardInterrupt as exc:  # SIGINT, SIGTERM, SIGHUP (rollout.run.interrupts), also inside _fail
            with INTERRUPTS.shielded():
                self._interrupted(exc)
        finally:
            # a signal from here on is said and ignored: the traffic, the fleet and the record come first
            with INTERRUPTS.shielded():
                self._end(completed, live)
        return ctx.result

    def _run_phase(self, phase: Phase) -> None:
        """One phase, then its decision recorded: what it returned, or an abort taken while it ran; a
        phase that raised after an abort still leaves the abort's ROLLBACK (beside the run's error)."""
        outcome = None
        try:
            outcome = phase.run(self.ctx)
        finally:
            self.ctx.record_decision(outcome)

    def _interrupted(self, exc: KeyboardInterrupt) -> None:
        """A signal ended the run: an error (exit 130) naming it; a cause found before it stays first."""
        ctx, result = self.ctx, self.ctx.result
        # Ray's waits may raise a plain KeyboardInterrupt for the signal: the handler noted which one it was
        name = exc.signal_name if isinstance(exc, Interrupted) else INTERRUPTS.received or "SIGINT"
        result.interrupted = name
        result.error = f"interrupted by {name}" if result.error is None else f"{result.error}; then interrupted by {name}"
        ctx.say(f"interrupted by {name}: traffic back to the stable config, then teardown")
        try:
            ctx.event("error", "interrupted", name)
        except Exception as err:  # a store that cannot be written: the end says so again
            ctx.say(f"interrupted: the event could not be stored: {type(err).__name__}: {err}")

    def _end(self, completed: bool, live: LiveMetrics | None) -> None:
        """Every end of a run, in order: production traffic back on the stable config unless the run
        decided (weight_hook, the router), the fleet torn down, the end recorded (store, decision.json,
        reports, webhook), the live endpoint closed. One step failing never skips the next."""
        ctx = self.ctx
        ctx.leases.stop()
        if ctx.result.error is not None:
            self._back_to_stable()
        try:
            self._teardown()
        except Exception as exc:  # the fleet's own teardown names each replica it could not stop
            ctx.say(f"teardown: {type(exc).__name__}: {self._scrub(str(exc))}")
        try:
            self._record_end(completed)
        finally:
            if ctx.result.error is not None and not self._back_on_stable:
                self._back_to_stable()  # the end itself failed (a full disk): no verdict, so the stable config serves
            if live is not None:  # the decision served (for metrics.linger_s), then the port closed
                live.finish(decision_document(ctx.result))
                live.stop(linger=ctx.result.interrupted is None)

    def _live_metrics(self) -> LiveMetrics | None:
        """The run's Prometheus endpoint when the config asks for one (metrics.port); its URL in the log."""
        ctx, cfg = self.ctx, self.ctx.cfg.metrics
        if cfg.port is None:
            return None

        def router_state():
            return ctx.router.state(ROUTER_TIMEOUT_S) if ctx.router is not None else None

        try:
            live = LiveMetrics(ctx.store.path, ctx.run_id, router_state, host=cfg.host, port=cfg.port,
                               linger_s=cfg.linger_s)
        except OSError as exc:
            raise InfrastructureError(str(exc)) from None
        ctx.say(f"metrics: live Prometheus metrics at {live.url}")
        return live

    def _fail(self, error: str) -> None:
        """End the run as an infrastructure error: no verdict, so the stable config serves."""
        ctx = self.ctx
        error = self._scrub(error)
        ctx.result.error = error
        ctx.say(f"infrastructure error: {error}")
        try:
            ctx.event("error", "infrastructure_error", error.splitlines()[0] if error else "")
        except Exception as exc:  # the store may be what broke: the traffic goes back all the same (_end)
            ctx.say(f"infrastructure error: the event could not be stored: {type(exc).__name__}: {exc}")

    def _back_to_stable(self) -> None:
        """No verdict: production traffic (weight_hook) and the run's router back on the stable config.

        The hook first, whatever the router or the store do: with `endpoints:` production stays on the
        canary until the hook says 0 (a dead router or a full disk must not keep it there). A hook that
        does not confirm 0 is added to the run's error: no one may read the end as safe."""
        ctx = self.ctx
        self._back_on_stable = True
        hook = ctx.cfg.weight_hook
        if hook is not None:
            try:
                call = call_weight_hook(hook, 0.0, ctx.run_id, "error", (ctx.result.error or "error").splitlines()[0])
                ctx.say(f"weight_hook: canary 0%, production traffic on the stable config ({call.seconds:.1f} s)")
            except Exception as exc:  # WeightHookError: it exited non-zero, overran or could not start
                why = f"{exc}: production traffic may still reach the canary"
                ctx.result.error = f"{ctx.result.error}; {why}"
                ctx.say(f"infrastructure error: {why}")
        if ctx.router is not None and ctx.canary_weight > 0:
            try:
                ctx.router.set_canary_weight(0.0)
            except Exception as exc:  # the router itself may be what broke
                ctx.say(f"infrastructure error: the router did not take canary 0%: {type(exc).__name__}")
        if ctx.canary_weight > 0 or hook is not None:
            ctx.canary_weight = 0.0
            try:
                ctx.store.update_run(ctx.run_id, canary_weight=0.0, phase="error")
                ctx.event("error", "weights", "canary 0%: no verdict, the stable config serves")
            except Exception as exc:
                ctx.say(f"infrastructure error: canary 0% not stored: {type(exc).__name__}: {exc}")

    def _scrub(self, text: str) -> str:
        """An error's text may quote a replica's command line or a URL: never a secret in the log or the store."""
        if self._secrets is None:
            self._secrets = known_secrets(self.ctx.cfg.model_dump(mode="json"))
        return scrub(text, self._secrets)

    def _heartbeat(self) -> None:
        # the keeper's thread: a connection of its own (sqlite3 objects stay in their thread)
        store = RunStore(self.ctx.store.path)
        try:
            store.heartbeat(self.ctx.run_id)
        finally:
            store.close()

    # -- the run's row -----------------------------------------------------------
    def _open(self) -> bool:
        """Create (or, resuming, claim) the run's row; False when another controller claimed it first."""
        ctx, cfg = self.ctx, self.ctx.cfg
        if ctx.resuming:
            if not self._claimed:
                # the controller as read now: a caller that checked an earlier one claims it itself (cli resume)
                previous = ctx.store.run(ctx.run_id)["controller"]
                if not ctx.store.claim(ctx.run_id, controller_identity(), previous):
                    return False
            point = ctx.point
            ctx.result.started_at = point.started_at
            ctx.result.timeline = list(point.timeline)
            ctx.canary_weight = point.canary_weight
            ctx.say(f"run {ctx.run_id}: resuming (attempt {ctx.attempt}) after phase {point.last_phase} -> {ctx.run_dir}")
            ctx.event(point.last_phase, CONTROLLER_RESUME, f"attempt {ctx.attempt} by {controller_identity()}")
        else:
            model = cfg.baseline.engine.model if cfg.baseline.tiny_model is None else "tiny-mimo-v2"
            # redacted: a resume of a run with secrets is given the config file again (cli resume --config)
            ctx.store.create_run(ctx.run_id, cfg.name, model, redact_config(cfg.model_dump(mode="json")))
            ctx.event("prepare", "start", f"run {ctx.run_id}")
            ctx.say(f"run {ctx.run_id}: {cfg.name} -> {ctx.run_dir}")
        ctx.store.update_run(ctx.run_id, status="running", controller=controller_identity(), heartbeat_at=time.time())
        return True

    # -- the end -----------------------------------------------------------------
    def _teardown(self) -> None:
        ctx = self.ctx
        self._note_wholly_ejected()
        if ctx.cfg.keep_fleet and ctx.result.error is None:
            ctx.leases.release()
            url = ctx.router.url if ctx.router is not None else None
            ctx.say(f"keep_fleet: replicas and router left running ({url}, Ray namespace {ctx.namespace})")
            return
        for name, actor in list(ctx.leased.items()):
            kill_quietly(actor)
            ctx.leased.pop(name)
        if ctx.router is not None:
            ctx.router.stop()
            ctx.router = None
        if ctx.fleet is not None:
            ctx.fleet.teardown()
            ctx.fleet = None

    def _note_wholly_ejected(self) -> None:
        """Requests the router refused because every replica of an arm was out at once, read before the
        router stops: the record says the arm was out (its latency holds only what it served)."""
        ctx = self.ctx
        out = ctx.router.wholly_ejected() if ctx.router is not None else None
        if out:
            ctx.result.wholly_ejected = {**(ctx.result.wholly_ejected or {}), **out}
            ctx.say(f"router: WARNING: {wholly_ejected_line({'wholly_ejected': ctx.result.wholly_ejected})}")

    def _record_end(self, completed: bool) -> None:
        ctx, result = self.ctx, self.ctx.result
        result.timings["total_s"] = time.time() - result.started_at
        if result.usage is not None and ctx.fleet_since is not None:
            result.usage = UsageSummary.held(result.usage.gpus, result.usage.replicas, time.time() - ctx.fleet_since)
        if result.error is None and not completed:
            # never a verdict on a partial run, nor a "done" without one (a SystemExit from a library's handler)
            result.error = "the run ended before its last phase"
        try:
            self._commit_end()
        except Exception as exc:
            # A full disk, a store that cannot be written: the end is an error, and every source that
            # can still be written says so (the store, decision.json, the final line, the webhook).
            why = f"the run's end could not be recorded: {type(exc).__name__}: {self._scrub(str(exc))}"
            result.error = why if result.error is None else f"{result.error}; {why}"
            ctx.say(f"infrastructure error: {why}")
            self._commit_error_end()
        else:
            self._write_derived()
        if ctx.cfg.webhook_url:
            outcome = post_decision(ctx.cfg.webhook_url, decision_document(result), allow_http=ctx.cfg.webhook_allow_http)
            state = f"delivered (HTTP {outcome.status})" if outcome.ok else f"not delivered: {outcome.error}"
            ctx.say(f"webhook: {redact_url(ctx.cfg.webhook_url)}: {state} after {outcome.attempts} attempt(s)")

    def _finish_fields(self) -> dict:
        result = self.ctx.result
        return {"status": "error" if result.error else "done",
                "decision": None if result.error or result.decision is None else result.decision.value,
                "exit_code": result.exit_code, "reason": result.error or result.reason}

    def _commit_end(self) -> None:
        """decision.json written beside its place (where a full disk shows), then the store's end in one
        transaction with the stable mark, then decision.json renamed in: once decision.json exists
        (what a pipeline reads) the run is decided for `resume` too, never decided twice."""
        ctx, result = self.ctx, self.ctx.result
        promoted = result.decision == Decision.PROMOTE and result.error is None
        model = ctx.store.run(ctx.run_id)["model"]
        staged = stage_file(ctx.run_dir / "decision.json", json.dumps(decision_document(result), indent=2, default=str))
        try:
            ctx.store.finish_run(ctx.run_id, **self._finish_fields(),
                                 stable=(model, result.arms[CANARY]["engine"]) if promoted else None)
        except BaseException:
            staged.discard()
            raise
        staged.commit()
        if promoted:
            try:
                self._write_promoted(model)
            except Exception as exc:  # the decision stands (store and decision.json): the spec is a convenience
                ctx.say(f"report: promoted.yaml not written: {type(exc).__name__}: {exc}")

    def _commit_error_end(self) -> None:
        """The end as an error, wherever it can still be written (each on its own)."""
        ctx = self.ctx
        try:
            ctx.store.finish_run(ctx.run_id, **self._finish_fields())
        except Exception as exc:  # the row stays `running` under a dead controller: status says it is gone
            ctx.say(f"infrastructure error: the store does not record the error: {type(exc).__name__}: {exc}")
        try:
            write_atomically(ctx.run_dir / "decision.json",
                             json.dumps(decision_document(ctx.result), indent=2, default=str))
        except Exception as exc:
            ctx.say(f"infrastructure error: decision.json not written: {type(exc).__name__}: {exc}")
            return
        self._write_derived()

    def _write_derived(self) -> None:
        """report.md, report.html, junit.xml, metrics.prom from decision.json: a failure is said, and the
        decision (store and decision.json, which agree) stands."""
        ctx = self.ctx
        try:
            paths = regenerate_reports(ctx.run_dir)
        except Exception as exc:
            ctx.say(f"report: the reports beside decision.json not written: {type(exc).__name__}: {exc}")
            return
        ctx.say(f"report: {ctx.run_dir / 'decision.json'}, {paths['report']}, {paths['html']}, {paths['junit'].name}, "
                f"{paths['metrics'].name}")

    def _write_promoted(self, model: str) -> None:
        """The canary's arm is the stable one (the store says so): promoted.yaml is an arm spec a later run can use as baseline."""
        ctx = self.ctx
        seat = ctx.canary_arm  # the winning candidate's arm in a run with candidates
        canary = redact_config(seat.model_dump(mode="json", exclude_none=True))
        if seat.tiny_model is None:
            canary.pop("tiny_model", None)
        promoted = {"promoted_from_run": ctx.run_id, "baseline": canary}
        path = ctx.run_dir / "promoted.yaml"
        write_atomically(
            path,
            "# The promoted (now stable) arm of run " + ctx.run_id + ": paste under `baseline:` of the next run.\n"
            + (f"# Secret values are shown as {REDACTED}: fill them in from where you keep them.\n"
               if REDACTED in yaml.safe_dump(canary) else "")
            + yaml.safe_dump(promoted, sort_keys=False),
        )
        ctx.event("decide", "stable", f"{path.name} written; stable config for {model}")
