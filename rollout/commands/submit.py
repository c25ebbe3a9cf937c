"""`mtp-canary submit CONFIG`: a run as a Ray Job, and the run's own exit code back.

`ray job submit` exits 0 or 1 (SUCCEEDED or FAILED), so a pipeline cannot tell a rollback from
an inconclusive run from a broken cluster. This command submits `python -m rollout run CONFIG`
through Ray's Job SDK, follows the job's log to stdout, and exits with the run's code:
0 promote, 3 rollback, 4 inconclusive, 1 infrastructure error, 2 bad config. The code is the
run's final `mtp-canary: exit_code=N decision=X run_dir=DIR` line when the log has one and
Ray's record of the driver's exit agrees with it (else 1, naming both), else the driver's exit
code as Ray recorded it; a job stopped, or failed with no run code, is 1.

Ray 2.60's token authentication: the token is read as Ray reads it (RAY_AUTH_TOKEN, the file
RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token) and sent as the Authorization header, so
the client needs no RAY_AUTH_MODE=token; a cluster that refuses the request is one line
naming where the token goes (`ray get-auth-token` on the head prints it).

decision.json comes back through the job's log. The driver runs on the cluster and writes
runs/<id>/ there; the Job SDK has no file download, and the head's disk is not the
submitter's. So the run (told by MTP_CANARY_DECISION_IN_LOG, which submit puts in the job's
runtime env) prints the decision document as one line before its final line:
`mtp-canary: decision_json=<base64 of zlib of the JSON>` (zlib's checksum catches a line cut
or mangled on the way; bounded at DECISION_LINE_MAX characters; decision.json is already
redacted, so the log holds no secret the file did not). The log is what Ray keeps for every
job on the head and serves through the same authenticated API as the status, so it needs no
shared filesystem, no Ray client port and no second connection. `submit` writes the document
into --fetch-dir (default ./runs/<run_id>/) with junit.xml and metrics.prom rebuilt from it
by the same writers the run uses, and copies to --decision-out / --junit. A run that says it
decided (exit 0, 3, 4) but whose document is missing or unreadable is exit 1, never 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import NamedTuple, TextIO

from rollout.commands.arguments import parse_alone
from rollout.record.log_line import DECISION_IN_LOG_ENV, DECISION_PREFIX, decision_from_log

EXIT_INFRASTRUCTURE, EXIT_USAGE = 1, 2
RUN_CODES = {0, 2, 3, 4}  # what `rollout run` itself exits with; 1 is also its code, and the fallback
FINAL_LINE = re.compile(r"^mtp-canary: exit_code=(\d+) decision=(\S+)(?: run_dir=(.*))?$")
# Ray's working_dir upload is capped at 500 MiB; none of these is needed to run (.gitignore is honoured too)
UPLOAD_EXCLUDES = [".venv", "runs", ".cache", ".git", "__pycache__", ".hypothesis", ".pytest_cache", "*.egg-info"]
# nor these, which are secrets: the working_dir is stored on the cluster's head for anyone with job access
SECRET_EXCLUDES = [".env", ".env.*", "*.env", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore",
                   "kubeconfig", "*.kubeconfig", "kubeconfig*.y*ml", ".kube", ".ssh", "id_rsa*", "id_ecdsa*",
                   "id_ed25519*", ".netrc", ".pgpass", ".aws", ".gcp", ".azure", ".docker", ".git-credentials",
                   "*credentials*.json", "*service-account*.json"]
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
DECIDED_CODES = (0, 3, 4)  # a run that exits with these wrote a decision a pipeline reads
# Ray's supervisor SIGKILLs the driver this long after `ray job stop`'s SIGTERM (Ray's default:
# 3 s); the run's teardown waits up to 60 s for its replicas (README: `ray job stop`)
JOB_STOP_WAIT_S = "90"
AGENT_WAIT_S = 60.0
TOKEN_HELP = ("the cluster uses token authentication: set RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH to a file holding "
              "it, or write it to ~/.ray/auth_token (`ray get-auth-token` on the head prints it)")


class SubmitError(Exception):
    """One line for stderr; the submission ends with exit 1."""


class Outcome(NamedTuple):
    """How a followed job ended, and what `submit` exits with."""

    job_id: str
    status: str
    exit_code: int
    decision: str | None = None
    run_dir: str | None = None
    reason: str = ""
    decision_doc: dict | None = None  # decision.json as the job's log carried it
    decision_problem: str = ""  # why there is none


def ray_token() -> str | None:
    """The token Ray's own loader would use, in its order; None when there is none."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return os.environ["RAY_AUTH_TOKEN"].strip()
    for path in (os.environ.get("RAY_AUTH_TOKEN_PATH"), Path.home() / ".ray" / "auth_token"):
        try:
            token = Path(path).read_text().strip() if path else ""
        except OSError:
            token = ""
        if token:
            return token
    return None


def final_line(log: str) -> tuple[int, str, str | None] | None:
    """(exit code, decision, run dir) of the last `mtp-canary: exit_code=...` line in a log."""
    found = None
    for line in log.splitlines():
        match = FINAL_LINE.match(line.strip())
        if match:
            found = (int(match.group(1)), match.group(2), match.group(3))
    return found


def outcome_of(job_id: str, status: str, driver_exit_code: int | None, message: str, log: str) -> Outcome:
    """The exit code of a job that ended (see the module docstring for the order of evidence)."""
    line = final_line(log)
    if line is not None and status in ("SUCCEEDED", "FAILED"):
        # the line is what the run printed; Ray's record of how the driver exited must agree (a log
        # line can be echoed by anything the run prints; a crash after it leaves it standing)
        recorded = 0 if status == "SUCCEEDED" else driver_exit_code
        if (recorded is not None and recorded != line[0]) or (status == "FAILED" and line[0] == 0):
            said = "unknown" if recorded is None else recorded
            return Outcome(job_id, status, EXIT_INFRASTRUCTURE, reason=(
                f"job {job_id} {status}: the log's last line says exit_code={line[0]}, Ray recorded the driver's "
                f"exit as {said}"))
        return Outcome(job_id, status, line[0], decision=line[1], run_dir=line[2])
    if status == "SUCCEEDED":
        return Outcome(job_id, status, 0)
    if status == "FAILED" and driver_exit_code in RUN_CODES:
        return Outcome(job_id, status, driver_exit_code)
    why = " ".join((message or "").split())[:300]
    code = "" if driver_exit_code is None else f", driver exit {driver_exit_code}"
    return Outcome(job_id, status, EXIT_INFRASTRUCTURE, reason=f"job {job_id} {status}{code} with no run exit code: {why}")


_ADDRESSES = re.compile(r"\S+://\S+|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?|\S+:\d+")


def client_for(address: str):
    """A JobSubmissionClient for `address`, carrying the Ray token when there is one."""
    from ray.job_submission import JobSubmissionClient

    token = ray_token()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        return JobSubmissionClient(address, headers=headers)
    except Exception as exc:  # ConnectionError, or RuntimeError carrying Ray's 401/403 text
        raise SubmitError(_connect_error(address, exc, token)) from None


def _connect_error(address: str, exc: Exception, token: str | None) -> str:
    text = " ".join(str(exc).split())
    # the status codes, not digits of an address: port 52401 is no 401 (seen: an unreachable
    # server reported as a refused token)
    status_text = _ADDRESSES.sub(" ", text)
    if "Authentication required" in text or re.search(r"\b401\b", status_text):
        return f"{address}: {TOKEN_HELP}" if token is None else f"{address}: the cluster refused the token given"
    if "Authentication failed" in text or re.search(r"\b403\b", status_text):
        return f"{address}: the cluster refused the Ray token (RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH / ~/.ray/auth_token)"
    return f"cannot reach the Ray job server at {address}: {text[:300]}"


def _shown(line: str) -> str:
    """A log line as the person watching sees it: the decision line (kilobytes of base64) as a note."""
    if line.startswith(DECISION_PREFIX):
        return f"mtp-canary submit: decision.json in the log ({len(line) - len(DECISION_PREFIX)} characters)\n"
    return line


async def _tail(client, job_id: str, out: TextIO) -> str:
    seen, partial = [], ""
    async for chunk in client.tail_job_logs(job_id):
        seen.append(chunk)
        *lines, partial = (partial + chunk).split("\n")
        out.write("".join(_shown(line + "\n") for line in lines))
        out.flush()
    out.write(_shown(partial))
    out.flush()
    return "".join(seen)


def follow(client, job_id: str, out: TextIO, poll_s: float = 1.0) -> Outcome:
    """Stream a job's log to `out` until it ends; how it ended."""
    from ray.job_submission import JobStatus

    try:
        import asyncio

        log = asyncio.run(_tail(client, job_id, out))
    except Exception as exc:  # the log stream broke: the job may still run; poll it
        print(f"mtp-canary submit: log stream ended ({type(exc).__name__}); waiting for job {job_id}", file=sys.stderr)
        log = ""
    while not (info := client.get_job_info(job_id)).status.is_terminal():
        time.sleep(poll_s)
    if final_line(log) is None:
        log = client.get_job_logs(job_id)  # a stream cut short may have missed the last line
    status = info.status.value if isinstance(info.status, JobStatus) else str(info.status)
    outcome = outcome_of(job_id, status, getattr(info, "driver_exit_code", None), info.message or "", log)
    doc, why = decision_from_log(log)
    return outcome._replace(decision_doc=doc, decision_problem=why)


def submit_entrypoint(address: str, entrypoint: list[str], working_dir: Path | None, out: TextIO = sys.stdout,
                      wait: bool = True, job_id: str | None = None) -> Outcome | str:
    """Submit `entrypoint` as a Ray Job (working_dir uploaded, caches and runs left out); the
    Outcome once it ends, or its job id with wait=False. Raises SubmitError (one line)."""
    client = client_for(address)
    runtime_env = {"env_vars": {DECISION_IN_LOG_ENV: "1", "RAY_JOB_STOP_WAIT_TIME_S": JOB_STOP_WAIT_S}}
    if working_dir:
        runtime_env.update(working_dir=str(working_dir), excludes=UPLOAD_EXCLUDES + SECRET_EXCLUDES)
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            job_id = client.submit_job(entrypoint=shlex.join(entrypoint), runtime_env=runtime_env, submission_id=job_id)
            break
        except Exception as exc:
            # a head just started answers before its job agent is up ("try again later")
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise SubmitError(_connect_error(address, exc, ray_token())) from None
            time.sleep(2)
    print(f"mtp-canary submit: job {job_id} submitted to {address}", file=sys.stderr, flush=True)
    if not wait:
        return job_id
    try:
        return follow(client, job_id, out)
    except KeyboardInterrupt:
        # a cancelled pipeline step must not leave a canary running on the cluster
        client.stop_job(job_id)
        raise


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


DRIVER_RUNS_ROOT = "mtp-canary"  # a relative --runs-dir lands under the driver's $HOME/mtp-canary/


def run_entrypoint(config: Path, working_dir: Path, runs_dir: Path) -> list[str]:
    """The job's command: `rollout run` of CONFIG as the uploaded directory names it. The runs dir
    is resolved where the driver runs, never on the submitting machine: an absolute one as given (a
    path on the head, e.g. the runs volume's mount); a relative one under the driver's
    $HOME/mtp-canary (a relative path in the job's working dir is deleted with the job, and a
    laptop's absolute path may not exist or be writable on the head)."""
    relative = Path(config).resolve().relative_to(Path(working_dir).resolve())
    if Path(runs_dir).is_absolute():
        return ["python", "-m", "rollout", "run", str(relative), "--runs-dir", str(runs_dir)]
    # $HOME expands in the driver's shell (Ray runs the entrypoint with sh); the paths ride as $1, $2.
    # `~/x` is the driver's home too, never the submitter's.
    text = str(runs_dir)
    under = "$HOME" if text == "~" or text.startswith("~/") else f"$HOME/{DRIVER_RUNS_ROOT}"
    rest = text[2:] if text.startswith("~/") else ("." if text == "~" else text)
    return ["sh", "-c", f'exec python -m rollout run "$1" --runs-dir "{under}/$2"', "mtp-canary", str(relative), rest]


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser("submit", help="run a canary as a Ray Job; follow its log; exit with the run's own code",
                            description=__doc__.splitlines()[0])
    parser.add_argument("config", metavar="CONFIG", help="run config, inside --working-dir (it is uploaded with it)")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS,
                        help=f"the Ray job server (dashboard) URL (default: $RAY_ADDRESS, else {DEFAULT_ADDRESS})")
    parser.add_argument("--runs-dir", default="runs",
                        help="where the run writes runs/<id>/, on the node the driver runs on (the head): an "
                        "absolute path there as given, a relative one under the driver's $HOME/mtp-canary/ "
                        "(default: runs)")
    parser.add_argument("--working-dir", default=".", help="uploaded as the job's working directory (default: .)")
    parser.add_argument("--no-wait", action="store_true", help="print the job id and exit 0 once submitted")
    parser.add_argument("--fetch-dir", default=None, metavar="DIR",
                        help="where the run's decision.json, junit.xml and metrics.prom land here "
                        "(default: ./runs/<run_id>/)")
    parser.add_argument("--decision-out", default=None, metavar="FILE", help="also write the run's decision.json to FILE")
    parser.add_argument("--junit", default=None, metavar="FILE", help="also write the run's junit.xml to FILE (for CI)")
    parser.set_defaults(handler=run)
    return parser


def _refused_output(args: argparse.Namespace) -> str | None:
    """Why --decision-out / --junit cannot be written (checked before anything is submitted), or None."""
    for flag, value in (("--decision-out", args.decision_out), ("--junit", args.junit)):
        if value:
            path = Path(value)
            if path.is_dir() or not path.parent.is_dir():
                why = "is a directory" if path.is_dir() else f"is in {str(path.parent)!r}, which is not a directory"
                return f"{flag} {value!r} {why}"
    return None


def fetch_decision(outcome: Outcome, fetch_dir: Path | None, decision_out: Path | None, junit: Path | None) -> int:
    """Write the job's decision.json (with junit.xml and metrics.prom rebuilt from it) on this
    machine; the exit code: the run's, or 1 when a decided run's document did not come back."""
    from rollout.record.atomic_file import write_atomically
    from rollout.record.pipeline_artifacts import write_pipeline_artifacts

    doc = outcome.decision_doc
    if doc is None:
        if outcome.exit_code in DECIDED_CODES:
            print(f"mtp-canary submit: no decision.json from job {outcome.job_id}: {outcome.decision_problem}; exit 1",
                  file=sys.stderr)
            return EXIT_INFRASTRUCTURE
        return outcome.exit_code  # an error or a bad config: no decision was expected
    run_id = str(doc["run_id"])
    mismatch = _log_disagrees(doc, outcome)
    if mismatch:
        print(f"mtp-canary submit: {mismatch}; exit 1", file=sys.stderr)
        return EXIT_INFRASTRUCTURE
    target = fetch_dir if fetch_dir is not None else Path("runs") / run_id
    text = json.dumps(doc, indent=2) + "\n"
    try:
        target.mkdir(parents=True, exist_ok=True)
        write_atomically(target / "decision.json", text)
        artifacts = write_pipeline_artifacts(doc, target)
        if decision_out is not None:
            write_atomically(decision_out, text)
        if junit is not None:
            write_atomically(junit, artifacts["junit"].read_text())
    except (OSError, ValueError) as exc:  # ValueError: rollout.record.document.BadDocument, a document not ours
        print(f"mtp-canary submit: cannot write the fetched decision: {exc}; exit 1", file=sys.stderr)
        return EXIT_INFRASTRUCTURE
    print(f"mtp-canary submit: decision.json of run {run_id} ({doc.get('decision') or 'error'}) -> "
          f"{target / 'decision.json'}", file=sys.stderr)
    return outcome.exit_code


def _log_disagrees(doc: dict, outcome: Outcome) -> str:
    """Why the log's decision.json cannot be this run's, or "": its run id must be a run id (it
    names the directory written here) and the run's last line must name the same run and decision
    (a log that interleaves two runs, or a document that is not the one the exit code came from)."""
    from rollout.run.run_id import run_id_error

    run_id = str(doc["run_id"])
    bad_id = run_id_error(run_id, "the log's decision.json run_id")
    if bad_id:
        return bad_id
    if outcome.run_dir and Path(outcome.run_dir).name != run_id:
        return f"the log's decision.json is run {run_id!r}, the run's last line names {outcome.run_dir!r}"
    said = doc.get("decision") or "error"
    if outcome.decision is not None and outcome.decision != said:
        return (f"the log's decision.json of run {run_id!r} says {said!r}, the run's last line says "
                f"{outcome.decision!r}")
    return ""


def main(argv: list[str] | None = None, out: TextIO = sys.stdout) -> int:
    """`mtp-canary submit ...` parsed alone (`python -m rollout.commands.submit`, tests)."""
    return run(parse_alone(register, argv), out=out)


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Submit, follow, fetch the decision; the run's own exit code."""
    from rollout.config import ConfigError, load_config

    working_dir = Path(args.working_dir).resolve()
    config = Path(args.config).resolve()
    try:
        load_config(config)  # bad config: exit 2 here, nothing submitted
    except ConfigError as exc:
        print(f"mtp-canary submit: bad config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not config.is_relative_to(working_dir):
        print(f"mtp-canary submit: CONFIG {args.config} is outside --working-dir {working_dir}: "
              "the job sees only the uploaded directory", file=sys.stderr)
        return EXIT_USAGE
    refused = _refused_output(args)
    if refused:
        print(f"mtp-canary submit: {refused}", file=sys.stderr)
        return EXIT_USAGE
    entrypoint = run_entrypoint(config, working_dir, Path(args.runs_dir))
    # a cancelled pipeline step sends SIGTERM: the same path as Ctrl-C (the job is stopped)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        result = submit_entrypoint(args.address, entrypoint, working_dir, out=out, wait=not args.no_wait)
    except SubmitError as exc:
        print(f"mtp-canary submit: {exc}", file=sys.stderr)
        return EXIT_INFRASTRUCTURE
    except KeyboardInterrupt:
        print("mtp-canary submit: interrupted; job stopped", file=sys.stderr)
        return 130
    if isinstance(result, str):
        print(result, file=out)
        return 0
    report(result)
    optional = {key: Path(value) if value else None for key, value in
                (("fetch_dir", args.fetch_dir), ("decision_out", args.decision_out), ("junit", args.junit))}
    return fetch_decision(result, **optional)


def report(outcome: Outcome) -> int:
    """One line on stderr saying how the job ended; the exit code."""
    if outcome.reason:
        print(f"mtp-canary submit: {outcome.reason}", file=sys.stderr)
    else:
        where = f" -> {outcome.run_dir}/decision.json" if outcome.run_dir else ""
        print(f"mtp-canary submit: job {outcome.job_id} {outcome.status}: {outcome.decision or 'exit'} "
              f"(exit {outcome.exit_code}){where}", file=sys.stderr)
    return outcome.exit_code
