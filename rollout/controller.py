"""The rollout controller: one run from config to decision, readable in one place.

    prepare     tiny checkpoints written if asked; run row in SQLite
    fleet       baseline, canary (and twin) replicas started in parallel by Ray
    router      gateway actor over the arms; canary weight 0 until judged
    preflight   every replica answers; a speculative canary really drafts;
                engine warnings recorded
    accuracy    identical greedy items to every arm in batches, judged after
                each batch (early stop on a clear regression)
    experiment  Locust through the router, both arms pinned alternately with
                the same prompts (equal offered load per replica), judged
                after every window with the sequential latency gates and the
                /metrics acceptance deltas
    decide      PROMOTE | ROLLBACK | INCONCLUSIVE; router to 100% of the winner

Resume. The run's actors (replicas, router, the progressive load) are named in a
Ray namespace of their own and detached, each on a lease the controller renews.
If the controller dies (kill -9), `Controller(..., resume=True)` (`mtp-canary
resume RUN_ID`) reattaches to them, or restarts what is gone, and continues: a run
that had been judged continues its progressive phase after the last step_done; a
run that died before its judgement reruns preflight, accuracy and experiment from
their start (the interrupted attempt's rows are kept, marked superseded: the
sequential tests need one unbroken sequence of looks).

Every phase's result is committed to the store before the controller acts on
it. Statistics live in `rollout.judge` (pure); this module only gathers data,
calls the judges, and records what happened.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import requests
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.arms import BASELINE, CANARY
from cluster.fleet import ArmSpec, Fleet, FleetStartError
from cluster.ray_cluster import connect, find_actor, kill_quietly
from cluster.router import Router
from loadtests.health import percentile_ms
from loadtests.options import TrafficOptions
from loadtests.records import RequestRecord, read_records
from loadtests.swarm import Swarm, SwarmError, SwarmProgress, SwarmSpec
from rollout.config import TWIN, ArmConfig, RolloutConfig
from rollout.evals import EvalItem, ItemOutcome, evaluate_batch, load_items, outputs_differ
from rollout.experiment import LOAD_MARGIN_S, LOAD_STOP_TIMEOUT_S, ExperimentContext, ExperimentPhase
from rollout.judge.accuracy import judge_accuracy, judge_divergence
from rollout.judge.verdicts import Decision, GateResult, Verdict, decide, is_enabled
from rollout.store import RunStore, controller_identity
from tinymodel.checkpoint import DEFAULT_CACHE, TinyCheckpointSpec, checkpoint_dir, ensure_checkpoint
from tinymodel.sizing import TinySizing, engine_dtype_for, size_tiny_model, sizing_for_arm, tiny_spec_for

Progress = Callable[[str], None]

EXIT_CODES = {Decision.PROMOTE: 0, Decision.ROLLBACK: 3, Decision.INCONCLUSIVE: 4}
EXIT_INFRASTRUCTURE = 1

JUDGED = "judged"  # phase_results: the run's state once accuracy + experiment were judged (resume point)
PROGRESSIVE_OUTCOME = "progressive_outcome"  # phase_results: the progressive phase's verdict
PRE_JUDGEMENT_PHASES = ("preflight", "accuracy", "experiment")
ROUTER_NAME = "router"


def run_namespace(run_id: str) -> str:
    """The Ray namespace of one run's named actors."""
    return f"mtp-canary-{run_id}"




class InfrastructureError(RuntimeError):
    """The run could not measure (a replica, the router or Locust failed): exit 1, no verdict."""


@dataclass
class RunResult:
    """Everything the report needs; built up phase by phase."""

    run_id: str
    run_dir: Path
    config: RolloutConfig
    started_at: float = field(default_factory=time.time)
    decision: Decision | None = None
    reason: str = ""
    gates: list[GateResult] = field(default_factory=list)
    prepare: dict[str, Any] = field(default_factory=dict)  # what the run chose before starting: tiny model, cores
    preflight: dict[str, Any] = field(default_factory=dict)
    accuracy: dict[str, Any] = field(default_factory=dict)
    experiment: dict[str, Any] = field(default_factory=dict)
    progressive: dict[str, Any] = field(default_factory=dict)
    spec_decode: dict[str, dict] = field(default_factory=dict)
    engine_warnings: dict[str, list[str]] = field(default_factory=dict)
    arms: dict[str, dict] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    timeline: list[dict] = field(default_factory=list)
    error: str | None = None

    @property
    def exit_code(self) -> int:
        if self.error is not None or self.decision is None:
            return EXIT_INFRASTRUCTURE
        return EXIT_CODES[self.decision]


def new_run_id(name: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{uuid.uuid4().hex[:6]}"


def resolve_arm_engine(arm: ArmConfig, cache_dir: Path, progress: Progress, sizing: TinySizing | None = None):
    """The arm's EngineSpec with `model` pointing at a real checkpoint (tiny ones written now).

    sizing: a tinymodel.sizing.TinySizing, from `size_tiny_model(cache_dir,
    progress, options=cfg.baseline.tiny_model)` called once per run and passed
    to both arms (store `sizing.model_dump()` as decision.json prepare.tiny_model).
    None: sized here (the probe's answer is cached per machine, so both arms
    still get the same). An auto-sized tiny model also sets the engine's dtype
    (float32 without native bf16) unless tiny_model.dtype says otherwise;
    explicit num_layers / hidden_size / dtype win over the sizing.
    """
    if arm.tiny_model is None:
        return arm.engine
    options = arm.tiny_model
    sizing = sizing_for_arm(options, sizing, cache_dir, progress)
    spec: TinyCheckpointSpec = tiny_spec_for(options, sizing)
    # Keyed on the spec and the builder's code; built in a temporary sibling and renamed into place.
    path = checkpoint_dir(cache_dir, spec)
    progress(f"prepare: tiny MiMo-V2 checkpoint {path}")
    ensure_checkpoint(path, spec)
    update = {"model": str(path)}
    dtype = engine_dtype_for(options, sizing, arm.engine.dtype)
    if dtype != arm.engine.dtype:
        update["dtype"] = dtype
    return arm.engine.model_copy(update=update)


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
    ):
        self.cfg = config
        self.resuming = resume
        self.runs_dir = Path(runs_dir)
        self.run_id = run_id or new_run_id(config.name)
        self.run_dir = self.runs_dir / self.run_id
        self._say = progress
        self.cache_dir = cache_dir
        self.store = RunStore(self.runs_dir / "history.db")
        self.result = RunResult(run_id=self.run_id, run_dir=self.run_dir, config=config)
        self.fleet: Fleet | None = None
        self.router = None
        self.router_url: str | None = None
        self.canary_weight: float = 0.0
        self.engines: dict[str, Any] = {}
        self.namespace = run_namespace(self.run_id)
        self.attempt = 1
        self._leased: dict[str, Any] = {}  # extra leased actors (the progressive load), by name
        self._lease_stop = threading.Event()
        self._lease_thread: threading.Thread | None = None
        self._experiment_capped: str | None = None  # the experiment hit max_duration_s before its plan

    # -- bookkeeping -----------------------------------------------------------
    def say(self, message: str) -> None:
        self._say(f"[{time.strftime('%H:%M:%S')}] {message}")

    def event(self, phase: str, event: str, reason: str = "") -> None:
        entry = self.store.add_event(self.run_id, phase, event, reason, canary_weight=self.canary_weight)
        self.result.timeline.append(entry)
        self.store.update_run(self.run_id, phase=phase)

    def set_canary_weight(self, weight: float, phase: str, reason: str) -> None:
        ray.get(self.router.set_weights.remote({BASELINE: 100.0 - weight, CANARY: weight}))
        self.canary_weight = weight
        self.store.update_run(self.run_id, canary_weight=weight)
        self.event(phase, "weights", f"canary {weight:g}%: {reason}")

    # -- the run ---------------------------------------------------------------
    def run(self) -> RunResult:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.cfg
        if self.resuming:
            self._begin_resume()
        else:
            model = cfg.baseline.engine.model if cfg.baseline.tiny_model is None else "tiny-mimo-v2"
            self.store.create_run(self.run_id, cfg.name, model, cfg.model_dump(mode="json"))
            self.event("prepare", "start", f"run {self.run_id}")
            self.say(f"run {self.run_id}: {cfg.name} -> {self.run_dir}")
        self.store.update_run(self.run_id, status="running", controller=controller_identity())
        try:
            self._prepare()
            self._start_fleet_and_router()
            self._preflight()
            judged = self.store.phase_results(self.run_id, JUDGED) if self.resuming else []
            if judged:
                if self.result.decision is None:  # a preflight that fails now stands
                    self._restore_judged(judged[0])
            else:
                if self.resuming:
                    moved = self.store.supersede(self.run_id, PRE_JUDGEMENT_PHASES, self.attempt - 1)
                    self.say(f"resume: the run died before its judgement: accuracy and experiment run again "
                             f"({moved} rows of attempt {self.attempt - 1} kept as superseded)")
                self._judge_phases()
                self._checkpoint_judged()
            # Traffic steps only for a canary the experiment judged fit (or when
            # the steps are the only judge configured).
            if cfg.progressive.enabled and (self.result.decision == Decision.PROMOTE or not self.result.gates):
                self._progressive()
            self._finish_traffic()
        except (InfrastructureError, FleetStartError, SwarmError) as exc:
            self.result.error = str(exc)
            self.say(f"infrastructure error: {exc}")
            self.event("error", "infrastructure_error", str(exc).splitlines()[0])
            if self.router is not None and self.canary_weight > 0:
                # No verdict means the stable config serves: traffic back to baseline.
                self.set_canary_weight(0.0, "error", "infrastructure error")
        except KeyboardInterrupt:
            self.result.error = "interrupted"
            self.event("error", "interrupted", "SIGINT")
            raise
        finally:
            self._stop_lease_keeper()
            self._teardown()
            self._record_end()
        return self.result

    # -- resume ----------------------------------------------------------------
    def _begin_resume(self) -> None:
        row = self.store.run(self.run_id)
        if row is None:
            raise ValueError(f"no run {self.run_id!r} in {self.store.path}")
        events = self.store.events(self.run_id)
        # the first controller was attempt 1; every resume adds one
        self.attempt = 2 + sum(1 for e in events if e["event"] == "controller_resume")
        self.result.started_at = row["created_at"]
        self.result.timeline = [dict(e) for e in events]
        self.canary_weight = row["canary_weight"] or 0.0
        self.say(f"run {self.run_id}: resuming (attempt {self.attempt}) after phase {row['phase']} -> {self.run_dir}")
        self.event(row["phase"] or "prepare", "controller_resume", f"attempt {self.attempt} by {controller_identity()}")

    def _checkpoint_judged(self) -> None:
        """The judgement, committed before the controller acts on it (the resume point)."""
        r = self.result
        self.store.put_phase_result(
            self.run_id,
            JUDGED,
            1,
            {
                "decision": r.decision.value if r.decision else None,
                "reason": r.reason,
                "gates": [g.model_dump(mode="json") for g in r.gates],
                "preflight": r.preflight,
                "accuracy": r.accuracy,
                "experiment": r.experiment,
                "spec_decode": r.spec_decode,
                "engine_warnings": r.engine_warnings,
            },
        )

    def _restore_judged(self, judged: dict[str, Any]) -> None:
        r = self.result
        r.decision = Decision(judged["decision"]) if judged["decision"] else None
        r.reason = judged["reason"]
        r.gates = [GateResult.model_validate(g) for g in judged["gates"]]
        r.accuracy, r.experiment = judged["accuracy"], judged["experiment"]
        r.spec_decode, r.engine_warnings = judged["spec_decode"], judged["engine_warnings"]
        self.say(f"resume: judged before the crash: {r.decision.value if r.decision else 'none'} ({r.reason})")

    # -- leases ------------------------------------------------------------------
    def _leased_actors(self) -> list[Any]:
        actors = [h.actor for h in self.fleet.replicas] if self.fleet is not None else []
        if self.router is not None:
            actors.append(self.router)
        return actors + list(self._leased.values())

    def _renew_leases(self) -> None:
        for actor in self._leased_actors():
            try:
                actor.renew_lease.remote(self.cfg.lease_s)
            except Exception:  # a dead actor: the health checks say so
                pass

    def _start_lease_keeper(self) -> None:
        """Renew every actor's lease a few times per lease while this controller lives."""
        self._renew_leases()
        interval = max(1.0, self.cfg.lease_s / 6)

        def keep() -> None:
            while not self._lease_stop.wait(interval):
                self._renew_leases()

        self._lease_thread = threading.Thread(target=keep, name="lease-keeper", daemon=True)
        self._lease_thread.start()

    def _stop_lease_keeper(self) -> None:
        self._lease_stop.set()
        if self._lease_thread is not None:
            self._lease_thread.join(5)

    def _aborted(self, phase: str) -> bool:
        """`mtp-canary abort RUN_ID` arrived: the decision is ROLLBACK (the canary never got traffic weight)."""
        if self.store.take_command(self.run_id, accept=("abort",)) is None:
            return False
        self.result.decision = Decision.ROLLBACK
        self.result.reason = f"aborted by command during {phase}"
        self.say(f"{phase}: abort command received: rolling back")
        self.event(phase, "abort", "abort command")
        return True

    def _judge_phases(self) -> None:
        """accuracy, then experiment, then the decision they support (preflight has run)."""
        cfg = self.cfg
        if self.result.decision is None and cfg.accuracy.enabled:
            self._accuracy()
            if self.result.decision is None and any(
                g.verdict == Verdict.FAIL for g in self.result.gates if is_enabled(g.name, cfg.gates)
            ):
                # Fail fast: a canary that already lost accuracy gets no load.
                self.say("accuracy: a gate failed; skipping the experiment")
                self.event("accuracy", "abort", "accuracy gate failed")
                self._decide()
        if self.result.decision is None and cfg.experiment.enabled:
            self._experiment()
            if cfg.experiment.sweep.levels and self.result.decision is None:
                self._sweep()
        if self.result.decision is None:
            self._decide()

    def _prepare(self) -> None:
        cfg = self.cfg
        t0 = time.monotonic()
        # one sizing for both arms (the probe's answer is cached per machine): like with like
        tiny = cfg.baseline.tiny_model or cfg.canary.tiny_model
        sizing = size_tiny_model(self.cache_dir, self.say, options=tiny) if tiny and tiny.size == "auto" else None
        self.result.prepare["tiny_model"] = sizing.model_dump(mode="json") if sizing else None
        self.engines[BASELINE] = resolve_arm_engine(cfg.baseline, self.cache_dir, self.say, sizing=sizing)
        self.engines[CANARY] = resolve_arm_engine(cfg.canary, self.cache_dir, self.say, sizing=sizing)
        if cfg.twin_baseline:
            self.engines[TWIN] = self.engines[BASELINE]
        for arm, engine in self.engines.items():
            self.result.arms[arm] = {
                "replicas": cfg.canary.replicas if arm == CANARY else cfg.baseline.replicas,
                "engine": engine.model_dump(mode="json"),
                "tiny_model": (cfg.canary if arm == CANARY else cfg.baseline).tiny_model.model_dump()
                if (cfg.canary if arm == CANARY else cfg.baseline).tiny_model
                else None,
            }
        self.result.timings["prepare_s"] = time.monotonic() - t0

    def _start_fleet_and_router(self) -> None:
        cfg = self.cfg
        self.say(connect(cfg.ray.address, namespace=self.namespace))
        t0 = time.monotonic()
        arms = [
            ArmSpec(name=arm, engine=engine, replicas=self.result.arms[arm]["replicas"])
            for arm, engine in self.engines.items()
        ]
        # Named and detached in the run's namespace: a resumed controller finds them.
        self.fleet = Fleet(
            arms,
            log_dir=str(self.run_dir / "logs"),
            progress=self.say,
            bind_host=cfg.ray.bind_host,
            actor_name_prefix="replica-",
            namespace=self.namespace,
            detached=True,
            lease_s=cfg.lease_s,
        )
        self._start_lease_keeper()  # before anything starts: a fleet start can take many minutes
        previous_router = self._find_actor(ROUTER_NAME) if self.resuming else None
        if self.resuming and self.fleet.attach():
            urls = self.fleet.urls()
            self.event("fleet", "reattached", f"{len(self.fleet.replicas)} replicas")
        else:
            if self.resuming:
                self.fleet.remove_leftovers()
            self.event("fleet", "start", ", ".join(f"{a.name} x{a.replicas}" for a in arms))
            urls = self.fleet.start(timeout_s=cfg.startup_timeout_s)
            self.event("fleet", "ready", f"{sum(len(u) for u in urls.values())} replicas")
        self.result.prepare["cpu_cores"] = dict(self.fleet.cpu_cores)
        self.result.prepare["core_sharing"] = self.fleet.core_sharing
        if self.fleet.core_sharing:
            self.say(f"fleet: WARNING: {self.fleet.core_sharing}: arms share cores, latency includes their contention")
        elif any(self.fleet.cpu_cores.values()):
            self.say("fleet: cores per replica: " + ", ".join(f"{n} -> {c}" for n, c in self.fleet.cpu_cores.items()))
        self.result.timings["fleet_start_s"] = time.monotonic() - t0

        if previous_router is not None and self._reattach_router(previous_router, urls):
            return
        # The router runs on this (the driver's) node: Locust, started here, reaches it locally.
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        self.router = Router.options(
            scheduling_strategy=here, name=ROUTER_NAME, namespace=self.namespace, lifetime="detached"
        ).remote(initial_weights={BASELINE: 100.0, CANARY: 0.0}, seed=0)
        self.router.renew_lease.remote(cfg.lease_s)
        self.router_url = ray.get(self.router.start.remote(host=cfg.ray.bind_host))
        ray.get(self.router.set_arms.remote(urls))
        self.canary_weight = 0.0
        self.store.update_run(self.run_id, canary_weight=0.0)
        self.say(f"router: {self.router_url} (canary weight 0% until judged)")
        self.event("router", "ready", self.router_url)

    def _find_actor(self, name: str) -> Any:
        return find_actor(name, namespace=self.namespace)

    def _reattach_router(self, router: Any, urls: dict[str, list[str]]) -> bool:
        """Adopt the router an earlier attempt left (it kept serving at its weights)."""
        try:
            state = ray.get(router.get_state.remote(), timeout=10)
        except ray.exceptions.RayError:
            return False
        if not state["url"]:
            kill_quietly(router)
            return False
        self.router, self.router_url = router, state["url"]
        ray.get(self.router.set_arms.remote(urls))
        self.canary_weight = float(state["weights"].get(CANARY, 0.0))
        self.say(f"router: reattached at {self.router_url} (canary weight {self.canary_weight:g}%)")
        self.event("router", "reattached", self.router_url)
        return True

    # -- preflight -------------------------------------------------------------
    def _preflight(self) -> None:
        self.say("preflight: smoke request to every replica")
        model = self.engines[BASELINE].served_model_name
        answers = {}
        for handle in self.fleet.replicas:
            try:
                response = requests.post(
                    f"{handle.url}/v1/completions",
                    json={"model": model, "prompt": "Question: 1 + 1?\nAnswer:", "max_tokens": 8, "temperature": 0},
                    timeout=120,
                )
                response.raise_for_status()
                answers[handle.name] = response.json()["usage"]["completion_tokens"]
            except (requests.RequestException, KeyError, ValueError) as exc:
                raise InfrastructureError(f"preflight: replica {handle.name} did not answer: {exc}") from None
        metrics = self.fleet.metrics()
        missing = [h.name for h in self.fleet.replicas if h.name not in metrics]
        if missing:
            raise InfrastructureError(f"preflight: /metrics of {missing} could not be scraped")
        warnings = self.fleet.engine_warnings()
        self.result.engine_warnings = warnings
        canary_drafts = sum(metrics[h.name].spec_decode.drafts for h in self.fleet.handles(CANARY))
        speculative = self.engines[CANARY].num_speculative_tokens > 0
        self.result.preflight = {
            "smoke_completion_tokens": answers,
            "canary_speculative_tokens": self.engines[CANARY].num_speculative_tokens,
            "canary_drafts": canary_drafts,
            "notable_warnings": {name: w[:3] for name, w in warnings.items() if w},
        }
        self.store.put_phase_result(self.run_id, "preflight", 1, self.result.preflight)
        for name, lines in warnings.items():
            for line in lines:
                if "same MTP layer" in line:
                    self.say(f"preflight: {name} engine warning: {line}")
                    break
        if speculative and canary_drafts <= 0:
            # Fail closed: a speculative config that never drafts is not the config under test.
            reason = "canary is configured to speculate but produced no drafts in preflight"
            self.result.gates.append(
                GateResult(
                    name="preflight_speculation",
                    metric="canary_drafts",
                    baseline=None,
                    canary=float(canary_drafts),
                    threshold=1.0,
                    verdict=Verdict.FAIL,
                    detail=reason,
                )
            )
            self.result.decision = Decision.ROLLBACK
            self.result.reason = reason
            self.event("preflight", "fail", reason)
            return
        self.event("preflight", "pass", f"canary drafts {canary_drafts:g}")

    # -- accuracy --------------------------------------------------------------
    def _eval_spec(self):
        spec = self.cfg.accuracy
        if spec.kind == "golden" and not spec.path:
            spec = spec.model_copy(update={"path": str(Path(self.engines[BASELINE].model) / "golden.jsonl")})
        return spec

    def _accuracy(self) -> None:
        cfg = self.cfg
        spec = self._eval_spec()
        items: list[EvalItem] = load_items(spec)
        arms = [BASELINE, CANARY] + ([TWIN] if TWIN in self.engines else [])
        model = self.engines[BASELINE].served_model_name
        self.say(f"accuracy: {len(items)} {spec.kind} items to {', '.join(arms)} (greedy), batches of {cfg.accuracy.batch_size}")
        self.event("accuracy", "start", f"{len(items)} {spec.kind} items")
        t0 = time.monotonic()
        outcomes: dict[str, list[ItemOutcome]] = {arm: [] for arm in arms}
        look = 0
        accuracy_gate = divergence_gate = None
        for start in range(0, len(items), cfg.accuracy.batch_size):
            batch = items[start : start + cfg.accuracy.batch_size]
            got = evaluate_batch(self.router_url, model, batch, arms, spec)
            for arm in arms:
                outcomes[arm].extend(got[arm])
                self.store.add_eval_outcomes(self.run_id, got[arm])
            look += 1
            last = start + len(batch) >= len(items)
            accuracy_gate, divergence_gate = self._judge_accuracy(outcomes, interim=not last, look=look)
            self.store.put_phase_result(
                self.run_id, "accuracy", look, [accuracy_gate.model_dump(mode="json"), divergence_gate.model_dump(mode="json")]
            )
            done = len(outcomes[BASELINE])
            acc = {arm: np.mean([o.correct for o in outcomes[arm]]) for arm in arms}
            self.say(
                f"accuracy: {done}/{len(items)} items | "
                + " ".join(f"{arm} {acc[arm]:.3f}" for arm in arms)
                + f" | {accuracy_gate.name}: {accuracy_gate.verdict.value}, {divergence_gate.name}: {divergence_gate.verdict.value}"
            )
            if not last and self._aborted("accuracy"):
                break
            if not last and (accuracy_gate.verdict == Verdict.FAIL or divergence_gate.verdict == Verdict.FAIL):
                self.say("accuracy: clear regression, stopping early")
                self.event("accuracy", "early_stop", f"after {done} items")
                break
        errors = {arm: sum(o.error is not None for o in outcomes[arm]) for arm in arms}
        self.result.accuracy = {
            "kind": spec.kind,
            "items": len(outcomes[BASELINE]),
            "planned_items": len(items),
            "accuracy": {arm: float(np.mean([o.correct for o in outcomes[arm]])) if outcomes[arm] else None for arm in arms},
            "divergence_vs_baseline": {
                arm: float(np.mean([outputs_differ(a, b) for a, b in zip(outcomes[BASELINE], outcomes[arm])]))
                for arm in arms
                if arm != BASELINE and outcomes[arm]
            },
            "request_errors": errors,
            "duration_s": time.monotonic() - t0,
        }
        self.result.gates += [g for g in (accuracy_gate, divergence_gate) if g is not None]
        self.event("accuracy", "done", f"{accuracy_gate.verdict.value} / {divergence_gate.verdict.value}")
        if sum(errors.values()) and all(o.error for o in outcomes[BASELINE]):
            raise InfrastructureError(f"accuracy: every baseline request failed: {outcomes[BASELINE][0].error}")

    def _judge_accuracy(self, outcomes: dict[str, list[ItemOutcome]], interim: bool, look: int):
        gates_cfg = self.cfg.gates
        base, canary = outcomes[BASELINE], outcomes[CANARY]
        accuracy_gate = judge_accuracy(
            [o.correct for o in base], [o.correct for o in canary], gates_cfg, look=1, max_looks=1, interim=interim
        )
        twin = outcomes.get(TWIN)
        divergence_gate = judge_divergence(
            [outputs_differ(b, c) for b, c in zip(base, canary)],
            [outputs_differ(b, t) for b, t in zip(base, twin)] if twin is not None else None,
            gates_cfg,
            look=1,
            max_looks=1,
            interim=interim,
        )
        return accuracy_gate, divergence_gate

    # -- experiment ------------------------------------------------------------
    def _experiment(self) -> None:
        """One continuous load, looks by evidence (rollout.experiment); results into self.result."""
        exp = self.cfg.experiment
        replicas = self.cfg.canary.replicas
        self.say(
            f"experiment: looks every {exp.requests_per_look} completed requests per arm (at least {exp.window_s} s apart), "
            f"{exp.requests_per_arm} per arm planned ({exp.planned_looks} looks), at most {exp.max_duration_s:g} s; "
            + (
                f"open loop {exp.rate_per_replica:g} req/s per replica"
                if exp.rate_per_replica
                else f"closed loop {exp.users_per_replica} streams per replica"
            )
        )
        self.event("experiment", "start", f"looks every {exp.requests_per_look} requests per arm")
        out = self.run_dir / "experiment"
        traffic = self._pinned_traffic(
            out / "records.jsonl",
            tag="experiment",
            seed=exp.seed + 1,
            arm_pin=f"{BASELINE},{CANARY}",
            rate=exp.rate_per_replica * 2 * replicas if exp.rate_per_replica else None,
        )
        spec = self._swarm_spec(
            traffic, exp.users_per_replica * 2 * replicas, int(exp.max_duration_s + LOAD_MARGIN_S), out / "locust"
        ).model_copy(update={"stop_timeout_s": LOAD_STOP_TIMEOUT_S})
        if exp.web_ui:
            self.say(f"experiment: Locust web UI at http://{spec.web_host}:{spec.web_port} until the last look")
        phase = ExperimentPhase(
            ExperimentContext(
                run_id=self.run_id,
                config=exp,
                gates=self.cfg.gates,
                store=self.store,
                swarm_spec=spec,
                placement=exp.worker_placement,
                scrape=self.fleet.metrics,
                replica_arms={h.name: h.arm for h in self.fleet.replicas},
                router=self.router,
                speculative_canary=self.engines[CANARY].num_speculative_tokens > 0,
                say=self.say,
                event=lambda event, reason: self.event("experiment", event, reason),
                aborted=lambda: self._aborted("experiment"),
            )
        )
        outcome = phase.run()
        self._experiment_capped = outcome.capped_reason
        records = outcome.records
        self.result.spec_decode = {arm: stats.to_dict() for arm, stats in outcome.spec_decode.items()}
        for arm, stats in outcome.spec_decode.items():
            k = self.engines[arm].num_speculative_tokens
            if k > 1 and stats.per_position_rate:
                self.result.spec_decode[arm]["expected_length_by_k"] = {
                    str(kk): stats.expected_length_for_k(kk) for kk in range(1, k + 1)
                }
        self.result.experiment = {
            **outcome.summary,
            "latency_ms": {arm: _latency_summary(records, arm) for arm in (BASELINE, CANARY)},
            "client_tokens_per_chunk": {
                arm: _mean([r.decode_tokens_per_chunk for r in records if r.arm == arm]) for arm in (BASELINE, CANARY)
            },
            "stopped_by": "abort" if outcome.aborted else "max_duration_s" if outcome.capped_reason else "evidence",
        }
        self.result.gates += outcome.gates

    def _pinned_traffic(self, records: Path, **options: Any) -> TrafficOptions:
        """The experiment's prompts and lengths (exact output lengths: ignore_eos) plus `options`."""
        exp = self.cfg.experiment
        return TrafficOptions(
            dataset=exp.dataset,
            dataset_path=exp.dataset_path,
            input_tokens=exp.input_tokens,
            max_tokens=exp.max_tokens,
            endpoint=exp.endpoint,
            model=self.engines[BASELINE].served_model_name,
            records=str(records),
            ignore_eos=True,
            **options,
        )

    def _run_swarm(self, spec: SwarmSpec, on_progress=None):
        """One load test: workers under Ray actors on the cluster (worker_placement), or local processes."""
        placement = self.cfg.experiment.worker_placement
        if placement == "local" or spec.n_workers == 0:
            return Swarm(spec, on_progress=on_progress, progress_interval_s=1.0).run()
        from cluster.distributed_load import run_distributed_swarm

        return run_distributed_swarm(spec, placement, on_progress)

    def _swarm_spec(self, traffic: TrafficOptions, users: int, run_time_s: int | None, log_dir: Path) -> SwarmSpec:
        exp = self.cfg.experiment
        return SwarmSpec(
            host=self.router_url,
            traffic=traffic,
            users=max(users, exp.workers, 1),
            run_time_s=run_time_s,
            n_workers=exp.workers,
            web_ui=exp.web_ui,
            web_port=exp.web_port,
            log_dir=log_dir,
            # workers on other nodes reach the master on the cluster's interface
            master_bind_host=self.cfg.ray.bind_host if exp.worker_placement != "local" else "127.0.0.1",
        )

    # -- speedup vs load ---------------------------------------------------------
    def _sweep(self) -> None:
        """Both arms at each level of experiment.sweep (same prompts, pinned alternately); no gate."""
        from rollout.load_sweep import summarize_sweep

        exp = self.cfg.experiment
        sweep, replicas = exp.sweep, self.cfg.canary.replicas
        levels = ",".join(str(level) for level in sweep.levels)
        self.say(f"sweep: speedup vs load at {levels} streams per replica, {sweep.step_s} s each (no gate)")
        self.event("sweep", "start", f"levels {levels}")
        out = self.run_dir / "sweep"
        traffic = self._pinned_traffic(
            out / "records.jsonl",
            tag="sweep",
            seed=exp.seed + 500,
            arm_pin=f"{BASELINE},{CANARY}",
            steps=levels,
            step_s=sweep.step_s,
            level_users=2 * replicas,  # each user alternates arms: level streams per replica
        )
        spec = self._swarm_spec(traffic, max(sweep.levels) * 2 * replicas, None, out)
        last = [0.0]

        def on_progress(p: SwarmProgress) -> None:
            if p.elapsed_s - last[0] >= 15:
                last[0] = p.elapsed_s
                self.say(f"sweep: {p.phase} {p.elapsed_s:.0f}/{spec.duration_s:.0f} s, {p.requests_done} requests done")

        result = self._run_swarm(spec, on_progress)
        records = read_records(result.records_path)
        self.store.add_request_samples(self.run_id, "sweep", 1, records)
        rows = summarize_sweep(records, (BASELINE, CANARY), sweep.step_s)
        self.store.put_phase_result(self.run_id, "sweep", 1, rows)
        self.result.experiment["sweep"] = rows
        for row in rows:
            b, c = row["arms"][BASELINE], row["arms"][CANARY]
            self.say(
                f"sweep: {row['level']:g} streams/replica | TPOT p50 ms baseline {b['tpot_p50_ms']} canary {c['tpot_p50_ms']}"
                f" (ratio {row['tpot_ratio']}) | tokens/s {b['output_tokens_per_s']} vs {c['output_tokens_per_s']}"
            )
        self.event("sweep", "done", ", ".join(f"{r['level']:g}: {r['tpot_ratio']}" for r in rows))

    # -- decision --------------------------------------------------------------
    def _decide(self) -> None:
        gates_cfg = self.cfg.gates
        considered = [g for g in self.result.gates if g.name.startswith("preflight") or is_enabled(g.name, gates_cfg)]
        decision = decide(considered)
        failed = [g.name for g in considered if g.verdict == Verdict.FAIL]
        open_ = [g.name for g in considered if g.verdict == Verdict.INCONCLUSIVE]
        if decision == Decision.PROMOTE:
            reason = "every gate passed: " + ", ".join(g.name for g in considered)
        elif decision == Decision.ROLLBACK:
            reason = "failed: " + ", ".join(failed)
        else:
            reason = "not enough evidence: " + ", ".join(open_) if open_ else "no gate was judged"
            if self._experiment_capped:
                reason = f"{self._experiment_capped}; {reason}"
        self.result.decision, self.result.reason = decision, reason

    # -- progressive -----------------------------------------------------------
    def _progressive(self) -> None:
        """Canary weight steps with bake time; the judged verdict stands only if every step holds."""
        from rollout.progressive import ProgressiveContext, run_progressive

        prog, exp = self.cfg.progressive, self.cfg.experiment
        if self.resuming:
            done = self.store.phase_results(self.run_id, PROGRESSIVE_OUTCOME)
            if done:  # the phase had ended before the crash: its verdict stands
                self.result.progressive = done[0]["summary"]
                self._apply_progressive(
                    Decision(done[0]["decision"]), done[0]["reason"], [GateResult.model_validate(g) for g in done[0]["guards"]]
                )
                return
        first_step = sum(1 for e in self.store.events(self.run_id) if e["phase"] == "progressive" and e["event"] == "step_done")
        # every step done but no verdict committed (died in between): the last step bakes again
        first_step = min(first_step, len(prog.steps) - 1)
        previous = self._previous_loads() if self.resuming else []
        if len(previous) > 1:
            for actor in previous[:-1]:  # older attempts' loads: their lease will end them; end them now
                kill_quietly(actor)
        if first_step:
            self.say(f"progressive: resuming after step {first_step} of {len(prog.steps)}")
        self.say(
            "progressive: steps "
            + " -> ".join(f"{s.canary_weight:g}%" + (" (pause)" if s.pause else "") for s in prog.steps)
        )
        self.event("progressive", "start", f"{len(prog.steps)} steps")
        t0 = time.monotonic()
        context = ProgressiveContext(
            run_id=self.run_id,
            run_dir=self.run_dir,
            config=prog,
            router=self.router,
            router_url=self.router_url,
            model=self.engines[BASELINE].served_model_name,
            traffic={
                "dataset": exp.dataset,
                "dataset_path": exp.dataset_path,
                "input_tokens": exp.input_tokens,
                "max_tokens": exp.max_tokens,
                "endpoint": exp.endpoint,
                "seed": exp.seed + 1000,
            },
            set_canary_weight=lambda weight, reason: self.set_canary_weight(weight, "progressive", reason),
            event=lambda event, reason: self.event("progressive", event, reason),
            say=lambda message: self.say(f"progressive: {message}"),
            scrape=self.fleet.metrics,
            replica_arms={h.name: h.arm for h in self.fleet.replicas},
            replicas_alive=self._replicas_alive,
            store=self.store,
            speculative_canary=self.engines[CANARY].num_speculative_tokens > 0,
            n_workers=exp.workers,
            first_step=first_step,
            start_load=self._start_load,
            previous_load=previous[-1] if previous else None,
            master_bind_host=self.cfg.ray.bind_host if exp.worker_placement != "local" else "127.0.0.1",
        )
        outcome = run_progressive(context)
        self.result.progressive = {
            "steps_completed": outcome.steps_completed,
            "observed_split": outcome.observed_split,
            "requests_received": outcome.requests_received,
            "records_stored": outcome.records_stored,
            "attempt": self.attempt,
            "duration_s": time.monotonic() - t0,
        }
        self.store.put_phase_result(
            self.run_id,
            PROGRESSIVE_OUTCOME,
            1,
            {
                "decision": outcome.decision.value,
                "reason": outcome.reason,
                "guards": [g.model_dump(mode="json") for g in outcome.guards],
                "summary": self.result.progressive,
            },
        )
        self._apply_progressive(outcome.decision, outcome.reason, outcome.guards)

    def _apply_progressive(self, decision: Decision, reason: str, guards: list[GateResult]) -> None:
        judged_promote = self.result.decision == Decision.PROMOTE
        self.result.gates += guards
        self.result.decision = decision
        # a PROMOTE keeps the experiment's reasons when it had them; otherwise the steps are the reason
        if decision != Decision.PROMOTE or not judged_promote:
            self.result.reason = reason

    def _start_load(self, spec) -> Any:
        """The progressive load's LoadRunner: named per attempt, detached, leased."""
        from cluster.load_runner import start_load_runner

        name = f"load-attempt-{self.attempt}"
        actor = start_load_runner(spec, name=name, namespace=self.namespace, placement=self.cfg.experiment.worker_placement)
        self._leased[name] = actor
        actor.renew_lease.remote(self.cfg.lease_s)
        return actor

    def _previous_loads(self) -> list[Any]:
        found = [self._find_actor(f"load-attempt-{n}") for n in range(1, self.attempt)]
        return [actor for actor in found if actor is not None]

    def _replicas_alive(self) -> dict[str, bool]:
        """Replica name -> alive; a replica that does not answer in time is left out (no evidence)."""
        alive = {}
        for handle in self.fleet.replicas:
            try:
                alive[handle.name] = bool(ray.get(handle.actor.alive.remote(), timeout=10))
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayError:
                alive[handle.name] = False  # the actor itself is gone
        return alive

    def _finish_traffic(self) -> None:
        decision = self.result.decision
        if decision is None:
            return
        self.say(f"decision: {decision.value.upper()} ({self.result.reason})")
        if decision == Decision.PROMOTE:
            self.set_canary_weight(100.0, "decide", "promoted")
        else:
            self.set_canary_weight(0.0, "decide", "rolled back" if decision == Decision.ROLLBACK else "inconclusive: stable stays")
        self.event("decide", decision.value, self.result.reason)

    def _teardown(self) -> None:
        if self.cfg.keep_fleet and self.result.error is None:
            for actor in self._leased_actors():
                try:
                    ray.get(actor.release_lease.remote(), timeout=10)
                except Exception:
                    pass
            self.say(f"keep_fleet: replicas and router left running ({self.router_url}, Ray namespace {self.namespace})")
            return
        for name, actor in list(self._leased.items()):
            kill_quietly(actor)
            self._leased.pop(name)
        if self.router is not None:
            try:
                ray.get(self.router.stop.remote(), timeout=10)
            except Exception:
                pass
            kill_quietly(self.router)
            self.router = None
        if self.fleet is not None:
            self.fleet.teardown()
            self.fleet = None

    def _record_end(self) -> None:
        from rollout.report import decision_document, write_reports
        from rollout.webhook import post_decision

        self.result.timings["total_s"] = time.time() - self.result.started_at
        if self.result.decision == Decision.PROMOTE and self.result.error is None:
            self._write_promoted()
        paths = write_reports(self.result)
        decision = self.result.decision.value if self.result.decision else None
        self.store.update_run(
            self.run_id,
            status="error" if self.result.error else "done",
            decision=None if self.result.error else decision,
            exit_code=self.result.exit_code,
            reason=self.result.error or self.result.reason,
        )
        self.say(f"report: {paths['decision']} and {paths['report']}")
        if self.cfg.webhook_url:
            outcome = post_decision(self.cfg.webhook_url, decision_document(self.result))
            state = f"delivered (HTTP {outcome.status})" if outcome.ok else f"not delivered: {outcome.error}"
            self.say(f"webhook: {self.cfg.webhook_url}: {state} after {outcome.attempts} attempt(s)")

    def _write_promoted(self) -> None:
        """The canary's arm becomes the stable one: promoted.yaml is an arm spec a later run can use as baseline."""
        import yaml

        canary = self.cfg.canary.model_dump(mode="json", exclude_none=True)
        if self.cfg.canary.tiny_model is None:
            canary.pop("tiny_model", None)
        promoted = {"promoted_from_run": self.run_id, "baseline": canary}
        path = self.run_dir / "promoted.yaml"
        path.write_text(
            "# The promoted (now stable) arm of run " + self.run_id + ": paste under `baseline:` of the next run.\n"
            + yaml.safe_dump(promoted, sort_keys=False)
        )
        model = self.store.run(self.run_id)["model"]
        self.store.mark_stable(model, self.run_id, self.result.arms[CANARY]["engine"])
        self.event("decide", "stable", f"{path.name} written; stable config for {model}")


# -- pure helpers --------------------------------------------------------------
def _latency_summary(records: list[RequestRecord], arm: str) -> dict[str, float | None]:
    ok = [r for r in records if r.arm == arm and r.ok and not r.cancelled]
    out: dict[str, float | None] = {}
    for metric, values in (
        ("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]),
        ("tpot", [r.tpot_s for r in ok if r.tpot_s is not None]),
        ("e2e", [r.e2e_s for r in ok]),
    ):
        for q in (50, 95, 99):
            out[f"{metric}_p{q}"] = percentile_ms(values, q)
    return out


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None
