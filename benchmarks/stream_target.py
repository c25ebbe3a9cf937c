"""A zero-work OpenAI-compatible streaming server that emits tokens on a known schedule.

A benchmark target only: it measures the load generator (timing fidelity, CPU cost,
pacing), never the canary. Feature tests of the canary run real vLLM.

Schedule of every streamed answer of N tokens (N = the request's max_tokens), timed
from the moment the request handler starts:
  token i is generated at  ttft + i * tpot         (i = 0 .. N-1)
  the first chunk carries token 0 alone (the prefill step), every later chunk carries
  `tokens_per_chunk` tokens (a speculative step) and leaves when its last token is
  generated, so the last chunk leaves at ttft + (N-1) * tpot whatever the chunking:
  a correct client measures TTFT = ttft and TPOT = (E2E - TTFT) / (N-1) = tpot.
The final chunk carries `usage` (when stream_options.include_usage is set) and
`target_timing`: the emission times the server actually achieved, so a benchmark can
separate the target's own timer jitter from the client's error.

Usage:  python benchmarks/stream_target.py --port 8100 --ttft-ms 50 --tpot-ms 10 --tokens-per-chunk 4
It prints `LISTENING http://HOST:PORT` once it accepts connections. GET /stats gives
request counts (started, completed, disconnected). GET /timings gives, for each
streamed request (keyed by its X-Request-Id header, or else by its completion id), the achieved [first chunk, last
chunk] send offsets in seconds from the handler's start, the wall-clock time of that
start and the tokens streamed (the last 100,000 requests): with the client's own wall-clock send time, where
each chunk really left, so that a benchmark can tell the client's error from the
target's lateness (both run on one machine, one clock). Requests that carry the header
x-mtp-canary-arm get it echoed back, like the router's arm pinning; otherwise the
--arm value (if any) is sent.

Faults, for the router's tests and benchmarks: --fail-status 500 answers every /v1
request with that status (an OpenAI error body); --hang accepts every /v1 request and
never answers. --metrics-status 500 answers /metrics with that status. --api-key KEY answers 401 to a /v1 request without `Authorization: Bearer KEY`,
as vLLM started with --api-key does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import select
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from aiohttp import web

ARM_HEADER = "x-mtp-canary-arm"
REPLICA_HEADER = "x-mtp-canary-replica"
DEFAULT_MAX_TOKENS = 16
TIMINGS_KEPT = 100_000


@dataclass(frozen=True)
class TokenSchedule:
    """When each chunk of an N-token answer leaves, relative to the request's arrival."""

    ttft_s: float
    tpot_s: float
    tokens_per_chunk: int

    def chunks(self, n_tokens: int) -> list[tuple[float, int]]:
        """(send offset in seconds, tokens in the chunk) for an answer of n_tokens."""
        if n_tokens < 1:
            return []
        plan = [(self.ttft_s, 1)]
        done = 1
        while done < n_tokens:
            size = min(self.tokens_per_chunk, n_tokens - done)
            done += size
            plan.append((self.ttft_s + (done - 1) * self.tpot_s, size))
        return plan


class AchievedTiming(NamedTuple):
    """What the target achieved for one request: first and last chunk send offsets from
    the handler's start, and the wall-clock (epoch) time of that start."""

    first_s: float
    last_s: float
    arrived_at: float
    tokens: int = 0  # streamed in the answer

    @property
    def first_sent_at(self) -> float:
        """Wall-clock time the first chunk left."""
        return self.arrived_at + self.first_s


@dataclass
class TargetStats:
    started: int = 0
    completed: int = 0
    disconnected: int = 0
    by_arm: dict[str, int] = field(default_factory=dict)


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        text = " ".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    else:
        prompt = body.get("prompt", "")
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    return len(text.split())


class StreamTarget:
    def __init__(
        self, schedule: TokenSchedule, arm: str | None = None, replica: str | None = None,
        tpot_jitter: float = 0.0, seed: int = 0, fail_status: int | None = None, hang: bool = False,
        api_key: str | None = None, metrics_status: int = 200,
    ) -> None:
        self.schedule = schedule
        self.api_key = api_key
        self.metrics_status = metrics_status
        self.fail_status = fail_status
        self.hang = hang
        # log-sd of a per-request TPOT multiplier (0: every request exactly on the schedule):
        # latency that varies from request to request, as a real server's does
        self.tpot_jitter = tpot_jitter
        self._rng = random.Random(seed)
        self.arm = arm
        self.replica = replica
        self.stats = TargetStats()
        self.model = "stream-target"
        # request id -> (first chunk, last chunk) achieved send offsets, handler start (epoch), tokens; oldest first
        self.timings: dict[str, tuple[float, float, float, int]] = {}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/stats", self.stats_json)
        app.router.add_get("/timings", self.timings_json)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def metrics(self, _request: web.Request) -> web.Response:
        """A Prometheus page with no spec-decode counters, or the --metrics-status fault."""
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status, text="metrics exporter fails on purpose")
        return web.Response(text="# stream target: no vLLM counters\n")

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def stats_json(self, _request: web.Request) -> web.Response:
        stats = self.stats
        return web.json_response(
            {"started": stats.started, "completed": stats.completed, "disconnected": stats.disconnected,
             "by_arm": stats.by_arm}
        )

    async def timings_json(self, _request: web.Request) -> web.Response:
        return web.json_response(self.timings)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=True)

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)  # vLLM's answer
        if self.hang:
            await asyncio.Event().wait()  # until the client (or the router's timeout) gives up
        if self.fail_status is not None:
            self.stats.started += 1
            return web.json_response(
                {"error": {"message": f"stream target fails on purpose ({self.fail_status})", "type": "fault",
                           "code": self.fail_status}},
                status=self.fail_status,
            )
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        arrived_at = time.time()
        body = await request.json()
        n_tokens = int(body.get("max_tokens") or DEFAULT_MAX_TOKENS)
        arm = request.headers.get(ARM_HEADER) or self.arm
        self.stats.started += 1
        if arm:
            self.stats.by_arm[arm] = self.stats.by_arm.get(arm, 0) + 1
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        if arm:
            headers[ARM_HEADER] = arm
        if self.replica:
            headers[REPLICA_HEADER] = self.replica
        usage = {
            "prompt_tokens": _prompt_tokens(body),
            "completion_tokens": n_tokens,
            "total_tokens": _prompt_tokens(body) + n_tokens,
        }
        if not body.get("stream"):
            return await self._answer_whole(arrived, n_tokens, chat, usage, headers)

        response = web.StreamResponse(status=200, headers=headers)
        await response.prepare(request)
        # as vLLM does: the client's X-Request-Id, prefixed, is the completion's id
        completion_id = ("chatcmpl-" if chat else "cmpl-") + (request.headers.get("x-request-id") or uuid.uuid4().hex)
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        sent_offsets: list[float] = []
        # the bytes of a chunk depend only on its size and whether it is the last one: encode
        # each kind once per request (a zero-work target: its CPU is the benchmark's noise)
        encoded: dict[tuple[int, bool], bytes] = {}
        try:
            schedule = self.schedule
            if self.tpot_jitter > 0:
                factor = math.exp(self._rng.gauss(0.0, self.tpot_jitter))
                schedule = TokenSchedule(schedule.ttft_s, schedule.tpot_s * factor, schedule.tokens_per_chunk)
            plan = schedule.chunks(n_tokens)
            for number, (offset, size) in enumerate(plan):
                last = number == len(plan) - 1
                data = encoded.get((size, last))
                if data is None:
                    data = encoded[(size, last)] = self._chunk_bytes(completion_id, kind, created, chat, size, last,
                                                                     include_usage)
                if chat and number == 0:  # the role announcement, as vLLM sends it
                    data = _sse({"id": completion_id, "object": kind, "created": created, "model": self.model,
                                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None}]}) + data
                delay = arrived + offset - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                await response.write(data)
                sent_offsets.append(loop.time() - arrived)
            final: dict[str, Any] = {"id": completion_id, "object": kind, "created": created, "model": self.model,
                                     "choices": [], "target_timing": {
                                         "ttft_s": sent_offsets[0] if sent_offsets else None,
                                         "last_chunk_s": sent_offsets[-1] if sent_offsets else None}}
            if include_usage:
                final["usage"] = usage
            await response.write(_sse(final) + _sse("[DONE]"))
            await response.write_eof()
            # a client that sends no X-Request-Id (another project's benchmark) is timed under the completion id
            request_id = request.headers.get("x-request-id") or completion_id
            if sent_offsets:
                self.timings[request_id] = (sent_offsets[0], sent_offsets[-1], arrived_at, n_tokens)
                if len(self.timings) > TIMINGS_KEPT:
                    del self.timings[next(iter(self.timings))]
        except (ConnectionResetError, asyncio.CancelledError):
            self.stats.disconnected += 1
            raise
        self.stats.completed += 1
        return response


    def _chunk_bytes(self, completion_id: str, kind: str, created: int, chat: bool, size: int, last: bool,
                     include_usage: bool) -> bytes:
        text = " tok" * size
        finish = "length" if last else None
        if chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish}
        chunk: dict[str, Any] = {"id": completion_id, "object": kind, "created": created, "model": self.model,
                                 "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        return _sse(chunk)

    async def _answer_whole(
        self, arrived: float, n_tokens: int, chat: bool, usage: dict[str, int], headers: dict[str, str]
    ) -> web.Response:
        """A non-streaming request: the whole answer when its last token is due."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, arrived + self.schedule.chunks(n_tokens)[-1][0] - loop.time()))
        text = " tok" * n_tokens
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length"}
        self.stats.completed += 1
        headers = {key: value for key, value in headers.items() if key != "Content-Type"}
        return web.json_response(
            {"id": "cmpl-" + uuid.uuid4().hex, "model": self.model, "choices": [choice], "usage": usage},
            headers=headers,
        )


class TargetProcess:
    """The target in a child process, for tests and benchmarks: `with TargetProcess(...) as t: t.url`."""

    def __init__(
        self,
        ttft_ms: float = 50.0,
        tpot_ms: float = 10.0,
        tokens_per_chunk: int = 1,
        arm: str | None = None,
        replica: str | None = None,
        python: str = sys.executable,
        start_timeout_s: float = 30.0,
        tpot_jitter: float = 0.0,
        seed: int = 0,
        fail_status: int | None = None,
        hang: bool = False,
        api_key: str | None = None,
        metrics_status: int = 200,
    ) -> None:
        self._command = [python, str(Path(__file__).resolve()), "--port", "0", "--ttft-ms", str(ttft_ms),
                         "--tpot-ms", str(tpot_ms), "--tokens-per-chunk", str(tokens_per_chunk)]
        if arm:
            self._command += ["--arm", arm]
        if replica:
            self._command += ["--replica", replica]
        if tpot_jitter:
            self._command += ["--tpot-jitter", str(tpot_jitter), "--seed", str(seed)]
        if fail_status is not None:
            self._command += ["--fail-status", str(fail_status)]
        if hang:
            self._command += ["--hang"]
        if api_key:
            self._command += ["--api-key", api_key]
        if metrics_status != 200:
            self._command += ["--metrics-status", str(metrics_status)]
        self._start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> TargetProcess:
        self._process = subprocess.Popen(self._command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self._process.stdout is not None
        ready, _, _ = select.select([self._process.stdout], [], [], self._start_timeout_s)
        line = self._process.stdout.readline() if ready else ""
        if not line.startswith("LISTENING "):
            self.__exit__(None, None, None)
            raise RuntimeError(f"stream target did not start: {line!r}")
        self.url = line.split(" ", 1)[1].strip()
        return self

    @property
    def pid(self) -> int | None:
        """The target's process id (to pin it to a core), None before it starts."""
        return self._process.pid if self._process is not None else None

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/stats", timeout=10) as response:
            return json.loads(response.read())

    def timings(self) -> dict[str, AchievedTiming]:
        """Achieved (first chunk, last chunk) send offsets and handler start (epoch) per X-Request-Id."""
        with urllib.request.urlopen(self.url + "/timings", timeout=30) as response:
            return {key: AchievedTiming(*value) for key, value in json.loads(response.read()).items()}

    def __exit__(self, *_exc: object) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed at start)")
    parser.add_argument("--ttft-ms", type=float, default=50.0)
    parser.add_argument("--tpot-ms", type=float, default=10.0)
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--arm", default=None, help="value of x-mtp-canary-arm when the request pins none")
    parser.add_argument("--replica", default=None, help="value of x-mtp-canary-replica")
    parser.add_argument("--tpot-jitter", type=float, default=0.0,
                        help="log-sd of a per-request TPOT multiplier (0: exactly on schedule)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the jitter")
    parser.add_argument("--fail-status", type=int, default=None, help="answer every /v1 request with this status")
    parser.add_argument("--hang", action="store_true", help="accept every /v1 request and never answer")
    parser.add_argument("--api-key", default=None, help="401 to a /v1 request without Authorization: Bearer KEY")
    parser.add_argument("--metrics-status", type=int, default=200, help="answer /metrics with this status (a fault)")
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    if args.tokens_per_chunk < 1:
        raise SystemExit("--tokens-per-chunk must be at least 1")
    target = StreamTarget(
        TokenSchedule(args.ttft_ms / 1000.0, args.tpot_ms / 1000.0, args.tokens_per_chunk), args.arm, args.replica,
        tpot_jitter=args.tpot_jitter, seed=args.seed, fail_status=args.fail_status, hang=args.hang,
        api_key=args.api_key, metrics_status=args.metrics_status,
    )
    runner = web.AppRunner(target.app(), access_log=None)
    await runner.setup()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((args.host, args.port))
    site = web.SockSite(runner, listener)
    await site.start()
    host, port = listener.getsockname()[:2]
    print(f"LISTENING http://{host}:{port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    try:
        asyncio.run(serve(parse_args(argv)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
