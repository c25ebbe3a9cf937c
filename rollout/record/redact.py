"""Secrets out of every artifact: what decision.json, report.md, the webhook body, stored
configs and log lines may show of an engine, a config or a URL.

Pure functions over plain data (dicts as `model_dump(mode="json")` makes them); nothing here
touches what launches a server: a replica always gets the real env and args, only what is
written or printed goes through here. Every function is idempotent (redacting twice is
redacting once) and a no-op on data without secrets (a recorded decision.json round-trips).

- `redact_env`: engine `env` values -> REDACTED (the keys stay: they say what was set);
- `redact_args`: the value of every secret-bearing flag in `extra_args` (cluster.engine_spec
  says which: --api-key, --hf-token, any flag with a token/key/secret/password/credential word);
- `redact_url`: a webhook URL -> scheme and host only (its path or query often is the token);
- `redact_hook`: a weight_hook's command -> its program, the arguments REDACTED;
- `redact_config` / `redact_document`: every `engine` mapping and `webhook_url` at any depth of
  a config dict or a decision document (arms of any name, lists of arms, promoted.yaml);
- `known_secrets` and `scrub`: the secret strings of a config, replaced wherever they appear in
  free text (an error line, an engine warning, a timeline reason) as a last line of defence.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from cluster.engine_spec import REDACTED, is_secret_flag, printable_args

__all__ = [
    "REDACTED",
    "known_secrets",
    "redact_args",
    "redact_config",
    "redact_document",
    "redact_engine",
    "redact_env",
    "redact_hook",
    "redact_url",
    "scrub",
]

# Shorter "secrets" are left in free text: scrubbing "1" or "on" would mangle every line
# (the structured fields are redacted whatever their length).
MIN_SCRUBBED_LENGTH = 4


def redact_env(env: Mapping[str, Any]) -> dict[str, str]:
    """Keys kept (they say what was set), every value REDACTED."""
    return {str(key): REDACTED for key in env}


def redact_args(args: Iterable[str]) -> list[str]:
    """extra_args with the value of every secret-bearing flag REDACTED (`--api-key X`, `--api-key=X`)."""
    return printable_args([str(arg) for arg in args])


def redact_url(url: str | None) -> str | None:
    """`https://hooks.example.com/<redacted>`: scheme and host (and port) only; None stays None."""
    if url is None:
        return None
    try:
        parts = urlsplit(str(url))
        host, port = parts.hostname, parts.port
    except ValueError:  # an unparsable port or bracket: nothing of it is shown
        return REDACTED
    if not parts.scheme or not host:
        return REDACTED
    netloc = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{netloc}{f':{port}' if port else ''}/{REDACTED}"


def redact_engine(engine: Mapping[str, Any]) -> dict[str, Any]:
    """An EngineSpec dump with its env values and secret flag values REDACTED."""
    out = dict(engine)
    if isinstance(out.get("env"), Mapping):
        out["env"] = redact_env(out["env"])
    if isinstance(out.get("extra_args"), list):
        out["extra_args"] = redact_args(out["extra_args"])
    return out


def redact_hook(hook: Mapping[str, Any]) -> dict[str, Any]:
    """A weight_hook as it may be shown: its program, every argument REDACTED (an argv may carry a
    bearer token or a kubeconfig path; what the hook does is the operator's to know, not the record's)."""
    out = dict(hook)
    command = out.get("command")
    if isinstance(command, list) and command:
        out["command"] = [str(command[0])] + [REDACTED] * (len(command) - 1)
    return out


def _redact_tree(value: Any) -> Any:
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            if key == "engine" and isinstance(item, Mapping):
                out[key] = redact_engine(_redact_tree(item))
            elif key == "webhook_url" and (item is None or isinstance(item, str)):
                out[key] = redact_url(item)
            elif key == "weight_hook" and isinstance(item, Mapping):
                out[key] = redact_hook(item)
            else:
                out[key] = _redact_tree(item)
        return out
    if isinstance(value, list | tuple):
        return [_redact_tree(item) for item in value]
    return value


def redact_config(data: Mapping[str, Any]) -> dict[str, Any]:
    """A config dict (RolloutConfig.model_dump(mode="json"), an arm, promoted.yaml) as it may be
    stored or shown: every `engine` at any depth and `webhook_url` redacted, the rest unchanged."""
    return _redact_tree(data)


def known_secrets(config: Mapping[str, Any]) -> set[str]:
    """The secret strings of a config dict: values of secret-named env keys (HF_TOKEN), values of
    secret flags in extra_args, and the parts of a webhook URL past its host."""
    found: set[str] = set()

    def visit(value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                if key == "engine" and isinstance(item, Mapping):
                    found.update(_engine_secrets(item))
                elif key == "webhook_url" and isinstance(item, str):
                    found.update(_url_secrets(item))
                visit(item)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)

    visit(config)
    return {s for s in found if len(s) >= MIN_SCRUBBED_LENGTH and s != REDACTED}


def _engine_secrets(engine: Mapping[str, Any]) -> set[str]:
    found: set[str] = set()
    env = engine.get("env")
    if isinstance(env, Mapping):
        found |= {str(v) for k, v in env.items() if is_secret_flag("--" + str(k))}
    args = engine.get("extra_args")
    if isinstance(args, list):
        args = [str(a) for a in args]
        for given, shown in zip(args, printable_args(args)):
            if given != shown:
                found.add(given.split("=", 1)[1] if shown.endswith("=" + REDACTED) else given)
    return found


def _url_secrets(url: str) -> set[str]:
    try:
        parts = urlsplit(url)
    except ValueError:
        return {url}
    # the whole URL, and each part past the host as it would appear in an error line
    found = {url, parts.path.strip("/"), parts.query, parts.fragment, parts.username or "", parts.password or ""}
    return {p for p in found if p and p != REDACTED}


def scrub(value: Any, secrets: Iterable[str]) -> Any:
    """`value` (any JSON-like data) with every occurrence of each secret in any string REDACTED."""
    ordered = sorted({s for s in secrets if s and len(s) >= MIN_SCRUBBED_LENGTH}, key=len, reverse=True)
    if not ordered:
        return value

    def clean(item: Any) -> Any:
        if isinstance(item, str):
            for secret in ordered:
                if secret in item:
                    item = item.replace(secret, REDACTED)
            return item
        if isinstance(item, Mapping):
            return {clean(k) if isinstance(k, str) else k: clean(v) for k, v in item.items()}
        if isinstance(item, list | tuple):
            return [clean(v) for v in item]
        return item

    return clean(value)


def redact_document(doc: Mapping[str, Any], secrets: Iterable[str] = ()) -> dict[str, Any]:
    """A decision document (or any run record) as it may be written or sent: the structure
    redacted like a config, then `secrets` scrubbed from every string."""
    return scrub(redact_config(doc), secrets)
