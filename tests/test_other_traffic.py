"""Other traffic on either arm blocks PROMOTE: each launched replica's finished requests
(vllm:request_success_total) against what the router sent it over the experiment.

Someone on the cluster network who loads the baseline makes the canary look faster; the
experiment cannot judge arms that served someone else. The check reads the replicas' /metrics
and the router's per-replica counts before and after the phase (rollout.run.phases.experiment).
"""

from __future__ import annotations

from types import SimpleNamespace

from cluster.metrics import MetricsSnapshot, requests_not_routed
from rollout.config import load_config
from rollout.judge.verdicts import Decision, Verdict, decide
from rollout.run.phases.experiment import OTHER_TRAFFIC_CHECK, _check_other_traffic, _request_counts
from tests.conftest import REPO


def test_requests_the_router_did_not_send_are_counted_per_replica():
    finished = {"b": 120.0, "c": 100.0}
    routed = {"b": 100.0, "c": 100.0}
    assert requests_not_routed(finished, routed, {"b": 4}) == {"b": 16}
    # requests in flight when the window opened finish inside it: not someone else's
    assert requests_not_routed({"b": 104.0}, {"b": 100.0}, {"b": 4}) == {}


def _ctx(finished: dict[str, float], routed: dict[str, int]):
    cfg = load_config(REPO / "configs" / "local-cpu.yaml")
    replicas = [SimpleNamespace(name="baseline-0", arm="baseline", url="http://127.0.0.1:8001/"),
                SimpleNamespace(name="canary-0", arm="canary", url="http://127.0.0.1:8002")]
    fleet = SimpleNamespace(replicas=replicas, metrics=lambda: {
        name: MetricsSnapshot(requests_finished=finished[name]) for name in finished})
    router = SimpleNamespace(state=lambda: {"replica_counts": {
        "http://127.0.0.1:8001": {"arm": "baseline", "routed": routed["baseline-0"], "in_flight": 2},
        "http://127.0.0.1:8002": {"arm": "canary", "routed": routed["canary-0"], "in_flight": 2}}})
    said: list[str] = []
    return SimpleNamespace(cfg=cfg, fleet=fleet, router=router, say=said.append, result=SimpleNamespace(gates=[])), said


def test_other_traffic_on_an_arm_blocks_promote():
    ctx, said = _ctx({"baseline-0": 10.0, "canary-0": 10.0}, {"baseline-0": 10, "canary-0": 10})
    before = _request_counts(ctx)
    ctx.fleet.metrics = lambda: {"baseline-0": MetricsSnapshot(requests_finished=250.0),
                                 "canary-0": MetricsSnapshot(requests_finished=210.0)}
    ctx.router.state = lambda: {"replica_counts": {
        "http://127.0.0.1:8001": {"arm": "baseline", "routed": 210, "in_flight": 0},
        "http://127.0.0.1:8002": {"arm": "canary", "routed": 210, "in_flight": 0}}}
    _check_other_traffic(ctx, before, _request_counts(ctx))
    [check] = ctx.result.gates
    assert check.name == OTHER_TRAFFIC_CHECK and check.verdict == Verdict.INCONCLUSIVE
    assert "http://127.0.0.1:8001 (baseline) finished 38 requests the router did not send" in check.detail
    assert any("other traffic" in line for line in said)
    passing = [check.model_copy(update={"name": "tpot_p50_improvement", "verdict": Verdict.PASS}), check]
    assert decide(passing, ctx.cfg.gates) != Decision.PROMOTE


def test_the_experiments_own_traffic_adds_no_check():
    ctx, _ = _ctx({"baseline-0": 10.0, "canary-0": 10.0}, {"baseline-0": 10, "canary-0": 10})
    before = _request_counts(ctx)
    ctx.fleet.metrics = lambda: {"baseline-0": MetricsSnapshot(requests_finished=212.0),
                                 "canary-0": MetricsSnapshot(requests_finished=210.0)}
    ctx.router.state = lambda: {"replica_counts": {
        "http://127.0.0.1:8001": {"arm": "baseline", "routed": 210, "in_flight": 1},
        "http://127.0.0.1:8002": {"arm": "canary", "routed": 210, "in_flight": 1}}}
    _check_other_traffic(ctx, before, _request_counts(ctx))
    assert ctx.result.gates == []
