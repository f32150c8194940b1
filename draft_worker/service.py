"""The standalone draft worker service (``specprefill draft-worker --model PATH``).

``POST /v1/score`` {"token_ids": [...]} answers {"scores": base64 float32 little-endian, "length": n,
"identity": ..., "draft_ms": ...}; concurrent requests are batched into one draft forward.
``GET /v1/info`` tells the model's identity and the parameters that change scores (the gateway's cache key).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from common.errors import InvalidRequestError, install_error_handlers
from common.models import tokenizer_fingerprint
from common.protocol import WireModel
from draft_worker.batching import ScoreBatcher
from draft_worker.codec import scores_to_text
from draft_worker.settings import DraftWorkerSettings
from draft_worker.worker import DraftWorker


class ScoreRequest(WireModel):
    token_ids: list[int]


router = APIRouter()


def create_app(settings: DraftWorkerSettings, *, worker: DraftWorker | None = None) -> FastAPI:
    """The service; the model loads in the lifespan (at start-up, not import). ``worker`` replaces it (tests)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.worker = worker or DraftWorker.from_pretrained(
            settings.model,
            settings.scoring_config(),
            device=settings.device,
            dtype=settings.dtype,
            prefix_cache_bytes=settings.prefix_cache_mb << 20,
            cuda_graphs=settings.cuda_graphs,
            layers=settings.draft_layers,
        )
        app.state.batcher = ScoreBatcher(
            app.state.worker,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
            max_wait_s=settings.max_wait_ms / 1e3,
        )
        tokenizer = app.state.worker.tokenizer
        app.state.fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
        try:
            yield
        finally:
            await app.state.batcher.close()

    app = FastAPI(title="SpecPrefill draft worker", lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(router)
    return app


@router.post("/v1/score")
async def score(request: ScoreRequest, raw_request: Request) -> JSONResponse:
    start = time.perf_counter()
    try:
        scores = await raw_request.app.state.batcher.score(request.token_ids)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="token_ids") from None
    return JSONResponse(
        {
            "scores": scores_to_text(scores),
            "dtype": "float32",
            "length": scores.numel(),
            "identity": raw_request.app.state.worker.identity,
            "draft_ms": (time.perf_counter() - start) * 1e3,
        }
    )


@router.get("/v1/info")
async def info(raw_request: Request) -> JSONResponse:
    worker: DraftWorker = raw_request.app.state.worker
    return JSONResponse(
        {
            "model": worker.name,
            "identity": worker.identity,
            "score_params": list(worker.config.score_params),
            "scoring": worker.config.to_dict(),
            "max_prompt_tokens": worker.max_prompt_tokens,
            "tokenizer_fingerprint": raw_request.app.state.fingerprint,
        }
    )


@router.get("/health")
async def health(raw_request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok", "batches": raw_request.app.state.batcher.batches})
