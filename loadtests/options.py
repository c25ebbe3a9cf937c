"""The traffic a load test sends, as one typed object and as `--mtp-*` command-line flags.

The same `TrafficOptions` is built by the Swarm (and turned into flags), parsed by the
locustfile from Locust's options, and edited in Locust's web UI, so the flags are derived
from the model's fields rather than written twice. Importing this module never imports
Locust or gevent: a Ray driver builds these objects.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loadtests.arrivals import ArrivalKind
from loadtests.datasets import DatasetKind, LengthDistribution, TraceFormat
from loadtests.profiles import LoadProfile
from loadtests.records import Endpoint

# The router's bearer token, when it needs one (it binds beyond loopback): handed to every
# Locust process in its environment by whoever starts the load, never on a command line.
BEARER_TOKEN_ENV = "MTP_CANARY_BEARER_TOKEN"

FLAG_PREFIX = "mtp"
# prompt sources that draw their own words (no file)
SELF_MADE_DATASETS = ("synthetic", "shared_prefix", "multi_turn")


class TrafficOptions(BaseModel):
    """What each simulated user sends, and where the master keeps the records."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dataset: DatasetKind = Field(
        "synthetic", description="prompt source: synthetic, shared_prefix (synthetic suffixes after shared prefixes), "
        "multi_turn (sessions whose turns carry their history), gsm8k, jsonl or trace (replayed at its times)"
    )
    dataset_path: str | None = Field(
        None, description="JSONL file for gsm8k ({'question'}) or jsonl ({'prompt'} or {'messages'}); the trace file"
    )
    input_tokens: str = Field(
        "128", description="synthetic prompt length in tokens (~words): 128, uniform:64:256, normal:M:S, lognormal:MED:SIG"
    )
    output_tokens: str | None = Field(
        None, description="synthetic output length distribution (default: exactly --mtp-max-tokens)"
    )
    prefix_groups: int = Field(8, ge=1, le=100_000, description="shared_prefix: how many distinct prefixes")
    prefix_tokens: int = Field(256, ge=1, le=1_000_000, description="shared_prefix: each prefix's length in tokens (~words)")
    turns: int = Field(4, ge=1, le=1000, description="multi_turn: turns per session (each user keeps its session)")
    trace_format: TraceFormat = Field(
        "jsonl", description="trace: jsonl ({timestamp s, input_tokens, output_tokens[, session_id, prefix_id]}), "
        "mooncake or burstgpt"
    )
    trace_speedup: float = Field(1.0, gt=0, description="trace: replay this many times faster than recorded")
    max_tokens: int = Field(128, ge=1, le=1 << 20, description="max_tokens of each request (datasets without their own)")
    ignore_eos: bool = Field(False, description="send ignore_eos (always on for synthetic: exact output lengths)")
    endpoint: Endpoint = Field("completions", description="completions (/v1/completions) or chat (/v1/chat/completions)")
    model: str | None = Field(None, description="model name (default: the first one /v1/models lists)")
    temperature: float = Field(0.0, ge=0.0, description="sampling temperature (0: greedy)")
    records: str | None = Field(None, description="JSONL path where the master writes every request's record")
    tag: str = Field("loadtest", min_length=1, description="phase label stored in every record")
    seed: int = Field(0, description="seed of the prompt sequence and of random arrivals")
    arm_pin: str | None = Field(
        None,
        description="pin requests to arms via x-mtp-canary-arm; a comma list (baseline,canary) "
        "sends every prompt to each arm in turn",
    )
    arm_users: bool = Field(
        False,
        description="with a comma --mtp-arm-pin: each user keeps one arm (the arm with the fewest users when it "
        "starts) and every arm walks the same prompt sequence at its own pace, so each arm carries the same "
        "number of streams at every moment (default: each request takes the next arm in turn)",
    )
    rate: float | None = Field(None, gt=0, description="open loop: total requests/s over all workers (default: closed loop)")
    arrival: ArrivalKind = Field("poisson", description="open-loop arrivals: poisson, constant or gamma")
    burstiness: float = Field(1.0, gt=0, description="gamma arrivals: shape (1 = Poisson, <1 burstier)")
    steps: str | None = Field(
        None,
        description="stepped load: levels in order, e.g. 1,4,16, each for --mtp-step-s; closed loop: "
        "level x --mtp-level-users users; open loop: level x --mtp-rate requests/s. Records carry the level",
    )
    step_s: float = Field(30.0, gt=0, description="seconds each level of --mtp-steps lasts")
    ramp: str | None = Field(
        None, description="ramped load FROM:TO (levels, as --mtp-steps) over --mtp-ramp-s; records carry the level"
    )
    ramp_s: float = Field(60.0, gt=0, description="seconds the --mtp-ramp takes")
    level_users: float = Field(
        1.0, gt=0, description="closed loop with --mtp-steps/--mtp-ramp: users per unit of level (e.g. replicas)"
    )
    timeout_s: float = Field(600.0, gt=0, description="seconds a request may wait for its next bytes")
    deadline_s: float = Field(1800.0, gt=0, description="seconds a whole request may take, however its bytes trickle")
    ui_latency_rows: bool = Field(False, description="add TTFT and TPOT rows per arm to Locust's statistics")
    flush_timeout_s: float = Field(
        30.0, gt=0, description="how long the master waits for the workers' last records after a stop"
    )
    cpu_warn_pct: float = Field(
        85.0, gt=0, description="warn that the generator limits the load when a worker uses more than this percent of one core"
    )
    lag_warn_ms: float = Field(
        50.0, gt=0, description="open loop: warn that the generator limits the load when the send lag p99 exceeds this"
    )

    @field_validator("*", mode="before")
    @classmethod
    def _normalise(cls, value: Any) -> Any:
        if isinstance(value, PurePath):  # file options travel as command-line strings
            return str(value)
        # Locust's web UI sends "" for an optional field left empty
        return None if isinstance(value, str) and value.strip() == "" else value

    @model_validator(mode="after")
    def _consistent(self) -> TrafficOptions:
        if self.dataset not in SELF_MADE_DATASETS and not self.dataset_path:
            raise ValueError(f"dataset {self.dataset!r} needs --mtp-dataset-path")
        if self.dataset == "trace" and (self.rate is not None or self.steps is not None or self.ramp is not None):
            raise ValueError("a trace sets its own send times: no --mtp-rate, --mtp-steps or --mtp-ramp with it")
        if self.dataset in SELF_MADE_DATASETS:
            LengthDistribution.parse(self.input_tokens)
            LengthDistribution.parse(self.synthetic_output_tokens)
        if self.arm_pin is not None and not self.pinned_arms:
            raise ValueError("--mtp-arm-pin names no arm")
        if self.arm_users and len(self.pinned_arms) < 2:
            raise ValueError("--mtp-arm-users needs --mtp-arm-pin with two or more arms")
        if self.steps is not None and self.ramp is not None:
            raise ValueError("--mtp-steps and --mtp-ramp exclude each other")
        self.profile  # noqa: B018 - parses the profile: a bad one is refused here
        return self

    @property
    def profile(self) -> LoadProfile | None:
        """The stepped or ramped load profile, if the options ask for one."""
        if self.steps is not None:
            return LoadProfile.parse_steps(self.steps, self.step_s)
        if self.ramp is not None:
            return LoadProfile.parse_ramp(self.ramp, self.ramp_s)
        return None

    @property
    def open_loop(self) -> bool:
        """Requests leave on a schedule (a rate or a trace's times), not when a user is free."""
        return self.rate is not None or self.dataset == "trace"

    @property
    def pinned_arms(self) -> tuple[str, ...]:
        if not self.arm_pin:
            return ()
        return tuple(arm.strip() for arm in self.arm_pin.split(",") if arm.strip())

    @property
    def synthetic_output_tokens(self) -> str:
        return self.output_tokens or str(self.max_tokens)

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace | Any) -> TrafficOptions:
        """Read the `mtp_*` attributes of Locust's parsed options."""
        values = {}
        for name in cls.model_fields:
            dest = f"{FLAG_PREFIX}_{name}"
            if hasattr(namespace, dest):
                values[name] = getattr(namespace, dest)
        return cls.model_validate(values)

    def to_cli_args(self) -> list[str]:
        """The flags that reproduce these options (only those that differ from the defaults)."""
        args: list[str] = []
        for name, info in type(self).model_fields.items():
            value = getattr(self, name)
            if value == info.default:
                continue
            flag = _flag(name)
            if isinstance(value, bool):
                if value:
                    args.append(flag)
                else:  # a False that differs from a True default cannot be a store_true flag
                    raise ValueError(f"{flag} cannot be switched off on the command line")
            else:
                args += [flag, str(value)]
        return args


def _flag(name: str) -> str:
    return f"--{FLAG_PREFIX}-{name.replace('_', '-')}"


@dataclass(frozen=True)
class CliArgument:
    """One `--mtp-*` flag, ready for `parser.add_argument(flag, **kwargs)`."""

    flag: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    in_web_ui: bool = True


# fields that make no sense to change from the web form (the master opened its file at start)
# and the profile: the shape that applies it is installed when the process starts
_NOT_IN_WEB_UI = {"records", "flush_timeout_s", "steps", "step_s", "ramp", "ramp_s", "level_users"}


def cli_arguments() -> list[CliArgument]:
    """Every TrafficOptions field as a flag, typed from its annotation."""
    arguments = []
    for name, info in TrafficOptions.model_fields.items():
        annotation = info.annotation
        # Optional[X] -> X
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
        kwargs: dict[str, Any] = {"dest": f"{FLAG_PREFIX}_{name}", "default": info.default, "help": info.description}
        if annotation is bool:
            kwargs["action"] = "store_true"
        elif typing.get_origin(annotation) is Literal:
            kwargs["choices"] = list(typing.get_args(annotation))
        elif annotation in (int, float, str):
            kwargs["type"] = annotation
        else:
            raise TypeError(f"TrafficOptions.{name}: no command-line form for {annotation!r}")
        arguments.append(CliArgument(_flag(name), kwargs, in_web_ui=name not in _NOT_IN_WEB_UI))
    return arguments


def _print_flags() -> None:
    """`python -m loadtests.options --help`: the --mtp-* flags (Locust's own --help prints
    before it imports the locustfile, so it cannot list them)."""
    parser = argparse.ArgumentParser(
        prog="locust -f loadtests/locustfile.py",
        description="Traffic flags of the mtp-canary locustfile (besides Locust's own options).",
    )
    for argument in cli_arguments():
        parser.add_argument(argument.flag, **argument.kwargs)
    parser.parse_args()


if __name__ == "__main__":
    _print_flags()
