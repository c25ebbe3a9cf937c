"""The bad-config corpus (tests/data/bad-configs/): `run` refuses every malformed config with
one line on stderr naming the cause or the field, exit 2, before anything starts or is written.

Each file is configs/local-cpu.yaml with one thing wrong (or bytes that are no text at all);
EXPECTED.yaml maps it to a substring its one line must contain. Every file goes through the
CLI in-process (`rollout.commands.cli.main`, the path `python -m rollout run` takes; ~1-15 ms each);
the hostile ones also as a real `python -m rollout run` subprocess (~1.3 s of CPU each, mostly
imports), which also shows no Ray started and nothing written. The target is 2 s per config;
the 10 s bound here is loose for a slow, shared machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rollout.commands import cli
from rollout.commands import run as run_command
from rollout.config import MAX_CONFIG_BYTES
from tests.conftest import REPO

CORPUS = REPO / "tests" / "data" / "bad-configs"
EXPECTED: dict[str, str] = yaml.safe_load((CORPUS / "EXPECTED.yaml").read_text())
# what a hostile file can do to a loader that is not hardened: as real processes
SUBPROCESS_CASES = ("binary.yaml", "alias-bomb.yaml", "python-tag.yaml", "duplicate-key.yaml", "extra-args-host-prefix.yaml")
# A hang guard, not a speed figure: a loader that expanded an alias bomb or followed a recursive
# alias would run for minutes. A refusal takes ~1 ms in-process and ~1.2 s as a process here
# (mostly importing scipy); at a quarter of this machine's speed, on cores shared with a second
# test worker, one subprocess took 10.5 s.
WALL_BOUND_S = 60.0


def test_the_corpus_and_its_expectations_match():
    files = {p.name for p in CORPUS.iterdir() if p.name != "EXPECTED.yaml"}
    assert files == set(EXPECTED), (sorted(files - set(EXPECTED)), sorted(set(EXPECTED) - files))
    assert len(files) >= 30
    assert set(SUBPROCESS_CASES) <= files


def run_in_process(path: Path, tmp_path: Path, capsys, monkeypatch) -> tuple[int, str, str, float]:
    """`mtp-canary run PATH` through cli.main, failing the test if it would start a run."""
    monkeypatch.setattr(run_command, "start_run", lambda *a: pytest.fail(f"{path.name} was accepted"))
    runs = tmp_path / "runs"
    t0 = time.perf_counter()
    code = cli.main(["run", str(path), "--runs-dir", str(runs), "--ray-address", "local"])
    elapsed = time.perf_counter() - t0
    out = capsys.readouterr()
    assert not runs.exists(), "the runs directory was created"
    return code, out.out, out.err, elapsed


def assert_one_line_naming(stderr: str, expected: str) -> None:
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"not exactly one line: {stderr!r}"
    assert expected in lines[0], f"{expected!r} not in {lines[0]!r}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_bad_config_is_one_line_and_exit_2(name, tmp_path, capsys, monkeypatch):
    code, stdout, stderr, elapsed = run_in_process(CORPUS / name, tmp_path, capsys, monkeypatch)
    assert code == 2
    assert stdout == ""
    assert_one_line_naming(stderr, EXPECTED[name])
    assert elapsed < WALL_BOUND_S


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_a_hostile_config_is_refused_by_the_real_command(name, tmp_path):
    runs = tmp_path / "runs"
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rollout", "run", str(CORPUS / name), "--runs-dir", str(runs), "--ray-address", "local"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    elapsed = time.monotonic() - t0
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert_one_line_naming(done.stderr, EXPECTED[name])
    assert elapsed < WALL_BOUND_S, f"{elapsed:.1f} s"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "something was written (runs dir, python-tag's file)"


def test_a_huge_file_is_refused_without_being_parsed(tmp_path, capsys, monkeypatch):
    huge = tmp_path / "huge.yaml"
    base = (REPO / "configs" / "local-cpu.yaml").read_text()
    huge.write_text(base + "# " + "x" * MAX_CONFIG_BYTES + "\n")
    code, _, stderr, elapsed = run_in_process(huge, tmp_path, capsys, monkeypatch)
    assert code == 2
    assert_one_line_naming(stderr, f"larger than {MAX_CONFIG_BYTES // 1024} KiB")
    assert elapsed < WALL_BOUND_S


def test_a_config_that_is_a_directory_or_missing_is_one_line(tmp_path, capsys, monkeypatch):
    for path, cause in ((tmp_path, "cannot read"), (tmp_path / "nope.yaml", "cannot read")):
        code, _, stderr, _ = run_in_process(path, tmp_path, capsys, monkeypatch)
        assert code == 2
        assert_one_line_naming(stderr, cause)


def test_an_override_out_of_range_is_one_line_too(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_command, "start_run", lambda *a: pytest.fail("accepted"))
    code = cli.main(["run", str(REPO / "configs" / "local-cpu.yaml"), "--runs-dir", str(tmp_path / "runs"),
                     "--window-s", "0"])
    assert code == 2
    assert_one_line_naming(capsys.readouterr().err, "experiment.window_s")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("share", ["0", "1.5", "a quarter", "nan"])
def test_a_bad_declared_cpu_share_is_one_line_naming_it(share, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MTP_CANARY_CPU_SHARE", share)
    code, stdout, stderr, _ = run_in_process(REPO / "configs" / "local-cpu.yaml", tmp_path, capsys, monkeypatch)
    assert code == 2 and stdout == ""
    assert_one_line_naming(stderr, "MTP_CANARY_CPU_SHARE")
    # make-model --auto-size reads it too
    assert cli.main(["make-model", str(tmp_path / "model"), "--auto-size"]) == 2
    assert_one_line_naming(capsys.readouterr().err, "MTP_CANARY_CPU_SHARE")
    assert not (tmp_path / "model").exists()
