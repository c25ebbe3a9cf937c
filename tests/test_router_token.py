"""A router that requires a bearer token lets the run's own clients in: Locust (token in its
environment) and the accuracy evals (token given), and nothing without it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.stream_target import TargetProcess
from loadtests.options import BEARER_TOKEN_ENV, TrafficOptions
from loadtests.records import read_records
from loadtests.swarm import Swarm, SwarmSpec
from rollout.evals import EvalSpec, evaluate_batch, load_items
from tests.test_router_limits import Harness

TOKEN = "per-run-token-for-tests-0123456789"


@pytest.fixture(scope="module")
def routed() -> Iterator[str]:
    harness = Harness()
    with TargetProcess(ttft_ms=5, tpot_ms=2) as target:

        async def make() -> str:
            from cluster.router import RouterServer

            server = RouterServer(initial_weights={"baseline": 100.0})
            url = await server.start(token=TOKEN)  # what the controller hands the router it starts
            await server.set_arms({"baseline": [target.url]})
            harness._routers.append(server)
            return url

        try:
            yield harness.run(make())
        finally:
            harness.close()


def swarm(url: str, tmp_path, env: dict[str, str]) -> list:
    # 8 s of load: at a quarter of a fast machine's speed, Locust's start and the first requests
    # took most of 3 s and no request completed before the stop (the test saw no record)
    spec = SwarmSpec(host=url, users=2, run_time_s=8, n_workers=0, stop_timeout_s=5, env=env,
                     traffic=TrafficOptions(records=str(tmp_path / "r.jsonl"), max_tokens=4))
    assert "TOKEN" not in repr(spec) and TOKEN not in repr(spec)  # a logged spec never shows it
    Swarm(spec).run(timeout_s=120)
    return read_records(tmp_path / "r.jsonl")


def test_locust_with_the_token_in_its_environment_is_let_in(routed, tmp_path):
    # (requests still in flight when the load stops are recorded as cancelled: no status)
    records = [r for r in swarm(routed, tmp_path, {BEARER_TOKEN_ENV: TOKEN}) if not r.cancelled]
    assert records and all(r.status == 200 for r in records), {r.status for r in records}
    (tmp_path / "no").mkdir()
    refused = [r for r in swarm(routed, tmp_path / "no", {}) if not r.cancelled]
    assert refused and all(r.status == 401 for r in refused), {r.status for r in refused}


def test_the_evals_send_the_token_they_are_given(routed):
    items = load_items(EvalSpec(kind="gsm8k", limit=2, num_fewshot=0))
    spec = EvalSpec(max_tokens=4, concurrency=1, request_timeout_s=30)
    without = evaluate_batch(routed, "m", items, ["baseline"], spec)["baseline"]
    assert all(o.error and "HTTP 401" in o.error for o in without)
    given = evaluate_batch(routed, "m", items, ["baseline"], spec, token=TOKEN)["baseline"]
    assert not any(o.error and "HTTP 401" in o.error for o in given), [o.error for o in given]


def test_the_run_makes_a_token_beyond_loopback_and_takes_the_operators_when_set(monkeypatch):
    from rollout.config import load_config
    from rollout.run.phases.setup import router_token
    from tests.conftest import REPO

    cfg = load_config(REPO / "configs" / "local-cpu.yaml")
    monkeypatch.delenv(cfg.router.auth_token_env, raising=False)
    assert router_token(cfg) is None  # loopback: only this machine reaches it
    wide = cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"bind_host": "0.0.0.0"})})
    made = router_token(wide)
    assert made and len(made) >= 32 and router_token(wide) != made  # one per run, unguessable
    monkeypatch.setenv(cfg.router.auth_token_env, "operator-chosen-token")
    assert router_token(wide) == "operator-chosen-token" == router_token(cfg)


UPSTREAM_KEY = "sk-engine-key-for-tests-9876543210"


def test_a_replica_started_with_an_api_key_gets_it_from_the_router_and_never_the_clients_token(tmp_path):
    """Engines with --api-key: the router sends the replica's own key (the client's Authorization,
    here the router's token, is not it); without the key the replica refuses (401, an error)."""
    harness = Harness()
    with TargetProcess(ttft_ms=5, tpot_ms=2, api_key=UPSTREAM_KEY) as target:

        async def make(keys: dict[str, str] | None) -> str:
            from cluster.router import RouterServer

            server = RouterServer(initial_weights={"baseline": 100.0})
            url = await server.start(token=TOKEN)
            await server.set_arms({"baseline": [target.url]}, upstream_keys=keys)
            state = await server.get_state()
            assert UPSTREAM_KEY not in repr(state)  # /router/state never shows it
            harness._routers.append(server)
            return url

        try:
            keyed = harness.run(make({target.url: UPSTREAM_KEY}))
            records = [r for r in swarm(keyed, tmp_path, {BEARER_TOKEN_ENV: TOKEN}) if not r.cancelled]
            assert records and all(r.status == 200 for r in records), {r.status for r in records}
            items = load_items(EvalSpec(kind="gsm8k", limit=2, num_fewshot=0))
            spec = EvalSpec(max_tokens=4, concurrency=1, request_timeout_s=30)
            got = evaluate_batch(keyed, "m", items, ["baseline"], spec, token=TOKEN)["baseline"]
            assert not any(o.error for o in got), [o.error for o in got]

            unkeyed = harness.run(make(None))  # the same replica, its key not given to the router
            (tmp_path / "no").mkdir()
            refused = [r for r in swarm(unkeyed, tmp_path / "no", {BEARER_TOKEN_ENV: TOKEN}) if not r.cancelled]
            assert refused and all(r.status == 401 and not r.ok for r in refused), {r.status for r in refused}
        finally:
            harness.close()


def test_the_api_key_is_read_as_vllm_reads_it():
    from cluster.engine_spec import EngineSpec

    def key(extra_args: list[str], env: dict[str, str] | None = None) -> str | None:
        return EngineSpec(model="m", extra_args=extra_args, env=env or {}).api_key

    assert key(["--api-key=a"]) == "a"
    assert key(["--api_key", "a"]) == key(["--api-k", "a"]) == "a"  # '_' for '-', unambiguous prefixes
    assert key(["--max-num-seqs", "4"]) is None
    assert key([], {"VLLM_API_KEY": "e"}) == "e"
    assert key(["--api-key", "a"], {"VLLM_API_KEY": "e"}) == "a"  # the flag wins, as in vLLM


def test_the_api_key_reaches_vllm_by_its_environment_not_its_command_line():
    """vLLM logs its non-default arguments, and /proc shows a command line to every user: the key
    goes as $VLLM_API_KEY; two keys cannot (one line naming the flag)."""
    import pydantic

    from cluster.engine_spec import EngineSpec

    spec = EngineSpec(model="m", extra_args=["--max-num-seqs", "4", "--api_key", UPSTREAM_KEY, "--seed", "1"])
    cmd = spec.command(8000)
    assert UPSTREAM_KEY not in " ".join(cmd) and not any(a.startswith("--api") for a in cmd)
    assert cmd[-4:] == ["--max-num-seqs", "4", "--seed", "1"]
    assert spec.environment()["VLLM_API_KEY"] == UPSTREAM_KEY
    with pytest.raises(pydantic.ValidationError, match="--api-key takes one key"):
        EngineSpec(model="m", extra_args=["--api-key", "a", "b"])
