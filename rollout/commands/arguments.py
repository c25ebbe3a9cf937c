"""What every command checks of its arguments before it starts anything, and one command parsed alone.

Run ids, runs directories (a URL, a network filesystem, a relative path inside a Ray job are
refused), the environment a run reads later, the run a RUN_ID names in the store. Each refusal
is one line on stderr naming the argument, and exit 2 (EXIT_USAGE).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rollout.run.run_id import run_id_error

EXIT_USAGE = 2


def parse_alone(register: Callable[[argparse._SubParsersAction], argparse.ArgumentParser],
                argv: Sequence[str] | None) -> argparse.Namespace:
    """One command's arguments, parsed as `mtp-canary NAME ARGV...` would parse them (python -m, tests)."""
    parser = argparse.ArgumentParser(prog="mtp-canary")
    name = register(parser.add_subparsers(dest="command", required=True)).prog.split()[-1]
    return parser.parse_args([name, *(sys.argv[1:] if argv is None else argv)])


def refuse_run_id(run_id: str | None, what: str, command: str) -> bool:
    """True (after one line on stderr) when `run_id` is given and is no run id."""
    error = None if run_id is None else run_id_error(run_id, what)
    if error:
        print(f"mtp-canary{f' {command}' if command else ''}: {error}", file=sys.stderr)
    return error is not None


# Filesystems a runs directory may not be on: SQLite's WAL needs shared memory and locks that a network
# filesystem does not give (the SQLite docs: "WAL does not work over a network filesystem"), and a rename
# there is not atomic (gcsfuse and s3fs copy, then delete): decision.json could be read half written.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "9p", "ceph", "glusterfs", "lustre", "gpfs", "beegfs",
    "fuse.gcsfuse", "fuse.s3fs", "fuse.goofys", "fuse.mountpoint-s3", "fuse.rclone", "fuse.sshfs", "fuse.blobfuse",
    "fuse.blobfuse2", "fuse.glusterfs", "fuse.cephfs", "fuse.juicefs",
})


MOUNTS = "/proc/mounts"


def filesystem_type(path: Path, mounts: str | None = None) -> str | None:
    """The type of the filesystem `path` (or, not yet created, its nearest existing parent) is on, read
    from the mount table (the longest mount point above it); None when the table cannot be read."""
    target = Path(os.path.abspath(path))
    while not target.exists() and target != target.parent:
        target = target.parent
    target = target.resolve()
    try:
        lines = Path(mounts or MOUNTS).read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (target == Path(point) or Path(point) in target.parents) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def runs_dir_error(runs_dir: str, environ=os.environ) -> str | None:
    """Why a run may not write into `runs_dir`, in one line naming --runs-dir, or None.

    Inside a Ray job (RAY_JOB_ID) the working directory is the job's temporary copy of
    --working-dir, removed with the job (a KubeRay RayJob removes the whole cluster): a relative
    runs dir would lose decision.json, the reports and history.db. A URL is refused anywhere, and so
    is a mount of a network filesystem (NFS, SMB, gcsfuse, s3fs: NETWORK_FILESYSTEMS): the history is
    SQLite in WAL mode and the files are replaced by renames, neither of which holds there. Persistent
    storage for a run is a block volume (a PVC of a block storage class, the node's disk); copy the
    run directory to shared storage after the run."""
    if "://" in runs_dir:
        return (f"--runs-dir {runs_dir!r} is a URL: runs are written to a local filesystem (SQLite history); "
                "give a local path (not a mount of the remote store) and copy the run directory out after the run")
    if environ.get("RAY_JOB_ID") and not Path(runs_dir).is_absolute():
        return (f"--runs-dir {runs_dir!r} is relative inside a Ray job (RAY_JOB_ID is set): the job's working "
                "directory is temporary and goes with the job; give an absolute path on persistent storage")
    kind = filesystem_type(Path(runs_dir))
    if kind in NETWORK_FILESYSTEMS:
        return (f"--runs-dir {runs_dir!r} is on a network filesystem ({kind}): SQLite's WAL and atomic renames "
                "need a local one (a block volume, the node's disk); copy the run directory out after the run")
    return None


def refuse_runs_dir(runs_dir: str, command: str) -> bool:
    error = runs_dir_error(runs_dir)
    if error:
        print(f"mtp-canary {command}: {error}", file=sys.stderr)
    return error is not None


def refuse_bad_environment(command: str) -> bool:
    """True (after one line on stderr) when an environment variable the run reads later is malformed:
    MTP_CANARY_CPU_SHARE, which the tiny model's sizing reads once the run has started."""
    from tinymodel.sizing import declared_cpu_share

    try:
        declared_cpu_share()
    except ValueError as exc:
        print(f"mtp-canary {command}: bad environment: {exc}", file=sys.stderr)
        return True
    return False


def open_store(runs_dir: str, command: str):
    """The runs directory's history, or None (with one line on stderr) when there is none."""
    from rollout.run.store import RunStore

    db = Path(runs_dir) / "history.db"
    if not db.exists():
        print(f"mtp-canary {command}: no runs in {runs_dir} (no history.db)", file=sys.stderr)
        return None
    return RunStore(db)


def find_run(runs_dir: str, run_id: str, command: str):
    """(store, run row) of a run, or None after one line on stderr saying what is missing."""
    store = open_store(runs_dir, command)
    if store is None:
        return None
    run = store.run(run_id)
    if run is None:
        print(f"mtp-canary {command}: no run {run_id!r} in {runs_dir}", file=sys.stderr)
        return None
    return store, run


def local_time(epoch: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch)) if epoch else "-"
