"""decision.json as one line of a job's log: written by a run under `submit`, read back by `submit`.

The Job SDK has no file download and the head's disk is not the submitter's, so a run told by
MTP_CANARY_DECISION_IN_LOG prints its decision document as one line before its final line:
`mtp-canary: decision_json=<base64 of zlib of the JSON>`. zlib's checksum catches a line cut or
mangled on the way; the line is bounded at DECISION_LINE_MAX characters; decision.json is already
redacted, so the log holds no secret the file did not.
"""

from __future__ import annotations

import base64
import json
import zlib
from pathlib import Path


DECISION_IN_LOG_ENV = "MTP_CANARY_DECISION_IN_LOG"


DECISION_PREFIX = "mtp-canary: decision_json="


DECISION_OMITTED = "mtp-canary: decision_json_omitted="


DECISION_LINE_MAX = 4 * 1024 * 1024  # characters of the line: far above a real decision.json (~20 kB -> ~8 kB)


def decision_log_line(run_dir: Path) -> str:
    """The line that carries run_dir/decision.json in the job's log (or says why it does not)."""
    try:
        raw = (Path(run_dir) / "decision.json").read_bytes()
    except OSError as exc:
        return f"{DECISION_OMITTED}cannot read {Path(run_dir) / 'decision.json'}: {exc.strerror or exc}"
    line = DECISION_PREFIX + base64.b64encode(zlib.compress(raw, 9)).decode("ascii")
    if len(line) > DECISION_LINE_MAX:
        return f"{DECISION_OMITTED}decision.json is {len(raw)} bytes, over the log line's bound ({DECISION_LINE_MAX})"
    return line


def decision_from_log(log: str) -> tuple[dict | None, str]:
    """(decision document, "") from the last decision line of a job's log, or (None, why not)."""
    found = None
    for line in log.splitlines():
        line = line.strip()
        if line.startswith((DECISION_PREFIX, DECISION_OMITTED)):
            found = line
    if found is None:
        return None, "the job's log has no decision.json line (did the run reach its end?)"
    if found.startswith(DECISION_OMITTED):
        return None, f"the run did not send decision.json: {found[len(DECISION_OMITTED):]}"
    try:
        doc = json.loads(zlib.decompress(base64.b64decode(found[len(DECISION_PREFIX):], validate=True)))
    except (ValueError, zlib.error) as exc:  # binascii.Error and JSONDecodeError are ValueErrors
        return None, f"the decision.json line in the job's log is unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(doc, dict) or "decision" not in doc or "run_id" not in doc:
        return None, "the decision.json line in the job's log holds no decision document"
    return doc, ""
