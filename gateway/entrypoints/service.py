"""The gateway's own routes: the models it serves, its health and its metrics."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.entrypoints.http import AUTH, require_key_for_metrics
from gateway.serving import GatewayServing

router = APIRouter()


@router.get("/v1/models", dependencies=AUTH)
async def models(raw_request: Request) -> JSONResponse:
    """The served model (``--served-model-name``), then its ``--model-alias`` names."""
    serving: GatewayServing = raw_request.app.state.serving
    names = [serving.model_name, *(a for a in serving.settings.model_alias if a != serving.model_name)]
    created = int(time.time())
    data = [{"id": name, "object": "model", "created": created, "owned_by": "specprefill"} for name in names]
    return JSONResponse({"object": "list", "data": data})


@router.get("/health")
async def health(raw_request: Request) -> JSONResponse:
    """``ok``, or ``degraded`` while the draft or a backend replica is not ready (503 while draining);
    needs no key."""
    serving: GatewayServing = raw_request.app.state.serving
    draft_ready = await serving.draft.ready()
    ready = await asyncio.gather(*(r.backend.ready() for r in serving.replicas))
    backend = {"ready": any(ready), "kind": serving.backend.kind.name}
    if len(ready) > 1:  # replicas: the gateway serves while one of them does
        backend["replicas"] = [
            {"replica": r.index, "ready": ok, "routed": r.up} for r, ok in zip(serving.replicas, ready)
        ]
    return JSONResponse(
        {
            "status": "ok" if draft_ready and all(ready) else "degraded",
            "draft": {"ready": draft_ready, "tokenizer": getattr(serving.draft, "kind", "shared")},
            "backend": backend,
        }
    )


@router.get("/metrics", dependencies=[Depends(require_key_for_metrics)])
async def prometheus(raw_request: Request) -> Response:
    """Prometheus metrics (the key unless ``--metrics-public``)."""
    return Response(generate_latest(raw_request.app.state.metrics.exposed()), media_type=CONTENT_TYPE_LATEST)
