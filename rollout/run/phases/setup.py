"""Before anything is measured: what the plan can decide (each gate's detectable effect,
rollout.judge.power), the engines each arm runs (tiny checkpoints written and sized for this
machine), then the fleet of replicas and the router over them, started or, for a resumed run,
adopted from the attempt that died."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.arms import BASELINE, CANARY
from cluster.fleet import ArmSpec, Fleet
from cluster.placement import load_placement_notes
from cluster.ray_cluster import connect, find_actor, kill_quietly
from cluster.router import Router, RouterClient
from cluster.router_limits import is_loopback
from rollout.run import node_check
from rollout.config import TWIN, ArmConfig
from rollout.judge.power import detectable_effects, render
from rollout.run.plan_power import power_plan
from rollout.record.redact import known_secrets, redact_engine, scrub
from rollout.record.result import UsageSummary
from rollout.run.context import InfrastructureError, Progress, RunContext
from rollout.run.store import same_question_runs
from tinymodel.checkpoint import TinyCheckpointSpec, checkpoint_dir, ensure_checkpoint
from tinymodel.sizing import TinySizing, engine_dtype_for, size_tiny_model, sizing_for_arm, tiny_spec_for

ROUTER_NAME = "router"


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


def attempts_note(ctx: RunContext) -> None:
    """Earlier runs of the same comparison (rollout.run.store.same_question_runs): said before anything starts,
    with the ones judged INCONCLUSIVE and the alpha every judged attempt and this one spend together (a false
    promote in any of them is bounded by the sum, not by this run's alpha), and kept for decision.json."""
    rows = same_question_runs(ctx.store, ctx.run_id)
    before = [r for r in rows if r["run_id"] != ctx.run_id and r["decision"] is not None]
    if not before:
        return
    mine = next(r for r in rows if r["run_id"] == ctx.run_id)
    inconclusive = [r["run_id"] for r in before if r["decision"] == "inconclusive"]
    spent = round(sum(r["alpha"] for r in before) + mine["alpha"], 6)
    number = len(before) + 1
    ctx.result.attempts = {"comparison": mine["comparison"], "number": number, "alpha_spent_together": spent,
                           "judged_before": {r["run_id"]: r["decision"] for r in before},
                           "inconclusive_before": inconclusive}
    ctx.say(f"history: attempt {number} at this comparison (arms {mine['comparison']}): judged before as "
            + ", ".join(f"{r['run_id']} {r['decision'].upper()}" for r in before))
    if inconclusive:
        ctx.say(f"history: judged INCONCLUSIVE before: {', '.join(inconclusive)}; trying again spends alpha again: "
                f"the {number} attempts together bound a false promote by {spent:g} (sum of their alphas), "
                f"not {mine['alpha']:g}")


def arm_config(cfg, arm: str) -> ArmConfig:
    """The config of one arm (the twin is a second baseline; a candidate by its name)."""
    return cfg.arm(arm)


class Prepare:
    """Each arm's engine; one sizing of the tiny model for both arms (like with like)."""

    name = "prepare"

    def enabled(self, ctx: RunContext) -> bool:
        return True

    def run(self, ctx: RunContext) -> None:
        cfg, result = ctx.cfg, ctx.result
        t0 = time.monotonic()
        self._power(ctx, say=not ctx.resuming)  # a resumed run said it when it began
        if not ctx.resuming:
            attempts_note(ctx)
        tiny = cfg.baseline.tiny_model or cfg.canary.tiny_model
        # the probe's answer is cached per machine
        sizing = size_tiny_model(ctx.cache_dir, ctx.say, options=tiny) if tiny and tiny.size == "auto" else None
        result.prepare.tiny_model = sizing.model_dump(mode="json") if sizing else None
        ctx.engines[BASELINE] = resolve_arm_engine(cfg.baseline, ctx.cache_dir, ctx.say, sizing=sizing)
        if cfg.candidates:  # every candidate's arm; the canary's seat stays empty until one wins
            for candidate in cfg.candidates:
                ctx.engines[candidate.name] = resolve_arm_engine(candidate, ctx.cache_dir, ctx.say, sizing=sizing)
        else:
            ctx.engines[CANARY] = resolve_arm_engine(cfg.canary, ctx.cache_dir, ctx.say, sizing=sizing)
        if cfg.twin_baseline:
            ctx.engines[TWIN] = ctx.engines[BASELINE]
        for arm, engine in ctx.engines.items():
            arm_cfg = arm_config(cfg, arm)
            # what the record shows (decision.json, report, webhook, the stable mark): no secrets;
            # the replicas are started from ctx.engines, with the real env and args
            result.arms[arm] = {
                "replicas": arm_cfg.replicas,
                "engine": redact_engine(engine.model_dump(mode="json")),
                "tiny_model": arm_cfg.tiny_model.model_dump() if arm_cfg.tiny_model else None,
            }
            if arm_cfg.endpoints:  # servers this run judges but did not start (credentials refused by the config)
                result.arms[arm]["endpoints"] = list(arm_cfg.endpoints)
        result.timings["prepare_s"] = time.monotonic() - t0

    @staticmethod
    def _power(ctx: RunContext, say: bool) -> None:
        """What the plan can decide, said before anything starts, and kept for decision.json."""
        try:
            effects = detectable_effects(power_plan(ctx.cfg))
        except Exception as exc:  # noqa: BLE001 - what the plan can decide is said, never what stops a run
            if say:
                ctx.say(f"power: not computed ({type(exc).__name__}: {exc})")
            return
        ctx.result.detectable_effect = {e.gate: e for e in effects}
        for line in render(effects) if say else ():
            ctx.say(line)
        if say and ctx.cfg.experiment.enabled:
            ctx.say(design_line(ctx.cfg))


def design_line(cfg) -> str:
    """What the experiment's design cancels and what it only bounds: said before the run starts."""
    exp, gates = cfg.experiment, cfg.gates
    twin = ("a twin baseline measures the A/A floor (placement and drift between two replicas of one config)"
            if cfg.twin_baseline else
            "no twin baseline: drift between the arms' replicas is bounded only by the intervals (look-to-look "
            f"correlation <= {gates.look_correlation_max:g}); set twin_baseline: true where the hardware holds a third arm")
    return (f"design: warm-up {exp.warmup_requests_per_arm} requests per arm (not judged); "
            f"latency intervals drift-robust over {exp.planned_looks} planned looks; {twin}")


# the hub token a job's runtime environment may hold: scrubbed from copied logs like a config's secrets
HUB_TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def log_redactor(cfg):
    """What of a replica's server log may be written into the run directory: the config's secrets
    (rollout.record.redact.known_secrets) and the hub token of this environment scrubbed."""
    found = known_secrets(cfg.model_dump(mode="json")) | {os.environ[k] for k in HUB_TOKEN_ENV if os.environ.get(k)}
    return lambda text: scrub(text, found)


def router_token(cfg) -> str | None:
    """The bearer token the run's router requires: from cfg.router.auth_token_env when set; else,
    beyond loopback, one made for this run (handed to its Locust and eval clients, never written
    anywhere); else none (loopback: only this machine reaches it)."""
    token = cfg.router.auth_token()
    if token is None and not is_loopback(cfg.ray.bind_host):
        token = secrets.token_urlsafe(32)
    return token


class StartFleet:
    """Ray, the replicas (in parallel) and the router; a resumed run adopts what is still there."""

    name = "fleet"

    def enabled(self, ctx: RunContext) -> bool:
        return True

    def run(self, ctx: RunContext) -> None:
        cfg = ctx.cfg
        ctx.say(connect(cfg.ray.address, namespace=ctx.namespace))
        self._check_nodes(ctx)
        self._check_model_cache(ctx)
        t0 = time.monotonic()
        arms = [
            ArmSpec(name=arm, engine=engine, replicas=ctx.result.arms[arm]["replicas"],
                    cpus_per_replica=arm_config(cfg, arm).cpus_per_replica,
                    endpoints=arm_config(cfg, arm).endpoints, metrics_urls=arm_config(cfg, arm).metrics_urls)
            for arm, engine in ctx.engines.items()
        ]
        # Named and detached in the run's namespace: a resumed controller finds them.
        ctx.fleet = Fleet(
            arms,
            log_dir=str(ctx.run_dir / "logs"),
            progress=ctx.say,
            on_ready=lambda ready, total: ctx.tick("replicas ready", ready, total),
            bind_host=cfg.ray.bind_host,
            actor_name_prefix="replica-",
            namespace=ctx.namespace,
            detached=True,
            lease_s=cfg.lease_s,
            placement_timeout_s=cfg.placement_timeout_s,
            model_cache=cfg.model_cache,
            staging_timeout_s=cfg.staging_timeout_s,
            logs_back_to=str(ctx.run_dir / "replica-logs"),
            redact_log=log_redactor(cfg),
        )
        ctx.leases.start()  # before anything starts: a fleet start can take many minutes
        # held from here (placement reserves the GPUs) to the decision: decision.json `usage`
        ctx.fleet_since = time.time()
        ctx.result.usage = UsageSummary.held(
            gpus=sum(a.replicas * a.engine.world_size for a in arms if a.engine.device == "gpu"),
            replicas=sum(a.replicas for a in arms), held_s=0.0)
        previous_router = find_actor(ROUTER_NAME, namespace=ctx.namespace) if ctx.resuming else None
        if ctx.resuming and ctx.fleet.attach():
            urls = ctx.fleet.urls()
            ctx.event("fleet", "reattached", f"{len(ctx.fleet.replicas)} replicas")
        else:
            if ctx.resuming:
                ctx.fleet.remove_leftovers()
            ctx.event("fleet", "start", ", ".join(f"{a.name} x{a.replicas}" for a in arms))
            # placement, then every engine's own startup_timeout_s (the config checked that they fit)
            urls = ctx.fleet.start(timeout_s=cfg.startup_timeout_s)
            ctx.event("fleet", "ready", f"{sum(len(u) for u in urls.values())} replicas")
        self._report_cores(ctx)
        self._record_load_placement(ctx)
        if ctx.fleet.staged:
            ctx.result.prepare.weights = [w.model_dump(mode="json") for w in ctx.fleet.staged]
        ctx.result.timings["fleet_start_s"] = time.monotonic() - t0
        if previous_router is not None and self._reattach_router(ctx, previous_router, urls):
            return
        self._start_router(ctx, urls)

    @staticmethod
    def _check_nodes(ctx: RunContext) -> None:
        """Every node imports what the run needs, before anything is reserved (ray.check_nodes)."""
        if ctx.resuming or not node_check.wants_node_check(ctx.cfg):
            return
        ctx.say(f"nodes: checking that every node imports {', '.join(node_check.RUN_MODULES)} (ray.check_nodes)")
        failures = node_check.node_environment_failures()
        if failures:
            raise InfrastructureError("node environment: " + "; ".join(failures))
        ctx.say("nodes: every node has what the run imports")

    @staticmethod
    def _check_model_cache(ctx: RunContext) -> None:
        """model_cache usable on every node a staged replica may land on, before anything is reserved."""
        if ctx.resuming:
            return
        failures = node_check.model_cache_failures(ctx.cfg)
        if failures:
            raise InfrastructureError("; ".join(failures))

    @staticmethod
    def _record_load_placement(ctx: RunContext) -> None:
        """What the load shares with the GPU replicas (the driver and router, Locust workers on GPU
        nodes), said and kept for the report: that CPU use is in the arms' latency."""
        exp = ctx.cfg.experiment
        gpu_arms = any(engine.device == "gpu" for engine in ctx.engines.values())
        notes = load_placement_notes(gpu_arms, exp.worker_placement, exp.workers if exp.enabled else 0, ray.nodes(),
                                     ray.get_runtime_context().get_node_id())
        if notes:
            ctx.result.prepare.load_placement = "; ".join(note.removeprefix("load: ") for note in notes)
            ctx.say(f"fleet: load placement: {ctx.result.prepare.load_placement}")

    @staticmethod
    def _report_cores(ctx: RunContext) -> None:
        fleet = ctx.fleet
        ctx.result.prepare.cpu_cores = dict(fleet.cpu_cores)
        ctx.result.prepare.core_sharing = fleet.core_sharing
        if fleet.core_sharing:
            ctx.say(f"fleet: WARNING: {fleet.core_sharing}: arms share cores, latency includes their contention")
        elif any(fleet.cpu_cores.values()):
            ctx.say("fleet: cores per replica: " + ", ".join(f"{n} -> {c}" for n, c in fleet.cpu_cores.items()))

    @staticmethod
    def _start_router(ctx: RunContext, urls: dict[str, list[str]]) -> None:
        cfg = ctx.cfg
        # The router runs on this (the driver's) node: Locust, started here, reaches it locally.
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        actor = Router.options(
            scheduling_strategy=here, name=ROUTER_NAME, namespace=ctx.namespace, lifetime="detached"
        ).remote(initial_weights={BASELINE: 100.0, CANARY: 0.0}, seed=0, limits=cfg.router)
        actor.renew_lease.remote(cfg.lease_s)
        token = router_token(cfg)
        url = ray.get(actor.start.remote(host=cfg.ray.bind_host, token=token))
        ctx.router = RouterClient(actor, url, token)
        if token:
            given = cfg.router.auth_token() is not None
            ctx.say(f"router: bearer token required ({'from $' + cfg.router.auth_token_env if given else 'one for this run'})")
        ctx.router.set_arms(urls, ctx.fleet.upstream_keys())
        ctx.canary_weight = 0.0
        ctx.store.update_run(ctx.run_id, canary_weight=0.0)
        ctx.say(f"router: {url} (canary weight 0% until judged)")
        ctx.event("router", "ready", url)

    @staticmethod
    def _reattach_router(ctx: RunContext, actor: Any, urls: dict[str, list[str]]) -> bool:
        """Adopt the router an earlier attempt left (it kept serving at its weights)."""
        try:
            state = ray.get(actor.get_state.remote(), timeout=10)
        except ray.exceptions.RayError:
            return False
        token = ctx.cfg.router.auth_token()
        if not state["url"] or (state.get("auth_required") and token is None):
            # a router whose token died with the earlier controller (one made for that run):
            # nothing could reach it; a new one takes over
            kill_quietly(actor)
            return False
        ctx.router = RouterClient(actor, state["url"], token if state.get("auth_required") else None)
        ctx.router.set_arms(urls, ctx.fleet.upstream_keys())
        ctx.canary_weight = float(state["weights"].get(CANARY, 0.0))
        ctx.say(f"router: reattached at {ctx.router.url} (canary weight {ctx.canary_weight:g}%)")
        ctx.event("router", "reattached", ctx.router.url)
        return True
