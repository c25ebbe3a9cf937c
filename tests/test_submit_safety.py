"""`mtp-canary submit` uploads no secret and trusts no line over Ray's record.

The working_dir is stored on the cluster's head for anyone with job access: .env files, keys
and certificates, kubeconfigs and cloud credentials stay out of it (rollout.commands.submit.SECRET_EXCLUDES,
matched by Ray's own gitwildmatch). The run's final `mtp-canary: exit_code=` line is the exit
code only when Ray's record of how the driver exited agrees with it.
"""

from __future__ import annotations

from pathlib import Path

from ray._private.runtime_env.packaging import _get_excludes

from rollout.commands import submit
from rollout.commands.submit import EXIT_INFRASTRUCTURE, SECRET_EXCLUDES, UPLOAD_EXCLUDES, outcome_of

SECRETS = [".env", ".env.production", "deploy/prod.env", "certs/server.pem", "tls/client.key", "kubeconfig",
           "clusters/kubeconfig-prod.yaml", ".kube/config", ".ssh/id_ed25519", "id_rsa", ".netrc", ".aws/credentials",
           "gcp-credentials.json", "my-service-account.json", "store.p12"]
KEPT = ["configs/local-cpu.yaml", "loadtests/locustfile.py", "rollout/data/golden.jsonl", "README.md",
        "tinymodel/tokenizer.json", "deploy/README.md", "environment.py", "keys.md"]


def test_secrets_in_the_working_dir_are_not_uploaded(tmp_path, monkeypatch):
    for name in SECRETS + KEPT:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    excluded = _get_excludes(tmp_path, UPLOAD_EXCLUDES + SECRET_EXCLUDES)

    def out(name: str) -> bool:  # Ray drops a path when it or a directory above it matches
        parts = Path(name).parts
        return any(excluded(tmp_path.joinpath(*parts[: i + 1])) for i in range(len(parts)))

    assert [name for name in SECRETS if not out(name)] == []
    assert [name for name in KEPT if out(name)] == []

    sent: list[dict] = []

    class Client:
        def submit_job(self, entrypoint, runtime_env, submission_id=None):
            sent.append(runtime_env)
            return "job-1"

    monkeypatch.setattr(submit, "client_for", lambda address: Client())
    assert submit.submit_entrypoint("http://127.0.0.1:8265", ["true"], tmp_path, wait=False) == "job-1"
    assert set(SECRET_EXCLUDES) <= set(sent[0]["excludes"])


def test_the_last_line_counts_only_when_ray_recorded_the_same_exit():
    promote = "mtp-canary: exit_code=0 decision=promote run_dir=/r/x\n"
    rollback = "mtp-canary: exit_code=3 decision=rollback run_dir=/r/x\n"
    assert outcome_of("j", "SUCCEEDED", 0, "", promote).exit_code == 0
    assert outcome_of("j", "FAILED", 3, "", rollback).exit_code == 3
    # the driver crashed after the line (or something printed it): Ray's record wins, as an error
    crashed = outcome_of("j", "FAILED", 1, "", promote)
    assert crashed.exit_code == EXIT_INFRASTRUCTURE and "Ray recorded the driver's exit as 1" in crashed.reason
    assert outcome_of("j", "FAILED", None, "", promote).exit_code == EXIT_INFRASTRUCTURE
    assert outcome_of("j", "SUCCEEDED", None, "", rollback).exit_code == EXIT_INFRASTRUCTURE
    assert outcome_of("j", "FAILED", 4, "", rollback).exit_code == EXIT_INFRASTRUCTURE
