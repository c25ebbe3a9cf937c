"""Where acceptance changes: an arm's per-position acceptance by prompt length and by conversation turn.

Why: MTP's acceptance is not one number. vLLM issues report it collapsing past a context
length (#52873), and a multi-turn session's prompt grows with every turn; a canary that
drafts well on short prompts can draft badly on the long ones production sends, and the
arm's overall rate hides it when short prompts dominate. vLLM 0.32 answers each request
with its own spec-decode counters (``--per-request-spec-decode-metrics``: the record's
``acceptance_histogram``, verify steps by the number of drafts accepted), so the requests
can be grouped after the fact and each group's counters summed as the server would count
them (`rollout.judge.request_acceptance.spec_decode_of_requests`).

* `by_prompt_length(records, arm)`: buckets of the prompt's length in tokens, powers of two
  from 64 (<64, 64-127, 128-255, ...). A request's context grows while it decodes; the
  prompt is its context at the first draft, and for the short outputs a canary sends, most
  of it.
* `by_turn(records, arm)`: a multi_turn session's turns (0 first), where every turn's
  prompt holds the history before it.

Descriptive only: each slice has its requests and drafts beside its rates, and no test
or gate reads them (drafts of one request are correlated, and slices are chosen after
the fact; a claim about a difference between slices would need its own simulation).
An arm whose requests carry no per-request counters has no slices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from loadtests.records import RequestRecord
from rollout.judge.request_acceptance import spec_decode_of_requests

__all__ = ["AcceptanceSlice", "by_prompt_length", "by_turn", "prompt_bucket"]

# the first bucket's upper edge; each next bucket doubles it
FIRST_EDGE = 64


class AcceptanceSlice(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    slice: str = Field(description='which requests: "prompt 64-127 tokens", "turn 2"')
    requests: int
    drafts: float = Field(description="verify steps of the slice's requests")
    mean_acceptance_length: float | None
    per_position: list[float]


def prompt_bucket(prompt_tokens: int) -> tuple[int, int]:
    """The [low, high) edges of a prompt length's bucket: [0, 64), [64, 128), [128, 256), ..."""
    if prompt_tokens < FIRST_EDGE:
        return 0, FIRST_EDGE
    low = FIRST_EDGE
    while prompt_tokens >= 2 * low:
        low *= 2
    return low, 2 * low


def _slices(records: Sequence[RequestRecord], arm: str, key: Callable[[RequestRecord], object | None],
            label: Callable[[object], str]) -> list[AcceptanceSlice]:
    groups: dict[object, list[RequestRecord]] = {}
    for record in records:
        if record.served_arm != arm or not record.ok or record.cancelled:
            continue
        value = key(record)
        if value is not None:
            groups.setdefault(value, []).append(record)
    out = []
    for value in sorted(groups, key=lambda v: v if not isinstance(v, tuple) else v[0]):
        stats = spec_decode_of_requests(groups[value], arm)
        if stats is None:  # a request of the slice came without its own counters: the arm has none to slice
            return []
        out.append(AcceptanceSlice(slice=label(value), requests=len(groups[value]), drafts=stats.drafts,
                                   mean_acceptance_length=stats.mean_acceptance_length,
                                   per_position=[round(p, 4) for p in stats.per_position_rate or []]))
    return out


def by_prompt_length(records: Sequence[RequestRecord], arm: str) -> list[AcceptanceSlice]:
    """The arm's acceptance per prompt-length bucket, shortest first (only buckets with requests)."""
    return _slices(records, arm, lambda r: prompt_bucket(r.prompt_tokens) if r.prompt_tokens is not None else None,
                   lambda edges: f"prompt {edges[0]}-{edges[1] - 1} tokens")


def by_turn(records: Sequence[RequestRecord], arm: str) -> list[AcceptanceSlice]:
    """The arm's acceptance per multi_turn turn, first turn first (none for a load without sessions)."""
    return _slices(records, arm, lambda r: r.turn, lambda turn: f"turn {turn}")
