"""deploy/ against the schemas of the controllers that read it, and the KubeRay job against the
config it runs.

Each Kubernetes manifest is validated by check-jsonschema (pinned in the test extra) against its
CRD's openAPIV3Schema, vendored under tests/data/schemas/ (each file's `$comment` names the CRD
file and commit it was taken from): KubeRay's RayJob ray.io/v1, Argo Rollouts' AnalysisTemplate
argoproj.io/v1alpha1, Flagger's Canary flagger.app/v1beta1. The GitHub Actions workflow is
validated against check-jsonschema's own vendored github-workflows schema. Nothing is fetched.

The RayJob must be able to run its config: enough GPUs in pods each wide enough for one replica,
/dev/shm as memory on the GPU pods (NCCL), the model cache mounted at the config's model_cache
on every worker, and the runs volume where the driver runs (the head)."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
import yaml

from rollout.commands import cli
from rollout.config import load_config
from tests.conftest import REPO

DEPLOY = REPO / "deploy"
SCHEMAS = REPO / "tests" / "data" / "schemas"
MANIFESTS = [
    ("kuberay/rayjob.yaml", "rayjob-ray.io-v1.json"),
    ("argo-rollouts/analysis-template.yaml", "analysistemplate-argoproj.io-v1alpha1.json"),
    ("flagger/canary.yaml", "canary-flagger.app-v1beta1.json"),
]


def check_jsonschema(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", *args], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.parametrize("manifest,schema", MANIFESTS)
def test_manifest_validates_against_its_crd_schema(manifest, schema):
    done = check_jsonschema("--schemafile", str(SCHEMAS / schema), str(DEPLOY / manifest))
    assert done.returncode == 0, done.stdout + done.stderr


def test_github_actions_workflow_validates():
    done = check_jsonschema("--builtin-schema", "vendor.github-workflows", str(DEPLOY / "github-actions" / "canary.yml"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_schema_check_refuses_a_broken_rayjob(tmp_path):
    doc = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    doc["spec"]["shutdownAfterJobFinishes"] = "yes"
    bad = tmp_path / "rayjob.yaml"
    bad.write_text(yaml.safe_dump(doc))
    done = check_jsonschema("--schemafile", str(SCHEMAS / "rayjob-ray.io-v1.json"), str(bad))
    assert done.returncode == 1 and "shutdownAfterJobFinishes" in done.stdout


def _mounts(pod: dict) -> dict[str, dict]:
    """mount path -> the volume mounted there (over the pod's containers)."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for c in pod["containers"] for m in c.get("volumeMounts", [])}


def _gpus(pod: dict) -> int:
    return sum(int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)) for c in pod["containers"])


def test_the_rayjob_can_run_its_config():
    doc = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "rollout"]
    args = cli.build_parser().parse_args(argv[3:])
    cfg = load_config(REPO / args.config)
    arms = [cfg.baseline, cfg.canary] + ([cfg.baseline] if cfg.twin_baseline else [])
    widths = [arm.engine.world_size for arm in arms for _ in range(arm.replicas)]
    cluster = doc["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    # the driver's runs dir is on a volume of the head's, where the driver runs
    runs = _mounts(head).get(args.runs_dir)
    assert runs and "persistentVolumeClaim" in runs, f"{args.runs_dir} is no volume on the head"
    # the head holds no GPU: router and Locust there stay off the replicas' nodes
    assert _gpus(head) == 0 and cluster["headGroupSpec"]["rayStartParams"].get("num-gpus") == "0"
    pods: list[int] = []
    for group in cluster["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        mounts = _mounts(pod)
        assert "persistentVolumeClaim" in mounts.get(cfg.model_cache, {}), f"{group['groupName']}: no model cache"
        if _gpus(pod):
            shm = mounts.get("/dev/shm", {}).get("emptyDir", {})
            assert shm.get("medium") == "Memory", f"{group['groupName']}: /dev/shm is not memory"
        pods += [_gpus(pod)] * group["minReplicas"]
    # every replica's bundle (all its GPUs on one node) finds a pod of its own width
    free = sorted(pods, reverse=True)
    for width in sorted(widths, reverse=True):
        slot = next((i for i, gpus in enumerate(free) if gpus >= width), None)
        assert slot is not None, f"replicas of {widths} GPUs do not fit pods of {pods} GPUs"
        free[slot] -= width
