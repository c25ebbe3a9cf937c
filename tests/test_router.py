"""Tests of cluster/router.py: the pure routing core, then the Ray actor over real HTTP.

The router's upstreams here are `UpstreamDouble`s: minimal aiohttp servers in a
background thread that answer with their own name, as an SSE stream of a few
chunks. They are test doubles for "some HTTP server behind the router", not a
fake vLLM; the router against real vLLM replicas is covered by the end-to-end tests.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import pytest
import ray
import requests
from aiohttp import web

from cluster.arms import ARM_HEADER
from cluster.router import (
    REPLICA_HEADER,
    ArmSelector,
    ArmWeights,
    Router,
    RouterServer,
    pick_replica,
)

# --------------------------------------------------------------------------
# Pure core
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weights, complaint",
    [
        ({}, "non-empty"),
        ({"baseline": -1, "canary": 50}, "within 0..100"),
        ({"baseline": 100.5}, "within 0..100"),
        ({"baseline": float("nan"), "canary": 10}, "within 0..100"),
        ({"baseline": 0, "canary": 0}, "positive weight"),
        ({"baseline": "80"}, "must be a number"),
        ({"baseline": True}, "must be a number"),
        ({"": 10}, "non-empty string"),
    ],
)
def test_arm_weights_rejects_invalid_tables(weights: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        ArmWeights(weights)


def test_arm_weights_default_sends_everything_to_baseline() -> None:
    weights = ArmWeights()
    assert weights.share("baseline") == 1.0
    assert weights.weight("canary") == 0.0
    assert weights.positive_arms() == ["baseline"]
    assert ArmWeights({"baseline": 4, "canary": 1}).share("canary") == pytest.approx(0.2)


def _picks(selector: ArmSelector, n: int) -> list[str]:
    return [selector.choose() for _ in range(n)]


def test_selector_split_tracks_weights_within_one_block_at_every_prefix() -> None:
    block_size = 10
    selector = ArmSelector(ArmWeights({"baseline": 80, "canary": 20}), random.Random(1), block_size=block_size)
    picks = _picks(selector, 200)
    assert Counter(picks) == {"baseline": 160, "canary": 40}
    canary_so_far = 0
    for n, arm in enumerate(picks, start=1):
        canary_so_far += arm == "canary"
        assert abs(canary_so_far - 0.2 * n) <= block_size

    # A share that does not divide the block still converges (credits carry over).
    uneven = ArmSelector(ArmWeights({"baseline": 67, "canary": 33}), random.Random(2), block_size=block_size)
    assert abs(Counter(_picks(uneven, 3000))["canary"] - 990) <= block_size


def test_selector_never_picks_zero_weight_and_always_picks_full_weight() -> None:
    only_baseline = ArmSelector(ArmWeights({"baseline": 100, "canary": 0}), random.Random(3))
    assert set(_picks(only_baseline, 1000)) == {"baseline"}
    only_canary = ArmSelector(ArmWeights({"baseline": 0, "canary": 100}), random.Random(4))
    assert set(_picks(only_canary, 1000)) == {"canary"}


def test_selector_weight_change_applies_from_the_very_next_pick() -> None:
    selector = ArmSelector(ArmWeights({"baseline": 50, "canary": 50}), random.Random(5), block_size=10)
    _picks(selector, 3)  # mid-block: the rest of the block still holds canary picks
    selector.set_weights(ArmWeights({"baseline": 100, "canary": 0}))
    assert set(_picks(selector, 100)) == {"baseline"}


def test_selector_is_randomized_so_periodic_request_streams_are_not_confounded() -> None:
    # A strict round-robin would send every even-numbered request to one arm.
    # Blocked randomization gives each position of a period-2 stream both arms.
    selector = ArmSelector(ArmWeights({"baseline": 50, "canary": 50}), random.Random(6), block_size=10)
    picks = _picks(selector, 2000)
    canary_share_at_even_positions = sum(arm == "canary" for arm in picks[0::2]) / 1000
    assert 0.4 < canary_share_at_even_positions < 0.6


def test_selector_reasserting_same_weights_does_not_starve_a_small_arm() -> None:
    weights = {"baseline": 95, "canary": 5}
    selector = ArmSelector(ArmWeights(weights), random.Random(7), block_size=10)
    picks: list[str] = []
    for _ in range(40):
        selector.set_weights(ArmWeights(dict(weights)))  # a controller re-asserting its step
        picks += _picks(selector, 10)
    assert abs(Counter(picks)["canary"] - 20) <= 10


def test_pick_replica_prefers_least_outstanding_and_rotates_ties() -> None:
    assert pick_replica({"http://a": 3, "http://b": 1, "http://c": 2}, turn=0) == "http://b"
    idle = {"http://a": 0, "http://b": 0, "http://c": 0}
    assert [pick_replica(idle, turn) for turn in range(6)] == ["http://a", "http://b", "http://c"] * 2
    busy_a = {"http://a": 1, "http://b": 0, "http://c": 0}
    assert {pick_replica(busy_a, turn) for turn in range(4)} == {"http://b", "http://c"}
    with pytest.raises(ValueError):
        pick_replica({}, turn=0)


# --------------------------------------------------------------------------
# Upstream test doubles
# --------------------------------------------------------------------------


class UpstreamDouble:
    """A minimal HTTP upstream for the router, in its own thread and event loop.

    POST /v1/completions streams `chunks` SSE events naming this upstream,
    sleeping `chunk_delay_s` between them; `status` != 200 answers that status
    with a JSON error instead; `die_after_chunks` drops the connection mid-stream.
    GET /v1/models answers its name and the raw path (with query) it received.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.received_headers: list[dict[str, str]] = []
        self.streams_cut_by_peer = 0  # streams whose connection the router closed before the end
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"upstream-{name}", daemon=True)
        self.url = ""

    def start(self) -> str:
        self._thread.start()
        assert self._ready.wait(10), f"upstream double {self.name} did not start"
        return self.url

    def stop(self) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        self._loop.run_until_complete(self._runner.setup())
        listening_socket = socket.create_server(("127.0.0.1", 0))
        self._loop.run_until_complete(web.SockSite(self._runner, listening_socket).start())
        self.url = f"http://127.0.0.1:{listening_socket.getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.received_headers.append(dict(request.headers))
        params = await request.json()
        if params.get("status", 200) != 200:
            return web.json_response({"error": {"message": f"{self.name} says no"}}, status=params["status"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for index in range(params.get("chunks", 3)):
                if index == params.get("die_after_chunks"):
                    assert request.transport is not None
                    request.transport.abort()
                    return response
                if index > 0:
                    await asyncio.sleep(params.get("chunk_delay_s", 0.0))
                await response.write(f"data: {json.dumps({'upstream': self.name, 'index': index})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:
            self.streams_cut_by_peer += 1
        return response

    async def _models(self, request: web.Request) -> web.Response:
        self.received_headers.append(dict(request.headers))
        return web.json_response({"upstream": self.name, "raw_path": request.raw_path})


# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------

ROUTER_NAME = "router-under-test"
ROUTER_NAMESPACE = "mtp-canary-tests"


@pytest.fixture(scope="module")
def upstreams() -> Iterator[dict[str, UpstreamDouble]]:
    doubles = {name: UpstreamDouble(name) for name in ("baseline-0", "baseline-1", "canary-0")}
    for double in doubles.values():
        double.start()
    yield doubles
    for double in doubles.values():
        double.stop()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    # a new instance of its own: ray.init() would join a `ray start`ed cluster on this machine
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def router_actor(ray_cluster: None) -> Iterator[tuple[Any, str]]:
    actor = Router.options(name=ROUTER_NAME, namespace=ROUTER_NAMESPACE).remote(seed=11)
    url = ray.get(actor.start.remote())
    yield actor, url
    ray.get(actor.stop.remote())
    ray.kill(actor)


@pytest.fixture
def router(router_actor: tuple[Any, str], upstreams: dict[str, UpstreamDouble]) -> tuple[Any, str]:
    """The module's router, reset to one baseline and one canary replica at 50/50."""
    actor, url = router_actor
    # Dropping the replicas first forgets their health: one test's failures must not eject a replica in the next.
    ray.get(actor.set_arms.remote({}))
    ray.get(actor.set_arms.remote({"baseline": [upstreams["baseline-0"].url], "canary": [upstreams["canary-0"].url]}))
    ray.get(actor.set_weights.remote({"baseline": 50, "canary": 50}))
    ray.get(actor.reset_counts.remote())
    return actor, url


def _complete(url: str, http: requests.Session, arm: str | None = None, **params: Any) -> requests.Response:
    headers = {ARM_HEADER: arm} if arm is not None else {}
    return http.post(f"{url}/v1/completions", json={"prompt": "hi", **params}, headers=headers, timeout=30)


def _complete_in_own_session(url: str, arm: str | None = None, **params: Any) -> requests.Response:
    with requests.Session() as http:
        return _complete(url, http, arm, **params)


def _upstream_names_in(sse_body: str) -> set[str]:
    events = [line[len("data: ") :] for line in sse_body.splitlines() if line.startswith("data: ")]
    return {json.loads(event)["upstream"] for event in events if event != "[DONE]"}


def _free_port_with_nothing_listening() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --------------------------------------------------------------------------
# The actor over HTTP
# --------------------------------------------------------------------------


def test_weighted_split_over_http_follows_weights(router: tuple[Any, str], upstreams: dict[str, UpstreamDouble]) -> None:
    actor, url = router
    ray.get(actor.set_weights.remote({"baseline": 80, "canary": 20}))
    arms_seen: Counter[str] = Counter()
    with requests.Session() as http:
        for _ in range(200):
            response = _complete(url, http)
            assert response.status_code == 200
            arm = response.headers[ARM_HEADER]
            arms_seen[arm] += 1
            # The tags tell the truth: the body came from the replica they name.
            (upstream_name,) = _upstream_names_in(response.text)
            assert upstream_name == f"{arm}-0"
            assert response.headers[REPLICA_HEADER] == upstreams[upstream_name].url
    assert abs(arms_seen["canary"] - 40) <= 10
    state = ray.get(actor.get_state.remote())
    assert state["weights"] == {"baseline": 80.0, "canary": 20.0}
    assert {arm: counts["routed"] for arm, counts in state["arm_counts"].items()} == dict(arms_seen)
    assert state["replica_counts"][upstreams["canary-0"].url]["routed"] == arms_seen["canary"]
    assert all(counts["in_flight"] == 0 and counts["errors"] == 0 for counts in state["arm_counts"].values())


def test_pinned_arm_overrides_weights_and_is_not_forwarded(
    router: tuple[Any, str], upstreams: dict[str, UpstreamDouble]
) -> None:
    actor, url = router
    ray.get(actor.set_weights.remote({"baseline": 100, "canary": 0}))
    with requests.Session() as http:
        for _ in range(5):
            response = _complete(url, http, arm="canary")
            assert response.status_code == 200
            assert response.headers[ARM_HEADER] == "canary"
            assert _upstream_names_in(response.text) == {"canary-0"}
    assert ARM_HEADER not in {name.lower() for name in upstreams["canary-0"].received_headers[-1]}


def test_unknown_pinned_arm_is_rejected_with_400(router: tuple[Any, str]) -> None:
    _, url = router
    response = requests.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers={ARM_HEADER: "canery"}, timeout=10)
    assert response.status_code == 400
    assert "unknown arm 'canery'" in response.json()["error"]["message"]


def test_arm_without_replicas_answers_503_pinned_or_weighted(
    router: tuple[Any, str], upstreams: dict[str, UpstreamDouble]
) -> None:
    actor, url = router
    ray.get(actor.set_arms.remote({"baseline": [upstreams["baseline-0"].url]}))
    with requests.Session() as http:
        pinned = _complete(url, http, arm="canary")
        assert pinned.status_code == 503
        assert "has no replicas" in pinned.json()["error"]["message"]
        ray.get(actor.set_weights.remote({"baseline": 0, "canary": 100}))
        weighted = _complete(url, http)
        assert weighted.status_code == 503
        assert weighted.headers[ARM_HEADER] == "canary"
    assert ray.get(actor.get_state.remote())["arm_counts"]["canary"]["rejected"] == 2


def test_sse_chunks_are_relayed_as_they_arrive(router: tuple[Any, str]) -> None:
    _, url = router
    chunk_delay_s, chunks = 0.4, 4

    async def read_with_arrival_times() -> list[tuple[float, bytes]]:
        arrivals: list[tuple[float, bytes]] = []
        async with aiohttp.ClientSession() as http:
            sent_at = time.monotonic()
            body = {"prompt": "hi", "stream": True, "chunks": chunks, "chunk_delay_s": chunk_delay_s}
            async with http.post(f"{url}/v1/completions", json=body, headers={ARM_HEADER: "baseline"}) as response:
                assert response.status == 200
                assert response.headers["Content-Type"].startswith("text/event-stream")
                async for data in response.content.iter_any():
                    arrivals.append((time.monotonic() - sent_at, data))
        return arrivals

    arrivals = asyncio.run(read_with_arrival_times())
    upstream_duration_s = (chunks - 1) * chunk_delay_s
    first_event_at = next(at for at, data in arrivals if b'"index": 0' in data)
    # The first event reached the client long before the upstream finished...
    assert first_event_at < upstream_duration_s / 2
    # ...and each later event arrived on its own, about one delay after the previous.
    event_times = [next(at for at, data in arrivals if f'"index": {i}'.encode() in data) for i in range(chunks)]
    gaps = [later - earlier for earlier, later in zip(event_times, event_times[1:])]
    assert all(gap > chunk_delay_s / 2 for gap in gaps), gaps
    assert b"".join(data for _, data in arrivals).endswith(b"data: [DONE]\n\n")


def test_rollback_to_zero_canary_stops_new_canary_requests_at_once(router: tuple[Any, str]) -> None:
    actor, url = router
    with requests.Session() as http, ThreadPoolExecutor(max_workers=1) as pool:
        # A long canary stream is in flight when the rollback happens.
        in_flight = pool.submit(_complete_in_own_session, url, "canary", chunks=3, chunk_delay_s=1.0)
        deadline = time.monotonic() + 10
        while ray.get(actor.get_state.remote())["arm_counts"]["canary"]["in_flight"] == 0:
            assert time.monotonic() < deadline, "the canary stream never started"
            time.sleep(0.02)
        for _ in range(7):  # leave the current randomization block half used
            _complete(url, http)
        canary_routed_at_rollback = ray.get(actor.get_state.remote())["arm_counts"]["canary"]["routed"]

        ray.get(actor.set_weights.remote({"baseline": 100, "canary": 0}))
        arms_after = {_complete(url, http).headers[ARM_HEADER] for _ in range(50)}

        assert arms_after == {"baseline"}
        # The stream that was already running is not cut by the rollback.
        assert in_flight.result(10).status_code == 200
    state = ray.get(actor.get_state.remote())
    assert state["arm_counts"]["canary"]["routed"] == canary_routed_at_rollback
    assert state["arm_counts"]["canary"]["in_flight"] == 0


def test_dead_upstream_answers_502_naming_the_replica_and_is_counted(router: tuple[Any, str]) -> None:
    actor, url = router
    dead_replica = f"http://127.0.0.1:{_free_port_with_nothing_listening()}"
    ray.get(actor.set_arms.remote({"baseline": [dead_replica]}))
    response = requests.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers={ARM_HEADER: "baseline"}, timeout=10)
    assert response.status_code == 502
    assert dead_replica in response.json()["error"]["message"]
    assert response.headers[REPLICA_HEADER] == dead_replica
    state = ray.get(actor.get_state.remote())
    assert state["replica_counts"][dead_replica] == {
        "arm": "baseline", "routed": 1, "in_flight": 0, "errors": 1, "ejected_until": None, "ejections": 0
    }
    assert state["arm_counts"]["baseline"]["errors"] == 1


def test_upstream_5xx_passes_through_and_counts_as_error(
    router: tuple[Any, str], upstreams: dict[str, UpstreamDouble]
) -> None:
    actor, url = router
    with requests.Session() as http:
        response = _complete(url, http, arm="canary", status=500)
    assert response.status_code == 500
    assert response.json() == {"error": {"message": "canary-0 says no"}}
    state = ray.get(actor.get_state.remote())
    assert state["replica_counts"][upstreams["canary-0"].url]["errors"] == 1
    assert state["arm_counts"]["canary"]["errors"] == 1


def test_upstream_dying_mid_stream_breaks_the_client_stream_and_is_counted(router: tuple[Any, str]) -> None:
    actor, url = router

    async def read_broken_stream() -> bytes:
        received = b""
        async with aiohttp.ClientSession() as http:
            body = {"prompt": "hi", "chunks": 4, "die_after_chunks": 2, "chunk_delay_s": 0.05}
            async with http.post(f"{url}/v1/completions", json=body, headers={ARM_HEADER: "canary"}) as response:
                assert response.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    async for data in response.content.iter_any():
                        received += data
        return received

    received = asyncio.run(read_broken_stream())
    # What arrived before the failure was relayed; no fake end-of-stream was added.
    assert b'"index": 1' in received and b"[DONE]" not in received
    assert ray.get(actor.get_state.remote())["arm_counts"]["canary"]["errors"] == 1


def test_client_disconnect_aborts_the_upstream_request_without_counting_an_error(
    router: tuple[Any, str], upstreams: dict[str, UpstreamDouble]
) -> None:
    actor, url = router
    canary_upstream = upstreams["canary-0"]
    cut_before = canary_upstream.streams_cut_by_peer

    async def read_first_event_then_hang_up() -> None:
        async with aiohttp.ClientSession() as http:
            body = {"prompt": "hi", "chunks": 1200, "chunk_delay_s": 0.1}  # a 2-minute stream
            response = await http.post(f"{url}/v1/completions", json=body, headers={ARM_HEADER: "canary"})
            assert b'"index": 0' in await response.content.readany()
            response.close()

    asyncio.run(read_first_event_then_hang_up())
    # The router closed its upstream connection, so the upstream stopped generating: its
    # next write (0.1 s later) fails. Waited for generously (it takes a fraction of a second
    # here), and still long before the 2-minute stream would have ended by itself.
    deadline = time.monotonic() + 30
    while canary_upstream.streams_cut_by_peer == cut_before:
        assert time.monotonic() < deadline, "the upstream kept streaming to a client that was gone"
        time.sleep(0.02)
    counts = ray.get(actor.get_state.remote())["arm_counts"]["canary"]
    assert counts == {"routed": 1, "in_flight": 0, "errors": 0, "rejected": 0}


def test_least_outstanding_replica_within_an_arm(router: tuple[Any, str], upstreams: dict[str, UpstreamDouble]) -> None:
    actor, url = router
    first, second = upstreams["baseline-0"].url, upstreams["baseline-1"].url
    ray.get(actor.set_arms.remote({"baseline": [first, second], "canary": [upstreams["canary-0"].url]}))
    with requests.Session() as http, ThreadPoolExecutor(max_workers=1) as pool:
        idle_picks = Counter(_complete(url, http, arm="baseline").headers[REPLICA_HEADER] for _ in range(10))
        assert idle_picks == {first: 5, second: 5}  # idle ties rotate

        busy = pool.submit(_complete_in_own_session, url, "baseline", chunks=2, chunk_delay_s=1.5)
        deadline = time.monotonic() + 10
        while ray.get(actor.get_state.remote())["arm_counts"]["baseline"]["in_flight"] == 0:
            assert time.monotonic() < deadline, "the long stream never started"
            time.sleep(0.02)
        busy_replica = next(
            replica
            for replica, counts in ray.get(actor.get_state.remote())["replica_counts"].items()
            if counts["in_flight"] == 1
        )
        while_busy = {_complete(url, http, arm="baseline").headers[REPLICA_HEADER] for _ in range(4)}
        assert while_busy == {first, second} - {busy_replica}
        assert busy.result(10).status_code == 200


def test_get_requests_keep_path_and_query(router: tuple[Any, str], upstreams: dict[str, UpstreamDouble]) -> None:
    _, url = router
    response = requests.get(f"{url}/v1/models?page=2&q=a%20b", headers={ARM_HEADER: "canary"}, timeout=10)
    assert response.status_code == 200
    assert response.json() == {"upstream": "canary-0", "raw_path": "/v1/models?page=2&q=a%20b"}
    assert response.headers[ARM_HEADER] == "canary"


def test_health_state_endpoint_and_named_actor(router: tuple[Any, str], upstreams: dict[str, UpstreamDouble]) -> None:
    actor, url = router
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    with requests.Session() as http:
        _complete(url, http, arm="canary")
    over_http = requests.get(f"{url}/router/state", timeout=10).json()
    assert over_http == ray.get(actor.get_state.remote())
    assert over_http["url"] == url
    assert over_http["arms"] == {"baseline": [upstreams["baseline-0"].url], "canary": [upstreams["canary-0"].url]}
    assert over_http["arm_counts"]["canary"]["routed"] == 1
    # The caller's name and namespace reach the actor; start() is idempotent.
    same_actor = ray.get_actor(ROUTER_NAME, namespace=ROUTER_NAMESPACE)
    assert ray.get(same_actor.start.remote()) == url


def test_control_calls_reject_bad_input(router: tuple[Any, str], upstreams: dict[str, UpstreamDouble]) -> None:
    actor, _ = router
    with pytest.raises(ValueError, match="unknown arm"):
        ray.get(actor.set_weights.remote({"baseline": 90, "canery": 10}))
    with pytest.raises(ValueError, match="positive weight"):
        ray.get(actor.set_weights.remote({"baseline": 0, "canary": 0}))
    shared = upstreams["baseline-0"].url
    with pytest.raises(ValueError, match="listed in arm"):
        ray.get(actor.set_arms.remote({"baseline": [shared], "canary": [shared]}))
    with pytest.raises(ValueError, match="http"):
        ray.get(actor.set_arms.remote({"baseline": ["127.0.0.1:8001"]}))
    # A rejected call leaves the previous configuration in place.
    assert ray.get(actor.get_state.remote())["weights"] == {"baseline": 50.0, "canary": 50.0}


def test_server_runs_without_ray_and_stops_cleanly(upstreams: dict[str, UpstreamDouble]) -> None:
    async def scenario() -> None:
        server = RouterServer()  # default weights: all traffic to baseline
        url = await server.start()
        await server.set_arms({"baseline": [upstreams["baseline-1"].url]})
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/health") as health:
                assert health.status == 200
            async with http.post(f"{url}/v1/completions", json={"prompt": "hi"}) as response:
                assert response.headers[ARM_HEADER] == "baseline"
                assert b"baseline-1" in await response.read()
            await server.stop()
            with pytest.raises(aiohttp.ClientConnectorError):
                async with http.get(f"{url}/health"):
                    pass

    asyncio.run(scenario())
