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
"""

from __future__ import annotations

import logging
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

    async def open(self, strip_authorization: bool) -> None:
        """`strip_authorization`: the router checks a token of its own, which is not the replicas' business."""
        limits = self._limits
        if strip_authorization:
            self._not_forwarded = _REQUEST_HEADERS_NOT_FORWARDED | {"authorization"}
        # Without limit=0 aiohttp caps the pool at 100 connections and would
        # silently queue the 101st concurrent stream inside the router.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        self._session = aiohttp.ClientSession(
            connector=connector,
            # sock_read bounds the wait for the first bytes here; once the
            # answer's headers are in, forward() lowers it to the idle timeout.
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

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

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

    def _idle_from_now_on(self, upstream: aiohttp.ClientResponse) -> None:
        """After the first body bytes, silence is bounded by the idle timeout.

        vLLM sends a stream's headers at once and its first token after
        queueing and prefill: that wait stays under the first-byte timeout
        (sock_read of the session); the gaps between tokens are shorter.
        """
        connection = upstream.connection
        # At EOF the connection goes back to the pool: a timer started now would fire on its next user.
        if connection is None or connection.protocol is None or upstream.content.is_eof():
            return
        connection.protocol.read_timeout = self._limits.upstream_idle_timeout_s
        connection.protocol.start_timeout()

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, route: Route) -> web.StreamResponse:
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
        first = True
        while True:
            try:
                chunk = await upstream.content.readany()
                if first:
                    first = False
                    self._idle_from_now_on(upstream)
            except (aiohttp.ClientError, TimeoutError) as exc:
                # The replica died or went silent mid-stream. The status line
                # is already sent, so the only honest signal left is to cut the
                # client's connection without the terminating chunk.
                self.failed(route, f"stream broken: {type(exc).__name__}: {exc}")
                if request.transport is not None:
                    request.transport.close()
                return response
            if not chunk:
                break
            try:
                await response.write(chunk)
            except ConnectionError:
                # The client went away; that is not the replica's fault.
                return response
        await response.write_eof()
        return response


__all__ = ["REPLICA_HEADER", "Forwarder", "Route", "RouteCounter", "error_response"]
