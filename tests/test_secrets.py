"""Secrets stay out of every artifact: a config whose engine has `env: {HF_TOKEN: ...}`,
`extra_args: [--api-key, ...]` and a webhook URL with a token in its path leaves none of them in
the config dict as stored or shown, decision.json, report.md, the webhook's result and log
lines, or the CLI's error line; while the replica still gets the real env and args."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from cluster.arms import BASELINE, CANARY
from rollout.commands import cli
from rollout.commands import run as run_command
from rollout.config import parse_config
from rollout.record.redact import REDACTED, known_secrets, redact_config, redact_document, redact_engine, redact_url
from rollout.record.markdown import markdown_report
from rollout.record.result import RunResult, decision_document
from tests.conftest import REPO
from tests.test_controller import Promotes

HF_TOKEN = "hf_secret123"
API_KEY = "sk-secret456"
HOOK_TOKEN = "T0K3N-secret789"
SECRETS = (HF_TOKEN, API_KEY, HOOK_TOKEN)


def secret_config_data(webhook: str = f"https://hooks.example.com/services/{HOOK_TOKEN}") -> dict:
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    for arm in ("baseline", "canary"):
        data[arm]["engine"] = {**data[arm]["engine"], "env": {"HF_TOKEN": HF_TOKEN, "OMP_PROC_BIND": "close"},
                               "extra_args": ["--api-key", API_KEY, "--seed", "7"]}
    data["webhook_url"] = webhook
    return data


def assert_no_secret(text: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"{leaked} in {text[:300]}"


def prepared_result(tmp_path: Path, say) -> tuple[RunResult, dict]:
    """RunResult after the real Prepare phase (no tiny model: nothing is written or started)."""
    from rollout.run.phases.setup import Prepare

    data = secret_config_data()
    for arm in ("baseline", "canary"):
        data[arm]["tiny_model"] = None
        data[arm]["engine"]["model"] = "/models/real"
    data["accuracy"]["path"] = "/data/golden.jsonl"  # not read by Prepare
    cfg = parse_config(data)
    result = RunResult(run_id="r1", run_dir=tmp_path / "r1", config=cfg)
    from rollout.run.store import RunStore

    store = RunStore(tmp_path / "history.db")  # Prepare counts earlier attempts at the same comparison
    store.create_run("r1", cfg.name, "/models/real", cfg.model_dump(mode="json"))
    ctx = SimpleNamespace(cfg=cfg, result=result, cache_dir=tmp_path / "cache", say=say, engines={}, resuming=False,
                          store=store, run_id="r1")
    Prepare().run(ctx)
    return result, ctx.engines


def test_the_decision_document_and_report_hold_no_secret(tmp_path):
    lines: list[str] = []
    result, engines = prepared_result(tmp_path, lines.append)
    # the replicas are launched from ctx.engines: the real env and args
    assert engines[CANARY].environment()["HF_TOKEN"] == HF_TOKEN
    assert engines[CANARY].environment()["VLLM_API_KEY"] == API_KEY  # by the environment, not the command line
    # the record: keys kept, values redacted
    assert result.arms[CANARY]["engine"]["env"] == {"HF_TOKEN": REDACTED, "OMP_PROC_BIND": REDACTED}
    assert result.arms[BASELINE]["engine"]["extra_args"] == ["--api-key", REDACTED, "--seed", "7"]
    # free text that met a secret (a replica's error line, an engine warning) is scrubbed too
    result.error = f"replica canary-0 exited: vllm ... --api-key {API_KEY} (HF_TOKEN={HF_TOKEN})"
    result.engine_warnings = {"canary-0": [f"POST https://hooks.example.com/services/{HOOK_TOKEN} failed"]}
    doc = decision_document(result)
    text = json.dumps(doc)
    assert_no_secret(text)
    assert_no_secret(markdown_report(doc))
    assert_no_secret("\n".join(lines))
    assert "--api-key" in text and "HF_TOKEN" in text  # what was set still shows


def test_decision_document_redacts_even_arms_recorded_raw(tmp_path):
    cfg = parse_config(secret_config_data())
    result = RunResult(run_id="r1", run_dir=tmp_path, config=cfg)
    result.arms = {arm: {"replicas": 1, "engine": getattr(cfg, arm).engine.model_dump(mode="json"), "tiny_model": None}
                   for arm in (BASELINE, CANARY)}
    assert_no_secret(json.dumps(decision_document(result)))


def test_the_config_as_stored_or_shown_holds_no_secret():
    cfg = parse_config(secret_config_data())
    dumped = cfg.model_dump(mode="json")
    shown = redact_config(dumped)
    assert_no_secret(json.dumps(shown))
    assert shown["webhook_url"] == f"https://hooks.example.com/{REDACTED}"
    assert shown["canary"]["engine"]["env"] == {"HF_TOKEN": REDACTED, "OMP_PROC_BIND": REDACTED}
    assert redact_config(shown) == shown  # idempotent
    assert dumped["canary"]["engine"]["env"]["HF_TOKEN"] == HF_TOKEN  # a copy: the config is untouched
    # arms under any name and in lists (promoted.yaml's `baseline:`, a future list of arms)
    other = {"arms": [{"name": "c2", "engine": dumped["canary"]["engine"]}], "baseline": dumped["canary"]}
    assert_no_secret(json.dumps(redact_config(other)))
    assert {HF_TOKEN, API_KEY} <= known_secrets(dumped)


@pytest.mark.parametrize(
    "url, shown",
    [
        ("https://hooks.example.com/services/T0/B0/XYZ", "https://hooks.example.com/<redacted>"),
        ("https://user:pw@hooks.example.com:8443/x?token=abc#f", "https://hooks.example.com:8443/<redacted>"),
        ("http://hooks.example.com", "http://hooks.example.com/<redacted>"),
        ("not a url", "<redacted>"),
        ("http://[::1]:99/x", "http://[::1]:99/<redacted>"),
        ("http://h:99999/x", "<redacted>"),
        (None, None),
    ],
)
def test_a_webhook_url_keeps_scheme_and_host_only(url, shown):
    assert redact_url(url) == shown
    assert redact_url(shown) == shown


def test_the_webhook_result_and_its_log_lines_hold_no_secret(caplog):
    from rollout.record.webhook import post_decision

    url = f"http://127.0.0.1:9/services/{HOOK_TOKEN}?sig={HOOK_TOKEN}"  # port 9: refused at once
    with caplog.at_level(logging.WARNING, logger="mtp_canary.webhook"):
        result = post_decision(url, {"decision": "promote"}, timeout_s=1, retries=2, deadline_s=3)
    assert not result.ok and result.error
    assert result.url == f"http://127.0.0.1:9/{REDACTED}"
    assert_no_secret(" ".join([result.error, *result.errors, caplog.text]))


def test_a_bad_config_error_line_names_the_flag_not_the_secret(tmp_path, capsys, monkeypatch):
    data = secret_config_data()
    data["canary"]["engine"]["extra_args"] = ["--api-key", API_KEY, f"--hos={HF_TOKEN}"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    monkeypatch.setattr(run_command, "start_run", lambda *a: pytest.fail("accepted"))
    assert cli.main(["run", str(bad), "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "--hos" in err
    assert_no_secret(err)


@pytest.mark.parametrize("run", sorted(p.name for p in (REPO / "tests" / "data" / "recorded_runs").iterdir()
                                       if (p / "decision.json").exists()))
def test_redaction_is_a_no_op_on_documents_without_secrets(run):
    doc = json.loads((REPO / "tests" / "data" / "recorded_runs" / run / "decision.json").read_text())
    assert redact_document(doc, known_secrets(doc)) == doc
    for info in doc["arms"].values():
        assert redact_engine(info["engine"]) == info["engine"]


# -- what the controller stores and writes ------------------------------------------------
def secret_controller(tmp_path, monkeypatch, *phases):
    from rollout.run import controller as controller_module

    monkeypatch.setattr(controller_module, "PHASES", phases)
    return controller_module.Controller(parse_config(secret_config_data()), runs_dir=tmp_path, run_id="s1",
                                        progress=lambda m: None)


class PromotesWithSecrets(Promotes):
    """The stand-in PROMOTE, its arms recorded as Prepare records them (redacted)."""

    def arms(self, ctx) -> dict:
        return {arm: {"replicas": 1, "engine": redact_engine(ctx.cfg.canary.engine.model_dump(mode="json"))}
                for arm in (BASELINE, CANARY)}


class FailsQuotingTheCommandLine:
    name = "fleet"

    def enabled(self, ctx) -> bool:
        return True

    def run(self, ctx) -> None:
        from rollout.run.context import InfrastructureError

        raise InfrastructureError(f"replica canary-0 failed: python -m vllm... --api-key {API_KEY} (HF_TOKEN={HF_TOKEN})")


def test_the_store_and_promoted_yaml_hold_no_secret(tmp_path, monkeypatch):
    import sqlite3

    result = secret_controller(tmp_path, monkeypatch, PromotesWithSecrets()).run()
    assert result.exit_code == 0
    promoted = (tmp_path / "s1" / "promoted.yaml").read_text()
    assert_no_secret(promoted)
    assert REDACTED in promoted and "fill them in" in promoted
    with sqlite3.connect(tmp_path / "history.db") as db:
        for table in ("runs", "events", "stable"):
            assert_no_secret(json.dumps(db.execute(f"SELECT * FROM {table}").fetchall()))
    assert_no_secret((tmp_path / "s1" / "decision.json").read_text())


def test_an_error_that_quotes_a_secret_is_scrubbed_in_the_log_and_the_store(tmp_path, monkeypatch):
    import sqlite3

    lines: list[str] = []
    ctl = secret_controller(tmp_path, monkeypatch, FailsQuotingTheCommandLine())
    ctl.ctx.progress = lines.append
    result = ctl.run()
    assert result.exit_code == 1 and "--api-key" in result.error
    assert_no_secret(result.error)
    assert_no_secret("\n".join(lines))
    with sqlite3.connect(tmp_path / "history.db") as db:
        assert_no_secret(json.dumps(db.execute("SELECT * FROM events").fetchall() + db.execute("SELECT * FROM runs").fetchall()))


def test_a_run_with_secrets_resumes_only_with_its_config_file_given_again(tmp_path, monkeypatch, capsys):
    from rollout.run.store import RunStore

    config_file = tmp_path / "secret.yaml"
    config_file.write_text(yaml.safe_dump(secret_config_data()))
    store = RunStore(tmp_path / "history.db")
    store.create_run("s2", "n", "m", redact_config(parse_config(secret_config_data()).model_dump(mode="json")))
    store.update_run("s2", controller="gone-host.invalid:1")
    started: list = []
    monkeypatch.setattr(run_command, "drive", lambda controller, *_, **__: started.append(controller) or 0)
    assert cli.main(["resume", "s2", "--runs-dir", str(tmp_path), "--force"]) == 2
    assert "give its config file again with --config FILE" in capsys.readouterr().err
    other = secret_config_data()
    other["experiment"]["requests_per_arm"] = 123
    other_file = tmp_path / "other.yaml"
    other_file.write_text(yaml.safe_dump(other))
    assert cli.main(["resume", "s2", "--runs-dir", str(tmp_path), "--force", "--config", str(other_file)]) == 2
    assert "is not the config run s2 started with" in capsys.readouterr().err
    assert not started
    assert cli.main(["resume", "s2", "--runs-dir", str(tmp_path), "--force", "--config", str(config_file)]) == 0
    (controller,) = started
    assert controller.ctx.cfg.canary.engine.env["HF_TOKEN"] == HF_TOKEN  # the real secrets start the replicas


def test_the_replica_log_names_no_secret_flag_value(tmp_path):
    from cluster.engine_spec import EngineSpec
    from cluster.replica import VLLMReplicaServer

    spec = EngineSpec(model="m", device="cpu", extra_args=["--api-key", API_KEY], env={"HF_TOKEN": HF_TOKEN},
                      startup_timeout_s=1)
    replica = VLLMReplicaServer("canary-0", "canary", spec, str(tmp_path))
    replica.launch()  # a real launch: python -m vllm... on a model that does not exist; it exits
    replica.stop(grace_s=2)
    log = (tmp_path / "canary-0.log").read_text()
    assert "--api-key" not in log.splitlines()[0]  # the key went by $VLLM_API_KEY
    assert_no_secret(log)


@pytest.mark.parametrize("key", ["CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND"])
def test_an_engine_env_cannot_override_what_the_replica_sets(key):
    from cluster.engine_spec import EngineSpec

    with pytest.raises(ValueError, match=f"env: {key} is set from the engine spec"):
        EngineSpec(model="m", env={key: "0"})
    EngineSpec(model="m", env={"HF_HOME": "/cache"})  # anything else is the user's
