"""The live metrics endpoint beyond loopback needs a bearer token (rollout.run.live_metrics).

Its series tell anyone who reaches the port the run's gates and traffic as they are judged:
bound to 0.0.0.0 without $MTP_CANARY_METRICS_TOKEN it does not start (the controller's
infrastructure error names metrics.host); with the token, a scrape without it gets 401.
"""

from __future__ import annotations

import pytest
import requests

from rollout.run.live_metrics import METRICS_TOKEN_ENV, LiveMetrics


def test_beyond_loopback_without_a_token_it_does_not_start(tmp_path, monkeypatch):
    monkeypatch.delenv(METRICS_TOKEN_ENV, raising=False)
    with pytest.raises(OSError, match="metrics.host 0.0.0.0 is beyond loopback"):
        LiveMetrics(tmp_path / "history.db", "r1", router_state=lambda: None, host="0.0.0.0", port=0)


def test_with_a_token_a_scrape_needs_it(tmp_path, monkeypatch):
    monkeypatch.setenv(METRICS_TOKEN_ENV, "m3trics")
    live = LiveMetrics(tmp_path / "history.db", "r1", router_state=lambda: None, host="0.0.0.0", port=0)
    try:
        url = live.url.replace("0.0.0.0", "127.0.0.1")
        assert requests.get(url, timeout=10).status_code == 401
        assert requests.get(url, timeout=10, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert requests.get(url, timeout=10, headers={"Authorization": "Bearer m3trics"}).status_code == 200
    finally:
        live.stop(linger=False)


def test_on_loopback_it_stays_open(tmp_path, monkeypatch):
    monkeypatch.delenv(METRICS_TOKEN_ENV, raising=False)
    live = LiveMetrics(tmp_path / "history.db", "r1", router_state=lambda: None, port=0)
    try:
        assert requests.get(live.url, timeout=10).status_code == 200
    finally:
        live.stop(linger=False)
