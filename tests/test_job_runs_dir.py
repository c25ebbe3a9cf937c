"""Artifacts under a Ray job: inside `ray job submit` (RAY_JOB_ID set) the working directory is the
job's temporary copy, so `run` and `resume` refuse a relative --runs-dir before anything starts or is
written (one line naming --runs-dir and why, exit 2); a URL is refused anywhere (runs are written to a
filesystem: a remote store is given as its mount's absolute path)."""

from __future__ import annotations

import pytest

from rollout.cli import main, runs_dir_error
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
