"""The cause of a failed server, read from its log: the line a person would look for first.

A failed vLLM start leaves hundreds of lines after the cause (the engine core's traceback, then
the API server's "Engine core initialization failed" and its own traceback, shutdown noise), so
the log's tail often shows only the consequence. `failure_cause` picks, in this order:
  1. an out-of-memory line (CUDA OOM, torch.OutOfMemoryError, "No available memory for the cache
     blocks", the kernel's "Killed") — the fix differs from any other failure;
  2. the exception line that ends the FIRST traceback (the root, not the re-raise);
  3. a command-line usage error (argparse's "PROG: error: ...": an engine flag vLLM does not know);
  4. the first ERROR line vLLM logged;
vLLM's prefixes ("(EngineCore pid=12) ", "ERROR 12-02 01:02:03 [core.py:700] ") are stripped.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["failure_cause"]

_PROCESS_PREFIX = re.compile(r"^\((?:[A-Za-z_:]+ )?(?:pid|PID)=\d+\)\s*")
_LEVEL_PREFIX = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\]\s*")
_OOM = re.compile(
    r"CUDA out of memory|OutOfMemoryError|out of memory|No available memory for the cache blocks|^Killed$",
    re.IGNORECASE,
)
_USAGE_ERROR = re.compile(r"^\S+: error: .+")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure)\b(?::.*)?$")
MAX_CHARS = 300


def _clean(line: str) -> str:
    line = _PROCESS_PREFIX.sub("", line.rstrip())
    return _LEVEL_PREFIX.sub("", line)


def failure_cause(lines: Sequence[str]) -> str | None:
    """The most telling line of a failed server's log (see the module docstring), or None."""
    cleaned = [_clean(line) for line in lines]
    for line in cleaned:
        if _OOM.search(line.strip()):
            return line.strip()[:MAX_CHARS]
    in_traceback = False
    for line in cleaned:
        if line.startswith("Traceback (most recent call last):"):
            in_traceback = True
        elif in_traceback and line and not line[0].isspace() and _EXCEPTION.match(line):
            return line[:MAX_CHARS]
    for line in cleaned:
        if _USAGE_ERROR.match(line):
            return line[:MAX_CHARS]
    for raw, line in zip(lines, cleaned):
        if " ERROR " in f" {raw} " or raw.lstrip().startswith("ERROR"):
            if line.strip():
                return line.strip()[:MAX_CHARS]
    return None
