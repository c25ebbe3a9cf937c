"""What the router accepts from a client, and how long it waits: `RouterLimits` and their enforcement.

The router faces whatever sends it traffic: a body cap (checked on
Content-Length and again while reading, so a lying or chunked client cannot
make it buffer more), header and body deadlines (a client trickling bytes is
cut off), a cap on open connections (beyond it a connection is answered 503
and closed at once), upstream timeouts (connect, first byte, idle between
chunks), origin-form `/v1/...` targets only, and a shared bearer token, which
it requires before binding beyond loopback.

The token's value lives only in the environment variable `auth_token_env`
names and in the running router's memory: the limits carry the variable's
name, never the value, so dumping them (state, logs) is safe.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
import urllib.parse
from collections.abc import Callable

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cluster.outlier import EjectionPolicy

MIB = 1024 * 1024
DEFAULT_TOKEN_ENV = "MTP_CANARY_ROUTER_TOKEN"
LOOPBACK_NAMES = frozenset({"localhost"})
# The router's own endpoints; every other path must be /v1/... (what vLLM serves to clients).
PROXIED_PREFIX = "/v1/"


class RouterLimits(BaseModel):
    """The router's limits; every field has a default, so `RouterLimits()` is a safe router."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(16 * MIB, ge=1, description="request body cap; beyond it 413, without buffering it")
    header_timeout_s: float = Field(
        30.0, gt=0,
        description="a request's headers must arrive within this time of the connection opening or of the previous "
        "answer's end (an idle keep-alive connection is closed after it too)",
    )
    body_timeout_s: float = Field(30.0, gt=0, description="a request's whole body must arrive within this time (408)")
    max_connections: int = Field(
        1024, ge=1, description="open client connections; a connection beyond them is answered 503 and closed"
    )
    upstream_connect_timeout_s: float = Field(10.0, gt=0, description="connecting to a replica (then 504)")
    upstream_first_byte_timeout_s: float = Field(
        300.0, gt=0,
        description="from sending a request to a replica to its first bytes (queueing and prefill; then 504); it "
        "also bounds the wait from the answer's headers to its first body bytes",
    )
    upstream_idle_timeout_s: float = Field(
        60.0, gt=0, description="silence between two chunks of a replica's answer; then the client's stream is cut"
    )
    upstream_keepalive_s: float = Field(
        2.0, gt=0,
        description="an idle pooled connection to a replica is closed after this; keep it below the replicas' own "
        "keep-alive (vLLM: 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE), or a request can go out on a connection the replica "
        "is closing and fail unanswered (ServerDisconnectedError)",
    )
    auth_token_env: str = Field(
        DEFAULT_TOKEN_ENV, min_length=1,
        description="environment variable holding the shared token: when set, every request needs "
        "'Authorization: Bearer <token>'; binding beyond loopback requires it",
    )
    eject_after_failures: int = Field(
        3, ge=1, description="consecutive connect errors, timeouts or 5xx that eject a replica"
    )
    ejection_base_s: float = Field(10.0, gt=0, description="first ejection's length; doubles per consecutive ejection")
    ejection_max_s: float = Field(300.0, gt=0, description="cap of an ejection's length")

    @model_validator(mode="after")
    def _ejection_cap_covers_the_base(self) -> RouterLimits:
        if self.ejection_max_s < self.ejection_base_s:
            raise ValueError(f"ejection_max_s ({self.ejection_max_s:g}) must be >= ejection_base_s ({self.ejection_base_s:g})")
        return self

    def ejection_policy(self) -> EjectionPolicy:
        return EjectionPolicy(self.eject_after_failures, self.ejection_base_s, self.ejection_max_s)

    def auth_token(self) -> str | None:
        """The token from the environment (None: unset or empty)."""
        return os.environ.get(self.auth_token_env) or None


def limits_error(exc: ValidationError) -> str:
    """A ValidationError as one line naming the field: 'max_body_bytes: Input should be greater than ...'."""
    first = exc.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "limits"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{field}: {first['msg']}{more}"


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None, limits: RouterLimits) -> None:
    """Refuse to serve beyond loopback without a token (one line naming the variable)."""
    if token is None and not is_loopback(host):
        raise RuntimeError(
            f"router: refusing to bind {host!r} (beyond loopback) without a token: set the environment variable "
            f"{limits.auth_token_env} (auth_token_env) or bind 127.0.0.1"
        )


def authorized(request: web.Request, token: str | None) -> bool:
    if token is None:
        return True
    given = request.headers.get("Authorization", "")
    scheme, _, value = given.partition(" ")
    # compare_digest: the time taken must not tell how much of a guess was right.
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


def target_problem(request: web.Request, proxied: bool) -> str | None:
    """Why the request target is refused (None: fine); `proxied` for the /v1/... route.

    Only origin-form targets (RFC 9112 3.2.1): an absolute-form `GET http://evil/v1/x`
    is not a proxy request for another host. A proxied path must stay within /v1/
    once dot segments are resolved (`/v1/../admin` is not under /v1/ at the replica).
    """
    raw = request.raw_path
    if not raw.startswith("/") or raw.startswith("//"):
        return f"request target must be an origin-form path like /v1/completions, got {raw[:100]!r}"
    if not proxied:
        return None
    path = raw.split("?", 1)[0]
    if not path.startswith(PROXIED_PREFIX):
        return f"only {PROXIED_PREFIX}... paths are routed, got {path[:100]!r}"
    if "." in path or "%" in path:  # fast path: most targets have neither
        segments = urllib.parse.unquote(path).split("/")
        if any(segment in (".", "..") for segment in segments):
            return f"dot segments are not routed, got {path[:100]!r}"
    return None


class BodyRefused(Exception):
    """The request body is not read (too large, too slow): the status and one line why."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


async def read_body(request: web.Request, limits: RouterLimits) -> bytes:
    """The whole body, at most max_body_bytes, within body_timeout_s; else BodyRefused."""
    cap = limits.max_body_bytes
    declared = request.content_length
    if declared is not None and declared > cap:
        raise BodyRefused(413, "body_too_large", f"request body of {declared} bytes exceeds the router's cap of {cap} bytes")
    if not request.body_exists:
        return b""
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > cap:
                    raise BodyRefused(413, "body_too_large", f"request body exceeds the router's cap of {cap} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyRefused(
            408, "body_timeout", f"request body not complete within {limits.body_timeout_s:g} s (body_timeout_s)"
        ) from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _refusal_bytes() -> bytes:
    body = json.dumps(
        {"error": {"message": "router: too many open connections (max_connections)", "type": "service_unavailable",
                   "code": 503}}
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"
    )
    return head.encode() + body


class _Refusal(asyncio.Protocol):
    """A connection beyond max_connections: one 503, then closed, before any request is parsed."""

    _ANSWER = _refusal_bytes()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self._ANSWER)
        transport.close()


class CappedSockSite(web.SockSite):
    """aiohttp's SockSite, with at most `max_connections` connections open at once.

    aiohttp has no connection cap of its own, so the protocol factory decides
    at accept time: a connection beyond the cap never reaches aiohttp's parser.
    """

    def __init__(self, runner: web.BaseRunner, sock: object, max_connections: int, on_refused: Callable[[], None]) -> None:
        super().__init__(runner, sock)  # type: ignore[arg-type]
        self._max_connections = max_connections
        self._on_refused = on_refused

    async def start(self) -> None:
        await super(web.SockSite, self).start()  # BaseSite.start: registers the site with its runner
        server = self._runner.server
        assert server is not None

        def protocol() -> asyncio.Protocol:
            if len(server.connections) >= self._max_connections:
                self._on_refused()
                return _Refusal()
            return server()

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(protocol, sock=self._sock, backlog=self._backlog)


__all__ = [
    "BodyRefused",
    "CappedSockSite",
    "RouterLimits",
    "authorized",
    "check_bind",
    "is_loopback",
    "limits_error",
    "read_body",
    "target_problem",
]
