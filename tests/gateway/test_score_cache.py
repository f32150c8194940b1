"""The score cache against a real Redis server this test starts (so it can stop and restart it)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import httpx
import numpy as np
import pytest
import redis
import torch

from common.process import free_port
from draft_worker import DraftWorker
from draft_worker.codec import decode_scores, encode_scores
from gateway.app import create_app
from gateway.planning.draft import LocalDraft
from gateway.planning.score_cache import MemoryScoreCache
from tests.helpers import chat_messages as _messages
from tests.helpers import gateway_settings, serve


class CountingDraft(LocalDraft):
    def __init__(self, worker: DraftWorker, delay: float = 0.0) -> None:
        super().__init__(worker)
        self.calls = 0
        self.delay = delay

    async def score(self, token_ids):
        self.calls += 1
        await asyncio.sleep(self.delay)
        return await super().score(token_ids)


class RedisProcess:
    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is needed (make test installs it)"
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@pytest.fixture
def redis_server():
    server = RedisProcess()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def worker(model_pair):
    return DraftWorker.from_pretrained(model_pair / "draft", device="cpu", prefix_cache_bytes=0)


def _compress(url: str, keep: str, question: str = "Which number?") -> httpx.Response:
    body = {"model": "tiny", "messages": _messages(question), "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-keep-rate": keep}, timeout=60)


def _sent(url: str, keep: str, question: str = "Which number?") -> list[int]:
    body = {"model": "tiny", "messages": _messages(question)}
    return httpx.post(f"{url}/v1/specprefill/compress", json=body, headers={"x-keep-rate": keep}, timeout=60).json()[
        "token_ids"
    ]


def test_redis_hits_skip_the_draft_and_are_shared_by_replicas(model_pair, engine_backend, redis_server, worker):
    draft_a, draft_b = CountingDraft(worker), CountingDraft(worker)
    settings = gateway_settings(model_pair, backend_url=engine_backend[0], redis_url=redis_server.url)
    with serve(create_app(settings, draft=draft_a)) as a, serve(create_app(settings, draft=draft_b)) as b:
        first = _compress(a, "0.3")
        assert first.headers["x-specprefill-cache"] == "miss" and draft_a.calls == 1
        kept_first = _sent(a, "0.3")  # a hit now
        again = _compress(a, "0.3")
        assert again.headers["x-specprefill-cache"] == "hit" and draft_a.calls == 1
        assert _sent(a, "0.3") == kept_first
        other_rate = _compress(a, "0.1")
        assert other_rate.headers["x-specprefill-cache"] == "hit" and draft_a.calls == 1
        assert int(other_rate.headers["x-specprefill-kept-tokens"]) < int(again.headers["x-specprefill-kept-tokens"])
        replica = _compress(b, "0.3")
        assert replica.headers["x-specprefill-cache"] == "hit" and draft_b.calls == 0
        assert _sent(b, "0.3") == kept_first

        # stored values are plain float32 arrays, not pickles
        keys = redis.Redis.from_url(redis_server.url).keys("specprefill:scores:*")
        assert len(keys) == 1
        raw = redis.Redis.from_url(redis_server.url).get(keys[0])
        assert not raw.startswith(b"\x80")  # a pickle's PROTO opcode
        assert len(raw) == 4 * int(first.headers["x-specprefill-original-tokens"])
        assert np.isfinite(np.frombuffer(raw, "<f4")).all()


def test_redis_outage_fails_no_request_and_hits_come_back(model_pair, engine_backend, redis_server, worker, caplog):
    draft = CountingDraft(worker)
    settings = gateway_settings(model_pair, backend_url=engine_backend[0], redis_url=redis_server.url)
    with serve(create_app(settings, draft=draft)) as gw:
        assert _compress(gw, "0.3").headers["x-specprefill-cache"] == "miss"
        redis_server.stop()
        with caplog.at_level("WARNING"):
            for question in ("a?", "b?", "c?"):
                response = _compress(gw, "0.3", question)
                assert response.status_code == 200
                assert response.headers["x-specprefill-cache"] == "off"
                assert response.headers["x-specprefill-status"] == "compressed"
        for logger in ("specprefill.cache", "specprefill.gateway"):  # the score cache and the engine-cache model
            assert sum("Redis unavailable" in r.message for r in caplog.records if r.name == logger) == 1, logger
        redis_server.start()  # restarted empty
        time.sleep(1.1)  # the cache retries after its back-off
        with caplog.at_level("WARNING"):
            assert _compress(gw, "0.3").headers["x-specprefill-cache"] == "miss"
            assert _compress(gw, "0.3").headers["x-specprefill-cache"] == "hit"
        for logger in ("specprefill.cache", "specprefill.gateway"):  # each says so once
            assert sum("Redis is back" in r.message for r in caplog.records if r.name == logger) == 1, logger


async def test_concurrent_identical_prompts_are_scored_once(model_pair, engine_backend, worker):
    draft = CountingDraft(worker, delay=0.3)
    settings = gateway_settings(model_pair, backend_url=engine_backend[0])  # in-memory cache
    with serve(create_app(settings, draft=draft)) as gw:
        body = {"model": "tiny", "messages": _messages("same?"), "max_tokens": 1}
        async with httpx.AsyncClient(timeout=60) as client:
            responses = await asyncio.gather(
                *(client.post(f"{gw}/v1/chat/completions", json=body, headers={"x-keep-rate": "0.3"}) for _ in range(5))
            )
        assert all(r.status_code == 200 for r in responses)
        assert {r.headers["x-specprefill-status"] for r in responses} == {"compressed"}
        assert draft.calls == 1
        assert _compress(gw, "0.3", "same?").headers["x-specprefill-cache"] == "hit"


async def test_memory_cache_lru_ttl_and_size_cap():
    cache = MemoryScoreCache(max_bytes=4 * 250, ttl=60, max_entry_bytes=4 * 200)
    scores = [torch.rand(100) for _ in range(3)]
    assert await cache.put("a", scores[0]) and await cache.put("b", scores[1])
    assert (await cache.get("a"))[0] == "hit"  # a is now the most recent
    await cache.put("c", scores[2])  # over 250 floats: the least recent (b) goes
    assert (await cache.get("b"))[0] == "miss"
    torch.testing.assert_close((await cache.get("a"))[1], scores[0])
    assert not await cache.put("big", torch.rand(201))
    expired = MemoryScoreCache(max_bytes=10**6, ttl=0.01, max_entry_bytes=10**6)
    await expired.put("x", scores[0])
    await asyncio.sleep(0.02)
    assert (await expired.get("x"))[0] == "miss"


def test_score_encoding_is_exact_float32():
    scores = torch.rand(1000)
    torch.testing.assert_close(decode_scores(encode_scores(scores)), scores, rtol=0, atol=0)
