"""A replica's Prometheus `/metrics`, reduced to what the canary judges.

Counters are cumulative since the server booted; a phase is judged on the
*difference* of two snapshots (`MetricsSnapshot.delta`), never on totals, or a
warm-up or an earlier phase would leak into the verdict.

Speculative decoding (vLLM v1 names):
  acceptance rate          = accepted_tokens / draft_tokens
  mean acceptance length   = 1 + accepted_tokens / drafts
  per-position rate[i]     = accepted_per_pos[i] / drafts

KV cache (vLLM 0.32 v1 loggers): `vllm:kv_cache_usage_perc` (a gauge, 1.0 = full),
`vllm:num_preemptions_total` (a counter), and `vllm:cache_config_info` (an info gauge whose
labels carry num_gpu_blocks, block_size and kv_cache_size_tokens). k=3 and k=1 may differ in
KV capacity (the drafts' KV) and preempt differently: `kv_stats` reduces the snapshots sampled
during a phase (`MetricsSampler`) to an arm's peak and mean usage, its preemptions in the
phase and its capacity.

Prefix cache: `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` (counters, in
prompt tokens looked up / found). An arm's hit rate over a phase is the rise of hits over the
rise of queries, summed over its replicas (`kv_stats`); it means most under a shared-prefix load
(loadtests.datasets.SharedPrefixPrompts), where both arms see the same groups.

Requests: `vllm:request_success_total` (every finished request, anyone's): set beside the
router's own count, it tells whether other traffic reached a replica.

Pages are read bounded (`fetch_metrics_text`: a byte cap, a total deadline) and parsed bounded
(MAX_POSITIONS): a hostile page fails its scrape (the replica's data is missing, never zero).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from cluster.bounded_body import BodyLimitError, read_bounded

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
REQUESTS_RUNNING = "vllm:num_requests_running"
REQUESTS_WAITING = "vllm:num_requests_waiting"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"
CACHE_CONFIG = "vllm:cache_config_info"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
REQUESTS_FINISHED = "vllm:request_success_total"  # every request the server finished, any finish reason

# A replica (or an `endpoints:` server) may be broken or hostile: its page is read within a byte
# cap and a total deadline, and a speculative position past MAX_POSITIONS (a `position` label of
# 999999999 would allocate a tuple that long) makes the page unusable, never a huge profile.
MAX_POSITIONS = 64
METRICS_MAX_BYTES = 16 << 20
METRICS_DEADLINE_S = 30.0


class MetricsPageError(ValueError):
    """A /metrics page that cannot be judged (too large, too slow, or a label no vLLM writes)."""


def fetch_metrics_text(url: str, timeout_s: float = 10.0, deadline_s: float = METRICS_DEADLINE_S,
                       max_bytes: int = METRICS_MAX_BYTES) -> str:
    """GET a /metrics page: each read within timeout_s, the whole within deadline_s and max_bytes."""
    import time

    import requests

    started = time.monotonic()
    with requests.get(url, timeout=timeout_s, stream=True) as response:
        response.raise_for_status()
        try:
            body = read_bounded(response, max_bytes, deadline_s, started)
        except BodyLimitError as exc:
            raise MetricsPageError(f"{url}: {str(exc).replace('the body', 'the page')}") from None
    return body.decode(response.encoding or "utf-8", errors="replace")


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
    kv_cache_usage: float | None = None  # mean over the server's engines now; None: not exported
    preemptions: float = 0.0
    # from cache_config_info, summed over engines; None where the label is absent or "None"
    num_gpu_blocks: float | None = None
    block_size: float | None = None
    kv_capacity_tokens: float | None = None
    prefix_cache_queries: float = 0.0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: float = 0.0  # of those, found
    requests_finished: float = 0.0  # requests the server finished (vllm:request_success_total), anyone's

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
            kv_cache_usage=self.kv_cache_usage,
            preemptions=self.preemptions - earlier.preemptions,
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            kv_capacity_tokens=self.kv_capacity_tokens,
            prefix_cache_queries=self.prefix_cache_queries - earlier.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits - earlier.prefix_cache_hits,
            requests_finished=self.requests_finished - earlier.requests_finished,
        )


def requests_not_routed(
    finished: Mapping[str, float], routed: Mapping[str, float], in_flight_at_start: Mapping[str, float]
) -> dict[str, int]:
    """Per replica, requests its server finished in a window beyond what the router sent it then
    (`finished`: vllm:request_success_total's rise; `routed`: the router's count's rise; a request in
    flight when the window opened finishes inside it). Only replicas with such requests appear:
    traffic that did not come through the router, someone else's."""
    out = {}
    for replica, done in finished.items():
        if replica not in routed or done < 0 or routed[replica] < 0:
            continue  # a counter went down (a restart in between): nothing to tell
        excess = int(done - routed[replica] - in_flight_at_start.get(replica, 0))
        if excess > 0:
            out[replica] = excess
    return out


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
    usage: list[float] = []
    cache: dict[str, list[float]] = {"num_gpu_blocks": [], "block_size": [], "kv_cache_size_tokens": []}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == KV_USAGE:
                usage.append(sample.value)
            elif sample.name == CACHE_CONFIG:
                for label, values in cache.items():
                    number = _number(sample.labels.get(label))
                    if number is not None:
                        values.append(number)
            elif sample.name == ACCEPTED_PER_POS:
                label = sample.labels.get("position", "")
                pos = int(label) if label.isdigit() and len(label) <= 3 else -1
                if not 0 <= pos < MAX_POSITIONS:
                    raise MetricsPageError(f"{ACCEPTED_PER_POS} has position {label[:20]!r}: "
                                           f"not a speculative position below {MAX_POSITIONS}")
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
            elif sample.name in (
                DRAFTS,
                DRAFT_TOKENS,
                ACCEPTED_TOKENS,
                REQUESTS_RUNNING,
                REQUESTS_WAITING,
                GENERATION_TOKENS,
                PROMPT_TOKENS,
                PREEMPTIONS,
                PREFIX_QUERIES,
                PREFIX_HITS,
                REQUESTS_FINISHED,
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
        kv_cache_usage=sum(usage) / len(usage) if usage else None,
        preemptions=totals.get(PREEMPTIONS, 0.0),
        num_gpu_blocks=sum(cache["num_gpu_blocks"]) if cache["num_gpu_blocks"] else None,
        block_size=max(cache["block_size"]) if cache["block_size"] else None,
        # what vLLM reports (the hybrid/sliding-window layers make it differ from blocks x block size)
        kv_capacity_tokens=sum(cache["kv_cache_size_tokens"]) if cache["kv_cache_size_tokens"] else None,
        prefix_cache_queries=totals.get(PREFIX_QUERIES, 0.0),
        prefix_cache_hits=totals.get(PREFIX_HITS, 0.0),
        requests_finished=totals.get(REQUESTS_FINISHED, 0.0),
    )


def _number(label: str | None) -> float | None:
    try:
        return float(label) if label is not None else None
    except ValueError:  # "None": not set in this engine's config
        return None


@dataclass(frozen=True)
class KvCacheStats:
    """An arm's KV cache over a phase, from the /metrics snapshots sampled during it.

    usage_peak / usage_mean: over every sample of every replica (1.0 = full); preemptions: the
    arm's replicas' counter increase from their first to their last sample (None when a replica
    restarted in between or was never scraped); capacity: per replica (the smallest of the arm's)."""

    samples: int = 0
    usage_peak: float | None = None
    usage_mean: float | None = None
    preemptions: float | None = None
    capacity_tokens: float | None = None
    num_gpu_blocks: float | None = None
    block_size: float | None = None
    # prompt tokens the arm looked up in / found in its prefix cache over the phase (None: a replica
    # restarted in between or was never scraped); hit rate = hits / queries
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        if self.prefix_cache_queries is None or self.prefix_cache_hits is None or self.prefix_cache_queries <= 0:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    def to_dict(self) -> dict:
        return {
            "samples": self.samples,
            "usage_peak": self.usage_peak,
            "usage_mean": self.usage_mean,
            "preemptions": self.preemptions,
            "capacity_tokens": self.capacity_tokens,
            "num_gpu_blocks": self.num_gpu_blocks,
            "block_size": self.block_size,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
        }


def kv_stats(samples: Iterable[Mapping[str, MetricsSnapshot]], replicas: Iterable[str]) -> KvCacheStats:
    """Reduce sampled scrapes (each: replica name -> snapshot; a replica may be missing from some)
    to one arm's KvCacheStats over `replicas`. Pure."""
    names = list(replicas)
    seen: dict[str, list[MetricsSnapshot]] = {name: [] for name in names}
    count = 0
    for sample in samples:
        present = [name for name in names if name in sample]
        count += bool(present)
        for name in present:
            seen[name].append(sample[name])
    usage = [s.kv_cache_usage for snaps in seen.values() for s in snaps if s.kv_cache_usage is not None]
    def risen(attr: str) -> float | None:
        """A counter's rise over the phase, summed over the arm's replicas; None when one was never
        scraped or its counter went down (the server restarted): unknown, not a partial sum."""
        total = 0.0
        for snaps in seen.values():
            rise = getattr(snaps[-1], attr) - getattr(snaps[0], attr) if snaps else -1.0
            if rise < 0:
                return None
            total += rise
        return total

    preemptions = risen("preemptions")
    def smallest(attr: str) -> float | None:
        values = [getattr(s, attr) for snaps in seen.values() for s in snaps[:1] if getattr(s, attr) is not None]
        return min(values) if values else None
    return KvCacheStats(
        samples=count,
        usage_peak=max(usage) if usage else None,
        usage_mean=sum(usage) / len(usage) if usage else None,
        preemptions=preemptions,
        capacity_tokens=smallest("kv_capacity_tokens"),
        num_gpu_blocks=smallest("num_gpu_blocks"),
        block_size=smallest("block_size"),
        prefix_cache_queries=risen("prefix_cache_queries"),
        prefix_cache_hits=risen("prefix_cache_hits"),
    )


class MetricsSampler:
    """Scrapes every replica every `every_s` on a thread of its own while a phase runs, and keeps
    what its `recording` wrapper sees of the phase's own scrapes: the samples a gauge's peak and
    mean need (the looks alone are minutes apart). A failed scrape is skipped (missing, never zero)."""

    def __init__(self, scrape: Callable[[], dict[str, MetricsSnapshot]], every_s: float = 5.0) -> None:
        self._scrape = scrape
        self.every_s = every_s
        self.samples: list[dict[str, MetricsSnapshot]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def recording(self) -> dict[str, MetricsSnapshot]:
        """The scrape, its answer kept as a sample (pass it where the phase scrapes)."""
        snapshot = self._scrape()
        with self._lock:
            self.samples.append(dict(snapshot))
        return snapshot

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.recording()
            except Exception:  # the fleet or Ray going away mid-phase: the phase itself reports it
                continue

    def start(self) -> "MetricsSampler":
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[dict[str, MetricsSnapshot]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        with self._lock:
            return list(self.samples)
