"""Fault corpus: an interrupt (Ctrl-C, SIGTERM) while the fleet waits for the cluster to place the GPU
replicas. The run's placement group is detached (a resumed controller adopts it): nobody would free
its bundles if the fleet let go of it before placement succeeded. Real Ray, a cluster with no GPU
(the wait never ends by itself); no vLLM is started.
"""

from __future__ import annotations

import pytest
import ray

from cluster import fleet as fleet_module
from cluster.engine_spec import EngineSpec
from cluster.fleet import ArmSpec, Fleet


def live_groups() -> list[dict]:
    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def test_an_interrupt_during_the_gpu_placement_wait_leaves_no_group_reserved(local_ray, tmp_path, monkeypatch):
    real_wait = fleet_module._wait_placement
    waited = []

    def interrupted_wait(pg, timeout_s, progress, every_s=30.0):
        def ctrl_c(line: str) -> None:  # the wait's progress line: the group exists and is pending
            waited.append([g["state"] for g in live_groups()])
            raise KeyboardInterrupt

        return real_wait(pg, timeout_s, ctrl_c, every_s=0.5)

    monkeypatch.setattr(fleet_module, "_wait_placement", interrupted_wait)
    gpu = EngineSpec(model="some/model", device="gpu")
    fleet = Fleet([ArmSpec(name="baseline", engine=gpu), ArmSpec(name="canary", engine=gpu)],
                  log_dir=str(tmp_path / "logs"), progress=lambda line: None, actor_name_prefix="replica-",
                  namespace="placement-interrupted", detached=True, lease_s=60, placement_timeout_s=600)
    with pytest.raises(KeyboardInterrupt):
        fleet.start(timeout_s=900)
    assert waited == [["PENDING"]]
    assert live_groups() == []
    assert fleet.replicas == []
