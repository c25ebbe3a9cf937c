"""A launched replica bound beyond loopback requires a key of its own on /v1.

Without one, anyone on the cluster network could load the baseline and make the canary look
faster. The key is made in the replica's actor, reaches vLLM by $VLLM_API_KEY (never the command
line, which `ps` shows every user), and reaches the fleet over Ray: the router and the preflight
send it, and a run that adopts the replicas after a crash asks the same actors for it (nothing
in the runs directory holds it).
"""

from __future__ import annotations

import pytest
import ray

from cluster.engine_spec import API_KEY_ENV, EngineSpec
from cluster.fleet import ArmSpec, Fleet, ReplicaHandle
from cluster.replica import ReplicaState, ReplicaStatus, VLLMReplicaServer


def _engine(**kw) -> EngineSpec:
    return EngineSpec(model="m", device="cpu", **kw)


def test_a_replica_beyond_loopback_gets_a_key_in_its_environment_never_its_command(tmp_path):
    wide = VLLMReplicaServer("canary-0", "canary", _engine(), str(tmp_path), host="0.0.0.0")
    command, env = wide.planned_launch(8000)
    key = env[API_KEY_ENV]
    assert len(key) >= 32 and wide.api_key() == key
    assert not any(key in arg for arg in command) and "--api-key" not in command
    other = VLLMReplicaServer("canary-1", "canary", _engine(), str(tmp_path), host="10.0.0.7")
    assert other.api_key() not in (None, key)  # each server its own


def test_a_loopback_replica_stays_open_and_a_configured_key_wins(tmp_path):
    for host in ("127.0.0.1", "localhost"):
        local = VLLMReplicaServer("b-0", "baseline", _engine(), str(tmp_path), host=host)
        assert API_KEY_ENV not in local.planned_launch(8000)[1] and local.api_key() is None
    configured = VLLMReplicaServer("b-0", "baseline", _engine(env={API_KEY_ENV: "theirs"}), str(tmp_path),
                                   host="0.0.0.0")
    assert configured.planned_launch(8000)[1][API_KEY_ENV] == "theirs" and configured.api_key() == "theirs"


def test_upstream_keys_hold_each_replicas_own_key_and_the_configured_ones(tmp_path):
    arms = [ArmSpec(name="baseline", engine=_engine(env={API_KEY_ENV: "theirs"})), ArmSpec(name="canary", engine=_engine())]
    fleet = Fleet(arms, log_dir=str(tmp_path), progress=lambda m: None)
    ready = lambda url: ReplicaStatus(name="x", arm="x", state=ReplicaState.READY, url=url)  # noqa: E731
    fleet.replicas = [ReplicaHandle("baseline-0", "baseline", None, ready("http://a:1")),
                      ReplicaHandle("canary-0", "canary", None, ready("http://b:2"), api_key="own")]
    assert fleet.upstream_keys() == {"http://a:1": "theirs", "http://b:2": "own"}
    assert "own" not in repr(fleet.replicas[1])


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_resumed_fleet_asks_the_adopted_actors_for_the_same_keys(local_ray, tmp_path):
    """The keys live in the replicas' actors: a second fleet (a resumed run's) that finds them by
    name gets the keys their servers were started with, without reading anything from disk."""
    arms = [ArmSpec(name="baseline", engine=_engine()), ArmSpec(name="canary", engine=_engine())]
    first = Fleet(arms, log_dir=str(tmp_path), progress=lambda m: None, actor_name_prefix="keyrun-",
                  bind_host="0.0.0.0")
    try:
        handles = first.create_actors()
        planned = ray.get([h.actor.planned_launch.remote(8000) for h in handles])
        first._take_keys(handles)
        assert [h.api_key for h in handles] == [env[API_KEY_ENV] for _, env in planned]
        assert len({h.api_key for h in handles}) == 2
        again = Fleet(arms, log_dir=str(tmp_path), progress=lambda m: None, actor_name_prefix="keyrun-",
                      bind_host="0.0.0.0")
        adopted = [ReplicaHandle(name, arm, again._find(name)) for name, arm in again.planned_names()]
        again._take_keys(adopted)
        assert [h.api_key for h in adopted] == [h.api_key for h in handles]
    finally:
        first.teardown()
