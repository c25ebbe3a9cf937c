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
  ``accepted_tokens_per_pos``), carrying each request's own (verify steps, accepted
  tokens) and its accepted tokens at every draft position beside the sums
  (`RequestSpecDecodeStats`: the acceptance floor's interval, and the per-position
  profile gate's, are clustered by request, since a hard prompt accepts less in every step); None
  when any completed request of the arm came without them (a server without the
  flag, or one that does not speculate): then the judge falls back to the server's
  counters, which can never pass the floor (no request-clustered interval).
* `spec_decode_of_counts(drafts, accepted_per_position)`: the same from per-request
  arrays (the calibration's simulated requests).
* `attribute(...)`: the server's counters over the phase against the requests'
  own. More verify steps on the server than the experiment's requests can account
  for (past the steps of requests it cannot see whole: cut off at the end, or begun
  before the counters' start) is other traffic on that arm: said, and kept out of
  the gate, which counts the requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cluster.metrics import SpecDecodeStats
from loadtests.records import RequestRecord

__all__ = ["AcceptanceAttribution", "RequestSpecDecodeStats", "attribute", "positions_of_histogram",
           "spec_decode_of_counts", "spec_decode_of_requests", "unseen_steps_bound"]

#: Verify steps of other traffic, as a share of the server's, below which the arm counts as the experiment's
#: alone: what the bound on unseen steps leaves is rounding, not another client.
OTHER_TRAFFIC_SHARE = 0.02


@dataclass(frozen=True)
class RequestSpecDecodeStats(SpecDecodeStats):
    """Spec-decode counters summed over requests, with each request's own (verify steps, accepted tokens).

    The sums are the server's shape; ``per_request`` is what a request-clustered interval of
    accepted / drafts needs (drafts of one prompt are not independent); ``per_request_positions``
    holds, in the same order, each request's accepted tokens at draft positions 1..k (what the
    per-position profile gate clusters). Adding two of them, or one to server counters, gives plain
    ``SpecDecodeStats``: whose requests those are is no longer known.
    """

    per_request: tuple[tuple[float, float], ...] = ()
    per_request_positions: tuple[tuple[float, ...], ...] = ()

    def position_counts(self) -> tuple[tuple[float, tuple[float, ...]], ...]:
        """Each request's (verify steps, accepted tokens at positions 1..k); () where the positions are unknown."""
        if len(self.per_request_positions) != len(self.per_request):
            return ()
        return tuple((steps, positions) for (steps, _), positions in zip(self.per_request, self.per_request_positions))

    def sums(self) -> SpecDecodeStats:
        """The counters alone (what a /metrics delta would show)."""
        return SpecDecodeStats(drafts=self.drafts, draft_tokens=self.draft_tokens,
                               accepted_tokens=self.accepted_tokens, accepted_per_position=self.accepted_per_position)


def spec_decode_of_counts(drafts: Sequence[float] | np.ndarray, accepted_per_position: np.ndarray,
                          draft_tokens: Sequence[float] | np.ndarray | None = None) -> RequestSpecDecodeStats | None:
    """Counters of requests given as arrays: ``drafts[i]`` verify steps of request i, ``accepted_per_position[i, p]``
    its accepted tokens at draft position p + 1 (``draft_tokens``: proposed tokens per request; default drafts x k).
    None for no requests."""
    d = np.asarray(drafts, dtype=float).reshape(-1)
    if d.size == 0:
        return None
    per_pos = np.asarray(accepted_per_position, dtype=float)
    per_pos = per_pos.reshape(d.size, per_pos.shape[-1] if per_pos.ndim == 2 else -1)
    k = per_pos.shape[1]
    proposed = float(np.sum(draft_tokens)) if draft_tokens is not None else float(d.sum() * k)
    accepted = per_pos.sum(axis=1)
    return RequestSpecDecodeStats(
        drafts=float(d.sum()), draft_tokens=proposed, accepted_tokens=float(accepted.sum()),
        accepted_per_position=tuple(float(x) for x in per_pos.sum(axis=0)),
        per_request=tuple(zip(d.tolist(), accepted.tolist())),
        per_request_positions=tuple(tuple(row) for row in per_pos.tolist()),
    )


def positions_of_histogram(histogram: Sequence[int], width: int) -> tuple[float, ...]:
    """Accepted tokens at draft positions 1..``width - 1`` of a request whose verify steps by drafts accepted are
    ``histogram``: position p was accepted in every step that accepted p or more drafts (vLLM's own count)."""
    return tuple(float(sum(histogram[p:])) for p in range(1, width))


def spec_decode_of_requests(records: Sequence[RequestRecord], arm: str) -> RequestSpecDecodeStats | None:
    """The arm's spec-decode counters summed over its completed requests' own, each request's kept
    (None where one lacks them)."""
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
    per_request: list[tuple[float, float]] = []
    for histogram in histograms:
        for j, count in enumerate(histogram):
            steps[j] += count
        per_request.append((float(sum(histogram)), float(sum(j * n for j, n in enumerate(histogram)))))
    positions = tuple(positions_of_histogram(histogram, width) for histogram in histograms)
    per_position = positions_of_histogram(steps, width)  # the arm's steps by drafts accepted, as one histogram
    return RequestSpecDecodeStats(
        drafts=float(sum(steps)),
        draft_tokens=float(drafted),
        accepted_tokens=float(sum(j * n for j, n in enumerate(steps))),
        accepted_per_position=tuple(per_position),
        per_request=tuple(per_request),
        per_request_positions=positions,
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
