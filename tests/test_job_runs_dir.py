"""Artifacts under a Ray job: inside `ray job submit` (RAY_JOB_ID set) the working directory is the
job's temporary copy, so `run` and `resume` refuse a relative --runs-dir before anything starts or is
written (one line naming --runs-dir and why, exit 2); a URL or a network filesystem's mount is refused
anywhere (SQLite's WAL and atomic renames need a local filesystem)."""

from __future__ import annotations

import pytest

from rollout.commands.arguments import runs_dir_error
from rollout.commands.cli import main
from tests.conftest import REPO

CONFIG = str(REPO / "configs" / "local-cpu.yaml")


def test_the_rule():
    job = {"RAY_JOB_ID": "02000000"}
    assert "relative inside a Ray job" in runs_dir_error("runs", job)
    assert runs_dir_error("/mnt/shared/runs", job) is None
    assert runs_dir_error("runs", {}) is None  # outside a job the working directory is the user's own
    assert "is a URL" in runs_dir_error("s3://bucket/runs", {})


@pytest.mark.parametrize("command", [["run", CONFIG], ["resume", "20260101-000000-x-abcd"]])
def test_run_and_resume_refuse_a_relative_runs_dir_inside_a_ray_job(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_JOB_ID", "02000000")
    assert main([*command, "--runs-dir", "runs"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--runs-dir 'runs'" in err and "temporary" in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_url_runs_dir_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_JOB_ID", raising=False)
    assert main(["run", CONFIG, "--runs-dir", "gs://bucket/runs"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--runs-dir 'gs://bucket/runs' is a URL" in err and "mount" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["run", CONFIG], ["resume", "20260101-000000-x-abcd"]])
@pytest.mark.parametrize("kind", ["nfs4", "fuse.gcsfuse", "fuse.s3fs", "cifs"])
def test_a_runs_dir_on_a_network_filesystem_is_refused_before_anything_starts(command, kind, tmp_path, monkeypatch,
                                                                               capsys):
    mounts = tmp_path / "mounts"
    shared = tmp_path / "shared"
    shared.mkdir()
    # the machine's mount table with the runs directory's mount on a network filesystem (the longest match wins)
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\nserver:/export {shared} {kind} rw 0 0\n")
    monkeypatch.setattr("rollout.commands.arguments.MOUNTS", str(mounts))
    monkeypatch.delenv("RAY_JOB_ID", raising=False)
    assert main([*command, "--runs-dir", str(shared / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"is on a network filesystem ({kind})" in err and "--runs-dir" in err
    assert list(shared.iterdir()) == []  # nothing written
    assert runs_dir_error(str(tmp_path / "elsewhere" / "runs"), {}) is None  # on / (ext4)
