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

Around it: cluster/router_limits.py (`RouterLimits`: body cap, header and body
deadlines, connection cap, upstream timeouts, origin-form targets, the bearer
token), cluster/router_proxy.py (`Forwarder`: one request to its replica and
back, its outcome counted) and cluster/outlier.py (passive ejection: a replica
failing in a row is skipped for a doubling backoff; if every replica of an arm
is ejected the arm answers 503, counted as its error).
"""

from __future__ import annotations

import math
import random
import socket
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import ray
from aiohttp import web
from yarl import URL

from cluster.arms import ARM_HEADER, BASELINE, CANARY
from cluster.lease import Lease
from loadtests.options import BEARER_TOKEN_ENV
from cluster.router_limits import (
    BodyRefused,
    CappedSockSite,
    RouterLimits,
    authorized,
    check_bind,
    read_body,
    target_problem,
)
from cluster.router_proxy import REPLICA_HEADER, Forwarder, Route, RouteCounter, error_response

# Arms a client may always pin, even before `set_arms` (then: 503, not 400).
DEFAULT_ARMS: tuple[str, ...] = (BASELINE, CANARY)

MAX_WEIGHT = 100.0
# Until told otherwise all traffic goes to the baseline: a router that comes
# up before the controller sets weights must not expose users to the canary.
DEFAULT_WEIGHTS: Mapping[str, float] = {BASELINE: 100.0, CANARY: 0.0}
# Seconds `stop()` waits for in-flight requests before cancelling them.
SHUTDOWN_GRACE_S = 2.0
# After refusing a body (413, 408), aiohttp reads and discards what the client
# still sends for this long, so the client sees the answer rather than a reset;
# aiohttp's 10 s would let each refused client hold a connection for 10 s.
LINGER_S = 2.0


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
    # upstream 5xx, connection failures, upstream timeouts, streams broken mid-way,
    # and (arm only) requests answered 503 because every replica of the arm was ejected
    errors: int


class ArmCounts(RouteCounts):
    rejected: int  # requests answered 503 because the arm had no replicas, or none not ejected


class ReplicaCounts(RouteCounts):
    arm: str
    ejected_until: float | None  # epoch seconds the current ejection ends; None: not ejected
    ejections: int  # ejections since the replica joined its arm (kept by reset_counts)


class RouterState(TypedDict):
    url: str | None
    weights: dict[str, float]
    arms: dict[str, list[str]]  # arm -> replica base URLs
    arm_counts: dict[str, ArmCounts]
    replica_counts: dict[str, ReplicaCounts]  # replica base URL -> counts
    # requests and connections refused before routing, by cause (not in any arm's counts):
    # unauthorized, bad_target, body_too_large, body_timeout, connections
    refused: dict[str, int]
    # arm -> requests answered 503 because every replica of the arm was ejected at once, since the
    # router started (kept by reset_counts: a run's record says the arm was out, in whichever phase)
    wholly_ejected: dict[str, int]
    auth_required: bool  # a bearer token is required (its value is never reported)
    limits: dict[str, Any]  # RouterLimits as a dict


def _normalize_replica_url(url: Any, arm: str) -> str:
    if not isinstance(url, str):
        raise ValueError(f"replica of arm {arm!r} must be a URL string, got {url!r}")
    parsed = URL(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"replica of arm {arm!r} must be an http(s) base URL like http://127.0.0.1:8001, got {url!r}")
    return str(parsed).rstrip("/")


def _replica_counts(arm: str, c: RouteCounter, now: float, wall: float) -> ReplicaCounts:
    health = c.health
    ejected_until = wall + (health.ejected_until - now) if health.ejected(now) else None
    return {
        "arm": arm, "routed": c.routed, "in_flight": c.in_flight, "errors": c.errors,
        "ejected_until": ejected_until, "ejections": health.ejections,
    }


# --------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------


class RouterServer:
    """Weighted, arm-pinning, streaming reverse proxy in front of the arms.

    Create it inside a running event loop's owner (as a Ray actor: `Router`),
    then `await start()`, `await set_arms(...)`, `await set_weights(...)`.
    `limits` (default `RouterLimits()`): what it accepts and how long it waits.
    """

    def __init__(
        self,
        initial_weights: Mapping[str, float] | None = None,
        seed: int | None = None,
        block_size: int = 10,
        limits: RouterLimits | None = None,
    ) -> None:
        self._limits = limits if limits is not None else RouterLimits()
        self._selector = ArmSelector(
            ArmWeights(dict(initial_weights if initial_weights is not None else DEFAULT_WEIGHTS)),
            random.Random(seed),
            block_size=block_size,
        )
        self._arms: dict[str, list[str]] = {}
        # Replica counters of the current arms; a request in flight keeps a
        # reference to its own counter, so set_arms can drop replicas safely.
        self._replica_counters: dict[str, dict[str, RouteCounter]] = {}
        self._upstream_keys: dict[str, str] = {}  # replica URL -> its --api-key (set_arms)
        self._arm_counters: dict[str, RouteCounter] = {arm: RouteCounter() for arm in DEFAULT_ARMS}
        self._turns: dict[str, int] = {}
        self._refused: Counter[str] = Counter()
        self._wholly_ejected: Counter[str] = Counter()
        self._forwarder = Forwarder(self._limits)
        self._token: str | None = None
        self._runner: web.AppRunner | None = None
        self._bound: tuple[str, int] | None = None
        self._url: str | None = None
        # Unrenewed (its controller dead and nobody resuming), the router ends its process.
        self._lease = Lease("router")

    # ---- lifecycle -------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> str:
        """Serve on host:port (port 0: a free one); returns the base URL.

        Calling it again on a started router returns the same URL (a
        controller resuming a run may re-attach to the named actor), unless
        it asks for a different address. Beyond loopback it needs the token
        (RouterLimits.auth_token_env) and refuses to start without it.
        """
        if self._url is not None:
            assert self._bound is not None
            bound_host, bound_port = self._bound
            if host != bound_host or port not in (0, bound_port):
                raise RuntimeError(f"router already serves on {self._url}; cannot also bind {host}:{port}")
            return self._url
        limits = self._limits
        # Given by the controller (who hands it to its clients too), or read here, in the process
        # that serves: the Ray actor's environment, not the caller's.
        token = token or limits.auth_token()
        check_bind(host, token, limits)
        self._token = token
        await self._forwarder.open(strip_authorization=token is not None)

        app = web.Application(client_max_size=limits.max_body_bytes)
        app.router.add_get("/health", self._handle_health)
        app.router.add_get("/router/state", self._handle_state)
        app.router.add_route("*", "/v1/{tail:.*}", self._handle_proxy)
        app.router.add_route("*", "/{tail:.*}", self._handle_not_routed)
        # access_log=None: no per-request logging in the latency path.
        # handler_cancellation: when a client gives up, the upstream request
        # is closed at once, so vLLM aborts it instead of generating for nobody.
        # keepalive_timeout: aiohttp closes a connection whose next request's
        # headers are not complete this long after it opened or after the
        # previous answer: the header deadline (a trickling client is cut off).
        runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S,
            keepalive_timeout=limits.header_timeout_s, lingering_time=LINGER_S,
        )
        await runner.setup()
        try:
            listening_socket = self._bind(host, port)
            try:
                site = CappedSockSite(runner, listening_socket, limits.max_connections, self._refused_connection)
                await site.start()
            except BaseException:
                listening_socket.close()
                raise
        except BaseException:
            # e.g. the port is taken: leave nothing half-started behind.
            await runner.cleanup()
            await self._forwarder.close()
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
        await self._forwarder.close()
        self._url = None
        self._bound = None

    def _refused_connection(self) -> None:
        self._refused["connections"] += 1

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

    async def set_arms(self, arms: Mapping[str, Sequence[str]], upstream_keys: Mapping[str, str] | None = None) -> None:
        """Replace the replicas of every arm: arm name -> replica base URLs.

        Arms left out have no replicas afterwards. Counters (and ejections) of
        replicas that stay are kept. A replica URL may belong to one arm only.
        `upstream_keys`: replica URL -> the key that replica requires (its engine's
        --api-key), sent as its Authorization; kept in memory, never in the state.
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
            arm: {url: self._replica_counters.get(arm, {}).get(url) or RouteCounter() for url in urls}
            for arm, urls in normalized.items()
        }
        self._arms = normalized
        self._upstream_keys = {
            _normalize_replica_url(url, "upstream_keys"): key for url, key in (upstream_keys or {}).items() if key
        }
        for arm in normalized:
            self._arm_counters.setdefault(arm, RouteCounter())
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
            self._arm_counters.setdefault(arm, RouteCounter())

    async def reset_counts(self) -> None:
        """Zero routed/errors/rejected counts (in_flight and replica health are live and stay)."""
        for counter in self._arm_counters.values():
            counter.reset_totals()
        for replicas in self._replica_counters.values():
            for counter in replicas.values():
                counter.reset_totals()
        self._refused.clear()

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
        now, wall = time.monotonic(), time.time()
        arm_counts: dict[str, ArmCounts] = {
            arm: {"routed": c.routed, "in_flight": c.in_flight, "errors": c.errors, "rejected": c.rejected}
            for arm, c in self._arm_counters.items()
        }
        replica_counts = {
            url: _replica_counts(arm, c, now, wall)
            for arm, replicas in self._replica_counters.items()
            for url, c in replicas.items()
        }
        return {
            "url": self._url,
            "weights": dict(self._selector.weights.by_arm),
            "arms": {arm: list(urls) for arm, urls in self._arms.items()},
            "arm_counts": arm_counts,
            "replica_counts": replica_counts,
            "refused": dict(self._refused),
            "wholly_ejected": dict(self._wholly_ejected),
            "auth_required": self._token is not None,
            "limits": self._limits.model_dump(mode="json"),
        }

    # ---- HTTP handlers -----------------------------------------------------

    def _refusal(self, request: web.Request, proxied: bool) -> web.Response | None:
        """401 without the token, 400 for a target the router does not route; None: go on."""
        if not authorized(request, self._token):
            self._refused["unauthorized"] += 1
            return error_response(
                401, "router: missing or wrong token (Authorization: Bearer <token>)", "authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
        problem = target_problem(request, proxied)
        if problem is not None:
            self._refused["bad_target"] += 1
            return error_response(400, f"router: {problem}", "invalid_request_error")
        return None

    async def _handle_health(self, request: web.Request) -> web.Response:
        refusal = self._refusal(request, proxied=False)
        return refusal if refusal is not None else web.json_response({"status": "ok"})

    async def _handle_state(self, request: web.Request) -> web.Response:
        refusal = self._refusal(request, proxied=False)
        return refusal if refusal is not None else web.json_response(self._state())

    async def _handle_not_routed(self, request: web.Request) -> web.Response:
        refusal = self._refusal(request, proxied=True)
        assert refusal is not None, "a path outside /v1/ is always refused"
        return refusal

    async def _handle_proxy(self, request: web.Request) -> web.StreamResponse:
        refusal = self._refusal(request, proxied=True)
        if refusal is not None:
            return refusal
        # Read the body before choosing: no await between the choice and the
        # in_flight increment, so concurrent requests see each other's picks.
        try:
            body = await read_body(request, self._limits)
        except BodyRefused as exc:
            self._refused[exc.kind] += 1
            response = error_response(exc.status, f"router: {exc}", "invalid_request_error")
            response.force_close()  # what is left of the body is not read
            return response

        pinned_arm = request.headers.get(ARM_HEADER)
        if pinned_arm is not None:
            arm = pinned_arm.strip()
            if arm not in self._known_arms():
                return error_response(
                    400,
                    f"unknown arm {arm!r} in header {ARM_HEADER}; known arms: {sorted(self._known_arms())}",
                    "invalid_request_error",
                )
        else:
            arm = self._selector.choose()

        arm_counter = self._arm_counters.setdefault(arm, RouteCounter())
        replica_counters = self._replica_counters.get(arm)
        how = "pinned" if pinned_arm is not None else "chosen by weight"
        if not replica_counters:
            arm_counter.rejected += 1
            return error_response(
                503, f"arm {arm!r} ({how}) has no replicas", "service_unavailable", headers={ARM_HEADER: arm}
            )
        replica = self._pick(arm, replica_counters)
        if replica is None:
            # Failing closed: the arm's errors must reach the guards, not vanish in a retry elsewhere.
            arm_counter.rejected += 1
            arm_counter.errors += 1
            self._wholly_ejected[arm] += 1
            return error_response(
                503, f"arm {arm!r} ({how}): every replica is ejected after consecutive failures",
                "service_unavailable", headers={ARM_HEADER: arm},
            )

        replica_counter = replica_counters[replica]
        arm_counter.routed += 1
        replica_counter.routed += 1
        arm_counter.in_flight += 1
        replica_counter.in_flight += 1
        try:
            route = Route(arm, replica, arm_counter, replica_counter, self._upstream_keys.get(replica))
            return await self._forwarder.forward(request, body, route)
        finally:
            arm_counter.in_flight -= 1
            replica_counter.in_flight -= 1

    def _pick(self, arm: str, replica_counters: Mapping[str, RouteCounter]) -> str | None:
        """The least-outstanding replica that is not ejected (None: all are)."""
        turn = self._turns.get(arm, 0)
        self._turns[arm] = turn + 1
        now = time.monotonic()
        candidates = {url: c.in_flight for url, c in replica_counters.items() if not c.health.ejected(now)}
        return pick_replica(candidates, turn) if candidates else None


# The Ray actor. num_cpus=0: it waits on sockets, and must never be the reason
# a replica or a Locust worker cannot be scheduled. Create it with
# Router.options(name=..., namespace=..., lifetime=...).remote(...).
Router = ray.remote(num_cpus=0)(RouterServer)

__all__ = [
    "DEFAULT_ARMS",
    "REPLICA_HEADER",
    "RouterLimits",
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


ROUTER_WATCH_NAME = "router"  # the router among the replicas in a phase's liveness answers


# a control call on the router actor (weights, arms): an answer in well under a second; longer is a hung actor
CONTROL_TIMEOUT_S = 30.0


class RouterClient:
    """The driver's side of one Router actor: its URL, weights, arms and counts (each call bounded)."""

    def __init__(self, actor: Any, url: str, token: str | None = None) -> None:
        self.actor = actor
        self.url = url
        self.token = token  # the bearer token clients send (None: the router needs none)

    def __repr__(self) -> str:  # never the token
        return f"RouterClient({self.url})"

    def client_env(self) -> dict[str, str]:
        """What a Locust process needs in its environment to be let in."""
        return {BEARER_TOKEN_ENV: self.token} if self.token else {}

    @property
    def id(self) -> str:
        """The actor's id: a replaced router (whose counts restarted at 0) has another."""
        return self.actor._actor_id.hex()

    def set_canary_weight(self, weight: float, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        """Applied at once: the canary gets `weight` percent, the baseline the rest (GetTimeoutError
        when the actor does not answer: a hung router must not hang the run's way back to 0)."""
        ray.get(self.actor.set_weights.remote({BASELINE: 100.0 - weight, CANARY: weight}), timeout=timeout_s)

    def set_arms(self, urls: Mapping[str, Sequence[str]], upstream_keys: Mapping[str, str] | None = None,
                 timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        ray.get(self.actor.set_arms.remote(dict(urls), dict(upstream_keys or {})), timeout=timeout_s)

    def state(self, timeout_s: float = 10) -> RouterState:
        return ray.get(self.actor.get_state.remote(), timeout=timeout_s)

    def alive(self, timeout_s: float = 10) -> bool | None:
        """True: the actor answers. False: it is gone (killed, its process died). None: no answer in time."""
        try:
            self.state(timeout_s)
        except ray.exceptions.GetTimeoutError:
            return None
        except ray.exceptions.RayError:
            return False
        return True

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

    def wholly_ejected(self) -> dict[str, int] | None:
        """arm -> requests refused because every replica of the arm was ejected at once (since the
        router started); None when the router does not answer."""
        try:
            return dict(self.state().get("wholly_ejected") or {})
        except Exception:
            return None

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
