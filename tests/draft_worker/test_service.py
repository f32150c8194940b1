"""Remote draft workers: real ``specprefill draft-worker`` processes, batching, failover."""

from __future__ import annotations

import asyncio
import subprocess

import httpx
import pytest
import torch

from common.process import free_port
from draft_worker import DraftWorker
from draft_worker.batching import ScoreBatcher
from draft_worker.codec import scores_from_text
from gateway.app import create_app
from tests.helpers import chat_messages as _messages
from tests.helpers import gateway_settings, serve, start_command


def _start_worker(model_dir) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return start_command(["draft-worker", "--model", str(model_dir), "--port", str(port), "--device", "cpu"], url), url


@pytest.fixture
def two_workers(model_pair):
    started = [_start_worker(model_pair / "draft") for _ in range(2)]
    yield started
    for process, _ in started:
        process.kill()
        process.wait()


def test_a_worker_scores_like_the_local_draft(model_pair, two_workers):
    _, url = two_workers[0]
    ids = list(range(5, 400))
    payload = httpx.post(f"{url}/v1/score", json={"token_ids": ids}, timeout=60).json()
    local = DraftWorker.from_pretrained(model_pair / "draft", device="cpu", prefix_cache_bytes=0).score(ids)
    # Another process: float32 sums may run in another order there (MKL picks kernels by alignment and
    # threads), so the scores agree to float32 noise (CI once saw 5e-6 apart), not to the last bit.
    torch.testing.assert_close(scores_from_text(payload["scores"]), local, rtol=1e-3, atol=1e-5)
    info = httpx.get(f"{url}/v1/info").json()
    assert info["identity"] == payload["identity"] and info["score_params"] == [8, 13]
    bad = httpx.post(f"{url}/v1/score", json={"token_ids": [10**7]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "token_ids"


def test_killing_a_worker_mid_run_fails_no_request(model_pair, engine_backend, two_workers):
    settings = gateway_settings(
        model_pair, backend_url=engine_backend[0], memory_cache_mb=0, draft_worker_url=[url for _, url in two_workers]
    )
    with serve(create_app(settings)) as gw:
        statuses = []
        for i in range(8):
            if i == 3:
                two_workers[0][0].kill()
            body = {"model": "tiny", "messages": _messages(f"question {i}?"), "max_tokens": 1}
            response = httpx.post(f"{gw}/v1/chat/completions", json=body, headers={"x-keep-rate": "0.3"}, timeout=60)
            assert response.status_code == 200
            statuses.append(response.headers["x-specprefill-status"])
        assert statuses == ["compressed"] * 8  # the surviving worker took over
        two_workers[1][0].kill()
        response = httpx.post(
            f"{gw}/v1/chat/completions",
            timeout=60,
            headers={"x-keep-rate": "0.3"},
            json={"model": "tiny", "messages": _messages("none left?"), "max_tokens": 1},
        )
        assert response.status_code == 200
        assert response.headers["x-specprefill-reason"] == "draft_error"  # full prompt, no error


async def test_concurrent_requests_share_batches_and_score_as_alone(model_pair):
    worker = DraftWorker.from_pretrained(model_pair / "draft", device="cpu", prefix_cache_bytes=0)
    batcher = ScoreBatcher(worker, max_batch_size=8, max_wait_s=0.02)
    prompts = [
        torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (100, 250, 90, 400, 120, 300, 64, 200)
    ]
    results = await asyncio.gather(*(batcher.score(p) for p in prompts))
    assert batcher.batches < len(prompts)
    for prompt, scores in zip(prompts, results):
        torch.testing.assert_close(scores, worker.score(prompt), rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError):
        await batcher.score([])
    await batcher.close()


def test_batches_respect_the_token_budget(model_pair):
    worker = DraftWorker.from_pretrained(model_pair / "draft", device="cpu", prefix_cache_bytes=0)
    batcher = ScoreBatcher(worker, max_batch_size=8, max_batch_tokens=1000)
    loop = asyncio.new_event_loop()
    from draft_worker.batching import _Pending

    for n in (300, 300, 300, 600):
        batcher._queue.append(_Pending(list(range(n)), loop.create_future()))
    assert [len(p.token_ids) for p in batcher._take_batch()] == [300, 300, 300]  # 4 × 600 > 1000
    assert [len(p.token_ids) for p in batcher._take_batch()] == [600]
    loop.close()
