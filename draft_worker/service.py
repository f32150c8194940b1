"""The standalone draft worker service (``specprefill draft-worker --model PATH``).

``POST /v1/score`` {"token_ids": [...]} answers {"scores": base64 float32 little-endian, "length": n,
"identity": ..., "draft_ms": ...}; concurrent requests are batched into one draft forward.
``GET /v1/info`` tells the model's identity and the parameters that change scores (the gateway's cache key).
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from draft_worker.batching import ScoreBatcher
from draft_worker.worker import DraftWorker
from specprefill.openai_api import InvalidRequestError, WireModel, install_error_handlers


class ScoreRequest(WireModel):
    token_ids: list[int]


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), separators=(",", ":"))
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]


def create_app(worker_factory, *, max_batch_size: int = 8, max_batch_tokens: int = 65536,
               max_wait_ms: float = 5.0) -> FastAPI:
    """``worker_factory`` builds the ``DraftWorker`` in the lifespan (models load at start-up, not import)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker: DraftWorker = worker_factory()
        app.state.worker = worker
        app.state.batcher = ScoreBatcher(worker, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                                         max_wait_s=max_wait_ms / 1e3)
        app.state.fingerprint = tokenizer_fingerprint(worker.tokenizer) if worker.tokenizer is not None else None
        try:
            yield
        finally:
            await app.state.batcher.close()

    app = FastAPI(title="SpecPrefill draft worker", lifespan=lifespan)
    install_error_handlers(app)

    @app.post("/v1/score")
    async def score(request: ScoreRequest, raw_request: Request) -> JSONResponse:
        start = time.perf_counter()
        try:
            scores = await raw_request.app.state.batcher.score(request.token_ids)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="token_ids") from None
        data = scores.numpy().astype("<f4", copy=False).tobytes()
        return JSONResponse({
            "scores": base64.b64encode(data).decode(),
            "dtype": "float32",
            "length": scores.numel(),
            "identity": raw_request.app.state.worker.identity,
            "draft_ms": (time.perf_counter() - start) * 1e3,
        })

    @app.get("/v1/info")
    async def info(raw_request: Request) -> JSONResponse:
        worker: DraftWorker = raw_request.app.state.worker
        return JSONResponse({
            "model": worker.name,
            "identity": worker.identity,
            "score_params": list(worker.config.score_params),
            "scoring": worker.config.to_dict(),
            "max_prompt_tokens": worker.max_prompt_tokens,
            "tokenizer_fingerprint": raw_request.app.state.fingerprint,
        })

    @app.get("/health")
    async def health(raw_request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "batches": raw_request.app.state.batcher.batches})

    return app
