"""A replica's Prometheus `/metrics`, reduced to what the canary judges.

Counters are cumulative since the server booted; a phase is judged on the
*difference* of two snapshots (`MetricsSnapshot.delta`), never on totals, or a
warm-up or an earlier phase would leak into the verdict.

Speculative decoding (vLLM v1 names):
  acceptance rate          = accepted_tokens / draft_tokens
  mean acceptance length   = 1 + accepted_tokens / drafts
  per-position rate[i]     = accepted_per_pos[i] / drafts
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
REQUESTS_RUNNING = "vllm:num_requests_running"
REQUESTS_WAITING = "vllm:num_requests_waiting"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative-decoding counters over some window (or since boot)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_position: tuple[float, ...] = ()

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens > 0 else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts > 0 else None

    @property
    def per_position_rate(self) -> list[float] | None:
        if self.drafts <= 0:
            return None
        return [a / self.drafts for a in self.accepted_per_position]

    def expected_length_for_k(self, k: int) -> float | None:
        """Expected acceptance length had the engine drafted only k tokens.

        Position i is accepted only if every earlier one was, so the per-position
        profile of a k-step run gives every shorter k' directly: 1 + sum of the
        first k' rates (the report uses it to say which k is worth running).
        """
        rates = self.per_position_rate
        if rates is None or k > len(rates):
            return None
        return 1.0 + sum(rates[:k])

    def __add__(self, other: "SpecDecodeStats") -> "SpecDecodeStats":
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        a = list(self.accepted_per_position) + [0.0] * (n - len(self.accepted_per_position))
        b = list(other.accepted_per_position) + [0.0] * (n - len(other.accepted_per_position))
        return SpecDecodeStats(
            drafts=self.drafts + other.drafts,
            draft_tokens=self.draft_tokens + other.draft_tokens,
            accepted_tokens=self.accepted_tokens + other.accepted_tokens,
            accepted_per_position=tuple(x + y for x, y in zip(a, b)),
        )

    def to_dict(self) -> dict:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position": self.per_position_rate,
        }


@dataclass(frozen=True)
class MetricsSnapshot:
    """The counters and gauges of one scrape."""

    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    requests_running: float = 0.0
    requests_waiting: float = 0.0

    def delta(self, earlier: "MetricsSnapshot") -> "MetricsSnapshot":
        """Counters accumulated since `earlier`; gauges as of now.

        A counter that went down means the server restarted in between; the
        window is then unusable and we say so rather than report negatives.
        """
        a, b = self.spec_decode, earlier.spec_decode
        n = len(a.accepted_per_position)
        before = list(b.accepted_per_position) + [0.0] * max(0, n - len(b.accepted_per_position))
        counters = [
            a.drafts - b.drafts,
            a.draft_tokens - b.draft_tokens,
            a.accepted_tokens - b.accepted_tokens,
            self.generation_tokens - earlier.generation_tokens,
        ]
        per_pos = tuple(x - y for x, y in zip(a.accepted_per_position, before))
        if min(counters + list(per_pos), default=0.0) < 0:
            raise ValueError("a /metrics counter went down: the server restarted within the window")
        return MetricsSnapshot(
            spec_decode=SpecDecodeStats(counters[0], counters[1], counters[2], per_pos),
            generation_tokens=counters[3],
            prompt_tokens=self.prompt_tokens - earlier.prompt_tokens,
            requests_running=self.requests_running,
            requests_waiting=self.requests_waiting,
        )


def spec_decode_delta(
    before: Mapping[str, MetricsSnapshot] | None, after: Mapping[str, MetricsSnapshot] | None, replicas: Iterable[str]
) -> SpecDecodeStats | None:
    """The speculative-decoding counters `replicas` accumulated between two scrapes (replica name ->
    snapshot), summed; None when either scrape is missing, a replica is missing from one, or one
    restarted in between: the delta is then unknown, never a partial sum that reads as low acceptance."""
    if before is None or after is None:
        return None
    total = SpecDecodeStats()
    for name in replicas:
        if name not in before or name not in after:
            return None
        try:
            total = total + after[name].delta(before[name]).spec_decode
        except ValueError:  # a counter went down: the replica restarted in between
            return None
    return total


def parse_metrics(text: str) -> MetricsSnapshot:
    """Parse a vLLM `/metrics` page (summing over engines and label sets)."""
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == ACCEPTED_PER_POS:
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
            elif sample.name in (
                DRAFTS,
                DRAFT_TOKENS,
                ACCEPTED_TOKENS,
                REQUESTS_RUNNING,
                REQUESTS_WAITING,
                GENERATION_TOKENS,
                PROMPT_TOKENS,
            ):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ()
    return MetricsSnapshot(
        spec_decode=SpecDecodeStats(
            drafts=totals.get(DRAFTS, 0.0),
            draft_tokens=totals.get(DRAFT_TOKENS, 0.0),
            accepted_tokens=totals.get(ACCEPTED_TOKENS, 0.0),
            accepted_per_position=positions,
        ),
        generation_tokens=totals.get(GENERATION_TOKENS, 0.0),
        prompt_tokens=totals.get(PROMPT_TOKENS, 0.0),
        requests_running=totals.get(REQUESTS_RUNNING, 0.0),
        requests_waiting=totals.get(REQUESTS_WAITING, 0.0),
    )
