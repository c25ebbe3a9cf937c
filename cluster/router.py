"""The gateway between the load (Locust, eval clients) and the two arms.

One HTTP endpoint in front of every replica of every arm. Each `/v1/*` request
is assigned an arm (by weight, or pinned by the `x-mtp-canary-arm` request
header), then the replica of that arm with the fewest requests in flight, and
is proxied there with the response body streamed back chunk by chunk. Every
response says where it went (`x-mtp-canary-arm`, `x-mtp-canary-replica`), so
client-side records can be split per arm without trusting the router's split.

Layout:
- a pure core (`ArmWeights`, `ArmSelector`, `pick_replica`) with no I/O,
  unit-tested on its own;
- `RouterServer`, a plain asyncio class that runs an aiohttp server inside the
  event loop it is started on, and keeps the routing counters;
- `Router`, the same class as a Ray actor (`num_cpus=0`: it mostly waits on
  sockets). Its async methods and the HTTP handlers share one event loop, so
  a `set_weights` call is atomic with respect to routing decisions: every
  request routed after the call returns sees the new weights.

The router sits in the latency path (TTFT is measured through it), so the
per-request work is a few dict operations, no logging, and no buffering of
response bodies.
"""

from __future__ import annotations

import asyncio
import math
import random
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import aiohttp
import ray
from aiohttp import web
from yarl import URL

from cluster.arms import ARM_HEADER, BASELINE, CANARY
from cluster.lease import Lease

# Arms a client may always pin, even before `set_arms` (then: 503, not 400).
DEFAULT_ARMS: tuple[str, ...] = (BASELINE, CANARY)

REPLICA_HEADER = "x-mtp-canary-replica"

MAX_WEIGHT = 100.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# Until told otherwise all traffic goes to the baseline: a router that comes
# up before the controller sets weights must not expose users to the canary.
DEFAULT_WEIGHTS: Mapping[str, float] = {BASELINE: 100.0, CANARY: 0.0}
# Requests are small JSON documents, but long-context prompts can exceed
# aiohttp's 1 MiB default body limit.
MAX_REQUEST_BODY_BYTES = 256 * 1024 * 1024
# Seconds `stop()` waits for in-flight requests before cancelling them.
SHUTDOWN_GRACE_S = 2.0

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


# --------------------------------------------------------------------------
# Pure core
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmWeights:
    """Traffic weight per arm name, each in [0, 100], not all zero.

    Weights are relative (80/20 and 4/1 route alike); an arm that is absent
    has weight 0. Construction validates, so an `ArmWeights` is always usable.
    """

    by_arm: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))

    def __post_init__(self) -> None:
        if not isinstance(self.by_arm, Mapping) or not self.by_arm:
            raise ValueError(f"arm weights must be a non-empty mapping of arm name -> weight, got {self.by_arm!r}")
        validated: dict[str, float] = {}
        for arm, weight in self.by_arm.items():
            if not isinstance(arm, str) or not arm.strip():
                raise ValueError(f"arm name must be a non-empty string, got {arm!r}")
            # bool is an int subclass; True/False as a weight is a caller bug.
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise ValueError(f"weight of arm {arm!r} must be a number, got {weight!r}")
            if not math.isfinite(weight) or not 0.0 <= weight <= MAX_WEIGHT:
                raise ValueError(f"weight of arm {arm!r} must be within 0..{MAX_WEIGHT:g}, got {weight!r}")
            validated[arm] = float(weight)
        if sum(validated.values()) <= 0.0:
            raise ValueError(f"at least one arm needs a positive weight, got {validated}")
        object.__setattr__(self, "by_arm", validated)

    def weight(self, arm: str) -> float:
        return self.by_arm.get(arm, 0.0)

    @property
    def total(self) -> float:
        return sum(self.by_arm.values())

    def share(self, arm: str) -> float:
        """Fraction of weighted traffic this arm should receive."""
        return self.weight(arm) / self.total

    def positive_arms(self) -> list[str]:
        return [arm for arm, weight in self.by_arm.items() if weight > 0.0]


class ArmSelector:
    """Chooses the arm of each weighted (unpinned) request.

    Why not plain weighted random: over the 50-200 requests of a progressive
    step, a 10% canary would get anywhere from 2 to 9 of 50 requests (binomial
    noise), so guard windows would judge a varying amount of canary traffic.
    Why not plain smooth weighted round-robin (nginx): it is periodic - at
    50/50 it strictly alternates - so any periodicity in the request stream
    (a user alternating a long and a short prompt) would send one kind of
    request to one arm only, a confound a canary comparison must not have.

    So: blocked randomization, as in clinical trials. Smooth weighted
    round-robin decides *how many* requests of each arm a block of
    `block_size` requests holds (its credits carry over between blocks, so
    the long-run split is exact even when block_size * share is fractional),
    and the block is shuffled to decide *which* requests. The observed split
    never strays more than about one block from the weights, while the arm of
    any given request stays random. An arm of weight 0 is never chosen: it is
    never put in a block, and a weight change discards the rest of the block.
    """

    def __init__(self, weights: ArmWeights, rng: random.Random, block_size: int = 10) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._rng = rng
        self._block_size = block_size
        self._weights = weights
        self._credits: dict[str, float] = {}
        self._block: list[str] = []  # remaining picks of the current block, consumed from the end
        self.set_weights(weights, force=True)

    @property
    def weights(self) -> ArmWeights:
        return self._weights

    def set_weights(self, weights: ArmWeights, force: bool = False) -> None:
        """Use `weights` from the next `choose()` on.

        Re-setting identical weights keeps the current block and credits:
        restarting the round-robin from zero credits on every call would
        starve a small-weight arm if the caller re-asserts weights often.
        """
        if not force and weights == self._weights:
            return
        self._weights = weights
        self._credits = {arm: 0.0 for arm in weights.positive_arms()}
        self._block = []

    def choose(self) -> str:
        if not self._block:
            self._block = self._next_block()
        return self._block.pop()

    def _next_block(self) -> list[str]:
        block = [self._smooth_weighted_round_robin_step() for _ in range(self._block_size)]
        self._rng.shuffle(block)
        return block

    def _smooth_weighted_round_robin_step(self) -> str:
        # nginx's algorithm: every arm earns its weight, the richest arm is
        # chosen and pays the total. Credits always sum to zero after a step,
        # which bounds each arm's deviation from its share to one request.
        total = self._weights.total
        for arm in self._credits:
            self._credits[arm] += self._weights.by_arm[arm]
        chosen = max(self._credits, key=self._credits.__getitem__)
        self._credits[chosen] -= total
        return chosen


def pick_replica(outstanding: Mapping[str, int], turn: int) -> str:
    """The replica with the fewest outstanding requests.

    Ties (e.g. every replica idle under light load) go round-robin: the caller
    passes an ever-increasing `turn` per arm, and the `turn`-th tied replica in
    mapping order is chosen, so sequential requests spread over all replicas
    instead of always hitting the first one.
    """
    if not outstanding:
        raise ValueError("no replicas to pick from")
    least = min(outstanding.values())
    tied = [url for url, count in outstanding.items() if count == least]
    return tied[turn % len(tied)]


# --------------------------------------------------------------------------
# State reported to callers (plain dicts: JSON for /router/state, cheap over Ray)
# --------------------------------------------------------------------------


class RouteCounts(TypedDict):
    routed: int  # requests sent upstream since start or the last reset_counts()
    in_flight: int  # requests sent upstream whose response has not finished
    errors: int  # upstream 5xx responses, connection failures, streams broken mid-way


class ArmCounts(RouteCounts):
    rejected: int  # requests answered 503 because the arm had no replicas


class ReplicaCounts(RouteCounts):
    arm: str


class RouterState(TypedDict):
    url: str | None
    weights: dict[str, float]
    arms: dict[str, list[str]]  # arm -> replica base URLs
    arm_counts: dict[str, ArmCounts]
    replica_counts: dict[str, ReplicaCounts]  # replica base URL -> counts


@dataclass
class _Counter:
    routed: int = 0
    in_flight: int = 0
    errors: int = 0
    rejected: int = 0

    def reset_totals(self) -> None:
        # in_flight is a live gauge (and drives least-outstanding picking):
        # requests still streaming must still be subtracted when they finish.
        self.routed = 0
        self.errors = 0
        self.rejected = 0


def _normalize_replica_url(url: Any, arm: str) -> str:
    if not isinstance(url, str):
        raise ValueError(f"replica of arm {arm!r} must be a URL string, got {url!r}")
    parsed = URL(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"replica of arm {arm!r} must be an http(s) base URL like http://127.0.0.1:8001, got {url!r}")
    return str(parsed).rstrip("/")


def _error_response(status: int, message: str, error_type: str, headers: Mapping[str, str] | None = None) -> web.Response:
    # OpenAI's error envelope, so OpenAI clients and Locust users parse it as they parse vLLM's.
    body = {"error": {"message": message, "type": error_type, "code": status}}
    return web.json_response(body, status=status, headers=headers)


# --------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------


class RouterServer:
    """Weighted, arm-pinning, streaming reverse proxy in front of the arms.

    Create it inside a running event loop's owner (as a Ray actor: `Router`),
    then `await start()`, `await set_arms(...)`, `await set_weights(...)`.
    """

    def __init__(
        self,
        initial_weights: Mapping[str, float] | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        seed: int | None = None,
        block_size: int = 10,
    ) -> None:
        if connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s}")
        self._connect_timeout_s = connect_timeout_s
        self._selector = ArmSelector(
            ArmWeights(dict(initial_weights if initial_weights is not None else DEFAULT_WEIGHTS)),
            random.Random(seed),
            block_size=block_size,
        )
        self._arms: dict[str, list[str]] = {}
        # Replica counters of the current arms; a request in flight keeps a
        # reference to its own counter, so set_arms can drop replicas safely.
        self._replica_counters: dict[str, dict[str, _Counter]] = {}
        self._arm_counters: dict[str, _Counter] = {arm: _Counter() for arm in DEFAULT_ARMS}
        self._turns: dict[str, int] = {}
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._bound: tuple[str, int] | None = None
        self._url: str | None = None
        # Unrenewed (its controller dead and nobody resuming), the router ends its process.
        self._lease = Lease("router")

    # ---- lifecycle -------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on host:port (port 0: a free one); returns the base URL.

        Calling it again on a started router returns the same URL (a
        controller resuming a run may re-attach to the named actor), unless
        it asks for a different address.
        """
        if self._url is not None:
            assert self._bound is not None
            bound_host, bound_port = self._bound
            if host != bound_host or port not in (0, bound_port):
                raise RuntimeError(f"router already serves on {self._url}; cannot also bind {host}:{port}")
            return self._url

        # Without limit=0 aiohttp caps the pool at 100 connections and would
        # silently queue the 101st concurrent stream inside the router.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        self._session = aiohttp.ClientSession(
            connector=connector,
            # Streams last as long as generation does; only connecting is bounded.
            timeout=aiohttp.ClientTimeout(
                total=None, connect=self._connect_timeout_s, sock_connect=self._connect_timeout_s, sock_read=None
            ),
            # Bodies pass through byte for byte; the client's own headers say
            # what it accepts, the proxy must not add encodings or agents.
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            trust_env=False,
        )

        app = web.Application(client_max_size=MAX_REQUEST_BODY_BYTES)
        app.router.add_get("/health", self._handle_health)
        app.router.add_get("/router/state", self._handle_state)
        app.router.add_route("*", "/v1/{tail:.*}", self._handle_proxy)
        # access_log=None: no per-request logging in the latency path.
        # handler_cancellation: when a client gives up, the upstream request
        # is closed at once, so vLLM aborts it instead of generating for nobody.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S)
        await runner.setup()
        try:
            listening_socket = self._bind(host, port)
            try:
                await web.SockSite(runner, listening_socket).start()
            except BaseException:
                listening_socket.close()
                raise
        except BaseException:
            # e.g. the port is taken: leave nothing half-started behind.
            await runner.cleanup()
            await self._session.close()
            self._session = None
            raise
        self._runner = runner
        bound_port = listening_socket.getsockname()[1]
        self._bound = (host, bound_port)
        self._url = f"http://{self._advertised_host(host)}:{bound_port}"
        return self._url

    async def stop(self) -> None:
        """Stop serving (in-flight requests get SHUTDOWN_GRACE_S) and close upstream connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._url = None
        self._bound = None

    @staticmethod
    def _bind(host: str, port: int) -> socket.socket:
        # Binding the socket ourselves gives the chosen port without reaching
        # into aiohttp's private server objects.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listening_socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            listening_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listening_socket.bind((host, port))
        except OSError:
            listening_socket.close()
            raise
        return listening_socket

    @staticmethod
    def _advertised_host(host: str) -> str:
        # A wildcard bind is reachable at the node's address, not at 0.0.0.0.
        if host in ("0.0.0.0", "::", ""):
            return ray.util.get_node_ip_address()
        return f"[{host}]" if ":" in host else host

    # ---- control ----------------------------------------------------------

    async def set_arms(self, arms: Mapping[str, Sequence[str]]) -> None:
        """Replace the replicas of every arm: arm name -> replica base URLs.

        Arms left out have no replicas afterwards. Counters of replicas that
        stay are kept. A replica URL may belong to one arm only.
        """
        normalized: dict[str, list[str]] = {}
        owner_of_url: dict[str, str] = {}
        for arm, urls in arms.items():
            if not isinstance(arm, str) or not arm.strip():
                raise ValueError(f"arm name must be a non-empty string, got {arm!r}")
            if isinstance(urls, str):
                raise ValueError(f"replicas of arm {arm!r} must be a list of URLs, got the string {urls!r}")
            normalized[arm] = []
            for url in urls:
                replica = _normalize_replica_url(url, arm)
                if replica in owner_of_url:
                    raise ValueError(f"replica {replica} is listed in arm {owner_of_url[replica]!r} and in arm {arm!r}")
                owner_of_url[replica] = arm
                normalized[arm].append(replica)

        self._replica_counters = {
            arm: {url: self._replica_counters.get(arm, {}).get(url) or _Counter() for url in urls}
            for arm, urls in normalized.items()
        }
        self._arms = normalized
        for arm in normalized:
            self._arm_counters.setdefault(arm, _Counter())
            self._turns.setdefault(arm, 0)

    async def set_weights(self, weights: Mapping[str, float] | ArmWeights) -> None:
        """Replace the weight table; arms left out get weight 0.

        Effective for every request routed after this call returns, e.g.
        {"baseline": 100, "canary": 0} (a rollback) sends no new request to
        the canary; requests already streaming from it finish normally.
        """
        arm_weights = weights if isinstance(weights, ArmWeights) else ArmWeights(dict(weights))
        unknown = sorted(set(arm_weights.by_arm) - self._known_arms())
        if unknown:
            raise ValueError(f"weights name unknown arm(s) {unknown}; known arms: {sorted(self._known_arms())}")
        self._selector.set_weights(arm_weights)
        for arm in arm_weights.by_arm:
            self._arm_counters.setdefault(arm, _Counter())

    async def reset_counts(self) -> None:
        """Zero routed/errors/rejected counts (in_flight is live and stays)."""
        for counter in self._arm_counters.values():
            counter.reset_totals()
        for replicas in self._replica_counters.values():
            for counter in replicas.values():
                counter.reset_totals()

    async def release_lease(self) -> None:
        """No deadline: the actor stays until stopped (keep_fleet)."""
        self._lease.release()

    async def renew_lease(self, seconds: float) -> float:
        """Keep the router alive `seconds` longer (see cluster.lease)."""
        return self._lease.renew(seconds)

    async def get_state(self) -> RouterState:
        return self._state()

    def _known_arms(self) -> set[str]:
        return set(DEFAULT_ARMS) | set(self._arms) | set(self._selector.weights.by_arm)

    def _state(self) -> RouterState:
        arm_counts: dict[str, ArmCounts] = {
            arm: {"routed": c.routed, "in_flight": c.in_flight, "errors": c.errors, "rejected": c.rejected}
            for arm, c in self._arm_counters.items()
        }
        replica_counts: dict[str, ReplicaCounts] = {
            url: {"arm": arm, "routed": c.routed, "in_flight": c.in_flight, "errors": c.errors}
            for arm, replicas in self._replica_counters.items()
            for url, c in replicas.items()
        }
        return {
            "url": self._url,
            "weights": dict(self._selector.weights.by_arm),
            "arms": {arm: list(urls) for arm, urls in self._arms.items()},
            "arm_counts": arm_counts,
            "replica_counts": replica_counts,
        }

    # ---- HTTP handlers -----------------------------------------------------

    async def _handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _handle_state(self, request: web.Request) -> web.Response:
        return web.json_response(self._state())

    async def _handle_proxy(self, request: web.Request) -> web.StreamResponse:
        # Read the body before choosing: no await between the choice and the
        # in_flight increment, so concurrent requests see each other's picks.
        body = await request.read()

        pinned_arm = request.headers.get(ARM_HEADER)
        if pinned_arm is not None:
            arm = pinned_arm.strip()
            if arm not in self._known_arms():
                return _error_response(
                    400,
                    f"unknown arm {arm!r} in header {ARM_HEADER}; known arms: {sorted(self._known_arms())}",
                    "invalid_request_error",
                )
        else:
            arm = self._selector.choose()

        arm_counter = self._arm_counters.setdefault(arm, _Counter())
        replica_counters = self._replica_counters.get(arm)
        if not replica_counters:
            arm_counter.rejected += 1
            how = "pinned" if pinned_arm is not None else "chosen by weight"
            return _error_response(
                503, f"arm {arm!r} ({how}) has no replicas", "service_unavailable", headers={ARM_HEADER: arm}
            )

        turn = self._turns.get(arm, 0)
        self._turns[arm] = turn + 1
        replica = pick_replica({url: c.in_flight for url, c in replica_counters.items()}, turn)
        replica_counter = replica_counters[replica]
        arm_counter.routed += 1
        replica_counter.routed += 1
        arm_counter.in_flight += 1
        replica_counter.in_flight += 1
        try:
            return await self._forward(request, body, arm, replica, arm_counter, replica_counter)
        finally:
            arm_counter.in_flight -= 1
            replica_counter.in_flight -= 1

    async def _forward(
        self,
        request: web.Request,
        body: bytes,
        arm: str,
        replica: str,
        arm_counter: _Counter,
        replica_counter: _Counter,
    ) -> web.StreamResponse:
        # No retry on another replica: a failing canary replica must show up
        # as errors in the verdict, not be hidden by the router.
        assert self._session is not None, "router not started"
        tags = {ARM_HEADER: arm, REPLICA_HEADER: replica}
        upstream_url = URL(replica + request.raw_path, encoded=True)
        forwarded_headers = [
            (name, value)
            for name, value in request.headers.items()
            if name.lower() not in _REQUEST_HEADERS_NOT_FORWARDED
        ]
        try:
            upstream = await self._session.request(
                request.method, upstream_url, headers=forwarded_headers, data=body or None, allow_redirects=False
            )
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            arm_counter.errors += 1
            replica_counter.errors += 1
            return _error_response(
                502,
                f"replica {replica} of arm {arm!r} failed before responding: {type(exc).__name__}: {exc}",
                "bad_gateway",
                headers=tags,
            )

        try:
            if upstream.status >= 500:
                arm_counter.errors += 1
                replica_counter.errors += 1
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _RESPONSE_HEADERS_NOT_FORWARDED:
                    response.headers.add(name, value)
            response.headers.update(tags)
            try:
                await response.prepare(request)
            except ConnectionError:
                return response  # the client went away before the status line

            # Chunk by chunk as the bytes arrive: an SSE event is flushed to
            # the client the moment vLLM emits it (readany never waits to fill
            # a buffer), so TTFT measured through the router is vLLM's TTFT.
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    # The replica died mid-stream. The status line is already
                    # sent, so the only honest signal left is to cut the
                    # client's connection without the terminating chunk.
                    arm_counter.errors += 1
                    replica_counter.errors += 1
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
        finally:
            # A fully read response returns its connection to the pool; an
            # unfinished one (client gone, handler cancelled) is closed, which
            # makes vLLM abort the request instead of generating for nobody.
            if upstream.content.is_eof():
                upstream.release()
            else:
                upstream.close()


# The Ray actor. num_cpus=0: it waits on sockets, and must never be the reason
# a replica or a Locust worker cannot be scheduled. Create it with
# Router.options(name=..., namespace=..., lifetime=...).remote(...).
Router = ray.remote(num_cpus=0)(RouterServer)

__all__ = [
    "DEFAULT_ARMS",
    "REPLICA_HEADER",
    "ArmCounts",
    "ArmSelector",
    "ArmWeights",
    "ReplicaCounts",
    "RouteCounts",
    "Router",
    "RouterServer",
    "RouterState",
    "pick_replica",
]


class RouterClient:
    """The driver's side of one Router actor: its URL, weights, arms and counts (each call bounded)."""

    def __init__(self, actor: Any, url: str) -> None:
        self.actor = actor
        self.url = url

    @property
    def id(self) -> str:
        """The actor's id: a replaced router (whose counts restarted at 0) has another."""
        return self.actor._actor_id.hex()

    def set_canary_weight(self, weight: float) -> None:
        """Applied at once: the canary gets `weight` percent, the baseline the rest."""
        ray.get(self.actor.set_weights.remote({BASELINE: 100.0 - weight, CANARY: weight}))

    def set_arms(self, urls: Mapping[str, Sequence[str]]) -> None:
        ray.get(self.actor.set_arms.remote(dict(urls)))

    def state(self, timeout_s: float = 10) -> RouterState:
        return ray.get(self.actor.get_state.remote(), timeout=timeout_s)

    def request_counts(self, with_rejected: bool = True) -> dict[str, int]:
        """Requests the router received per arm (routed, + rejected when asked); {} when it does not answer."""
        try:
            state = self.state()
        except Exception:
            return {}
        return {
            arm: int(c["routed"]) + (int(c["rejected"]) if with_rejected else 0)
            for arm, c in state["arm_counts"].items()
        }

    def stop(self) -> None:
        """Stop serving and end the actor (quietly: it may be gone already)."""
        try:
            ray.get(self.actor.stop.remote(), timeout=10)
        except Exception:
            pass
        try:
            ray.kill(self.actor)
        except Exception:
            pass
