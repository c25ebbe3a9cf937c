"""deploy/: every example loads, has the shape its kind requires, runs commands the real CLI accepts,
and its dashboard queries only metrics the exporters write.

Shapes are checked at the level a reviewer would check them (the required keys of each kind, as
the GitHub Actions, Argo Rollouts, KubeRay, Flagger and Grafana docs define them), without the
controllers themselves; every `mtp-canary ...` or `python -m rollout ...` command line is parsed
by the real argparse parser of its subcommand (nothing runs), and every config it names exists
and validates.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from rollout.commands import cli
from rollout.config import load_config
from rollout.run.live_metrics import gate_families, router_families, run_families
from rollout.record.prometheus import metrics_text
from tests.conftest import REPO

DEPLOY = REPO / "deploy"
METRIC = re.compile(r"\bmtp_canary_[a-z_]+\b")


def load(relative: str):
    return yaml.safe_load((DEPLOY / relative).read_text())


def commands_in(text: str) -> list[list[str]]:
    """argv of every mtp-canary / python -m rollout command in a shell snippet (continuations joined)."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        for part in re.split(r"&&|;|\|\|", line):
            words = shlex.split(part, comments=True)
            for i, word in enumerate(words):
                if word == "mtp-canary":
                    found.append(words[i + 1:])
                elif words[i:i + 3] == ["python", "-m", "rollout"]:
                    found.append(words[i + 3:])
    return found


def parse(argv: list[str]):
    """The argparse namespace the real CLI builds for argv (no execution); a usage error fails the test."""
    assert argv, "a bare mtp-canary"
    try:
        return cli.build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"the CLI refuses {shlex.join(argv)!r} (exit {exc.code})")


def check_commands(argvs: list[list[str]], expect: str, substitute: dict[str, str] | None = None) -> None:
    assert argvs, "no mtp-canary command found"
    for argv in argvs:
        argv = [substitute.get(word, word) if substitute else word for word in argv]
        args = parse(argv)
        assert argv[0] == expect, argv
        if getattr(args, "config", None):
            load_config(REPO / args.config)  # the config it names exists and validates
        if expect == "submit":
            assert Path(args.runs_dir).is_absolute(), "a relative --runs-dir lands in the job's deleted copy"


def test_github_actions_job():
    doc = load("github-actions/canary.yml")
    assert doc["name"] and (doc.get("on") or doc.get(True))  # YAML 1.1 reads the key `on` as true
    job = doc["jobs"]["canary"]
    assert job["runs-on"] and job["steps"]
    for step in job["steps"]:
        assert ("run" in step) != ("uses" in step), step
    runs = "\n".join(step["run"] for step in job["steps"] if "run" in step)
    check_commands(commands_in(runs), "submit")
    assert any("junit.xml" in step.get("with", {}).get("report_paths", "") for step in job["steps"])
    assert "${{ secrets.RAY_AUTH_TOKEN }}" in job["env"]["RAY_AUTH_TOKEN"]  # a secret, never in the file


def test_argo_rollouts_analysis_template_runs_submit_as_its_job():
    doc = load("argo-rollouts/analysis-template.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("argoproj.io/v1alpha1", "AnalysisTemplate") and doc["metadata"]["name"]
    args = {a["name"]: a["value"] for a in doc["spec"]["args"]}
    for metric in doc["spec"]["metrics"]:
        job = metric["provider"]["job"]["spec"]
        assert job["backoffLimit"] == 0  # a retried rollback could pass the second time
        pod = job["template"]["spec"]
        assert pod["restartPolicy"] in ("Never", "OnFailure")
        for container in pod["containers"]:
            assert container["name"] and container["image"]
            argv = container["command"] + container.get("args", [])
            assert argv[0] == "mtp-canary"
            check_commands([argv[1:]], "submit", {f"{{{{args.{k}}}}}": v for k, v in args.items()})


def test_kuberay_rayjob():
    doc = load("kuberay/rayjob.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayJob")
    spec = doc["spec"]
    check_commands(commands_in(spec["entrypoint"]), "run")
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert int(runtime_env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"]) >= 90  # the teardown's grace (docs/gpu-cluster.md)
    cluster = spec["rayClusterSpec"]
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    for group in cluster["workerGroupSpecs"]:
        assert group["groupName"] and group["template"]["spec"]["containers"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_flagger_webhook():
    doc = load("flagger/canary.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("flagger.app/v1beta1", "Canary")
    spec = doc["spec"]
    assert spec["targetRef"]["kind"] and spec["targetRef"]["name"] and spec["service"]["port"]
    analysis = spec["analysis"]
    assert analysis["interval"] and analysis["threshold"] >= 1
    hooks = analysis["webhooks"]
    allowed = {"confirm-rollout", "pre-rollout", "rollout", "confirm-traffic-increase", "confirm-promotion",
               "post-rollout", "rollback", "event"}
    for hook in hooks:
        assert hook["name"] and hook["url"].startswith("http") and hook.get("type", "rollout") in allowed
    commands = [argv for hook in hooks for argv in commands_in(hook["metadata"]["cmd"])]
    check_commands(commands, "submit")


def exported_metric_names() -> set[str]:
    """Every family the two exporters write: metrics.prom of a recorded run, and the live endpoint."""
    doc = json.loads((REPO / "tests/data/recorded_runs/promote/decision.json").read_text())
    names = set(METRIC.findall(metrics_text(doc)))
    gates = [{**g, "interval": g.get("interval") or [0.1, 0.2]} for g in doc["gates"]]
    run = {"status": "running", "phase": "progressive", "canary_weight": 10.0, "step": 1}
    families = run_families("r", run, [{"phase": "experiment", "look": 2, "result": gates}], paused=False)
    families += router_families("r", {"arm_counts": {"canary": {"routed": 1, "errors": 0, "rejected": 0, "in_flight": 0}}})
    assert gate_families("r", [])  # the gate families exist even before a look
    return names | {family.name for family in families}


def test_grafana_dashboard_queries_only_exported_metrics():
    dash = json.loads((DEPLOY / "grafana/mtp-canary-dashboard.json").read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    exported = exported_metric_names()
    queried = set()
    ids = [panel["id"] for panel in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert panel["type"] and panel["title"] and {"x", "y", "w", "h"} <= set(panel["gridPos"])
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["refId"] and target["expr"]
            queried |= set(METRIC.findall(target["expr"]))
    missing = queried - exported
    assert not missing, f"the dashboard queries metrics no exporter writes: {sorted(missing)}"
    # the live run's state is on the dashboard, not only the decided run's
    assert {"mtp_canary_canary_weight", "mtp_canary_phase", "mtp_canary_look", "mtp_canary_router_requests",
            "mtp_canary_router_errors", "mtp_canary_gate_estimate", "mtp_canary_gate_status",
            "mtp_canary_decision"} <= queried


def test_the_smoke_config_validates_and_every_yaml_in_deploy_is_checked():
    load_config(DEPLOY / "smoke-cpu.yaml")
    checked = {"github-actions/canary.yml", "argo-rollouts/analysis-template.yaml", "kuberay/rayjob.yaml",
               "flagger/canary.yaml", "smoke-cpu.yaml"}
    present = {str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml")}
    assert present == checked, "a new example under deploy/ needs its check here"


def test_commands_in_reads_continuations_and_chains():
    text = "cd /x && mtp-canary submit a.yaml \\\n  --address http://h:8265 # comment\npython -m rollout status r1"
    assert commands_in(text) == [["submit", "a.yaml", "--address", "http://h:8265"], ["status", "r1"]]
