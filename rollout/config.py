"""The run config: what to compare, how to load it, how to judge it.

`load_config(path)` reads YAML into a validated `RolloutConfig`; anything wrong
raises `ConfigError` with one line naming the field (the CLI exits 2 with it,
before anything starts).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.arms import BASELINE, CANARY
from cluster.engine_spec import EngineSpec
from cluster.placement import (
    CPU_PLACEMENT_TIMEOUT_S,
    FLEET_START_SLACK_S,
    GPU_PLACEMENT_TIMEOUT_S,
    default_cpus_per_replica,
    default_placement_timeout_s,
)
from cluster.router_limits import RouterLimits
from cluster.staging import STAGING_TIMEOUT_S
from loadtests.datasets import open_prompt_source
from rollout import engine_parity
from rollout.evals import EvalSpec
from rollout.judge.config import GatesConfig, GuardConfig
from rollout.judge.stats import MAX_PLANNED_LOOKS
from rollout.judge.verdicts import is_enabled

TWIN = "twin"  # the second baseline arm (twin_baseline: the A/A noise floor)


class ConfigError(ValueError):
    """A config that cannot run; the message is one line naming the field."""


class TinyModelOptions(BaseModel):
    """Serve the project's tiny MiMo-V2 checkpoint (written on first use into the cache).

    Its size and the engine's dtype: `size: auto` (the default) lets a short
    probe of this machine pick the depth (and, on a slow machine, the width) so
    that single-stream TPOT at k=1 lands near 25 ms (band 15-40 ms), and the
    dtype (float32 without native bf16), cached per machine (tinymodel/sizing.py);
    the arm's `engine.dtype` then follows the probe. `size: default` is the
    fixed 24 layers x hidden 1024. Explicit num_layers / hidden_size / dtype
    win over the probe (dtype also sets engine.dtype).
    """

    model_config = ConfigDict(extra="forbid")

    draft_noise: float = Field(0.0, ge=0, description="MTP draft noise: 0 = drafts always right")
    draft_decay: float = Field(
        0.0, ge=0, lt=1, description="share of drafts after the first that are wrong (the first stays right), as vLLM's "
        "reuse of MTP layer 0 makes them: per-position acceptance ~1, 1 - d, (1 - d)^2; 0 = none")
    broken: bool = Field(False, description="outputs differ from the golden continuations")
    mtp_layers: int = Field(1, ge=1)
    seed: int = 0
    size: Literal["auto", "default"] = Field(
        "auto", description="auto: sized for this machine by a short cached probe; default: 24 layers x hidden 1024"
    )
    num_layers: int | None = Field(None, ge=1, le=128, description="decoder layers (wins over the probe)")
    hidden_size: int | None = Field(
        None, ge=256, le=4096, multiple_of=256, description="width (wins over the probe; heads and MLP follow it)"
    )
    dtype: Literal["bfloat16", "float32"] | None = Field(
        None, description="the engine's dtype (wins over the probe's choice and over engine.dtype)"
    )


class ArmConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=1, le=1024)
    engine: EngineSpec
    cpus_per_replica: float | None = Field(
        None,
        ge=0,
        description="CPUs each replica's placement bundle reserves beside its GPUs (vLLM's API server, engine core "
        "and one worker per GPU are busy processes); null: tensor_parallel_size + 2 on GPU, 0 on CPU",
    )
    tiny_model: TinyModelOptions | None = Field(
        None, description="write the tiny checkpoint and serve it (engine.model is then ignored)"
    )
    endpoints: list[str] = Field(
        default_factory=list,
        max_length=1024,
        description="servers someone else started and runs (Kubernetes, KServe, llm-d), one replica each, e.g. "
        "['http://10.0.0.5:8000']: nothing is launched, reserved or stopped for this arm; `engine` then says what they "
        "serve (served_model_name, speculative_config; env.VLLM_API_KEY: their key on /v1); replicas follows the list",
    )
    metrics_urls: list[str] | None = Field(
        None, description="one Prometheus URL per endpoint (null: each endpoint's /metrics, as vLLM serves it)"
    )

    @model_validator(mode="before")
    @classmethod
    def _tiny_model_fills_engine_model(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("tiny_model") is not None:
            engine = dict(data.get("engine") or {})
            engine.setdefault("model", "tiny-mimo-v2")
            engine.setdefault("served_model_name", "tiny-mimo-v2")
            data = {**data, "engine": engine}
        return data

    @model_validator(mode="before")
    @classmethod
    def _endpoints_are_the_replicas(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("endpoints"), list) and data["endpoints"]:
            given = data.get("replicas")
            if given is not None and given != len(data["endpoints"]):
                raise ValueError(f"replicas: {given} for {len(data['endpoints'])} endpoints (leave it out: one replica "
                                 "per endpoint)")
            data = {**data, "replicas": len(data["endpoints"])}
        return data

    @field_validator("endpoints", "metrics_urls")
    @classmethod
    def _server_urls(cls, urls: list[str] | None) -> list[str] | None:
        if urls is None:
            return None
        cleaned = [endpoint_url(url) for url in urls]
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("lists one server twice")
        return cleaned

    @property
    def launched(self) -> bool:
        """This run starts the arm's replicas (False: its endpoints run elsewhere)."""
        return not self.endpoints

    @model_validator(mode="after")
    def _endpoints_are_not_launched(self) -> "ArmConfig":
        if self.endpoints and self.tiny_model is not None:
            raise ValueError("endpoints and tiny_model: an external server serves its own model (drop tiny_model, or "
                             "the endpoints to let the run start the tiny checkpoint)")
        if self.metrics_urls is not None and len(self.metrics_urls) != len(self.endpoints):
            raise ValueError(f"metrics_urls: {len(self.metrics_urls)} for {len(self.endpoints)} endpoints")
        return self


def endpoint_url(url: str) -> str:
    """An external server's base URL, checked: http(s), a host, no credentials, query or fragment
    (a URL is recorded in decision.json and the log: a key belongs in engine.env.VLLM_API_KEY)."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL with a host")
    if parts.username or parts.password:
        raise ValueError(f"{parts.hostname}: credentials in the URL would be recorded; give the server's key as engine.env.VLLM_API_KEY")
    if parts.query or parts.fragment:
        raise ValueError(f"{parts.hostname}: no query or fragment in a server's URL")
    return url.rstrip("/")


class WeightHookConfig(BaseModel):
    """A command run with every traffic weight the run sets for the canary (Argo Rollouts' and Flagger's
    traffic routing, as a hook): the run's own router splits only the run's load; this moves the real
    traffic (a mesh's VirtualService, a gateway's weights, an llm-d route). Fail closed: a hook that
    exits non-zero or overruns timeout_s ends the run as an infrastructure error (the weight back to 0)."""

    model_config = ConfigDict(extra="forbid")

    command: list[str] = Field(
        ..., min_length=1,
        description="argv, no shell; {weight} (0-100), {run_id} and {phase} are replaced; the environment also has "
        "MTP_CANARY_WEIGHT, MTP_CANARY_RUN_ID, MTP_CANARY_PHASE and MTP_CANARY_REASON",
    )
    timeout_s: float = Field(60, gt=0, le=3600, description="how long one call may take")


class AccuracyConfig(EvalSpec):
    """The accuracy phase: identical greedy items to both arms (and the twin)."""

    enabled: bool = True
    batch_size: int = Field(16, ge=1, description="items per interim look (early stop on a clear regression)")
    max_duration_s: float = Field(
        7200, gt=0, description="the whole phase, every batch to every arm: past it the run ends as an infrastructure "
        "error naming what each arm still owed (a replica answering each read in time but never finishing)")


WORKER_PLACEMENTS = ("local", "auto", "spread", "pack", "node", "label", "resource")


class AdaptiveSweepConfig(BaseModel):
    """The sweep picks its own levels to find where speculation stops paying (rollout.analysis.crossover.next_level)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="doubling from start_level, then bisection around the crossover load")
    start_level: int = Field(1, ge=1, description="first level, closed-loop streams per replica")
    max_level: int = Field(32, ge=1, description="doubling stops at this level (streams per replica)")
    min_step: float = Field(
        1.0, gt=0, description="bisection stops when the last winning and first losing levels are at most this far apart"
    )
    max_levels: int = Field(8, ge=2, le=32, description="levels in all (doubling and bisection), each step_s long")

    @model_validator(mode="after")
    def _range(self) -> "AdaptiveSweepConfig":
        if self.max_level < self.start_level:
            raise ValueError(f"max_level {self.max_level} is below start_level {self.start_level}")
        return self


class SweepConfig(BaseModel):
    """Speedup vs load: after the judged windows, both arms at several loads (informational, no gate)."""

    model_config = ConfigDict(extra="forbid")

    levels: list[int] = Field(
        default_factory=list, description="closed-loop streams per replica, in order, e.g. [1, 4, 16]; empty: no sweep"
    )
    step_s: int = Field(30, ge=5, description="seconds at each level")
    adaptive: AdaptiveSweepConfig = Field(
        default_factory=AdaptiveSweepConfig, description="pick the levels adaptively instead of listing them"
    )

    @field_validator("levels")
    @classmethod
    def _positive(cls, levels: list[int]) -> list[int]:
        if any(level < 1 for level in levels):
            raise ValueError("sweep levels are streams per replica: each must be >= 1")
        return levels

    @model_validator(mode="after")
    def _one_way_to_pick_levels(self) -> "SweepConfig":
        if self.adaptive.enabled and self.levels:
            raise ValueError("levels and adaptive.enabled exclude each other (the adaptive sweep picks its levels)")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.levels) or self.adaptive.enabled

    @property
    def planned_s(self) -> int:
        """The sweep's length at its bound: every level (at most adaptive.max_levels) for step_s."""
        return (self.adaptive.max_levels if self.adaptive.enabled else len(self.levels)) * self.step_s


class ExperimentConfig(BaseModel):
    """Locust load through the router at equal offered load per replica."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    # Looks by evidence: one load runs from the first look to the last; a look happens when
    # every arm has requests_per_look more completed requests (and window_s has passed), and
    # alpha is spent by the information fraction n / requests_per_arm, so a slow machine gets
    # the same statistical plan as a fast one, only later.
    requests_per_look: int = Field(100, ge=5, description="completed requests each arm needs between two looks")
    requests_per_arm: int = Field(
        500, ge=5, description="planned requests per arm (information fraction 1: the last look)"
    )
    window_s: int = Field(30, ge=1, description="at least this many seconds between two looks")
    # A fresh engine's first requests are slower (allocator, caches, the first batches of a new
    # shape), on one arm more than the other: seen as TTFT p50 180-220 ms for a CPU canary's first
    # ~50 requests against ~148 ms after. Judged, they sit in the first block alone and inflate
    # the design effect. GuideLLM's and AIPerf's warm-up requests, here per arm.
    warmup_requests_per_arm: int | None = Field(
        None, ge=0, description="the first N completed requests of every arm are stored (records.jsonl, the store's "
        "look 0) but not judged: the looks, their information fraction and the acceptance counters begin after them; "
        "null (default): one look's worth (requests_per_look); 0: no warm-up",
    )
    min_looks: int = Field(1, ge=1, description="no early stop before this many looks")
    max_duration_s: float = Field(
        1800, gt=0, description="wall-clock cap of the experiment phase: reached before the plan, INCONCLUSIVE"
    )
    rate_per_replica: float | None = Field(
        None, gt=0, description="open loop: requests/s offered to each replica (default: closed loop)"
    )
    users_per_replica: int = Field(2, ge=1, description="closed loop: streams in flight per replica")
    arm_users: bool = Field(
        False,
        description="closed loop: each Locust user keeps one arm, so every arm carries users_per_replica streams per "
        "replica at every moment and both walk the same prompts; default: each request takes the next arm in turn "
        "(equal request counts, but the streams on each arm drift as the faster arm's users come back sooner)",
    )
    dataset: Literal["synthetic", "shared_prefix", "multi_turn", "gsm8k", "jsonl", "trace"] = Field(
        "synthetic", description="synthetic; shared_prefix (prefix_groups prefixes of prefix_tokens words, each prompt "
        "one of them plus an input_tokens suffix: the prefix cache's hits, per arm in arms.<arm>.kv); multi_turn "
        "(sessions of `turns` turns, each turn's prompt the history plus an input_tokens message; a user keeps its "
        "session, both arms get the same histories); gsm8k or jsonl (dataset_path); trace (dataset_path in "
        "trace_format, replayed open loop at its own times / trace_speedup, looping; users_per_replica caps the "
        "requests in flight; samples in loadtests/data/traces)"
    )
    dataset_path: str | None = None
    turns: int = Field(4, ge=1, le=1000, description="multi_turn: turns per session")
    trace_format: Literal["jsonl", "mooncake", "burstgpt"] = Field(
        "jsonl", description="trace: jsonl ({timestamp s, input_tokens, output_tokens[, session_id, prefix_id, "
        "prefix_tokens]}), mooncake (Mooncake's JSONL) or burstgpt (BurstGPT's CSV)"
    )
    trace_speedup: float = Field(1.0, gt=0, description="trace: replay this many times faster than recorded")
    input_tokens: str = Field("64", description="synthetic prompt length (shared_prefix: the suffix's): N, uniform:A:B, "
                              "normal:M:S, lognormal:M:S")
    prefix_groups: int = Field(8, ge=1, le=100_000, description="shared_prefix: how many distinct prefixes")
    prefix_tokens: int = Field(256, ge=1, le=1_000_000, description="shared_prefix: each prefix's length (~words)")
    max_tokens: int = Field(64, ge=2)
    temperature: float = Field(
        0.0,
        ge=0.0,
        le=2.0,
        description="sampling temperature of the load's requests (0: greedy); the same on every arm. Above 0 the "
        "latency and acceptance gates see speculation as sampled traffic gets it (vLLM's rejection sampler)",
    )
    endpoint: str = Field("completions", description="completions or chat")
    workers: int = Field(1, ge=0, description="Locust worker processes (0: one local process)")
    worker_placement: str = Field(
        "auto",
        description="where Locust workers run, each under a Ray actor: 'auto' (nodes without GPUs when the cluster "
        "has both kinds, else spread), 'spread' (spread over the nodes), 'pack', "
        "'node:<id or ip>', 'label:key=value', 'resource:NAME[=N]', or 'local' (child processes of the controller)",
    )
    sweep: SweepConfig = Field(default_factory=SweepConfig)
    under_test: list[str] = Field(
        list(engine_parity.DEFAULT_UNDER_TEST),  # pydantic copies a list default per instance
        description="the engine fields the canary may change; any other difference from the baseline is refused "
        "before anything starts (engine parity). Names: an engine field (speculative_config, dtype, model, ...), "
        "cpu.<limit>, tiny_model.<option> (tiny_model.draft_noise), extra_args:--<flag> (extra_args:--max-num-seqs, "
        "any spelling vLLM reads as that flag), env:<NAME>; a group (extra_args, env, cpu, tiny_model) covers all of it",
    )
    web_ui: bool = Field(
        False,
        description="serve Locust's web UI, with the Rollout console tab (phase, look, gates, canary weight, "
        "Promote / Abort), from the experiment's first request to the end of the progressive phase (whose own "
        "Locust master serves it again at the same address; `run --web-ui`)",
    )
    web_host: str = Field("127.0.0.1", min_length=1, description="interface the web UI binds (`run --web-host`)")
    web_port: int = Field(8089, ge=1, le=65535, description="port of the web UI (`run --web-port`)")
    seed: int = 0

    @field_validator("worker_placement")
    @classmethod
    def _placement(cls, placement: str) -> str:
        kind, sep, value = placement.partition(":")
        if kind not in WORKER_PLACEMENTS or (kind in ("node", "label", "resource")) != bool(sep and value):
            raise ValueError(
                f"unknown placement {placement!r}: local, auto, spread, pack, node:<id or ip>, label:key=value or resource:NAME[=N]"
            )
        return placement

    @field_validator("under_test")
    @classmethod
    def _known_fields(cls, names: list[str]) -> list[str]:
        for name in names:
            error = engine_parity.under_test_error(name, TinyModelOptions.model_fields)
            if error:
                raise ValueError(error)
        return list(dict.fromkeys(engine_parity.normalize_under_test(name) for name in names))

    @property
    def planned_looks(self) -> int:
        return math.ceil(self.requests_per_arm / self.requests_per_look)

    @model_validator(mode="after")
    def _looks(self) -> "ExperimentConfig":
        if self.requests_per_look > self.requests_per_arm:
            raise ValueError("requests_per_look must be <= requests_per_arm")
        if self.planned_looks > MAX_PLANNED_LOOKS:
            raise ValueError(
                f"requests_per_arm / requests_per_look gives {self.planned_looks} looks; at most {MAX_PLANNED_LOOKS}"
            )
        if self.min_looks > self.planned_looks:
            raise ValueError(f"min_looks must be <= the {self.planned_looks} planned looks")
        if self.warmup_requests_per_arm is None:  # a fresh engine's first look is left out unless told otherwise
            self.warmup_requests_per_arm = self.requests_per_look
        if self.worker_placement != "local" and self.workers == 0:
            raise ValueError("workers: 0 (one local Locust process) needs worker_placement: local")
        if self.arm_users and self.rate_per_replica:
            raise ValueError("arm_users keeps each closed-loop user on one arm: it does not apply with rate_per_replica")
        if self.dataset == "trace":
            if self.rate_per_replica:
                raise ValueError("dataset: trace sends at the trace's own times: no rate_per_replica with it")
            if self.sweep.enabled:
                raise ValueError("dataset: trace sends at the trace's own times: no sweep (stepped levels) with it")
        if self.dataset in ("gsm8k", "jsonl", "trace") and not self.dataset_path:
            raise ValueError(f"dataset: {self.dataset} needs dataset_path")
        if self.dataset_path and self.dataset in ("gsm8k", "jsonl", "trace"):
            # read it now, as the load generator will: a missing file or a bad line stops the run
            # before anything starts, not at the first look with replicas up
            try:
                open_prompt_source(self.dataset, path=self.dataset_path, seed=self.seed, trace_format=self.trace_format,
                                   trace_speedup=self.trace_speedup)
            except (OSError, ValueError) as exc:
                raise ValueError(f"dataset_path: {exc}") from None
        return self


MAX_CANDIDATES = 8


class CandidateConfig(ArmConfig):
    """One candidate of a several-candidates run (`candidates:`): an arm and the name its replicas,
    records and verdicts carry (decision.json candidates[].name, the winner)."""

    name: str = Field(..., pattern=r"^[a-z][a-z0-9_-]{0,31}$",
                      description="the candidate's arm name, e.g. k2 (lowercase letters, digits, - and _)")

    def arm(self) -> ArmConfig:
        """The arm config without the name: what takes the canary's place when this candidate wins."""
        return ArmConfig.model_validate(self.model_dump(exclude={"name"}))


class RolloutStep(BaseModel):
    """One traffic step of the progressive phase (Argo Rollouts' setWeight + pause)."""

    model_config = ConfigDict(extra="forbid")

    canary_weight: float = Field(..., ge=0, le=100, description="percent of traffic to the canary")
    bake_s: int = Field(30, ge=1, description="how long the step runs, judged every guard window")
    pause: bool = Field(False, description="after baking, wait for `mtp-canary promote|abort RUN_ID`")


class ProgressiveConfig(BaseModel):
    """Canary weight steps with bake time after the experiment; a failed guard aborts at once."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    steps: list[RolloutStep] = Field(default_factory=list)
    guards: GuardConfig = Field(default_factory=GuardConfig)
    users: int = Field(4, ge=1, description="closed-loop streams through the router during the steps")
    rate: float | None = Field(None, gt=0, description="open loop instead: total requests/s through the router")
    pause_timeout_s: float = Field(600, gt=0, description="how long a pause waits for promote/abort")
    on_pause_timeout: Literal["abort", "promote"] = Field("abort", description="what an unanswered pause becomes")

    @model_validator(mode="after")
    def _steps_when_enabled(self) -> "ProgressiveConfig":
        if self.enabled and not self.steps:
            raise ValueError("steps must list at least one step when progressive is enabled")
        return self


class RayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    address: str = Field("auto", description="'auto': the cluster this job runs in, else a local instance")
    bind_host: str = Field(
        "127.0.0.1",
        description="interface replicas and the router listen on; '0.0.0.0' on a multi-node cluster",
    )
    check_nodes: Literal["auto", "always", "never"] = Field(
        "auto",
        description="before the fleet starts, import what a run needs (vllm, ray, locust, scipy, aiohttp, the "
        "project) on every live node, as `mtp-canary plan` does, and fail naming the node: 'auto' on a multi-node "
        "cluster or with GPU engines (a single local node fails fast anyway)",
    )


class MetricsConfig(BaseModel):
    """The controller's live Prometheus endpoint (rollout.run.live_metrics): off unless a port is given."""

    model_config = ConfigDict(extra="forbid")

    port: int | None = Field(
        None, ge=0, le=65535,
        description="serve live Prometheus metrics at http://host:port/metrics while the run goes; 0: a free port, "
        "printed in the run's log; null: off (a run opens no port it was not asked for)",
    )
    host: str = Field("127.0.0.1", min_length=1, description="interface the metrics endpoint binds; '0.0.0.0' for a "
                      "Prometheus on another host")
    linger_s: float = Field(0, ge=0, le=3600, description="keep serving the decided run this long before the "
                            "controller exits, so a scrape sees the decision (metrics.prom keeps it for good)")


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # it names the run's directory (run id: timestamp-name-hex, at most 128 characters)
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100)
    description: str = ""
    ray: RayConfig = Field(default_factory=RayConfig)
    baseline: ArmConfig
    canary: ArmConfig
    candidates: list[CandidateConfig] = Field(
        default_factory=list,
        max_length=MAX_CANDIDATES,
        description="several candidate arms judged at once against the baseline (instead of canary), each at alpha / K; "
        "the winner is rolled out (rollout.judge.candidates)",
    )
    twin_baseline: bool = Field(False, description="start a second baseline arm: the A/A noise floor of divergence")
    accuracy: AccuracyConfig = Field(default_factory=AccuracyConfig)
    experiment: ExperimentConfig = Field(default_factory=ExperimentConfig)
    gates: GatesConfig = Field(default_factory=GatesConfig)
    progressive: ProgressiveConfig = Field(default_factory=ProgressiveConfig)
    weight_hook: WeightHookConfig | None = Field(
        None, description="a command called with every canary traffic weight the run sets (progressive steps, the "
        "decision, a rollback): what moves production traffic"
    )
    webhook_url: str | None = Field(None, description="POST decision.json here when the run ends (never blocks it)")
    webhook_allow_http: bool = Field(False, description="allow a plain http:// webhook beyond loopback")
    router: RouterLimits = Field(
        default_factory=RouterLimits,
        description="the router's limits (body cap, deadlines, connections, upstream timeouts, ejection) and "
        "auth_token_env: beyond loopback a bearer token is required (from that variable, else one per run)",
    )
    keep_fleet: bool = Field(False, description="leave the replicas running after the decision")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="live Prometheus metrics of the run")
    placement_timeout_s: float | None = Field(
        None,
        gt=0,
        description="how long the fleet waits for Ray to place every replica's bundle (GPUs and CPUs) before it "
        "gives up and withdraws the request (an autoscaler adds nodes only while it stands); null: "
        f"{GPU_PLACEMENT_TIMEOUT_S:g} s when any arm is on GPU, {CPU_PLACEMENT_TIMEOUT_S:g} s on CPU",
    )
    startup_timeout_s: float | None = Field(
        None,
        gt=0,
        description="the fleet's whole start: placement, then every replica ready (each within its own "
        "engine.startup_timeout_s); at least placement_timeout_s + the longest engine.startup_timeout_s; "
        f"null: that sum + {FLEET_START_SLACK_S:g} s",
    )
    model_cache: str | None = Field(
        None,
        description="stage each arm's hub model once per node into this directory before any replica starts "
        "(one Ray task per node; a shared mount is downloaded once), then serve it offline (HF_HUB_OFFLINE=1); "
        "a path on the nodes, absolute or from $VARS / ~ expanded there; HF_HOME / HF_TOKEN come from the job's "
        "runtime environment; a local engine.model (the tiny checkpoint) is never staged. null: each server "
        "downloads its model itself",
    )
    preflight_timeout_s: float = Field(
        120, gt=0, description="the preflight's smoke round: every replica's answer whole within it (and 1 MiB), "
        "else the run ends as an infrastructure error naming the replica")
    staging_timeout_s: float = Field(
        STAGING_TIMEOUT_S, gt=0, description="how long weight staging (model_cache) may take on the slowest node"
    )
    lease_s: float = Field(
        300,
        ge=10,
        description="how long the run's replicas, router and load outlive a dead controller "
        "(time to `mtp-canary resume RUN_ID`); then they stop themselves",
    )

    @model_validator(mode="before")
    @classmethod
    def _candidates_take_the_canary_seat(cls, data: Any) -> Any:
        # With candidates the canary's seat (the arm the router's canary weight and a promotion go
        # to) is empty until one wins; it starts as the first candidate's config, so every check of
        # `canary` also holds for it. A stored config (decision.json) carries that copy: accepted.
        if not isinstance(data, dict) or not isinstance(data.get("candidates"), list) or not data["candidates"]:
            return data
        first = data["candidates"][0]
        if not isinstance(first, dict):
            return data
        seat = {k: v for k, v in first.items() if k != "name"}
        if "canary" in data and data["canary"] != seat:
            raise ValueError("canary and candidates exclude each other: list every candidate under candidates "
                             "(canary is the one-candidate form)")
        return {**data, "canary": seat}

    @property
    def experiment_arms(self) -> tuple[str, ...]:
        """The arms the accuracy items and the experiment's pinned traffic go to, in turn."""
        if self.candidates:
            return (BASELINE, *(c.name for c in self.candidates))
        return (BASELINE, CANARY, TWIN) if self.twin_baseline else (BASELINE, CANARY)

    def arm(self, name: str) -> ArmConfig:
        """The config of arm `name` (the twin is a second baseline; a candidate by its name)."""
        if name in (BASELINE, TWIN):
            return self.baseline
        if name == CANARY:
            return self.canary
        for candidate in self.candidates:
            if candidate.name == name:
                return candidate
        raise KeyError(name)

    @model_validator(mode="after")
    def _candidates_fit(self) -> "RolloutConfig":
        if not self.candidates:
            return self
        if len(self.candidates) < 2:
            raise ValueError("candidates: list at least two (one candidate is the canary: write it under canary)")
        names = [c.name for c in self.candidates]
        taken = {BASELINE, CANARY, TWIN}
        for i, name in enumerate(names):
            if name in taken:
                raise ValueError(f"candidates.{i}.name: {name!r} is taken (baseline, canary, twin, or an earlier "
                                 "candidate): give each candidate a name of its own")
            taken.add(name)
        for i, candidate in enumerate(self.candidates):
            where = f"candidates.{i} ({candidate.name})"
            if candidate.replicas != self.baseline.replicas:
                raise ValueError(f"{where}: replicas {candidate.replicas} and baseline.replicas "
                                 f"{self.baseline.replicas} must be equal (compare like with like)")
            if candidate.engine.served_model_name != self.baseline.engine.served_model_name:
                raise ValueError(f"{where}: must serve the baseline's served_model_name (one router, one model name)")
            if not candidate.launched:
                raise ValueError(f"{where}.endpoints: candidates are started by the run; judge servers that run "
                                 "elsewhere one at a time, as canary")
        # not built for several candidates yet: each would need its own A/A floor
        if self.twin_baseline:
            raise ValueError("twin_baseline with candidates is not supported: run the A/A noise floor with one canary")
        if not self.accuracy.enabled and not self.experiment.enabled:
            raise ValueError("candidates with accuracy and experiment disabled: nothing would choose the winner")
        if self.baseline.endpoints:
            raise ValueError("baseline.endpoints with candidates is not supported: the candidates' load would share "
                             "servers this run does not own")
        differences = {
            c.name: engine_parity.engine_differences(self.baseline.engine, c.engine, self.baseline.tiny_model,
                                                     c.tiny_model)
            for c in self.candidates  # by name (the first is also the canary's seat: _engine_parity leaves it here)
        }
        error = engine_parity.parity_error(differences, self.experiment.under_test)
        if error:
            raise ValueError(error)
        return self

    @model_validator(mode="after")
    def _like_with_like(self) -> "RolloutConfig":
        # Kayenta's rule: judge arms of the same size under the same load.
        if self.baseline.replicas != self.canary.replicas:
            raise ValueError("baseline.replicas and canary.replicas must be equal (compare like with like)")
        if self.baseline.engine.served_model_name != self.canary.engine.served_model_name:
            raise ValueError("baseline and canary must serve the same served_model_name (one router, one model name)")
        if self.accuracy.enabled and self.accuracy.kind == "golden" and not self.accuracy.path:
            if self.baseline.tiny_model is None:
                raise ValueError("accuracy.path is required for a golden eval (or serve tiny_model)")
        if self.twin_baseline and self.baseline.endpoints:
            raise ValueError("twin_baseline with baseline.endpoints: the twin is a second set of baseline servers this "
                             "run starts; judge the noise floor with a run of its own, or drop twin_baseline")
        if not self.accuracy.enabled and not self.experiment.enabled and not self.progressive.enabled:
            raise ValueError("accuracy, experiment and progressive are all disabled: nothing to judge")
        if self.accuracy.enabled and self.accuracy.temperature > 0 and is_enabled("output_divergence", self.gates):
            raise ValueError(
                f"accuracy.temperature {self.accuracy.temperature:g}: sampled outputs differ between arms by chance, so "
                "output_divergence cannot be judged; name it in gates.disabled (accuracy_noninferiority still is)"
            )
        exp = self.experiment
        if exp.dataset == "trace" and self.progressive.enabled and self.progressive.rate:
            raise ValueError("progressive.rate with experiment.dataset: trace: the trace sets its own send times")
        arms = 2 + len(self.candidates[1:])
        users = exp.users_per_replica * arms * self.canary.replicas
        if exp.arm_users and users % (arms * max(exp.workers, 1)):
            # each Locust process balances its own users over the arms: an odd share leaves one arm a stream short
            raise ValueError(
                f"experiment.arm_users: the {users} users must split evenly over {max(exp.workers, 1)} Locust "
                f"worker(s) and {arms} arms (change users_per_replica or workers)"
            )
        return self

    @model_validator(mode="after")
    def _engine_parity(self) -> "RolloutConfig":
        # the arms may differ only in what the run judges: anything else would be credited to it
        if self.candidates:  # each candidate by its name (_candidates_fit), the seat's copy included
            return self
        differences = engine_parity.engine_differences(
            self.baseline.engine, self.canary.engine, self.baseline.tiny_model, self.canary.tiny_model
        )
        error = engine_parity.parity_error({"canary": differences}, self.experiment.under_test)
        if error:
            raise ValueError(error)
        return self

    @field_validator("model_cache")
    @classmethod
    def _cache_is_a_node_path(cls, value: str | None) -> str | None:
        # read on each node, from the worker's working directory (the job's temporary one): a relative
        # path would download into what the job removes
        if value is not None and not value.startswith(("/", "$", "~")):
            raise ValueError(f"{value!r} is relative: give an absolute path on the nodes (or one from $VAR or ~)")
        return value

    @model_validator(mode="after")
    def _hub_token_from_the_job(self) -> "RolloutConfig":
        # staging downloads in a Ray task with the job's runtime environment: a token in an engine's
        # env would never reach it (and the engines start offline)
        if self.model_cache:
            named = [("baseline", self.baseline), ("canary", self.canary)]
            for side, arm in named + [(f"candidates.{i}", c) for i, c in enumerate(self.candidates)]:
                for key in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HOME"):
                    if key in arm.engine.env:
                        raise ValueError(f"{side}.engine.env.{key}: with model_cache the weights are staged with the "
                                         f"job's runtime environment; set {key} there (--runtime-env-json env_vars)")
                # staging fetches the hub's default revision: a pinned one would be served from the
                # wrong files (both arms alike, so the comparison would not even show it)
                for arg in arm.engine.extra_args:
                    if arg.split("=", 1)[0] in ("--revision", "--code-revision", "--tokenizer-revision"):
                        raise ValueError(f"{side}.engine.extra_args: {arg.split('=', 1)[0]} with model_cache: staging "
                                         "fetches the default revision; pin it by staging that revision into the cache")
        return self

    @model_validator(mode="after")
    def _timeouts_fit(self) -> "RolloutConfig":
        # The fleet's clock covers placement and then each replica's own start; one shorter than
        # their sum gives up on a start still within its limits (MiMo-V2.5: 1800 s of engine start
        # under a 900 s fleet clock burnt 12 H200 x 15 min). Filled in here, so decision.json,
        # `plan` and the fleet all see the numbers the run uses.
        arms = (self.baseline, self.canary, *self.candidates)
        for arm in arms:
            if arm.cpus_per_replica is None:
                arm.cpus_per_replica = default_cpus_per_replica(arm.engine) if arm.launched else 0.0
        if self.placement_timeout_s is None:  # servers that run elsewhere are placed by nobody here
            self.placement_timeout_s = default_placement_timeout_s([arm.engine for arm in arms if arm.launched])
        engine_s = max(arm.engine.startup_timeout_s for arm in arms)
        need = self.placement_timeout_s + engine_s
        if self.startup_timeout_s is None:
            self.startup_timeout_s = need + FLEET_START_SLACK_S
        elif self.startup_timeout_s < need:
            raise ValueError(
                f"startup_timeout_s: {self.startup_timeout_s:g} s is shorter than placement_timeout_s "
                f"({self.placement_timeout_s:g} s) + the longest engine.startup_timeout_s ({engine_s:g} s) = "
                f"{need:g} s: the fleet would give up on replicas still within their own limits"
            )
        return self


def _one_line(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p)[:60] for p in first["loc"]) or "config"
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"{where}: {first['msg'].removeprefix('Value error, ')}{more}"


def _line(text: str, limit: int = 400) -> str:
    """One printable line: a key or a path with a newline or an escape code cannot split the error."""
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _config_error(source: str, detail: str) -> ConfigError:
    return ConfigError(_line(f"{source}: {detail}"))


def _first_non_finite(value: Any, where: str = "") -> str | None:
    """The path of the first NaN or infinity (YAML .nan, .inf, 1e999): no bound in the config
    means anything with them (an infinite max_duration_s never caps the experiment)."""
    if isinstance(value, float) and not math.isfinite(value):
        return where or "config"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _first_non_finite(item, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def parse_config(data: Any, source: str = "config") -> RolloutConfig:
    if data is None:
        raise _config_error(source, "empty: the top level must be a mapping")
    if not isinstance(data, dict):
        raise _config_error(source, f"the top level must be a mapping, not {type(data).__name__}")
    non_finite = _first_non_finite(data)
    if non_finite:
        raise _config_error(source, f"{non_finite}: must be a finite number")
    try:
        return RolloutConfig.model_validate(data)
    except ValidationError as exc:
        raise _config_error(source, _one_line(exc)) from None


# -- reading the file ----------------------------------------------------------------------
# A config is a few KiB of plain YAML. Anything else is refused before it is built: the file
# is read at most MAX_CONFIG_BYTES (256 KiB: 60x the largest shipped config; composing the
# densest 256 KiB of YAML takes ~0.5 s, 1 MiB ~2 s), and its node graph is checked before any
# Python object is made (aliases share nodes, so a "billion laughs" is small until expanded).
MAX_CONFIG_BYTES = 256 * 1024
MAX_YAML_NODES = 100_000  # the expanded document (every alias counted each time it is used)
MAX_YAML_DEPTH = 64
_YAML = "tag:yaml.org,2002:"
# what safe_load builds from untagged YAML; any other tag (!!python/object, !custom) is refused
PLAIN_TAGS = {_YAML + t for t in ("null", "bool", "int", "float", "str", "seq", "map", "merge", "timestamp")}


class _Refused(yaml.MarkedYAMLError):
    """YAML that parses but is no plain config (a tag, a duplicate key, an alias bomb)."""


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _check_plain(node: yaml.Node) -> None:
    if node.tag not in PLAIN_TAGS:
        raise _Refused(problem=f"tag {node.tag.replace(_YAML, '!!')} is not allowed (plain YAML data only)",
                       problem_mark=node.start_mark)
    if isinstance(node, yaml.MappingNode):
        seen: set[tuple[str, str]] = set()
        for key, _ in node.value:  # its own keys: a merged-in key (<<: *anchor) may be overridden
            if isinstance(key, yaml.ScalarNode) and key.tag != _YAML + "merge":
                if (key.tag, key.value) in seen:
                    raise _Refused(problem=f"duplicate key {key.value[:60]!r}", problem_mark=key.start_mark)
                seen.add((key.tag, key.value))


def check_yaml_nodes(root: yaml.Node) -> None:
    """Tags, duplicate keys, size and depth of a composed document, aliases expanded (iteratively:
    a deep document must not exhaust the stack here either). Raises a yaml.MarkedYAMLError."""
    state: dict[int, int] = {}  # 1: on the current path, 2: done
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            kids = _children(node)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            state[key] = 2
            if size[key] > MAX_YAML_NODES:
                raise _Refused(problem=f"expands to more than {MAX_YAML_NODES} nodes (an alias bomb?)",
                               problem_mark=node.start_mark)
            if depth[key] > MAX_YAML_DEPTH:
                raise _Refused(problem=f"nested deeper than {MAX_YAML_DEPTH} levels", problem_mark=node.start_mark)
            continue
        if state.get(key) == 2:
            continue
        if state.get(key) == 1:
            raise _Refused(problem="a recursive alias (a node that contains itself)", problem_mark=node.start_mark)
        _check_plain(node)
        state[key] = 1
        stack.append((node, True))
        stack.extend((kid, False) for kid in _children(node))


class ConfigLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """safe_load's loader (libyaml's when present: it also caps nesting), plus check_yaml_nodes
    on the composed document before anything is constructed."""

    def get_single_node(self):  # noqa: ANN201 (PyYAML's signature)
        node = super().get_single_node()
        if node is not None:
            check_yaml_nodes(node)
        return node


def _read_text(path: Path) -> str:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise _config_error(str(path), f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise _config_error(str(path), f"larger than {MAX_CONFIG_BYTES // 1024} KiB: too large for a config")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _config_error(
            str(path), f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}): a config is YAML text"
        ) from None


def _yaml_error(path: Path, exc: yaml.YAMLError) -> ConfigError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f" line {mark.line + 1}:" if mark is not None else ""
    if isinstance(exc, _Refused):
        return _config_error(str(path), f"{where} {exc.problem}")
    problem = getattr(exc, "problem", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
    context = getattr(exc, "context", None)
    return _config_error(str(path), f"{where} invalid YAML: {problem}{f' ({context})' if context else ''}")


def load_config(path: str | Path) -> RolloutConfig:
    """The validated config of a YAML file; ConfigError (one line naming the field or the cause)
    for anything else: unreadable, too large, not UTF-8, not YAML, not plain data, not valid."""
    path = Path(path)
    text = _read_text(path)
    loader = ConfigLoader(text)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None
    except RecursionError:
        raise _config_error(str(path), f"invalid YAML: nested too deeply (at most {MAX_YAML_DEPTH} levels)") from None
    finally:
        loader.dispose()
    return parse_config(data, source=str(path))
