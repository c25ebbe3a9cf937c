"""`mtp-canary submit`: a real local Ray head with its job server, real jobs, the run's exit codes back.

The jobs are `mtp-canary judge` of recorded runs (no vLLM): the submit path, the log stream and
the exit-code mapping are the same as for `run`, whose final line is checked on its own.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rollout.record import log_line
from rollout.commands import submit
from rollout.commands.submit import Outcome, final_line, outcome_of, submit_entrypoint

REPO = Path(__file__).resolve().parent.parent
REJUDGE = "tests/data/rejudge/promote"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _head(**auth_env: str):
    """A Ray head with the dashboard's job server on 127.0.0.1, its own temp dir; its URL."""
    port, dash = _free_port(), _free_port()
    temp = Path("/tmp") / f"ray-submit-{port}"
    bindir = str(Path(sys.executable).parent)
    # the job's `python` is this venv's: the head's PATH is what its drivers see
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PATH": f"{bindir}:{os.environ.get('PATH', '')}", **auth_env}
    env.pop("RAY_ADDRESS", None)
    try:
        subprocess.run([str(Path(bindir) / "ray"), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                        "--num-cpus=2", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                        f"--dashboard-port={dash}", f"--temp-dir={temp}", "--disable-usage-stats",
                        # the agent's HTTP port is fixed (52365) by default: a second head on the machine
                        # (the other fixture's, another session's) would leave this one with no job agent
                        f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
                        f"--metrics-export-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}"],
                       check=True, capture_output=True, timeout=180, env=env)
        address = f"http://127.0.0.1:{dash}"
        deadline = time.monotonic() + 90
        while True:  # the job server comes up after `ray start` returns (401 under token auth: it is up)
            try:
                with urllib.request.urlopen(f"{address}/api/version", timeout=5):
                    break
            except urllib.error.HTTPError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        yield address
    finally:
        from tests.conftest import stop_ray_cluster

        stop_ray_cluster(temp)


@pytest.fixture(scope="module")
def ray_head():
    """Token auth off (RAY_AUTH_MODE=disabled), as a test cluster on one machine."""
    with _head(RAY_AUTH_MODE="disabled") as address:
        yield address


def test_token_auth_cluster(monkeypatch, tmp_path):
    """Ray 2.60's token auth: with the token in RAY_AUTH_TOKEN (and no RAY_AUTH_MODE here) the job runs;
    without it, one line naming where the token goes and exit 1, nothing submitted."""
    token = "mtp-canary-test-token-" + "0123456789abcdef" * 2
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token of the machine's user
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    with _head(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token) as address:
        monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
        # a harmless entrypoint: were the token not required, nothing heavy would start
        with pytest.raises(submit.SubmitError) as refused:
            submit_entrypoint(address, ["python", "-c", "pass"], None, out=io.StringIO())
        assert "RAY_AUTH_TOKEN" in str(refused.value) and "~/.ray/auth_token" in str(refused.value)
        monkeypatch.setenv("RAY_AUTH_TOKEN", token)
        done = submit_entrypoint(address, ["python", "-c", "raise SystemExit(4)"], None, out=io.StringIO())
        assert (done.status, done.exit_code) == ("FAILED", 4)


def test_final_line_and_outcome_rules():
    log = "noise\nmtp-canary: rollback (exit 3) -> r/x/decision.json\nmtp-canary: exit_code=3 decision=rollback run_dir=/r/x\n"
    assert final_line(log) == (3, "rollback", "/r/x")
    assert outcome_of("j", "FAILED", 3, "", log) == Outcome("j", "FAILED", 3, decision="rollback", run_dir="/r/x")
    assert outcome_of("j", "FAILED", 4, "", "no line").exit_code == 4
    stopped = outcome_of("j", "STOPPED", None, "Job was intentionally stopped.", "no line")
    assert stopped.exit_code == 1 and "STOPPED" in stopped.reason
    assert outcome_of("j", "FAILED", 137, "killed", "").exit_code == 1


def test_entrypoint_is_a_run_the_cli_accepts(tmp_path):
    from rollout.commands import cli

    argv = submit.run_entrypoint(REPO / "configs/examples/local-progressive.yaml", REPO, Path("/srv/runs"))
    assert argv[:3] == ["python", "-m", "rollout"]
    args = cli.build_parser().parse_args(argv[3:])
    assert args.command == "run" and args.config == "configs/examples/local-progressive.yaml"
    assert Path(args.runs_dir).is_absolute()


def test_config_outside_the_working_dir_is_exit_2(tmp_path, capsys):
    code = submit.main([str(REPO / "configs/examples/local-progressive.yaml"), "--working-dir", str(tmp_path),
                        "--address", f"http://127.0.0.1:{_free_port()}"])
    assert code == 2 and "outside --working-dir" in capsys.readouterr().err


def test_run_prints_the_line_submit_reads(capsys):
    """The contract between `rollout run`'s last line and `submit`: the run's code, decision and directory."""
    import signal
    from types import SimpleNamespace

    from rollout.commands import run as run_command
    from rollout.record.result import Decision

    result = SimpleNamespace(decision=Decision.INCONCLUSIVE, error=None, exit_code=4, run_dir=Path("/runs/r 1"))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert run_command.drive(SimpleNamespace(run=lambda: result)) == 4
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert final_line(capsys.readouterr().out) == (4, "inconclusive", "/runs/r 1")


def test_bad_config_is_exit_2_and_nothing_submitted(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nexperiment: {window_s: -1}\n")
    # an address nothing listens on: reaching it would be a different error (exit 1)
    assert submit.main([str(bad), "--address", f"http://127.0.0.1:{_free_port()}", "--working-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mtp-canary submit: bad config:")


def test_unreachable_job_server_is_exit_1(capsys):
    # a port this test holds bound and never listens on: connections are refused, and no process
    # another test starts meanwhile (a Ray head picking free ports) can take it
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        code = submit.main(["configs/examples/local-progressive.yaml", "--address",
                            f"http://127.0.0.1:{held.getsockname()[1]}", "--working-dir", str(REPO)])
    assert code == 1
    assert "cannot reach the Ray job server" in capsys.readouterr().err


@pytest.mark.parametrize("port", [52401, 40300, 8265])
def test_a_refused_connection_is_never_read_as_a_refused_token_whatever_the_port(port):
    address = f"http://127.0.0.1:{port}"
    refused = ConnectionError(f"Failed to connect to Ray at address: {address}. HTTPConnectionPool(host='127.0.0.1', "
                              f"port={port}): Max retries exceeded (Connection refused)")
    assert submit._connect_error(address, refused, "a-token").startswith("cannot reach the Ray job server")
    denied = RuntimeError(f"Request failed with status code 401: Unauthorized (at {address})")
    assert "refused the token given" in submit._connect_error(address, denied, "a-token")


def test_missing_token_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert submit.ray_token() is None
    message = submit._connect_error("http://h:8265", RuntimeError("Authentication required: Unauthorized"), None)
    assert "RAY_AUTH_TOKEN" in message and "~/.ray/auth_token" in message
    (tmp_path / "tok").write_text("secret\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "tok"))
    assert submit.ray_token() == "secret"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "fromenv")
    assert submit.ray_token() == "fromenv"


def _records(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A run config and two records files whose judgement is known: a faster canary, a slower one."""
    import numpy as np

    from tests.test_rejudge import run_config, write_records

    config = run_config(tmp_path, ["tpot_p50_improvement", "sample_ratio"])
    rng = np.random.default_rng(1)
    n = 640  # the demo config's warm-up (one look) and its 600 planned per arm
    faster = write_records(tmp_path / "faster.jsonl", {"baseline": rng.lognormal(np.log(0.03), 0.2, n),
                                                       "canary": rng.lognormal(np.log(0.021), 0.2, n)},
                           ttft_by_arm={arm: rng.lognormal(np.log(0.05), 0.3, n) for arm in ("baseline", "canary")})
    slower = write_records(tmp_path / "slower.jsonl", {"baseline": rng.lognormal(np.log(0.03), 0.2, n),
                                                       "canary": rng.lognormal(np.log(0.06), 0.2, n)})
    return config, faster, slower


def test_submitted_job_exit_codes_come_back(ray_head, tmp_path):
    """Real jobs on the local head (the records under tmp_path are read by path: same machine)."""
    config, faster, slower = _records(tmp_path)
    judge = ["python", "-m", "rollout", "judge", "--config", str(config)]
    out = io.StringIO()
    promoted = submit_entrypoint(ray_head, judge + [str(faster)], REPO, out=out)
    assert (promoted.status, promoted.exit_code) == ("SUCCEEDED", 0), out.getvalue()[-3000:]
    assert "PROMOTE" in out.getvalue()  # the job's log reached stdout

    out = io.StringIO()
    rolled = submit_entrypoint(ray_head, judge + [str(slower)], REPO, out=out)
    assert (rolled.status, rolled.exit_code) == ("FAILED", 3), out.getvalue()[-3000:]

    # the recorded run from the uploaded working dir: not enough evidence for the objective -> 4
    undecided = submit_entrypoint(ray_head, ["python", "-m", "rollout", "judge", REJUDGE], REPO, out=io.StringIO())
    assert (undecided.status, undecided.exit_code) == ("FAILED", 4)

    bad = submit_entrypoint(ray_head, judge + ["no/such/records"], REPO, out=io.StringIO())
    assert (bad.status, bad.exit_code) == ("FAILED", 2)

    crashed = submit_entrypoint(ray_head, ["python", "-c", "import os; os._exit(7)"], REPO, out=io.StringIO())
    assert crashed.exit_code == 1 and "driver exit 7" in crashed.reason

    # the run's final line, when the log has it, is the code (and names the run directory)
    line = "mtp-canary: exit_code=3 decision=rollback run_dir=/runs/x"
    printed = submit_entrypoint(ray_head, ["python", "-c", f"print({line!r}); raise SystemExit(3)"], None,
                                out=io.StringIO())
    assert (printed.exit_code, printed.decision, printed.run_dir) == (3, "rollback", "/runs/x")


def test_no_wait_returns_the_job_id(ray_head):
    job_id = submit_entrypoint(ray_head, ["python", "-c", "print('hi')"], None, wait=False)
    assert isinstance(job_id, str) and job_id


# -- decision.json back to the submitter ------------------------------------------------
RECORDED = REPO / "tests/data/recorded_runs"


def test_decision_travels_in_one_log_line_and_a_mangled_one_is_refused(tmp_path):
    import json

    line = log_line.decision_log_line(RECORDED / "bad")
    assert line.startswith(log_line.DECISION_PREFIX) and "\n" not in line
    doc, why = log_line.decision_from_log(f"noise\n{line}\nmtp-canary: exit_code=3 decision=rollback run_dir=/r/bad\n")
    assert why == "" and doc == json.loads((RECORDED / "bad" / "decision.json").read_text())
    # a line cut short (a truncated log) or with one character changed: zlib's checksum or base64 refuses it
    for broken in (line[:-40], line[:-10] + ("A" if line[-10] != "A" else "B") + line[-9:]):
        doc, why = log_line.decision_from_log(broken)
        assert doc is None and "unreadable" in why
    assert log_line.decision_from_log("no line at all")[0] is None
    missing = log_line.decision_log_line(tmp_path / "none")
    doc, why = log_line.decision_from_log(missing)
    assert doc is None and "did not send decision.json" in why and "cannot read" in why


def test_the_streamed_log_shows_a_note_not_the_base64():
    line = log_line.decision_log_line(RECORDED / "bad")
    assert submit._shown(line + "\n").startswith("mtp-canary submit: decision.json in the log (")
    assert submit._shown("[12:00:00] look 3\n") == "[12:00:00] look 3\n"


def _outcome(code: int, doc: dict | None, run_dir: str | None = None, problem: str = "") -> Outcome:
    return Outcome("job-1", "FAILED" if code else "SUCCEEDED", code, run_dir=run_dir, decision_doc=doc,
                   decision_problem=problem)


def test_a_decided_run_without_its_decision_is_exit_1_never_0(tmp_path, capsys):
    for code in submit.DECIDED_CODES:
        assert submit.fetch_decision(_outcome(code, None, problem="no line"), tmp_path, None, None) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all("no decision.json from job job-1: no line" in e for e in err)
    # an infrastructure error or a config the cluster refused: no decision expected, the run's code stands
    assert submit.fetch_decision(_outcome(2, None), tmp_path, None, None) == 2
    assert submit.fetch_decision(_outcome(1, None), tmp_path, None, None) == 1
    assert not any(tmp_path.iterdir())


def test_the_fetched_decision_is_written_with_junit_and_metrics(tmp_path, monkeypatch):
    import json
    import xml.etree.ElementTree as ET

    doc = json.loads((RECORDED / "bad" / "decision.json").read_text())
    monkeypatch.chdir(tmp_path)
    junit, out = tmp_path / "ci-junit.xml", tmp_path / "ci-decision.json"
    assert submit.fetch_decision(_outcome(3, doc, run_dir="/head/runs/bad"), None, out, junit) == 3
    fetched = tmp_path / "runs" / "bad"  # the default: ./runs/<run_id>/
    assert json.loads((fetched / "decision.json").read_text()) == doc == json.loads(out.read_text())
    failures = ET.parse(junit).getroot().iter("failure")
    failed = {g["name"] for g in doc["gates"] if g["verdict"] == "fail"}
    assert len(list(failures)) == len(failed) + 1  # one per failed gate, and the decision case
    assert (fetched / "junit.xml").read_text() == junit.read_text()
    assert "mtp_canary_decision" in (fetched / "metrics.prom").read_text()
    # a document of another run than the one the last line names is refused
    assert submit.fetch_decision(_outcome(3, doc, run_dir="/head/runs/other"), tmp_path / "x", None, None) == 1
    assert not (tmp_path / "x").exists()


def test_a_log_whose_decision_disagrees_with_its_last_line_or_names_no_run_id_writes_nothing(tmp_path, monkeypatch,
                                                                                              capsys):
    import json

    doc = json.loads((RECORDED / "bad" / "decision.json").read_text())
    monkeypatch.chdir(tmp_path)
    said_promote = Outcome("job-1", "FAILED", 3, decision="promote", run_dir="/head/runs/bad", decision_doc=doc)
    assert submit.fetch_decision(said_promote, None, None, None) == 1
    assert "says 'rollback', the run's last line says 'promote'" in capsys.readouterr().err
    # the run id names the directory written here: one that climbs out of ./runs is refused
    escaping = {**doc, "run_id": "../../escaped"}
    assert submit.fetch_decision(_outcome(3, escaping), None, None, None) == 1
    assert "is not a run id" in capsys.readouterr().err
    assert not any(tmp_path.rglob("decision.json")) and not (tmp_path.parent / "escaped").exists()


def test_an_output_in_a_missing_directory_is_exit_2_before_submitting(tmp_path, capsys):
    code = submit.main(["configs/examples/local-progressive.yaml", "--working-dir", str(REPO),
                        "--address", f"http://127.0.0.1:{_free_port()}", "--junit", str(tmp_path / "no" / "j.xml")])
    assert code == 2 and "--junit" in capsys.readouterr().err


# the run's own end (rollout.commands.run.drive, the hook `run` takes) inside a real job: the environment submit
# gives the job makes it print decision.json into the log; the recorded run stands in for a controller
DRIVE_RECORDED = """
import sys
from pathlib import Path
from types import SimpleNamespace
from rollout.commands import run as run_command
from rollout.record.result import Decision
run_dir = Path('tests/data/recorded_runs/bad').resolve()
result = SimpleNamespace(decision=Decision.ROLLBACK, error=None, exit_code=3, run_dir=run_dir)
sys.exit(run_command.drive(SimpleNamespace(run=lambda: result)))
"""


def test_a_real_job_brings_its_decision_back(ray_head, tmp_path):
    import json

    out = io.StringIO()
    done = submit_entrypoint(ray_head, ["python", "-c", DRIVE_RECORDED], REPO, out=out)
    assert (done.status, done.exit_code, done.decision) == ("FAILED", 3, "rollback"), out.getvalue()[-3000:]
    assert done.decision_doc == json.loads((RECORDED / "bad" / "decision.json").read_text()), done.decision_problem
    assert log_line.DECISION_PREFIX not in out.getvalue() and "decision.json in the log" in out.getvalue()
    assert submit.fetch_decision(done, tmp_path / "fetched", None, None) == 3
    assert json.loads((tmp_path / "fetched" / "decision.json").read_text())["decision"] == "rollback"
    # the job's environment: the stop grace the teardown needs (docs/gpu-cluster.md: `ray job stop`)
    env = submit_entrypoint(ray_head, ["python", "-c", "import os; print('grace', os.environ['RAY_JOB_STOP_WAIT_TIME_S'])"],
                            None, out=(seen := io.StringIO()))
    assert env.exit_code == 0 and f"grace {submit.JOB_STOP_WAIT_S}" in seen.getvalue()
