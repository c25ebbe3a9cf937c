"""POST the decision document to a webhook, without ever holding the decision hostage.

`post_decision(url, document)` tries a few times (5xx, 429, timeouts and
connection errors are retried; other 4xx are not: the receiver said no), stays
within a bounded total time, logs what went wrong, and returns a `WebhookResult`.
It never raises: the decision is already made and written when it is called.

Only to `https://` (plain http only to a loopback receiver, for tests, or with
`allow_http`), and never to where a redirect points: a 3xx is a failed
delivery (a 307 to 127.0.0.1/internal/admin would otherwise get the whole
decision). Logs and the result name the receiver by scheme and host only.

Worst-case time: retries * timeout_s plus the back-off between tries
(BACKOFF_S, doubling, capped), and never more than `deadline_s` when given
(+0.25 s): each try runs in a daemon thread that the call stops waiting for when
its time is up, so even a server that trickles its answer cannot hold it.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import requests

from rollout.record.redact import known_secrets, redact_url, scrub

__all__ = ["WebhookResult", "post_decision"]

logger = logging.getLogger("mtp_canary.webhook")

BACKOFF_S = 0.5  # before the 2nd try; doubles, capped at BACKOFF_MAX_S
BACKOFF_MAX_S = 4.0
USER_AGENT = "mtp-canary-webhook/1"


@dataclass
class WebhookResult:
    ok: bool  # a 2xx answer arrived
    url: str  # as it may be shown: scheme and host only (rollout.record.redact.redact_url)
    attempts: int
    status: int | None = None  # HTTP status of the last answer (None: none arrived)
    error: str | None = None  # why it failed (last attempt), None when ok
    elapsed_s: float = 0.0
    errors: list[str] = field(default_factory=list)  # one line per failed attempt

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "url": self.url,
            "attempts": self.attempts,
            "status": self.status,
            "error": self.error,
            "elapsed_s": round(self.elapsed_s, 3),
        }


def _retryable(status: int) -> bool:
    return status >= 500 or status in (408, 429)


def post_decision(
    url: str,
    document: dict[str, Any],
    timeout_s: float = 5,
    retries: int = 3,
    deadline_s: float | None = None,
    allow_http: bool = False,
) -> WebhookResult:
    """POST `document` as JSON to `url`; at most `retries` tries, never raises.

    `timeout_s` bounds each try (connect and each read); `deadline_s` (default:
    retries * timeout_s + the back-offs) bounds the whole call. `allow_http`:
    a plain http:// receiver beyond loopback is accepted (the decision travels unencrypted).
    """
    started = time.monotonic()
    tries = max(1, int(retries))
    budget = deadline_s if deadline_s is not None else tries * timeout_s + _total_backoff(tries)
    # A webhook URL's path often is its token: logs and the result show scheme and host only,
    # and error lines (requests names the URL in them) are scrubbed of the rest.
    shown, secrets = redact_url(url), known_secrets({"webhook_url": url})
    result = WebhookResult(ok=False, url=shown, attempts=0)
    refusal = _url_refusal(url, allow_http)
    if refusal is not None:  # nothing is sent
        result.error = refusal
        logger.error("webhook %s: %s", shown, refusal)
        return result
    try:
        body = json.dumps(document, default=str).encode()
    except (TypeError, ValueError) as exc:  # cannot happen with default=str, but never raise
        result.error = f"document is not JSON: {exc}"
        logger.error("webhook %s: %s", shown, result.error)
        return result
    backoff = BACKOFF_S
    for attempt in range(1, tries + 1):
        remaining = budget - (time.monotonic() - started)
        if remaining <= 0:
            break
        result.attempts = attempt
        status, text, failure = _post_once(url, body, min(timeout_s, remaining))
        result.status = status
        if failure is None and status is not None and 200 <= status < 300:
            result.ok, result.error = True, None
            break
        if failure is None:
            line, retry = f"HTTP {status}: {text[:200]!r}", _retryable(status)
            if 300 <= status < 400:
                line = f"HTTP {status}: a redirect, not followed (the decision goes to the configured receiver only)"
        else:
            line, retry = failure
        line = scrub(line, secrets)
        result.error = line
        result.errors.append(f"try {attempt}: {line}")
        logger.warning("webhook %s try %d/%d failed: %s", shown, attempt, tries, line)
        if not retry or attempt == tries:
            break
        pause = min(backoff, budget - (time.monotonic() - started))
        if pause <= 0:
            break
        time.sleep(pause)
        backoff = min(backoff * 2, BACKOFF_MAX_S)
    result.elapsed_s = time.monotonic() - started
    if not result.ok:
        logger.error("webhook %s gave up after %d try(s) in %.1f s: %s", shown, result.attempts, result.elapsed_s, result.error)
    return result


def _url_refusal(url: str, allow_http: bool) -> str | None:
    """Why the decision is not sent to `url` (None: it may be)."""
    try:
        parts = urlsplit(str(url))
        host = parts.hostname or ""
    except ValueError as exc:
        return f"webhook URL is not a URL: {exc}"
    if not host or parts.scheme not in ("https", "http"):
        return f"webhook URL must be https://HOST/..., got scheme {parts.scheme!r} and host {host!r}"
    if parts.scheme == "http" and not allow_http and not _is_loopback(host):
        return f"webhook URL must be https:// (got http://{host}; allow_http sends the decision unencrypted)"
    return None


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _total_backoff(tries: int) -> float:
    total, backoff = 0.0, BACKOFF_S
    for _ in range(tries - 1):
        total += backoff
        backoff = min(backoff * 2, BACKOFF_MAX_S)
    return total


def _post_once(url: str, body: bytes, timeout_s: float) -> tuple[int | None, str, tuple[str, bool] | None]:
    """One POST, strictly within timeout_s (a server that trickles bytes cannot hold it longer).

    Returns (status, body text, failure) where failure is (message, retryable) or None.
    """
    outcome: dict[str, Any] = {}

    def attempt() -> None:
        try:
            with requests.Session() as session:
                session.trust_env = False
                response = session.post(
                    url,
                    data=body,
                    headers={"Content-Type": "application/json", "User-Agent": USER_AGENT},
                    timeout=timeout_s,
                    # A redirect is not followed: the receiver is the configured one or nobody.
                    allow_redirects=False,
                )
                outcome["status"], outcome["text"] = response.status_code, response.text
        except requests.RequestException as exc:
            outcome["failure"] = (f"{type(exc).__name__}: {exc}", True)
        except Exception as exc:  # e.g. a malformed URL: never raise, never retry
            outcome["failure"] = (f"{type(exc).__name__}: {exc}", False)

    worker = threading.Thread(target=attempt, name="webhook-post", daemon=True)
    worker.start()
    worker.join(timeout_s + 0.25)
    if worker.is_alive():  # left to finish on its own (daemon): the decision does not wait
        return None, "", (f"no complete answer within {timeout_s:g} s", True)
    if "failure" in outcome:
        return None, "", outcome["failure"]
    return outcome.get("status"), outcome.get("text", ""), None
