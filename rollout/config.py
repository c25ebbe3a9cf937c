"""The run config: what to compare, how to load it, how to judge it.

`load_config(path)` reads YAML into a validated `RolloutConfig`; anything wrong
raises `ConfigError` with one line naming the field (the CLI exits 2 with it,
before anything starts).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.engine_spec import EngineSpec
from rollout.evals import EvalSpec
from rollout.judge.config import GatesConfig, GuardConfig
from rollout.judge.stats import MAX_PLANNED_LOOKS

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

    replicas: int = Field(1, ge=1)
    engine: EngineSpec
    tiny_model: TinyModelOptions | None = Field(
        None, description="write the tiny checkpoint and serve it (engine.model is then ignored)"
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


class AccuracyConfig(EvalSpec):
    """The accuracy phase: identical greedy items to both arms (and the twin)."""

    enabled: bool = True
    batch_size: int = Field(16, ge=1, description="items per interim look (early stop on a clear regression)")


WORKER_PLACEMENTS = ("local", "spread", "pack", "node", "label", "resource")


class SweepConfig(BaseModel):
    """Speedup vs load: after the judged windows, both arms at several loads (informational, no gate)."""

    model_config = ConfigDict(extra="forbid")

    levels: list[int] = Field(
        default_factory=list, description="closed-loop streams per replica, in order, e.g. [1, 4, 16]; empty: no sweep"
    )
    step_s: int = Field(30, ge=5, description="seconds at each level")

    @field_validator("levels")
    @classmethod
    def _positive(cls, levels: list[int]) -> list[int]:
        if any(level < 1 for level in levels):
            raise ValueError("sweep levels are streams per replica: each must be >= 1")
        return levels


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
    min_looks: int = Field(1, ge=1, description="no early stop before this many looks")
    max_duration_s: float = Field(
        1800, gt=0, description="wall-clock cap of the experiment phase: reached before the plan, INCONCLUSIVE"
    )
    rate_per_replica: float | None = Field(
        None, gt=0, description="open loop: requests/s offered to each replica (default: closed loop)"
    )
    users_per_replica: int = Field(2, ge=1, description="closed loop: streams in flight per replica")
    dataset: str = Field("synthetic", description="synthetic, gsm8k or jsonl")
    dataset_path: str | None = None
    input_tokens: str = Field("64", description="synthetic prompt length: N, uniform:A:B, normal:M:S, lognormal:M:S")
    max_tokens: int = Field(64, ge=2)
    endpoint: str = Field("completions", description="completions or chat")
    workers: int = Field(1, ge=0, description="Locust worker processes (0: one local process)")
    worker_placement: str = Field(
        "spread",
        description="where Locust workers run: 'spread' (each under a Ray actor, spread over the nodes), 'pack', "
        "'node:<id or ip>', 'label:key=value', 'resource:NAME[=N]', or 'local' (child processes of the controller)",
    )
    sweep: SweepConfig = Field(default_factory=SweepConfig)
    web_ui: bool = Field(False, description="serve Locust's web UI while the experiment runs")
    web_port: int = Field(8089, ge=1, le=65535)
    seed: int = 0

    @field_validator("worker_placement")
    @classmethod
    def _placement(cls, placement: str) -> str:
        kind, sep, value = placement.partition(":")
        if kind not in WORKER_PLACEMENTS or (kind in ("node", "label", "resource")) != bool(sep and value):
            raise ValueError(
                f"unknown placement {placement!r}: local, spread, pack, node:<id or ip>, label:key=value or resource:NAME[=N]"
            )
        return placement

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
        if self.worker_placement != "local" and self.workers == 0:
            raise ValueError("workers: 0 (one local Locust process) needs worker_placement: local")
        return self


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


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    description: str = ""
    ray: RayConfig = Field(default_factory=RayConfig)
    baseline: ArmConfig
    canary: ArmConfig
    twin_baseline: bool = Field(False, description="start a second baseline arm: the A/A noise floor of divergence")
    accuracy: AccuracyConfig = Field(default_factory=AccuracyConfig)
    experiment: ExperimentConfig = Field(default_factory=ExperimentConfig)
    gates: GatesConfig = Field(default_factory=GatesConfig)
    progressive: ProgressiveConfig = Field(default_factory=ProgressiveConfig)
    webhook_url: str | None = Field(None, description="POST decision.json here when the run ends (never blocks it)")
    keep_fleet: bool = Field(False, description="leave the replicas running after the decision")
    startup_timeout_s: float = Field(900, gt=0, description="all replicas must be ready within this")
    lease_s: float = Field(
        300,
        ge=10,
        description="how long the run's replicas, router and load outlive a dead controller "
        "(time to `mtp-canary resume RUN_ID`); then they stop themselves",
    )

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
        if not self.accuracy.enabled and not self.experiment.enabled and not self.progressive.enabled:
            raise ValueError("accuracy, experiment and progressive are all disabled: nothing to judge")
        return self


def _one_line(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "config"
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"


def parse_config(data: Any, source: str = "config") -> RolloutConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        return RolloutConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_one_line(exc)}") from None


def load_config(path: str | Path) -> RolloutConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} invalid YAML: {getattr(exc, 'problem', exc)}") from None
    return parse_config(data, source=str(path))
