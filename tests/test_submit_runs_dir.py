"""`mtp-canary submit --runs-dir`: resolved where the driver runs (the head), never on the
submitting machine. The job's entrypoint is run by a shell as Ray's job supervisor runs it
(`sh`, shell=True), with another $HOME and working directory than this process: a `python` on
PATH records the argv the driver's `rollout run` would get."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from rollout.commands import cli, submit
from tests.conftest import REPO

CONFIG = REPO / "configs" / "examples" / "local-progressive.yaml"


def driver_argv(entrypoint: list[str], home: Path, cwd: Path) -> list[str]:
    """The argv `python` gets when the driver's shell runs the entrypoint."""
    bin_dir = cwd / "bin"
    bin_dir.mkdir()
    record = cwd / "argv"
    fake = bin_dir / "python"
    fake.write_text(f"#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done > {shlex.quote(str(record))}\n")
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home)}
    subprocess.run(shlex.join(entrypoint), shell=True, cwd=cwd, env=env, check=True, timeout=30)
    return record.read_text().splitlines()


def test_a_relative_runs_dir_lands_under_the_drivers_home_not_the_submitters_cwd(tmp_path, monkeypatch):
    laptop = tmp_path / "laptop"
    laptop.mkdir()
    monkeypatch.chdir(laptop)
    head_home, job_dir = tmp_path / "head-home", tmp_path / "job"
    head_home.mkdir()
    job_dir.mkdir()
    argv = driver_argv(submit.run_entrypoint(CONFIG, REPO, Path("runs")), head_home, job_dir)
    assert argv[:3] == ["-m", "rollout", "run"]
    args = cli.build_parser().parse_args(argv[2:])
    assert args.config == "configs/examples/local-progressive.yaml"
    assert args.runs_dir == f"{head_home}/mtp-canary/runs"
    assert str(laptop) not in " ".join(argv)


def test_an_absolute_runs_dir_is_the_heads_path_as_given(tmp_path):
    argv = submit.run_entrypoint(CONFIG, REPO, Path("/mnt/runs"))
    args = cli.build_parser().parse_args(argv[3:])
    assert argv[:3] == ["python", "-m", "rollout"] and args.runs_dir == "/mnt/runs"


def test_a_tilde_runs_dir_is_the_drivers_home(tmp_path):
    head_home, job_dir = tmp_path / "head-home", tmp_path / "job"
    head_home.mkdir()
    job_dir.mkdir()
    argv = driver_argv(submit.run_entrypoint(CONFIG, REPO, Path("~/canary-runs")), head_home, job_dir)
    assert cli.build_parser().parse_args(argv[2:]).runs_dir == f"{head_home}/canary-runs"
