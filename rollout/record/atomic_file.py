"""Files a pipeline reads (decision.json, report.md, promoted.yaml): whole or absent, and on disk.

A reader polling for a file never sees half of it (write a temporary file beside it, then
rename), and a machine that loses power right after the run does not come back with an
empty decision.json (fsync the file before the rename and the directory after it). A write
that fails (a full disk) leaves no temporary file behind.

`stage` splits the two steps: the controller writes decision.json's content first (where a
full disk shows), commits the run's end to the store, and only then renames the file in.
"""

from __future__ import annotations

import os
from pathlib import Path


class StagedFile:
    """A file's new content, written and synced beside it; `commit()` puts it in place, `discard()` drops it."""

    def __init__(self, path: Path, tmp: Path) -> None:
        self.path = path
        self.tmp = tmp

    def commit(self) -> None:
        try:
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def discard(self) -> None:
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def stage(path: Path, text: str) -> StagedFile:
    """Write `text` to a temporary file beside `path` and sync it; `path` itself is untouched.
    On any failure (OSError ENOSPC) the temporary file is removed and the error raised."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        StagedFile(path, tmp).discard()
        raise
    return StagedFile(path, tmp)


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step, durably."""
    stage(path, text).commit()


def copy_atomically(source: Path, path: Path) -> None:
    """Copy `source` to `path` in one step (a pipeline's --decision-out, --junit): the reader sees the
    old file or the whole new one, never a part."""
    write_atomically(path, Path(source).read_text(encoding="utf-8"))
