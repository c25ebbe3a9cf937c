"""Weight staging (cluster.staging) and replica logs copied back (Fleet.copy_logs_back) on a fake
2-node GPU cluster (ray.cluster_utils.Cluster with fake GPUs, one per node).

Each GPU node's raylet gets its own NODE_DISK, and the cache is `$NODE_DISK/<test>`, expanded on the
node: two nodes with disks of their own, as on a real cluster (they share this machine's
filesystem otherwise). No network: the hub is a local directory (DirectorySource) holding a
snapshot, which counts its downloads; production passes huggingface_hub's snapshot_download."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.engine_spec import EngineSpec
from cluster.fleet import ArmSpec, Fleet, FleetStartError
from cluster.staging import MARKER, DirectorySource, StagingError, cached_weights, is_local_model, stage_on_nodes

MODEL = "example-org/tiny-snapshot"


@pytest.fixture(scope="module")
def two_gpu_nodes(tmp_path_factory):
    disks = [tmp_path_factory.mktemp(f"disk-{i}") for i in range(2)]
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    nodes = [cluster.add_node(num_cpus=2, num_gpus=1, env_vars={"NODE_DISK": str(disk)}) for disk in disks]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield [(node.node_id, disk) for node, disk in zip(nodes, disks)]
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def cache(tmp_path) -> str:
    """A cache of this test's own on each node's disk (the nodes outlive a test)."""
    return f"$NODE_DISK/{tmp_path.name}"


@pytest.fixture
def hub(tmp_path) -> DirectorySource:
    """A hub holding one snapshot (config, tokenizer, two weight shards); its downloads counted in calls.log."""
    snapshot = tmp_path / "hub" / MODEL.replace("/", "--")
    (snapshot / "sub").mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    (snapshot / "tokenizer.json").write_text("{}")
    (snapshot / "model-00001.safetensors").write_bytes(b"\0" * 4096)
    (snapshot / "sub" / "model-00002.safetensors").write_bytes(b"\1" * 1024)
    return DirectorySource(root=str(tmp_path / "hub"), calls=str(tmp_path / "calls.log"))


def downloads(hub: DirectorySource) -> list[str]:
    path = Path(hub.calls)
    return [line.split()[0] for line in path.read_text().splitlines()] if path.exists() else []


def test_staging_downloads_once_per_node_and_a_second_run_finds_it_cached(two_gpu_nodes, hub, cache, tmp_path):
    jobs = {node: [MODEL] for node, _ in two_gpu_nodes}
    said: list[str] = []
    slow = DirectorySource(root=hub.root, calls=hub.calls, pause_s=0.5)
    staged = stage_on_nodes(jobs, cache, slow, progress=said.append, every_s=0.2)
    # one download on each node, into that node's own disk
    assert sorted(downloads(hub)) == sorted(jobs)
    for node, disk in two_gpu_nodes:
        weights = staged[(node, MODEL)]
        assert not weights.cached and weights.node_id == node
        assert weights.path == str(disk / tmp_path.name / MODEL.replace("/", "--"))
        assert weights.files == 4 and weights.bytes == 4096 + 1024 + len('{"model_type": "tiny"}') + 2
        assert (Path(weights.path) / "sub" / "model-00002.safetensors").read_bytes() == b"\1" * 1024
    assert any("downloaded" in line and MODEL in line for line in said)
    # while it downloads, a line per node says how far it got
    ip = staged[(two_gpu_nodes[0][0], MODEL)].node_ip
    assert any(f"{MODEL} on node {ip}: " in line and "files" in line and "GB so far" in line for line in said), said
    # the second run downloads nothing: every node has a complete copy
    again = stage_on_nodes(jobs, cache, hub, progress=lambda _: None)
    assert sorted(downloads(hub)) == sorted(jobs)
    assert all(w.cached for w in again.values())


def test_a_copy_missing_a_file_is_not_cached_and_is_downloaded_again(two_gpu_nodes, hub, cache, tmp_path):
    (node, disk), _ = two_gpu_nodes
    stage_on_nodes({node: [MODEL]}, cache, hub, progress=lambda _: None)
    before = len(downloads(hub))
    shard = disk / tmp_path.name / MODEL.replace("/", "--") / "model-00001.safetensors"
    shard.write_bytes(b"\0" * 10)  # an interrupted or damaged shard: its size no longer matches the marker
    assert cached_weights(str(disk / tmp_path.name), MODEL) is None
    staged = stage_on_nodes({node: [MODEL]}, cache, hub, progress=lambda _: None)
    assert len(downloads(hub)) == before + 1 and not staged[(node, MODEL)].cached
    assert shard.stat().st_size == 4096


def test_a_failed_download_names_the_node_and_the_cause(two_gpu_nodes, cache, tmp_path):
    (node, _), _ = two_gpu_nodes
    empty = DirectorySource(root=str(tmp_path / "empty-hub"))
    with pytest.raises(StagingError) as failed:
        stage_on_nodes({node: ["example-org/not-there"]}, cache, empty, progress=lambda _: None)
    message = str(failed.value)
    assert node[:12] in message and "example-org/not-there" in message
    assert "FileNotFoundError" in message and "no snapshot of example-org/not-there" in message
    # nothing half-staged reads as cached
    assert not any((Path(d) / tmp_path.name / "example-org--not-there" / MARKER).exists() for _, d in two_gpu_nodes)


def gpu_arms(model: str) -> list[ArmSpec]:
    engine = EngineSpec(model=model, device="gpu", startup_timeout_s=60)
    k3 = engine.model_copy(update={"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}})
    return [ArmSpec(name="baseline", engine=engine), ArmSpec(name="canary", engine=k3)]


def test_the_fleet_stages_on_each_replicas_node_and_its_engines_start_offline(two_gpu_nodes, hub, cache, tmp_path):
    said: list[str] = []
    fleet = Fleet(gpu_arms(MODEL), log_dir=str(tmp_path / "logs"), progress=said.append, placement_timeout_s=30,
                  model_cache=cache, weights_source=hub)
    try:
        fleet.create_actors()  # places the GPU bundles (one per node) and the actors; no server starts
        fleet.stage_weights()
        where = {r.name: ray.get(r.actor.where.remote())[0] for r in fleet.replicas}
        assert sorted(where.values()) == sorted(node for node, _ in two_gpu_nodes)  # one replica per node
        assert sorted(downloads(hub)) == sorted(where.values())
        disks = dict(two_gpu_nodes)
        for r in fleet.replicas:
            cmd, env = ray.get(r.actor.planned_launch.remote(1234))
            local = str(disks[where[r.name]] / tmp_path.name / MODEL.replace("/", "--"))
            assert cmd[cmd.index("--model") + 1] == local
            assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
        assert {(w.node_id, w.model) for w in fleet.staged} == {(n, MODEL) for n in where.values()}
    finally:
        fleet.teardown()


def test_a_local_model_is_never_staged(two_gpu_nodes, hub, cache, tmp_path):
    local = tmp_path / "checkpoint"
    local.mkdir()
    assert is_local_model(str(local)) and not is_local_model(MODEL)
    fleet = Fleet(gpu_arms(str(local)), log_dir=str(tmp_path / "logs"), progress=lambda _: None,
                  placement_timeout_s=30, model_cache=cache, weights_source=hub)
    try:
        fleet.create_actors()
        assert fleet.stage_weights() == 0.0 and fleet.staged == [] and downloads(hub) == []
        cmd, env = ray.get(fleet.replicas[0].actor.planned_launch.remote(1234))
        assert cmd[cmd.index("--model") + 1] == str(local) and "HF_HUB_OFFLINE" not in env
    finally:
        fleet.teardown()


def test_a_staging_failure_stops_the_fleet_start_naming_the_node(two_gpu_nodes, cache, tmp_path):
    fleet = Fleet(gpu_arms("example-org/not-there"), log_dir=str(tmp_path / "logs"), progress=lambda _: None,
                  placement_timeout_s=30, model_cache=cache, weights_source=DirectorySource(root=str(tmp_path)))
    with pytest.raises(FleetStartError, match=r"weights: staging example-org/not-there .* on node .*no snapshot"):
        fleet.start(timeout_s=120)
    assert fleet.replicas == [] and _gpus_free(2)


def _gpus_free(expected: float, timeout_s: float = 30) -> bool:
    """The fleet's GPUs are back (Ray frees a removed placement group's resources moments later)."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0) != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_replica_logs_are_copied_back_capped_and_redacted_and_a_lost_one_is_named(two_gpu_nodes, tmp_path):
    back = tmp_path / "run" / "replica-logs"
    fleet = Fleet(gpu_arms("/models/any"), log_dir=str(tmp_path / "logs"), progress=(said := []).append,
                  placement_timeout_s=30, logs_back_to=str(back), log_copy_bytes=2000,
                  redact_log=lambda text: text.replace("hf_secret_token_1234", "<redacted>"))
    fleet.create_actors()
    for r in fleet.replicas:
        r.status = ray.get(r.actor.status.remote())
    # the servers' logs as their nodes hold them (a stand-in for a server's output: no vLLM starts here)
    logs = Path(fleet.log_dir)
    (logs / "baseline-0.log").write_text("INFO start\n" + "x" * 5000 + "\nERROR token hf_secret_token_1234 refused\n")
    (logs / "canary-0.log").write_text("INFO serving\n")
    lost = next(r for r in fleet.replicas if r.name == "canary-0")
    ray.kill(lost.actor)
    fleet.teardown()
    copied = (back / "baseline-0.log").read_text()
    assert copied.startswith("INFO start") and copied.rstrip().endswith("<redacted> refused")
    assert "hf_secret_token_1234" not in copied and "bytes of this log cut here" in copied
    assert len(copied.encode()) < 2200
    assert not (back / "canary-0.log").exists()
    line = next(s for s in said if "canary-0" in s and "not copied back" in s)
    assert f"on node {lost.status.node_ip}" in line


def plan_config(cache: str) -> "RolloutConfig":
    from rollout.config import parse_config

    engine = {"model": MODEL, "served_model_name": "tiny", "device": "gpu", "startup_timeout_s": 60,
              "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}
    k3 = {**engine, "speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}
    return parse_config({
        "name": "staging-plan", "model_cache": cache, "accuracy": {"enabled": False},
        "baseline": {"engine": engine, "cpus_per_replica": 1}, "canary": {"engine": k3, "cpus_per_replica": 1},
    })


def test_plan_says_per_node_whether_the_weights_are_cached(two_gpu_nodes, hub, cache):
    from rollout.run import cluster_plan

    cfg = plan_config(cache)
    before = cluster_plan.make_plan(cfg, modules=("ray",))
    replica_nodes = [n for n in before.nodes if n.weights]
    assert sorted(n.node_id for n in replica_nodes) == sorted(node for node, _ in two_gpu_nodes)
    assert all(n.weights == {MODEL: None} for n in replica_nodes)
    assert sum("not cached on node" in note for note in before.notes) == 2 and before.ok  # a note, not a failure
    stage_on_nodes({two_gpu_nodes[0][0]: [MODEL]}, cache, hub, progress=lambda _: None)
    after = {n.node_id: n.weights[MODEL] for n in cluster_plan.make_plan(cfg, modules=("ray",)).nodes if n.weights}
    staged, other = two_gpu_nodes[0][0], two_gpu_nodes[1][0]
    assert after[staged]["files"] == 4 and after[staged]["path"].endswith(MODEL.replace("/", "--"))
    assert after[other] is None
    assert "weights example-org/tiny-snapshot: cached at" in cluster_plan.render(cluster_plan.make_plan(cfg, modules=("ray",)))


def test_a_relative_model_cache_is_a_config_error_naming_the_field(tmp_path):
    import yaml

    from rollout.config import ConfigError, load_config

    cfg = plan_config("/abs").model_dump(mode="json")
    cfg["model_cache"] = "cache/hf"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as bad:
        load_config(path)
    message = str(bad.value)
    assert "model_cache" in message and "relative" in message and "\n" not in message
    for fine in ("/mnt/nvme/hf", "$LOCAL_SSD/hf", "~/hf"):
        assert plan_config(fine).model_cache == fine


def test_a_hub_token_in_an_engines_env_with_model_cache_is_refused_naming_the_field():
    from rollout.config import ConfigError, parse_config

    cfg = plan_config("/abs").model_dump(mode="json")
    for side in ("baseline", "canary"):  # both: the arms may not differ in env (engine parity)
        cfg[side]["engine"]["env"] = {"HF_TOKEN": "hf_not_here"}
    with pytest.raises(ConfigError) as bad:
        parse_config(cfg)
    assert "baseline.engine.env.HF_TOKEN" in str(bad.value) and "runtime-env" in str(bad.value)
    assert "hf_not_here" not in str(bad.value)


def test_a_pinned_revision_with_model_cache_is_refused_naming_the_field():
    from rollout.config import ConfigError, parse_config

    cfg = plan_config("/abs").model_dump(mode="json")
    for side in ("baseline", "canary"):
        cfg[side]["engine"]["extra_args"] = ["--revision=abc123"]
    with pytest.raises(ConfigError) as bad:
        parse_config(cfg)
    assert "baseline.engine.extra_args" in str(bad.value) and "--revision" in str(bad.value)
    cfg.pop("model_cache")  # without staging vLLM fetches the pinned revision itself
    assert parse_config(cfg).baseline.engine.extra_args == ["--revision=abc123"]
