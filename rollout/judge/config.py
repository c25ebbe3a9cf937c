"""How to judge: `GatesConfig` (the run YAML's `gates:`, with its `SloConfig` under `gates.slo:`) and
`GuardConfig` (`progressive.guards:`).

Plain pydantic models; the judges read them, `rollout.config` embeds them in the run config.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from rollout.judge import stats
from rollout.judge.names import GATE_NAMES

__all__ = ["SloConfig", "GatesConfig", "GuardConfig"]


class SloConfig(pydantic.BaseModel, extra="forbid"):
    """The per-request service-level objective the goodput gate counts (any subset of bounds)."""

    ttft_s: float | None = Field(
        None, gt=0.0, description="Largest time to first token (seconds) of a request that meets the SLO; null: no TTFT bound."
    )
    tpot_s: float | None = Field(
        None,
        gt=0.0,
        description="Largest time per output token after the first (seconds) of a request that meets the SLO (a "
        "one-token output has none to miss); null: no TPOT bound.",
    )
    e2e_s: float | None = Field(
        None, gt=0.0, description="Largest end-to-end latency (seconds) of a request that meets the SLO; null: no E2E bound."
    )

    @property
    def bounds(self) -> dict[str, float]:
        """The configured bounds by record field (ttft_s, tpot_s, e2e_s); empty: no SLO, no goodput gate."""
        return {name: value for name, value in (("ttft_s", self.ttft_s), ("tpot_s", self.tpot_s), ("e2e_s", self.e2e_s))
                if value is not None}

    def text(self) -> str:
        """The SLO as a reader sees it: 'TTFT <= 0.3 s, TPOT <= 0.05 s'."""
        labels = {"ttft_s": "TTFT", "tpot_s": "TPOT", "e2e_s": "E2E"}
        return ", ".join(f"{labels[name]} <= {value:g} s" for name, value in self.bounds.items()) or "no bound"


class GatesConfig(pydantic.BaseModel, extra="forbid"):
    """How to judge a canary; embedded in the run YAML under ``gates:``."""

    alpha: float = Field(
        0.05,
        gt=0.0,
        le=0.2,
        description="Error rate per decision side: the chance of promoting a canary that sits exactly at a gate's "
        "threshold, and (family-wise, over all looks) of rolling back on a guardrail that is not violated.",
    )
    accuracy_margin: float = Field(
        0.02,
        ge=0.0,
        lt=1.0,
        description="Non-inferiority margin on baseline accuracy minus canary accuracy (absolute, 0.02 = 2 points). "
        "Pass needs the upper confidence bound of the drop below it; fail needs the lower bound above it.",
    )
    divergence_margin: float = Field(
        0.05,
        ge=0.0,
        lt=1.0,
        description="Allowed excess of the canary-vs-baseline greedy output divergence rate over the twin (A/A) "
        "baseline's divergence rate; with no twin, the absolute cap on the canary-vs-baseline divergence rate.",
    )
    tpot_p50_min_improvement: float = Field(
        0.10,
        ge=0.0,
        lt=1.0,
        description="Objective: the canary's median time per output token must be at least this much lower "
        "(0.10: ratio canary/baseline <= 0.90), judged by the ratio's upper confidence bound. 0 asks only 'faster'.",
    )
    ttft_p95_max_ratio: float = Field(
        1.25,
        ge=1.0,
        description="Guardrail: largest acceptable ratio canary/baseline of the 95th-percentile time to first token.",
    )
    e2e_p95_max_ratio: float | None = Field(
        None,
        ge=1.0,
        description="Optional guardrail: largest acceptable ratio of the 95th-percentile end-to-end latency; "
        "null disables it.",
    )
    error_rate_max_increase: float = Field(
        0.01,
        ge=0.0,
        lt=1.0,
        description="Guardrail: largest acceptable canary error rate minus baseline error rate (absolute).",
    )
    min_acceptance_length: float | None = Field(
        1.5,
        ge=1.0,
        description="Floor on the canary's mean acceptance length (1 + accepted draft tokens per draft); "
        "null disables the gate.",
    )
    acceptance_profile: list[float] | None = Field(
        None,
        description="Expected acceptance rate at each draft position 1..k, as vLLM counts it: accepted tokens at "
        "position i over verify steps (accepted_tokens_per_pos[i] / drafts: the share of verify steps that accepted "
        "position i), non-increasing, each in [0, 1]. Gate acceptance_profile: the canary fails when a position's "
        "request-clustered upper bound is below its profile value minus acceptance_profile_margin (vLLM's reuse of "
        "MTP layer 0 for every draft step, a wrong layer loaded). A longer profile than the canary's k: the first k "
        "positions are judged; a shorter one: the positions it gives. Null disables the gate.",
    )
    acceptance_profile_margin: float = Field(
        0.10,
        ge=0.0,
        lt=1.0,
        description="How far (absolute, 0.10 = 10 points) a draft position's acceptance rate may fall below "
        "gates.acceptance_profile before the gate fails it; pass needs every judged position's lower bound at or "
        "above profile minus this margin.",
    )
    min_requests_per_arm: int = Field(
        30,
        ge=5,
        description="Fewer successful requests than this in either arm: latency gates are inconclusive.",
    )
    min_eval_items: int = Field(
        20,
        ge=1,
        description="Fewer paired eval items than this: accuracy and divergence can only fail (via the "
        "always-valid clear-regression rule), never pass.",
    )
    max_looks: int = Field(
        5,
        ge=1,
        le=stats.MAX_PLANNED_LOOKS,
        description="Planned equal looks over which alpha is spent when a judge is called without information "
        "fractions (a direct call of a judge). The experiment plans its own looks "
        "(experiment.requests_per_arm / requests_per_look) and spends alpha at the observed information fractions. "
        "Looks past this number reuse the last boundary and are outside the error guarantee.",
    )
    enabled: list[str] | None = Field(
        None,
        description=f"Optional subset of gate names to judge; null means all configured gates. "
        f"Known names: {', '.join(GATE_NAMES)}.",
    )
    # The complement of `enabled`: turning one gate off must not mean listing every other one
    # (such a list silently misses a gate the defaults gain later). A disabled gate's figures
    # (goodput per arm, prefix-cache hit rates) are still measured and reported.
    disabled: list[str] = Field(
        default_factory=list,
        description="Gate names not to judge (their figures are still reported, e.g. goodput per arm); "
        f"the rest of `enabled` (or of all configured gates) is judged. Known names: {', '.join(GATE_NAMES)}.",
    )
    look_correlation_max: float = Field(
        0.5,
        ge=0.0,
        lt=1.0,
        description="The look-to-look correlation of an arm's latency level (drift, a replica's state) the TPOT "
        "objective's critical values hold for: the latency intervals are drift-robust over the looks (a Bartlett "
        "long-run variance), the objective's with the worst case of an AR(1) level up to this correlation, the p95 "
        "guardrails' with the critical values of independent looks. From 6 looks on, the run's own (bias-corrected) "
        "estimate of the contrast's correlation replaces it when higher, and past 0.9 the objective cannot pass. "
        "Higher: wider intervals, slower drift covered; a twin baseline or a longer run covers drift beyond it "
        "(docs/statistics.md, docs/calibration.md).",
    )
    spending: Literal["obrien_fleming", "pocock"] = Field(
        "obrien_fleming",
        description="Alpha-spending function over the looks (Lan-DeMets): obrien_fleming keeps early looks strict, "
        "pocock stops earlier on large effects but needs more data at the last look.",
    )
    early_stop_alpha_fraction: float = Field(
        0.2,
        ge=0.0,
        lt=1.0,
        description="Share of the accuracy and divergence gates' rollback-side alpha given to the always-valid "
        "clear-regression rule that may fail a broken canary after a few dozen items at any look.",
    )

    max_baseline_eval_error_rate: float = Field(
        0.02,
        ge=0.0,
        lt=1.0,
        description="Eval items whose baseline request failed are left out of the paired accuracy and divergence "
        "statistics (a baseline error is no evidence about the canary); above this share of such items the accuracy "
        "and divergence gates are inconclusive (3% baseline timeouts counted as canary wins would hide a ~3-point drop).",
    )
    sample_ratio_alpha: float = Field(
        0.001,
        gt=0.0,
        le=0.05,
        description="Sample-ratio mismatch check (gate sample_ratio): the experiment's arms must receive the shares "
        "the pinning promised (equal); an exact binomial test below this p-value makes the run inconclusive "
        "(a dead or ejected replica, or a router bug, not the canary's merit, decided the data).",
    )

    slo: SloConfig | None = Field(
        None,
        description="Per-request SLO for the goodput gate (goodput_guard): a request meets it when it succeeded and "
        "every bound given holds; failed requests miss it, cancelled ones are not requests. Null (or every bound null): "
        "no goodput gate.",
    )
    goodput_max_decrease: float = Field(
        0.05,
        ge=0.0,
        lt=1.0,
        description="Goodput gate margin: the canary's share of requests meeting gates.slo may be at most this much "
        "below the baseline's (absolute, 0.05 = 5 points), paired by prompt. Pass needs the upper confidence bound of "
        "the drop below it; fail needs the lower bound above it.",
    )

    prefix_cache_max_drop: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="Prefix-cache gate margin (prefix_cache_guard): the canary's prefix-cache hit rate (vLLM's "
        "prefix_cache_hits / prefix_cache_queries over the experiment, prompt tokens) may be at most this much below "
        "the baseline's (absolute, 0.1 = 10 points), paired by look. Null: no prefix-cache gate. Meant for a load with "
        "shared prefixes (experiment.dataset shared_prefix, multi_turn, or a trace that shares them).",
    )

    @property
    def goodput_slo(self) -> SloConfig | None:
        """The SLO when it sets at least one bound (the goodput gate exists), else None."""
        return self.slo if self.slo is not None and self.slo.bounds else None

    @pydantic.model_validator(mode="after")
    def _enabled_and_disabled_apart(self) -> "GatesConfig":
        both = sorted(set(self.enabled or ()) & set(self.disabled))
        if both:
            raise ValueError(f"{both} both enabled and disabled: name a gate in one of the two lists")
        return self

    @pydantic.model_validator(mode="after")
    def _goodput_needs_an_slo(self) -> "GatesConfig":
        if self.enabled and "goodput_guard" in self.enabled and self.goodput_slo is None:
            raise ValueError("enabled names goodput_guard but gates.slo sets no bound: the gate would never be judged")
        if self.enabled and "prefix_cache_guard" in self.enabled and self.prefix_cache_max_drop is None:
            raise ValueError("enabled names prefix_cache_guard but gates.prefix_cache_max_drop is null: the gate would "
                             "never be judged")
        if self.enabled and "acceptance_profile" in self.enabled and self.acceptance_profile is None:
            raise ValueError("enabled names acceptance_profile but gates.acceptance_profile is null: the gate would "
                             "never be judged")
        return self

    @pydantic.field_validator("acceptance_profile")
    @classmethod
    def _profile_is_a_tail(cls, profile: list[float] | None) -> list[float] | None:
        # position i + 1 is accepted only in a step that accepted position i: the rates cannot rise
        if profile is None:
            return None
        if not profile:
            raise ValueError("acceptance_profile must give at least one position (or be null: no gate)")
        outside = [value for value in profile if not 0.0 <= value <= 1.0]
        if outside:
            raise ValueError(f"acceptance_profile values are acceptance rates in [0, 1], got {outside}")
        rises = [i + 2 for i in range(len(profile) - 1) if profile[i + 1] > profile[i]]
        if rises:
            raise ValueError(f"acceptance_profile must be non-increasing (position i + 1 is accepted only if i was): "
                             f"it rises at position {rises[0]}")
        return profile

    @pydantic.field_validator("enabled")
    @classmethod
    def _known_gate_names(cls, names: list[str] | None) -> list[str] | None:
        if names is None:
            return None
        _refuse_unknown(names)
        if not names:
            raise ValueError("enabled must name at least one gate (or be null for all)")
        return names

    @pydantic.field_validator("disabled")
    @classmethod
    def _known_disabled_names(cls, names: list[str]) -> list[str]:
        _refuse_unknown(names)
        return names


def _refuse_unknown(names: list[str]) -> None:
    unknown = sorted(set(names) - set(GATE_NAMES))
    if unknown:
        raise ValueError(f"unknown gate name(s) {unknown}; known: {list(GATE_NAMES)}")


class GuardConfig(BaseModel):
    """Guards judged on the canary's live data every window of the progressive phase."""

    model_config = ConfigDict(extra="forbid")

    window_s: int = Field(10, ge=2, description="seconds per guard window")
    min_requests: int = Field(5, ge=1, description="canary requests a window needs before latency guards judge it")
    error_rate_max_increase: float = Field(0.05, ge=0, le=1, description="canary minus baseline error rate in a window")
    ttft_p95_max_s: float | None = Field(None, gt=0, description="absolute SLO on the canary's TTFT p95")
    tpot_p95_max_s: float | None = Field(None, gt=0, description="absolute SLO on the canary's TPOT p95")
    min_acceptance_length: float | None = Field(None, ge=1, description="floor on the canary's mean acceptance length")
