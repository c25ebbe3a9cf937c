"""Fault corpus, the scrape's side: a replica (or an `endpoints:` server) whose /metrics is hostile.

A per-position counter with position="999999999" would allocate a tuple that long; a page that
never ends would hold the scrape forever and grow without bound. Each fails its scrape with a
MetricsPageError (the fleet leaves that replica's data out: missing, never zero), within a
bound. The target is the named fault server (tests/hostile_server.py).
"""

from __future__ import annotations

import sys
import time

import pytest

from cluster.external_replica import ExternalReplicaServer
from cluster.metrics import MetricsPageError, fetch_metrics_text, parse_metrics
from tests.conftest import REPO

sys.path.insert(0, str(REPO))
from tests.hostile_server import HUGE_POSITION_PAGE, HostileServer  # noqa: E402


def test_a_huge_position_label_is_refused_not_allocated():
    with pytest.raises(MetricsPageError, match="position '999999999'"):
        parse_metrics(HUGE_POSITION_PAGE)
    page = HUGE_POSITION_PAGE.replace("999999999", "2")
    assert parse_metrics(page).spec_decode.accepted_per_position == (0.0, 0.0, 1.0)


def test_a_page_that_never_ends_fails_the_scrape_within_its_caps():
    with HostileServer() as server:
        started = time.monotonic()
        with pytest.raises(MetricsPageError, match="ran past 1048576 bytes"):
            fetch_metrics_text(f"{server.url}/metrics/endless", timeout_s=10, max_bytes=1 << 20)
        with pytest.raises(MetricsPageError, match="longer than 0.5 s"):
            fetch_metrics_text(f"{server.url}/metrics/endless", timeout_s=10, deadline_s=0.5, max_bytes=1 << 40)
    assert time.monotonic() - started < 60


def test_an_endpoint_replica_scrapes_through_the_caps():
    with HostileServer() as server:
        replica = ExternalReplicaServer("b0", "baseline", server.url, metrics_url=f"{server.url}/metrics/huge-position")
        with pytest.raises(MetricsPageError):
            replica.metrics()


def test_the_servers_finished_requests_are_read():
    page = "# TYPE vllm:request_success_total counter\n" \
           'vllm:request_success_total{finished_reason="length"} 7.0\n' \
           'vllm:request_success_total{finished_reason="stop"} 3.0\n'
    assert parse_metrics(page).requests_finished == 10.0


def test_an_endpoint_whose_health_and_version_never_end_answers_at_once():
    with HostileServer() as server:
        replica = ExternalReplicaServer("b0", "baseline", server.url)
        started = time.monotonic()
        assert replica._health(5.0) is True  # the status line is the answer; the body is never read
        assert replica.environment()["packages"]["vllm"] is None  # a cut, unparsable answer: unknown
    assert time.monotonic() - started < 30
