"""Whose acceptance: spec-decode counters summed over the experiment's own requests, and the server's check.

A replica's ``/metrics`` counts every request it serves: the experiment's, an
operator's curl, another tool's (seen: two client requests pinned to the canary
pulled its measured acceptance to 0.59 while the experiment's own requests saw
3.38 tokens per chunk). vLLM 0.32 answers each request with its own counters when
the server runs with ``--per-request-spec-decode-metrics summary`` (the final
usage chunk's ``metrics.speculative_decoding``; `loadtests.records.RequestRecord`
keeps its ``acceptance_histogram``: verify steps by the number of drafts accepted).

* `spec_decode_of_requests(records, arm)`: the arm's counters as the sum of its
  requests' own, in the shape of the server's (``cluster.metrics.SpecDecodeStats``:
  a step that accepted j drafts accepted positions 1..j, exactly as vLLM counts
  ``accepted_tokens_per_pos``); None when any completed request of the arm came
  without them (a server without the flag, or one that does not speculate): then
  the judge falls back to the server's counters, as before.
* `attribute(...)`: the server's counters over the phase against the requests'
  own. More verify steps on the server than the experiment's requests can account
  for (past the steps of requests it cannot see whole: cut off at the end, or begun
  before the counters' start) is other traffic on that arm: said, and kept out of
  the gate, which counts the requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.metrics import SpecDecodeStats
from loadtests.records import RequestRecord

__all__ = ["AcceptanceAttribution", "attribute", "spec_decode_of_requests", "unseen_steps_bound"]

#: Verify steps of other traffic, as a share of the server's, below which the arm counts as the experiment's
#: alone: what the bound on unseen steps leaves is rounding, not another client.
OTHER_TRAFFIC_SHARE = 0.02


def spec_decode_of_requests(records: Sequence[RequestRecord], arm: str) -> SpecDecodeStats | None:
    """The arm's spec-decode counters summed over its completed requests' own (None where one lacks them)."""
    histograms: list[list[int]] = []
    drafted = 0
    for record in records:
        if record.served_arm != arm or not record.ok or record.cancelled:
            continue
        if record.acceptance_histogram is None or record.draft_tokens is None:
            return None
        histograms.append(record.acceptance_histogram)
        drafted += record.draft_tokens
    if not histograms:
        return None
    width = max(len(h) for h in histograms)
    steps = [0] * width  # steps[j]: verify steps that accepted exactly j drafts
    for histogram in histograms:
        for j, count in enumerate(histogram):
            steps[j] += count
    # position p (1-based) was accepted in every step that accepted p or more drafts
    per_position = [float(sum(steps[p:])) for p in range(1, width)]
    return SpecDecodeStats(
        drafts=float(sum(steps)),
        draft_tokens=float(drafted),
        accepted_tokens=float(sum(j * n for j, n in enumerate(steps))),
        accepted_per_position=tuple(per_position),
    )


def unseen_steps_bound(records: Sequence[RequestRecord], arm: str, streams: int) -> int:
    """How many verify steps of the experiment's own the server may count that no whole record carries:
    every cut-off request (its record has no counters) and one request per stream begun before the
    counters started, each at most one step per requested token."""
    cut_off = [r for r in records if r.served_arm == arm and (r.cancelled or not r.ok)]
    longest = max((r.requested_max_tokens or 0 for r in records if r.served_arm == arm), default=0)
    return (len(cut_off) + max(streams, 0)) * longest


@dataclass(frozen=True)
class AcceptanceAttribution:
    """One arm's acceptance: whose counters the gate judged, and what the server counted beside them.

    ``counted_from``: "requests" (the experiment's own, per request) or "server" (its /metrics
    deltas, when the requests carried none). ``other_steps``: verify steps the server ran past
    what the requests and ``unseen_steps`` account for; None where either side is unknown.
    """

    arm: str
    counted_from: str
    server: SpecDecodeStats | None
    requests: SpecDecodeStats | None
    unseen_steps: int

    @property
    def other_steps(self) -> int | None:
        if self.server is None or self.requests is None:
            return None
        return max(int(self.server.drafts - self.requests.drafts) - self.unseen_steps, 0)

    @property
    def other_traffic(self) -> bool:
        other = self.other_steps
        return other is not None and self.server is not None and other > OTHER_TRAFFIC_SHARE * self.server.drafts

    def note(self) -> str | None:
        """What an operator must know (None when the server's counters are the experiment's alone)."""
        if not self.other_traffic or self.server is None or self.requests is None:
            return None
        return (
            f"other traffic reached {self.arm}: its server ran {self.server.drafts:.0f} verify steps, the "
            f"experiment's requests {self.requests.drafts:.0f} (+ at most {self.unseen_steps} unseen); server "
            f"acceptance length {_length(self.server)} vs the requests' {_length(self.requests)}: the acceptance "
            "gate counts the experiment's own requests"
        )


def _length(stats: SpecDecodeStats) -> str:
    value = stats.mean_acceptance_length
    return "n/a" if value is None else f"{value:.2f}"


def attribute(arm: str, server: SpecDecodeStats | None, requests: SpecDecodeStats | None,
              unseen_steps: int) -> AcceptanceAttribution:
    """The arm's acceptance as the gate counts it: its requests' own where they carry counters, else the server's."""
    return AcceptanceAttribution(
        arm=arm, counted_from="requests" if requests is not None else "server",
        server=server, requests=requests, unseen_steps=unseen_steps,
    )
