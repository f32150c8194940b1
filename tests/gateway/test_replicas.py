"""Replicas of one model behind one gateway (``--backend-url`` repeated): routing by where a prompt costs least,
a conversation staying with its context, cold prompts spread, and a replica that dies losing no request."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time

import httpx
import numpy as np
from pydantic_settings import CliApp

from common.process import free_port
from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.gateway.planning import plan_prompt
from tests.helpers import LONG_DOC, engine_app, gateway_settings, serve, start_command


def test_backend_url_repeated_or_comma_separated_names_replicas():
    urls = ["http://a:8000", "http://b:8000"]
    flags = CliApp.run(GatewaySettings, cli_args=["--backend-url", "http://a:8000/", "--backend-url", urls[1]])
    assert flags.backend_url == urls
    os.environ["SPECPREFILL_BACKEND_URL"] = "http://a:8000, http://b:8000/"
    try:
        assert GatewaySettings().backend_url == urls
    finally:
        del os.environ["SPECPREFILL_BACKEND_URL"]
    assert GatewaySettings(backend_url="http://a:8000").backend_url == urls[:1]
    assert GatewaySettings().embedded and not GatewaySettings(backend_url=urls).embedded


def _chat(gateway: str, document: str, turns: int) -> dict:
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": document + "\n\nWhat is the first number?"},
    ]
    for turn in range(1, turns):
        messages += [{"role": "assistant", "content": "12."}, {"role": "user", "content": f"And number {turn + 1}?"}]
    response = httpx.post(
        f"{gateway}/v1/chat/completions",
        timeout=120,
        json={"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    return {
        "replica": int(re.search(r'replica;desc="(\d+)"', response.headers["server-timing"]).group(1)),
        "answer": response.json()["choices"][0]["message"]["content"],
        "cached": int(re.search(r'cached;desc="(\d+)"', response.headers["server-timing"]).group(1)),
        "engine_cached": response.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        "plan": (response.headers["x-specprefill-plan"], response.headers["x-specprefill-kept-tokens"]),
    }


def _metric(gateway: str, name: str) -> dict[str, float]:
    text = httpx.get(f"{gateway}/metrics").text
    return {labels: float(value) for labels, value in re.findall(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)}


def test_a_conversation_stays_with_its_context_and_cold_prompts_spread(model_pair):
    """Two idle replicas: a cold chat goes to one, another cold chat to the other (ties go to the replica chosen
    longest ago); each next turn goes where its context is cached and reads it from there. With the same plan as
    a single engine that served both chats gets (the cost models, fitted on live timings, may choose another),
    every turn gets the same answer."""
    other = " ".join(reversed(LONG_DOC.split()))
    # the order is such that ties broken by "chosen longest ago" would send turns 2 and 3 to the wrong replica
    order = [(LONG_DOC, 1), (other, 1), (other, 2), (LONG_DOC, 2), (LONG_DOC, 3), (other, 3)]
    with (
        serve(engine_app(model_pair)) as one,
        serve(engine_app(model_pair)) as two,
        serve(create_app(gateway_settings(model_pair, backend_url=[one, two], planner="cost"))) as gateway,
    ):
        turns = [_chat(gateway, document, n) for document, n in order]
        assert sorted(t["replica"] for t in turns[:2]) == [0, 1]
        home = {document: t["replica"] for (document, n), t in zip(order, turns) if n == 1}
        assert [t["replica"] for t in turns] == [home[document] for document, _ in order]
        routed = _metric(gateway, "specprefill_replica_requests_total")
        assert routed == {'{replica="0"}': 3.0, '{replica="1"}': 3.0}
    with (
        serve(engine_app(model_pair)) as alone,
        serve(create_app(gateway_settings(model_pair, backend_url=alone, planner="cost"))) as gateway,
    ):
        single = [_chat(gateway, document, n) for document, n in order]
    same = [(t, u) for t, u in zip(turns, single) if t["plan"] == u["plan"]]
    assert len(same) >= 4
    assert all(t["answer"] == u["answer"] for t, u in same)
    assert sum(t["engine_cached"] for t in turns) > 0


def test_a_replica_that_dies_loses_no_request(model_pair):
    """Eight requests in flight over two replicas; one replica is killed (SIGKILL) while they run: every request
    is answered (those it held had sent the client nothing: they go to the other), the dead replica is out of
    the routing (``specprefill_replica_up`` 0, the gateway's health degraded), and later requests all go to the
    one left."""
    engines = []
    for _ in range(2):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        engines.append(
            (
                start_command(
                    [
                        "engine",
                        "--model",
                        str(model_pair / "target"),
                        "--port",
                        str(port),
                        "--device",
                        "cpu",
                        "--served-model-name",
                        "target",
                    ],
                    url,
                ),
                url,
            )
        )
    settings = gateway_settings(model_pair, backend_url=[url for _, url in engines], backend_health_interval=0.5)
    try:
        with serve(create_app(settings)) as gateway:
            body = {"model": "tiny", "prompt": LONG_DOC, "max_tokens": 200, "temperature": 0, "ignore_eos": True}

            def complete(i: int) -> int:
                return httpx.post(
                    f"{gateway}/v1/completions", json={**body, "prompt": f"{i} {LONG_DOC}"}, timeout=120
                ).status_code

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                answers = [pool.submit(complete, i) for i in range(8)]
                reached = _until(
                    lambda: _metric(gateway, "specprefill_replica_requests_total").get('{replica="1"}', 0) >= 2
                )
                # where it does not happen, say what the gateway saw (a flake once in CI, not reproduced since)
                assert reached, (
                    _metric(gateway, "specprefill_replica_requests_total"),
                    _metric(gateway, "specprefill_replica_up"),
                    [a.done() for a in answers],
                    httpx.get(f"{gateway}/health").json(),
                )
                engines[1][0].send_signal(signal.SIGKILL)
                assert [a.result() for a in answers] == [200] * 8
            assert _metric(gateway, "specprefill_replica_up") == {'{replica="0"}': 1.0, '{replica="1"}': 0.0}
            assert _metric(gateway, "specprefill_replica_failovers_total")[""] >= 1
            health = httpx.get(f"{gateway}/health").json()
            assert health["status"] == "degraded" and health["backend"]["ready"]
            assert [r["routed"] for r in health["backend"]["replicas"]] == [True, False]
            before = _metric(gateway, "specprefill_replica_requests_total")
            assert [complete(i) for i in range(3)] == [200] * 3
            after = _metric(gateway, "specprefill_replica_requests_total")
            assert after['{replica="0"}'] - before['{replica="0"}'] == 3
            assert after['{replica="1"}'] == before['{replica="1"}']
    finally:
        for process, _ in engines:
            process.kill()
            process.wait()


def test_a_replica_back_from_a_restart_is_routed_to_again(model_pair):
    """A replica that does not answer its health check is out; once it passes, it is back in the routing."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serve(engine_app(model_pair)) as one:
        settings = gateway_settings(model_pair, backend_url=[one, url], backend_health_interval=0.2)
        with serve(create_app(settings)) as gateway:
            up = lambda: _metric(gateway, "specprefill_replica_up")  # noqa: E731
            assert _until(lambda: up() == {'{replica="0"}': 1.0, '{replica="1"}': 0.0})
            process = start_command(
                [
                    "engine",
                    "--model",
                    str(model_pair / "target"),
                    "--port",
                    str(port),
                    "--device",
                    "cpu",
                    "--served-model-name",
                    "target",
                ],
                url,
            )
            try:
                assert _until(lambda: up()['{replica="1"}'] == 1.0)
                other = " ".join(reversed(LONG_DOC.split()))
                assert sorted(_chat(gateway, doc, 1)["replica"] for doc in (LONG_DOC, other)) == [0, 1]
            finally:
                process.kill()
                process.wait()


def _until(predicate, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_behind_a_prefix_affinity_router_a_conversation_keeps_its_replica(model_pair):
    """The gateway in front of an existing router (one URL for it): the router sees the client's own messages
    (the kept tokens travel beside them, in ``vllm_xargs``), so prefix affinity keeps each conversation on one
    replica, whose cache serves its compressed turns."""
    from specprefill_lab.router import create_app as create_router

    other = " ".join(reversed(LONG_DOC.split()))
    with (
        serve(engine_app(model_pair)) as one,
        serve(engine_app(model_pair)) as two,
        serve(create_router([one, two], "prefix")) as router,
        serve(create_app(gateway_settings(model_pair, backend_url=router, planner="cost"))) as gateway,
    ):
        served, cached = [], 0
        for turns in (1, 2, 3):
            for document in (LONG_DOC, other):
                before = [_engine_requests(url) for url in (one, two)]
                cached += _chat(gateway, document, turns)["engine_cached"]
                after = [_engine_requests(url) for url in (one, two)]
                served.append([a - b for a, b in zip(after, before)].index(1))
        assert cached > 0
        assert served[0::2] == [served[0]] * 3 and served[1::2] == [served[1]] * 3 and served[0] != served[1]


def _engine_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(v) for v in re.findall(r'^specprefill_engine_requests_total\{status="ok"\} (\S+)$', text, re.M))


def _data_parallel_front(engines: list[str]):
    """One API server over data-parallel ranks, as vLLM's with ``--data-parallel-size``: a request goes to the
    rank its ``X-data-parallel-rank`` header names (else rank 0), and ``/kv_event_sources`` lists each rank's
    events."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def forward(request: Request) -> Response:
        rank = int(request.headers.get("x-data-parallel-rank", 0))
        ranks.append(rank)
        async with httpx.AsyncClient(timeout=120) as client:
            answer = await client.post(
                engines[rank] + request.url.path,
                content=await request.body(),
                headers={"content-type": "application/json"},
            )
        return Response(answer.content, answer.status_code, media_type="application/json")

    async def sources(request: Request) -> JSONResponse:
        return JSONResponse({str(r): httpx.get(f"{url}/kv_event_sources").json()["0"] for r, url in enumerate(engines)})

    async def first(request: Request) -> Response:
        answer = httpx.get(engines[0] + request.url.path)
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    ranks: list[int] = []
    app = Starlette(
        routes=[
            Route("/v1/{path:path}", forward, methods=["POST"]),
            Route("/kv_event_sources", sources),
            Route("/v1/models", first),
            Route("/health", first),
            Route("/metrics", first),
        ]
    )
    app.state.ranks = ranks
    return app


def test_data_parallel_ranks_behind_one_server_are_replicas(model_pair):
    """A server whose ``/kv_event_sources`` lists two ranks: each rank is a replica, reached with
    ``X-data-parallel-rank`` and followed by its own event stream. Two chats spread over the ranks and stay on
    theirs, and every turn's predicted cached tokens are what its rank served."""
    events = json.dumps(
        {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}
    )
    other = " ".join(reversed(LONG_DOC.split()))
    with (
        serve(engine_app(model_pair, kv_events_config=events)) as one,
        serve(engine_app(model_pair, kv_events_config=events)) as two,
    ):
        front = _data_parallel_front([one, two])
        settings = lambda url: gateway_settings(model_pair, backend_url=url, planner="cost")  # noqa: E731
        with serve(front) as url, serve(create_app(settings(url))) as gateway:
            turns = []
            for n in (1, 2, 3):
                for document in (LONG_DOC, other):
                    turns.append(_chat(gateway, document, n))
                    time.sleep(1.0)  # the answer's events reach the gateway (0.2 s was missed once inside the suite)
            assert sorted(front.state.ranks[:2]) == [0, 1]
            assert front.state.ranks[0::2] == [front.state.ranks[0]] * 3
            assert front.state.ranks[1::2] == [front.state.ranks[1]] * 3
            assert [t["replica"] for t in turns] == front.state.ranks
            assert all(t["cached"] == t["engine_cached"] for t in turns) and sum(t["cached"] for t in turns) > 0


async def test_a_turn_goes_where_its_earlier_selection_is_held_unless_the_wait_there_costs_more():
    """Routing prices the earlier selection a next turn would extend at each replica: the one that holds it wins
    (neither holds the whole prompt, only the kept tokens at their positions), until a wait there outweighs it."""
    from gateway.engines.cache import MemoryEngineCache
    from gateway.engines.load import EngineLoad
    from gateway.engines.replicas import Replica
    from gateway.metrics import GatewayMetrics
    from gateway.planning.costs import cost_models
    from gateway.planning.planner import Planner
    from gateway.planning.routing import Router
    from gateway.planning.scores import ScoreProvider
    from tests.gateway.test_planner import COSTS, OPTIONS, FakeDraft, _ids

    draft, metrics = FakeDraft(), GatewayMetrics()
    draft.peaks = [5, 40, 90]
    settings = GatewaySettings(target_model="t", draft_model="d", min_prompt_tokens=64, cost_coefficients=COSTS)
    replicas = [Replica(i, f"r{i}", None, EngineLoad(), MemoryEngineCache(16, 1 << 20)) for i in range(2)]
    planner = Planner(
        settings, draft, ScoreProvider(draft, None, metrics), metrics, (), cost_models(COSTS), replicas=replicas
    )
    first = _ids(4000, 1)
    await planner.completed(await plan_prompt(planner, first, OPTIONS, [], replica=replicas[1]), None, 1.0)
    assert [await r.cache.cached_tokens(first, None) for r in replicas] == [0, 0]
    turn = np.asarray(first + _ids(200, 2))
    assert (await Router(planner).route(turn, OPTIONS, None, dry_run=True))[0] is replicas[1]
    ahead = replicas[1].load.begin(30.0)  # a 30 s prefill in line there
    assert (await Router(planner).route(turn, OPTIONS, None, dry_run=True))[0] is replicas[0]
    replicas[1].load.end(ahead)


async def test_one_routing_rule_places_every_plan_even_where_a_price_went_wrong():
    """A plan the planner did not make (a prompt the gateway does not read) goes by the same rule as any other:
    here, away from a replica with a 30 s prefill in line. A price that is not a number, or below zero, never
    stops a request from going somewhere."""
    from gateway.engines.cache import MemoryEngineCache
    from gateway.engines.load import EngineLoad
    from gateway.engines.replicas import Replica
    from gateway.metrics import GatewayMetrics
    from gateway.planning.costs import cost_models
    from gateway.planning.plan import Plan
    from gateway.planning.planner import Planner
    from gateway.planning.routing import Router
    from gateway.planning.scores import ScoreProvider
    from tests.gateway.test_planner import COSTS, FakeDraft

    draft, metrics = FakeDraft(), GatewayMetrics()
    settings = GatewaySettings(target_model="t", draft_model="d", cost_coefficients=COSTS)
    replicas = [Replica(i, f"r{i}", None, EngineLoad(), MemoryEngineCache(16, 1 << 20)) for i in range(2)]
    planner = Planner(
        settings, draft, ScoreProvider(draft, None, metrics), metrics, (), cost_models(COSTS), replicas=replicas
    )
    router = Router(planner)
    ahead = replicas[0].load.begin(30.0)
    assert (await router.place(Plan([], passthrough=True))).replica is replicas[1]
    replicas[0].load.end(ahead)
    assert router._cheapest({replicas[0]: (float("nan"), False), replicas[1]: (-1.0, False)}) is replicas[1]
    assert router._cheapest({replicas[0]: (float("nan"), True), replicas[1]: (float("inf"), False)}) in replicas
