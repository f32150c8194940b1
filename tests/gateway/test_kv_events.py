"""The model of the engine's prefix cache from its KV cache events (the reference engine publishes them as vLLM
does), and, without events, from the answers' ``cached_tokens``.

Real parts: the reference engine with its prefix cache, ZMQ sockets on loopback, the gateway over HTTP in
front of the engine over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
import torch

from common.models import load_causal_lm, load_tokenizer
from engine.engine import ReferenceEngine
from engine.kv_events import EventPublisher, KVEventsConfig
from engine.prefix_cache import PrefixCache
from engine.sampling import SamplingParams
from gateway.app import create_app
from gateway.engines.cache import EventEngineCache, MemoryEngineCache
from gateway.engines.kv_events import EventSubscriber
from gateway.metrics import GatewayMetrics
from tests.helpers import LONG_DOC, engine_app, gateway_settings, serve

LOOPBACK = "tcp://127.0.0.1:0"


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def target(model_pair):
    return load_causal_lm(model_pair / "target", device="cpu"), load_tokenizer(model_pair / "target")


class Stack:
    """An engine whose prefix cache publishes its events, and a model following them."""

    def __init__(self, target, capacity: int, *, replay: bool = True) -> None:
        self.target = target
        self.capacity = capacity
        self.replay = replay
        self.metrics = GatewayMetrics()
        self.model = EventEngineCache(16, capacity)
        self.start_engine()

    def start_engine(self, endpoint: str = LOOPBACK, replay_endpoint: str | None = LOOPBACK) -> None:
        config = KVEventsConfig(True, endpoint=endpoint, replay_endpoint=replay_endpoint if self.replay else None)
        self.publisher = EventPublisher(config)
        self.engine = ReferenceEngine(
            *self.target, prefix_cache=PrefixCache(self.capacity, 16, publish=self.publisher.publish)
        )

    def stop_engine(self) -> None:
        self.engine.close()
        self.publisher.close()

    async def subscribe(self) -> EventSubscriber:
        self.subscriber = EventSubscriber(
            self.model, self.publisher.endpoint, replay_endpoint=self.publisher.replay_endpoint, metrics=self.metrics
        )
        self.subscriber.start()
        await asyncio.sleep(0.3)  # ZMQ's subscription reaches the publisher a moment after the connect
        return self.subscriber

    async def run(self, ids: list[int], positions: list[int] | None = None, *, stores: bool = True) -> int:
        """One greedy token; the tokens the engine served from its cache. A run that ``stores`` new blocks
        returns once the model has seen its events."""
        params = SamplingParams(max_tokens=1, temperature=0)
        steps = [s async for s in self.engine.generate(ids, positions or list(range(len(ids))), params)]
        await _until(lambda: self.engine.active == 0)  # its blocks stored (after its answer)
        if stores and hasattr(self, "subscriber"):
            await _until(
                lambda: (
                    self.publisher.published == self.publisher.queued
                    and self.subscriber.last == self.publisher.published - 1
                )
            )
        return steps[-1].cached_tokens

    def count(self, kind: str) -> float:
        return self.metrics.kv_events.labels(kind)._value.get()

    async def close(self) -> None:
        if hasattr(self, "subscriber"):
            await self.subscriber.close()
        self.stop_engine()


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the events did not come"
        await asyncio.sleep(0.01)


async def test_stored_blocks_are_known_at_their_positions_only(target):
    stack = Stack(target, 4096)
    await stack.subscribe()
    try:
        doc = _prompt(400, seed=1)
        positions = list(range(64)) + list(range(150, 250)) + list(range(330, 400))  # gapped after 4 blocks
        kept = [doc[p] for p in positions]
        assert await stack.run(kept, positions) == 0
        assert await stack.model.cached_tokens(kept, positions) == 224  # 14 full blocks, the last token excluded
        assert await stack.run(kept, positions, stores=False) == 224  # what the engine then serves
        assert await stack.model.cached_tokens(kept, None) == 64  # the same tokens at other positions: the head only
        shifted = [p + 1 for p in positions]
        assert await stack.model.cached_tokens(kept, shifted) == 0
        assert stack.count("stored") == 14 and stack.model.orphans == 0
    finally:
        await stack.close()


async def test_removed_blocks_and_a_cleared_cache_are_forgotten(target):
    stack = Stack(target, 160)  # 10 blocks
    await stack.subscribe()
    try:
        a, b = _prompt(120, seed=2), _prompt(120, seed=3)  # 7 full blocks each
        await stack.run(a)
        assert await stack.model.cached_tokens(a, None) == 112
        await stack.run(b)  # evicts a's least recently used blocks
        assert stack.count("removed") == 4
        predicted = [await stack.model.cached_tokens(p, None) for p in (a, b)]
        assert predicted == [48, 112]  # a's tail went first: its head is still there
        stack.engine.prefix_cache.clear()
        await _until(lambda: stack.count("cleared") == 1)
        assert await stack.model.cached_tokens(b, None) == 0 and stack.model.blocks == 0
    finally:
        await stack.close()


async def test_a_restart_empties_the_model_and_a_late_subscriber_replays_what_it_missed(target):
    stack = Stack(target, 4096)
    try:
        a = _prompt(200, seed=4)
        await stack.run(a)  # before anyone listens
        await _until(lambda: stack.publisher.published == 1)
        await stack.subscribe()
        b = a + _prompt(40, seed=5)  # extends a: its new blocks' parent is one of a's
        await stack.run(b)
        assert stack.count("replayed") == 1  # the batch it missed, asked for when the next one came
        assert await stack.model.cached_tokens(b, None) == 224 == await stack.run(b, stores=False)
        endpoint, replay = stack.publisher.endpoint, stack.publisher.replay_endpoint
        stack.stop_engine()
        await _until(lambda: stack.count("disconnected") == 1)  # at once: no request counts on the old cache
        assert await stack.model.cached_tokens(b, None) == 0
        stack.start_engine(endpoint, replay)  # the same endpoints, an empty cache, the numbers start over
        await asyncio.sleep(0.5)  # the subscriber's socket reconnects by itself
        c = _prompt(100, seed=6)
        await stack.run(c)
        assert await stack.model.cached_tokens(b, None) == 0
        assert await stack.model.cached_tokens(c, None) == 96
    finally:
        await stack.close()


async def test_numbers_that_start_over_are_a_restart():
    """A restart the socket did not see (the subscriber reconnected before it noticed): the sequence numbers
    start over, and the model with them."""
    from common.kv_events import BlockStored, EventBatch, encode_batch

    model = EventEngineCache(16, 4096)
    subscriber = EventSubscriber(model, "tcp://127.0.0.1:1", metrics=GatewayMetrics())

    def frames(seq: int, tokens: list[int]) -> list[bytes]:
        batch = EventBatch(0.0, [BlockStored([seq], None, tokens, 16, None, "GPU")])
        return [b"", seq.to_bytes(8, "big"), encode_batch(batch)]

    a, b = list(range(100, 116)), list(range(200, 216))
    await subscriber._received(frames(0, a))
    await subscriber._received(frames(1, b))
    assert await model.cached_tokens(a + [1], None) == 16
    await subscriber._received(frames(0, b))
    assert subscriber.metrics.kv_events.labels("restart")._value.get() == 1
    assert await model.cached_tokens(a + [1], None) == 0 and await model.cached_tokens(b + [1], None) == 16
    await subscriber.close()


async def test_without_replay_a_late_subscriber_knows_only_what_it_saw(target):
    stack = Stack(target, 4096, replay=False)
    try:
        a = _prompt(200, seed=7)
        await stack.run(a)
        await _until(lambda: stack.publisher.published == 1)
        await stack.subscribe()
        await stack.run(a + _prompt(40, seed=8))  # new blocks whose parent it never saw: not placed
        assert stack.model.orphans == 3 and await stack.model.cached_tokens(a, None) == 0
        c = _prompt(100, seed=9)
        await stack.run(c)
        assert await stack.model.cached_tokens(c, None) == 96
    finally:
        await stack.close()


async def test_blocks_sent_count_until_events_confirm_them_or_time_runs_out():
    now = [0.0]
    model = EventEngineCache(16, 4096, confirm_s=5.0, clock=lambda: now[0])
    ids = list(range(100, 200))
    await model.record(ids, None)
    assert await model.cached_tokens(ids, None) == 96
    now[0] = 6.0
    assert await model.cached_tokens(ids, None) == 0  # no event came: the engine did not keep them


async def test_without_events_a_misprediction_is_gone_after_one_answer():
    """An LRU engine that lost a block lost every block used before it: one answer that reports fewer cached
    tokens than predicted drops them all from the guessed model, so the next request on another context is
    predicted right too."""
    model = MemoryEngineCache(16, 4096)
    a, b, c = list(range(100, 200)), list(range(300, 400)), list(range(500, 600))
    for prompt in (a, b, c):
        await model.record(prompt, None)
    # the engine restarted: b's answer reports nothing cached
    await model.corrected(b, None, 0)
    await model.record(b, None)
    assert [await model.cached_tokens(p, None) for p in (a, b, c)] == [0, 96, 96]
    await model.corrected(c, None, 32)  # c's tail only was gone
    assert await model.cached_tokens(c, None) == 32


async def test_the_gateway_predicts_what_the_engine_serves(model_pair):
    """Gateway and engine over HTTP, the engine publishing events: chat turns (each sent twice), another
    client's long prompts straight to the engine (evicting), a cleared cache in the middle: every answer's
    cached tokens are what the plan predicted (the Server-Timing ``cached`` entry)."""
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": LOOPBACK, "replay_endpoint": LOOPBACK})
    engine = engine_app(model_pair, kv_cache_tokens=3072, kv_events_config=config)
    with serve(engine) as engine_url:
        events = engine.state.serving.events
        assert httpx.get(f"{engine_url}/kv_event_sources").json() == {"0": events.source()}  # as vLLM's says it
        # the gateway finds the events there (--backend-kv-events auto, the default)
        settings = gateway_settings(model_pair, backend_url=engine_url, backend_kind="reference", planner="cost")
        with serve(create_app(settings)) as url, httpx.Client(timeout=120) as client:
            time.sleep(0.3)
            pairs = []

            def chat(messages: list[dict]) -> None:
                r = client.post(
                    f"{url}/v1/chat/completions",
                    json={"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0},
                )
                assert r.status_code == 200, r.text
                predicted = int(re.search(r'cached;desc="(\d+)"', r.headers["server-timing"]).group(1))
                pairs.append((predicted, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]))
                time.sleep(0.2)  # the answer's events reach the gateway

            def foreign(seed: int) -> None:
                body = {"model": "target", "prompt": _prompt(600, seed), "max_tokens": 1}
                assert client.post(f"{engine_url}/v1/completions", json=body).status_code == 200
                time.sleep(0.2)

            messages = [{"role": "user", "content": LONG_DOC[:2500] + "\n\nWhat is the first number?"}]
            for turn in range(4):
                chat(messages)
                chat(messages)  # again (a retry, another user): the same selection, which the engine now holds
                messages = messages + [
                    {"role": "assistant", "content": f"Number {turn}."},
                    {"role": "user", "content": f"And number {turn + 2}?"},
                ]
                foreign(seed=20 + turn)
            chat(messages)
            for seed in range(30, 36):  # more than the cache holds: this chat's blocks are evicted
                foreign(seed)
            chat(messages)
            evicted = pairs[-1]
            client.post(f"{engine_url}/reset_prefix_cache")
            time.sleep(0.2)
            for _ in range(2):
                chat(messages)
            metrics = client.get(f"{url}/metrics").text
    assert all(p == c for p, c in pairs), pairs
    assert evicted == (0, 0)  # where a model of what the gateway sent would have predicted a hit
    assert sum(c > 0 for _, c in pairs) >= 3, pairs  # hits were predicted, not only misses
    assert re.search(r'specprefill_kv_events_total\{kind="removed"\} [1-9]', metrics)
    assert re.search(r'specprefill_kv_events_total\{kind="cleared"\} 1', metrics)
