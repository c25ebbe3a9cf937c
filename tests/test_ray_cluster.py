"""`ray.address: local` is a Ray instance of the run's own, whatever else runs on the machine.

A CI-like run's CLI test once joined a cluster another test had started (`ray.init()` without
an address finds a running local cluster) and failed on "num_cpus must not be provided". Ray's
`address="local"` is documented to start a new local instance even when one is running; this
checks connect() asks for exactly that (a real second cluster costs a minute on a slow machine).
"""

from __future__ import annotations

import ray

from cluster import ray_cluster


def test_local_asks_ray_for_a_new_instance_never_an_existing_one(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 1.0})
    ray_cluster.connect("local", local_num_cpus=1)
    assert calls[-1]["address"] == "local" and calls[-1]["num_cpus"] == 1

    def no_cluster(**kw):  # "auto" with nothing to join falls back to a new local instance too
        calls.append(kw)
        if kw.get("address") == "auto":
            raise ConnectionError("no cluster")

    monkeypatch.setattr(ray, "init", no_cluster)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_cluster.connect("auto", local_num_cpus=1)
    assert [c["address"] for c in calls[-2:]] == ["auto", "local"]
