"""One streamed request as the client saw it: the raw material every latency gate judges.

Locust's own statistics round response times into buckets (147 ms -> 150 ms) and know
nothing of tokens, so the gates never read them; they read these records, one per
request that was sent, written as JSON lines.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from loadtests.errors import SwarmError

Endpoint = Literal["completions", "chat"]


class RequestRecord(BaseModel):
    """What happened to one request, measured at the client.

    Times: `scheduled_at` and `sent_at` are wall-clock epoch seconds (comparable across
    processes and with server logs); the durations `ttft_s` and `e2e_s` come from
    `time.perf_counter()` taken at the socket read, so clock adjustments cannot bend them.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    request_id: str = Field(description="the client's id, sent as X-Request-Id")
    server_request_id: str | None = Field(
        default=None, description="the id the server's stream carried (vLLM: cmpl-/chatcmpl- + X-Request-Id)"
    )
    tag: str = Field(description="phase label the runner passes, e.g. 'experiment'")
    worker: str = Field(description="the Locust process that sent it")
    endpoint: Endpoint = "completions"
    arm: str | None = Field(default=None, description="response header x-mtp-canary-arm")
    replica: str | None = Field(default=None, description="response header x-mtp-canary-replica")
    pinned_arm: str | None = Field(default=None, description="arm the client asked for, if it pinned one")
    dataset_index: int | None = Field(default=None, description="position in the seeded prompt sequence")
    session: int | None = Field(default=None, description="multi_turn: the conversation this turn belongs to")
    turn: int | None = Field(default=None, description="multi_turn: the turn's number in its session (0 first)")
    level: float | None = Field(
        default=None, description="load level of a stepped or ramped profile when the request was due"
    )
    scheduled_at: float | None = Field(default=None, description="targeted send time (open loop only)")
    sent_at: float
    ttft_s: float | None = Field(default=None, description="send -> first chunk that carries output")
    e2e_s: float = Field(description="send -> end of the stream")
    output_tokens: int | None = Field(default=None, description="server usage.completion_tokens")
    prompt_tokens: int | None = Field(default=None, description="server usage.prompt_tokens")
    requested_max_tokens: int | None = None
    chunks: int = Field(default=0, description="SSE chunks that carried output tokens")
    finish_reason: str | None = None
    acceptance_histogram: list[int] | None = Field(
        default=None,
        description="the server's per-request spec-decode metrics (vLLM --per-request-spec-decode-metrics): its "
        "verify steps by the number of drafts accepted in each (index 0: none); None where the server sent none",
    )
    draft_tokens: int | None = Field(default=None, description="draft tokens the server proposed for this request")
    ok: bool
    status: int = Field(description="HTTP status; 0 when no response arrived")
    error: str | None = None
    cancelled: bool = Field(
        default=False,
        description="cut off by the load test stopping, not by the server: not an error of the arm",
    )

    @property
    def served_arm(self) -> str | None:
        """The arm that served the request (the one it was pinned to when the response did not say)."""
        return self.arm if self.arm is not None else self.pinned_arm

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, from the server's token count.

        Never from chunk gaps: with speculative decoding one chunk carries up to k+1
        tokens, and dividing by chunks instead of tokens overstates TPOT by that factor.
        """
        if self.ttft_s is None or self.output_tokens is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def tokens_per_chunk(self) -> float | None:
        """Mean output tokens per SSE chunk over the whole stream."""
        if not self.output_tokens or not self.chunks:
            return None
        return self.output_tokens / self.chunks

    @property
    def decode_tokens_per_chunk(self) -> float | None:
        """Mean tokens per chunk after the first (prefill) chunk.

        Each engine step streams one chunk, the first step yields one token and every
        decode step yields 1 + accepted drafts, so this is the client's view of vLLM's
        mean acceptance length (1 + accepted / drafts).
        """
        if self.output_tokens is None or self.output_tokens < 2 or self.chunks < 2:
            return None
        return (self.output_tokens - 1) / (self.chunks - 1)

    @property
    def send_lag_s(self) -> float | None:
        """How late the generator sent this request against its schedule (open loop only).

        A growing lag means the load generator, not the server, limited the offered load.
        """
        if self.scheduled_at is None:
            return None
        return self.sent_at - self.scheduled_at


def write_records(path: str | Path, records: Iterable[RequestRecord]) -> int:
    """Write records as JSON lines (replacing the file); returns how many were written."""
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for record in records:
            out.write(record.model_dump_json())
            out.write("\n")
            count += 1
    return count


def read_records(path: str | Path) -> list[RequestRecord]:
    """Read a JSONL records file; a line that is not a valid record raises with its number."""
    records: list[RequestRecord] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append(RequestRecord.model_validate(json.loads(line)))
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not a request record: {exc}") from exc
    return records


class RecordsError(SwarmError):
    """A line of the records file is not a record: the file cannot be judged (never a short pass)."""


class RecordsTail:
    """New complete lines of a growing JSONL records file (the Locust master appends them), as
    RequestRecords; a line still being written waits for the next read. A complete line that is
    not a record raises RecordsError: a request the gates cannot see fails the phase, never
    leaves it judged on the rest."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""
        self.bad_lines = 0

    def read(self) -> list[RequestRecord]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        out = []
        for line in lines:
            if not line.strip():
                continue
            try:
                out.append(RequestRecord.model_validate(json.loads(line)))
            except ValueError as exc:
                self.bad_lines += 1
                raise RecordsError(f"{self.path}: a line is not a request record ({self.bad_lines} so far; "
                                   f"{str(exc).splitlines()[0][:200]}): the records cannot be judged") from exc
        return out
