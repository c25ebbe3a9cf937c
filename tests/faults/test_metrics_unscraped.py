"""Fault corpus: the canary's /metrics answers 500 during the experiment.

Acceptance then is unknown, not zero and not fine: the acceptance gate stays INCONCLUSIVE and
the run cannot PROMOTE, however good the latency. Real Router actor, real Locust, real SQLite,
the scrape over real HTTP; the replicas are the named benchmark target, the canary's with its
/metrics fault (--metrics-status 500).
"""

from __future__ import annotations


import requests

from benchmarks.stream_target import TargetProcess
from cluster.metrics import parse_metrics
from rollout.config import ExperimentConfig
from rollout.judge.config import GatesConfig
from rollout.judge.verdicts import Decision, Verdict, decide
from tests.experiment_harness import routed, run_experiment


def scrape_like_the_fleet(urls: dict[str, str]):
    """Fleet.metrics: replica name -> snapshot; a replica whose /metrics fails is left out."""

    def scrape() -> dict:
        out = {}
        for name, url in urls.items():
            try:
                response = requests.get(f"{url}/metrics", timeout=5)
                response.raise_for_status()
                out[name] = parse_metrics(response.text)
            except requests.RequestException:
                pass
        return out

    return scrape


def test_an_unscrapable_canary_leaves_acceptance_open_and_the_run_unpromoted(local_ray, tmp_path, monkeypatch):
    exp = ExperimentConfig(requests_per_look=40, requests_per_arm=120, window_s=1, users_per_replica=3, max_tokens=12,
                           max_duration_s=240, workers=1, worker_placement="local")
    gates = GatesConfig(min_acceptance_length=1.5, error_rate_max_increase=0.5, min_requests_per_arm=20,
                        enabled=["tpot_p50_improvement", "error_rate_guard", "acceptance_length_floor"])
    with TargetProcess(ttft_ms=20, tpot_ms=20) as baseline, TargetProcess(ttft_ms=20, tpot_ms=8, metrics_status=500) as canary:
        scrape = scrape_like_the_fleet({"baseline-0": baseline.url, "canary-0": canary.url})
        assert set(scrape()) == {"baseline-0"}  # the fault: the canary's /metrics answers 500
        with routed(baseline.url, canary.url) as (router, url):
            outcome, _, _ = run_experiment(tmp_path, router, url, exp, gates, scrape=scrape,
                                           replica_arms={"baseline-0": "baseline", "canary-0": "canary"},
                                           speculative_canary=True)
    by_name = {g.name: g for g in outcome.gates}
    assert by_name["tpot_p50_improvement"].verdict == Verdict.PASS  # 2.5x faster: the latency is not in doubt
    assert by_name["acceptance_length_floor"].verdict == Verdict.INCONCLUSIVE, by_name["acceptance_length_floor"]
    assert decide(outcome.gates, gates) != Decision.PROMOTE
