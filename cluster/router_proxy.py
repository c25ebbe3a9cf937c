"""One routed request's trip to its replica and back: `Forwarder`, and the counters it updates.

The router (cluster/router.py) decides where a request goes; the `Forwarder`
sends it there, streams the answer back chunk by chunk, and counts the outcome:
a connect error, an upstream timeout, a 5xx or a stream broken mid-way is an
error of the arm and of the replica, and feeds the replica's outlier ejection
(cluster/outlier.py). No retry on another replica: a failing canary replica
must show up as errors in the verdict, not be hidden by the router.

Upstream timeouts (RouterLimits): connect and first byte end in a 504 (the
client's headers are not sent yet); silence between two chunks cuts the
client's stream, the only honest signal once its status line is out.

The idle timeout is one watchdog task for all streams (checked every
min(1 s, idle/4)), not a timer per stream: aiohttp's sock_read re-arms a timer
on every packet, which cost the router ~20% more CPU per relayed event.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from yarl import URL

from cluster.arms import ARM_HEADER
from cluster.outlier import EjectionPolicy, ReplicaHealth
from cluster.router_limits import RouterLimits

logger = logging.getLogger("mtp_canary.router")

REPLICA_HEADER = "x-mtp-canary-replica"

# Headers that describe one TCP hop (RFC 9110 section 7.6.1) or that aiohttp
# recomputes for the next hop; they must not be copied across the proxy.
_HOP_BY_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_REQUEST_HEADERS_NOT_FORWARDED = _HOP_BY_HOP_HEADERS | {
    "host",
    "content-length",
    "expect",  # the router has already read the whole body
    ARM_HEADER,  # routing instruction for this router, not for vLLM
}
_RESPONSE_HEADERS_NOT_FORWARDED = _HOP_BY_HOP_HEADERS | {ARM_HEADER, REPLICA_HEADER}


@dataclass
class RouteCounter:
    """Counts of one arm or one replica; a replica's also carries its health."""

    routed: int = 0
    in_flight: int = 0
    errors: int = 0
    rejected: int = 0
    health: ReplicaHealth = field(default_factory=ReplicaHealth)

    def reset_totals(self) -> None:
        # in_flight is a live gauge (and drives least-outstanding picking):
        # requests still streaming must still be subtracted when they finish.
        # health is live too: a reset of the counts does not forgive a dead replica.
        self.routed = 0
        self.errors = 0
        self.rejected = 0


@dataclass(frozen=True)
class Route:
    arm: str
    replica: str
    arm_counter: RouteCounter
    replica_counter: RouteCounter
    upstream_key: str | None = None  # the replica's own --api-key: sent instead of the client's Authorization


class _Watch:
    """One stream's silence: since when the router has waited for its next chunk (inf: not waiting)."""

    __slots__ = ("last", "silent", "upstream")

    def __init__(self, upstream: aiohttp.ClientResponse) -> None:
        self.last = math.inf  # until the first chunk, the first-byte timeout is the bound
        self.silent = False
        self.upstream = upstream


def error_response(status: int, message: str, error_type: str, headers: Mapping[str, str] | None = None) -> web.Response:
    # OpenAI's error envelope, so OpenAI clients and Locust users parse it as they parse vLLM's.
    body = {"error": {"message": message, "type": error_type, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class Forwarder:
    """Sends routed requests to replicas over one pooled client session."""

    def __init__(self, limits: RouterLimits) -> None:
        self._limits = limits
        self._policy: EjectionPolicy = limits.ejection_policy()
        self._session: aiohttp.ClientSession | None = None
        self._not_forwarded = _REQUEST_HEADERS_NOT_FORWARDED
        self._watched: set[_Watch] = set()
        self._watchdog: asyncio.Task[None] | None = None

    async def open(self, strip_authorization: bool) -> None:
        """`strip_authorization`: the router checks a token of its own, which is not the replicas' business."""
        limits = self._limits
        if strip_authorization:
            self._not_forwarded = _REQUEST_HEADERS_NOT_FORWARDED | {"authorization"}
        # Without limit=0 aiohttp caps the pool at 100 connections and would
        # silently queue the 101st concurrent stream inside the router.
        # keepalive_timeout: aiohttp's default keeps an idle connection 15 s, but vLLM's
        # server (uvicorn) closes it after 5 s; a request sent on it as the replica closes
        # it fails unanswered ("Server disconnected"), three in a row eject the replica.
        # Seen in CI at the experiment's start, right after the accuracy phase's pause.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=limits.upstream_keepalive_s)
        self._session = aiohttp.ClientSession(
            connector=connector,
            # sock_read bounds the wait for the answer's headers, and from
            # them to its first body bytes; then _relay turns it off (the
            # watchdog bounds the silences between chunks).
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=limits.upstream_connect_timeout_s,
                sock_connect=limits.upstream_connect_timeout_s,
                sock_read=limits.upstream_first_byte_timeout_s,
            ),
            # Bodies pass through byte for byte; the client's own headers say
            # what it accepts, the proxy must not add encodings or agents.
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            trust_env=False,
        )
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_idle(), name="router-idle-watchdog")

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _watch_idle(self) -> None:
        idle = self._limits.upstream_idle_timeout_s
        while True:
            await asyncio.sleep(min(1.0, idle / 4))
            longest_ago = time.monotonic() - idle
            for watch in [w for w in self._watched if w.last < longest_ago]:
                watch.silent = True
                watch.upstream.close()  # the stream's pending read raises at once

    def failed(self, route: Route, cause: str) -> None:
        """One failed request: an error of its arm and replica, and a strike against the replica."""
        route.arm_counter.errors += 1
        route.replica_counter.errors += 1
        health = route.replica_counter.health
        backoff = health.failed(time.monotonic(), self._policy)
        if backoff is not None:
            # Once per ejection, never per request: the latency path does not log.
            logger.warning(
                "router: ejected replica %s of arm %r for %.0f s (ejection %d, after %d consecutive failures; last: %s)",
                route.replica, route.arm, backoff, health.ejections, self._policy.threshold, cause,
            )

    def _no_answer(self, route: Route, status: int, error_type: str, message: str) -> web.Response:
        self.failed(route, message)
        tags = {ARM_HEADER: route.arm, REPLICA_HEADER: route.replica}
        return error_response(status, f"replica {route.replica} of arm {route.arm!r} {message}", error_type, tags)

    async def forward(self, request: web.Request, body: bytes, route: Route) -> web.StreamResponse:
        assert self._session is not None, "router not started"
        limits = self._limits
        upstream_url = URL(route.replica + request.raw_path, encoded=True)
        skip = self._not_forwarded
        forwarded_headers = [(name, value) for name, value in request.headers.items() if name.lower() not in skip]
        if route.upstream_key is not None:
            # the replica checks a key of its own: the client's Authorization (the router's token,
            # or none) is not it
            forwarded_headers = [(n, v) for n, v in forwarded_headers if n.lower() != "authorization"]
            forwarded_headers.append(("Authorization", f"Bearer {route.upstream_key}"))
        try:
            upstream = await self._session.request(
                request.method, upstream_url, headers=forwarded_headers, data=body or None, allow_redirects=False
            )
        except aiohttp.ConnectionTimeoutError:
            return self._no_answer(
                route, 504, "gateway_timeout",
                f"did not accept a connection within {limits.upstream_connect_timeout_s:g} s (upstream_connect_timeout_s)",
            )
        except aiohttp.SocketTimeoutError:
            return self._no_answer(
                route, 504, "gateway_timeout",
                f"sent no answer within {limits.upstream_first_byte_timeout_s:g} s (upstream_first_byte_timeout_s)",
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return self._no_answer(route, 502, "bad_gateway", f"failed before responding: {type(exc).__name__}: {exc}")
        try:
            return await self._relay(request, upstream, route)
        finally:
            # A fully read response returns its connection to the pool; an
            # unfinished one (client gone, handler cancelled) is closed, which
            # makes vLLM abort the request instead of generating for nobody.
            if upstream.content.is_eof():
                upstream.release()
            else:
                upstream.close()

    @staticmethod
    def _no_read_timer(upstream: aiohttp.ClientResponse) -> None:
        """No sock_read timer re-armed per packet from now on (the one pending bounds the first body bytes)."""
        connection = upstream.connection
        if connection is not None and connection.protocol is not None:
            connection.protocol.read_timeout = None

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, route: Route) -> web.StreamResponse:
        self._no_read_timer(upstream)
        if upstream.status >= 500:
            self.failed(route, f"HTTP {upstream.status}")
        else:
            route.replica_counter.health.succeeded()
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for name, value in upstream.headers.items():
            if name.lower() not in _RESPONSE_HEADERS_NOT_FORWARDED:
                response.headers.add(name, value)
        response.headers[ARM_HEADER] = route.arm
        response.headers[REPLICA_HEADER] = route.replica
        try:
            await response.prepare(request)
        except ConnectionError:
            return response  # the client went away before the status line

        # Chunk by chunk as the bytes arrive: an SSE event is flushed to the
        # client the moment vLLM emits it (readany never waits to fill a
        # buffer), so TTFT measured through the router is vLLM's TTFT.
        watch = _Watch(upstream)
        self._watched.add(watch)
        clock = time.monotonic
        try:
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    # The replica died or went silent mid-stream. The status line
                    # is already sent, so the only honest signal left is to cut the
                    # client's connection without the terminating chunk.
                    self.failed(route, self._broken_because(watch, exc))
                    if request.transport is not None:
                        request.transport.close()
                    return response
                watch.last = math.inf  # a slow client is not a silent replica
                if not chunk:
                    break
                try:
                    await response.write(chunk)
                except ConnectionError:
                    # The client went away; that is not the replica's fault.
                    return response
                watch.last = clock()
            await response.write_eof()
            return response
        finally:
            self._watched.discard(watch)

    def _broken_because(self, watch: _Watch, exc: BaseException) -> str:
        if watch.silent:
            return f"stream silent for {self._limits.upstream_idle_timeout_s:g} s (upstream_idle_timeout_s)"
        return f"stream broken: {type(exc).__name__}: {exc}"

__all__ = ["REPLICA_HEADER", "Forwarder", "Route", "RouteCounter", "error_response"]
