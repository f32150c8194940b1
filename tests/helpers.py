"""Helpers shared by the test packages: real servers on free ports, a recording wrapper, tiny models, clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import torch
import uvicorn
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from common.process import wait_healthy
from common.server import GuardMiddleware
from common.telemetry import RequestTelemetry
from engine.server import create_app as create_engine_app
from engine.settings import EngineSettings
from gateway.settings import GatewaySettings
from specprefill_lab.demo_models import synthetic_corpus

LONG_DOC = " ".join(synthetic_corpus(seed=3, n_sentences=60))


def chat_messages(question: str = "What is the third number?") -> list[dict]:
    return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": LONG_DOC + "\n\n" + question}]


def gateway_settings(model_pair, **overrides) -> GatewaySettings:
    """For tests of the gateway's mechanics: every prompt above 64 tokens compressed afresh, no warming, no probe
    (the planner's own tests turn each on)."""
    values = dict(
        target_model=str(model_pair / "target"),
        draft_model=str(model_pair / "draft"),
        min_prompt_tokens=64,
        device="cpu",
        served_model_name="tiny",
        planner="fresh",
        warming=False,
        calibrate=False,
    )
    values.update(overrides)
    return GatewaySettings(**values)


def engine_app(model_pair, **overrides):
    """A reference engine app serving the pair's target as "target" (the model loads when it starts)."""
    values = dict(model=str(model_pair / "target"), device="cpu", served_model_name="target")
    values.update(overrides)
    return create_engine_app(EngineSettings(**values))


@torch.no_grad()
def reference_logits(model, ids: list[int], positions: list[int]) -> torch.Tensor:
    """The oracle for positions: a plain transformers forward, eager attention, explicit positions and an explicit
    full causal mask (float, additive; without one, transformers reads gapped positions as packed sequences).
    Logits of the last token."""
    n = len(ids)
    mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
    out = model(torch.tensor([ids]), position_ids=torch.tensor([positions]), attention_mask=mask, use_cache=False)
    return out.logits[0, -1].float()


def assert_swap_mismatch_is_a_400(url: str) -> None:
    """A swap whose kept tokens are not the rendered chat's: a 400 naming the position (before the engine)."""
    body = {
        "model": "target",
        "messages": chat_messages(),
        "max_tokens": 1,
        "vllm_xargs": {"kept_token_ids": [1, 2, 3], "position_ids": [0, 1, 2]},
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "vllm_xargs.kept_token_ids" and "at position 0 differs" in error["message"]


def target_with_another_template(model_pair, folder):
    """A copy of the pair's target whose chat template differs from the engine's by one word (an ``x`` before
    each role): its renderings, and so its kept tokens, are not the engine's."""
    target = folder / "target"
    shutil.copytree(model_pair / "target", target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    template = config.get("chat_template") or (target / "chat_template.jinja").read_text()
    changed = template.replace("<|start_header_id|>' + message['role']", "<|start_header_id|>' + 'x' + message['role']")
    assert changed != template
    if "chat_template" in config:
        config["chat_template"] = changed
        (target / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        (target / "chat_template.jinja").write_text(changed)
    return target


OPEN_CLIENTS: list[openai.OpenAI | Any] = []  # OpenAI's and Anthropic's
"""SDK clients the tests made, closed at the end of the session (``conftest``): a client dropped unclosed leaves
its sockets to the cyclic garbage collector, whose ResourceWarning lands in whichever test runs then."""


def openai_client(url: str, api_key: str = "unused") -> openai.OpenAI:
    """The real OpenAI SDK pointed at one of our servers (no retries: a test sees every failure)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)
    OPEN_CLIENTS.append(client)
    return client


def tiny_llama(
    *,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    hidden: int = 64,
    vocab: int = 256,
    seed: int = 0,
    max_positions: int = 2048,
    eos: list[int] | None = None,
) -> LlamaForCausalLM:
    """A tiny random Llama, with larger weights than the default init so attention is far from uniform and
    greedy tokens vary."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        eos_token_id=eos if eos is not None else [1],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.2)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=0)
    return model.eval()


# --- servers ---


@contextlib.contextmanager
def serve(app, *, timeout: float = 60.0, port: int = 0, max_body_bytes: int = 16 << 20, writer=None) -> Iterator[str]:
    """Runs ``app`` on 127.0.0.1 at a free port (or ``port``) behind the production guard middleware, header limit
    and request telemetry (``writer``: its spans), in a background thread; yields its base URL; stops it on
    exit."""
    config = uvicorn.Config(
        RequestTelemetry(GuardMiddleware(app, max_body_bytes=max_body_bytes), writer),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def start_command(args: list[str], url: str, timeout: float = 120) -> subprocess.Popen:
    """``specprefill ARGS`` as a separate process, once ``url/health`` answers."""
    process = subprocess.Popen(
        [sys.executable, "-m", "specprefill", *args, "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(url, process, timeout)
    except RuntimeError:
        process.kill()
        process.wait()
        raise
    return process


class RecordingApp:
    """Wraps an ASGI app and keeps every HTTP request's path, headers and JSON body (what the backend received)."""

    def __init__(self, app) -> None:
        self.app = app
        self.requests: list[dict] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        messages, body = [], b""
        while True:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.requests.append({"path": scope["path"], "headers": headers, "body": json.loads(body) if body else None})

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    def last(self, path: str) -> dict:
        return next(r for r in reversed(self.requests) if r["path"] == path)


# --- the engine's activity ---


class FCFSEngine:
    """A stand-in engine for the gateway's timing logic: one request at a time, first come first served (as vLLM
    runs a prefill that holds its whole token budget), each taking ``fixed + per_token × new + per_cached ×
    cached`` seconds, with a prefix cache of whole blocks. ``complete(token_ids, priority)`` answers as a
    backend does, with the cached tokens in its usage."""

    def __init__(
        self, *, block_size: int = 16, fixed: float = 0.01, per_token: float = 1e-4, per_cached: float = 1e-6
    ) -> None:
        from gateway.engines.cache import MemoryEngineCache

        self.cache = MemoryEngineCache(block_size, 1 << 20)
        self.coefficients = (fixed, per_token, per_cached)
        self.lock = asyncio.Lock()
        self.requests: list[dict] = []  # length, cached, priority, start and end times

    def seconds(self, new: int, cached: int) -> float:
        fixed, per_token, per_cached = self.coefficients
        return fixed + per_token * new + per_cached * cached

    async def complete(
        self, token_ids: list[int], priority: int | None = None, position_ids: list[int] | None = None
    ) -> dict:
        async with self.lock:
            start = time.monotonic()
            cached = await self.cache.cached_tokens(token_ids, position_ids)
            await asyncio.sleep(self.seconds(len(token_ids) - cached, cached))
            await self.cache.record(token_ids, position_ids)
        self.requests.append(
            {"tokens": len(token_ids), "cached": cached, "priority": priority, "start": start, "end": time.monotonic()}
        )
        return {"usage": {"prompt_tokens_details": {"cached_tokens": cached}}}


def engine_active(engine_url: str) -> float:
    """Requests waiting or running in a reference engine, from its /metrics."""
    text = httpx.get(f"{engine_url}/metrics").text
    return float(
        next(line.split()[-1] for line in text.splitlines() if line.startswith("specprefill_engine_active_requests "))
    )


def requests_with_gaps(gateway_url: str, n: int = 4, pause: float = 0.3, model: str = "tiny") -> None:
    """``n`` short requests ``pause`` seconds apart: a gateway warms only in idle gaps its history says are long
    enough, and a new one has none."""
    for _ in range(n):
        time.sleep(pause)
        body = {"model": model, "prompt": "Hello", "max_tokens": 1}
        response = httpx.post(f"{gateway_url}/v1/completions", json=body, headers={"x-specprefill": "off"}, timeout=60)
        assert response.status_code == 200, response.text


def gateway_settled(gateway_url: str) -> bool:
    """No request of the gateway at the backend, and no context waiting to be warmed (its /metrics)."""
    text = httpx.get(f"{gateway_url}/metrics").text
    return all(
        float(line.rsplit(" ", 1)[1]) == 0
        for line in text.splitlines()
        if line.startswith(("specprefill_backend_requests_in_flight{", "specprefill_warming_pending_contexts "))
    )


async def eventually(predicate: Callable[[], bool], within: float) -> bool:
    """Polls ``predicate`` for up to ``within`` seconds without blocking the test's event loop; its last answer."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def disconnects_release_the_engine(url: str, body: dict, engine_url: str, headers: dict | None = None) -> None:
    """A client that goes away mid-stream, then one that abandons a non-streamed request while the engine
    generates: each time the engine at ``engine_url`` must drop the work within a second."""
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", url, json={**body, "stream": True}, headers=headers) as response:
            assert response.status_code == 200
            assert engine_active(engine_url) == 1
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break
    assert await eventually(lambda: engine_active(engine_url) == 0, within=1.0)
    async with httpx.AsyncClient(timeout=60) as client:
        task = asyncio.create_task(client.post(url, json=body, headers=headers))
        assert await eventually(lambda: engine_active(engine_url) == 1, within=2.0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("the request finished before it was abandoned")
    assert await eventually(lambda: engine_active(engine_url) == 0, within=1.0)
