"""Files a pipeline reads (decision.json, report.md, promoted.yaml): whole or absent, and on disk.

A reader polling for a file never sees half of it (write a temporary file beside it, then
rename), and a machine that loses power right after the run does not come back with an
empty decision.json (fsync the file before the rename and the directory after it).
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step, durably."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
