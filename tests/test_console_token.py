"""A console beyond loopback needs a router token the operator chose ($MTP_CANARY_ROUTER_TOKEN by
default), as README says: a token the run made for itself (a router beyond loopback gets one)
would guard Promote / Abort with a secret nobody can type (rollout.run.phases.web_ui.with_console)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from loadtests.options import TrafficOptions
from loadtests.swarm import SwarmSpec
from rollout.config import load_config
from rollout.run.phases.web_ui import with_console
from rollout.run.context import InfrastructureError
from tests.conftest import REPO


def _ctx(tmp_path: Path, made_token: str | None):
    cfg = load_config(REPO / "configs" / "local-cpu.yaml")
    cfg = cfg.model_copy(update={"experiment": cfg.experiment.model_copy(update={"web_ui": True,
                                                                                 "web_host": "0.0.0.0"})})
    router = SimpleNamespace(client_env=lambda: {"MTP_CANARY_BEARER_TOKEN": made_token} if made_token else {})
    return SimpleNamespace(cfg=cfg, router=router, say=lambda line: None, run_id="r1", run_dir=tmp_path / "r1")


def _spec(tmp_path: Path) -> SwarmSpec:
    traffic = TrafficOptions(dataset="synthetic", records=str(tmp_path / "r.jsonl"))
    return SwarmSpec(host="http://127.0.0.1:9", traffic=traffic, users=1, run_time_s=1, n_workers=0)


def test_a_console_beyond_loopback_with_a_token_the_run_made_is_refused(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path, made_token="made-for-the-run")
    monkeypatch.delenv(ctx.cfg.router.auth_token_env, raising=False)
    with pytest.raises(InfrastructureError, match="experiment.web_host 0.0.0.0 is beyond loopback"):
        with_console(ctx, _spec(tmp_path), "experiment")


def test_a_console_beyond_loopback_with_a_chosen_token_is_served(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path, made_token="chosen")
    monkeypatch.setenv(ctx.cfg.router.auth_token_env, "chosen")
    assert with_console(ctx, _spec(tmp_path), "experiment").web_host == "0.0.0.0"
