"""The gateway app: one module per API surface (``gateway.entrypoints``), each with its router and its serving
object over the shared path (``GatewayServing``); models load in the lifespan.

A surface module has a ``NAME``, a ``router`` and ``build(serving, built)``, which makes its serving object
(``built``: the surfaces made before it, by name); adding one is adding its module to ``SURFACES``."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from common.errors import install_error_handlers
from gateway.engines.backends import Backend
from gateway.entrypoints import chat, completions, dry_run, fast_lane, messages, responses, service
from gateway.metrics import GatewayMetrics
from gateway.planning.draft import DraftClient
from gateway.settings import GatewaySettings
from gateway.wiring import build_serving

logger = logging.getLogger("specprefill.gateway")

SURFACES = [chat, completions, responses, messages, dry_run]


class GatewayApp(FastAPI):
    """The FastAPI app, with chat completions and completions served past its layers once it serves
    (``gateway.entrypoints.fast_lane``; their routes stay in the app for the schema and for what the lane does not
    take)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if fast_lane.takes(scope) and hasattr(self.state, "surfaces"):
            await fast_lane.serve(self, scope, receive, send, super().__call__)
            return
        await super().__call__(scope, receive, send)


def create_app(
    settings: GatewaySettings | None = None, *, draft: DraftClient | None = None, backend: Backend | None = None
) -> GatewayApp:
    """Builds the gateway. ``draft`` and ``backend`` replace the configured ones (embedding, tests)."""
    settings = settings or GatewaySettings()
    surfaces = list(SURFACES)
    app = GatewayApp(title="SpecPrefill gateway", lifespan=functools.partial(_lifespan, draft, backend, surfaces))
    app.state.settings, app.state.metrics = settings, GatewayMetrics()
    install_error_handlers(app)
    for surface in surfaces:
        app.include_router(surface.router)
    app.include_router(service.router)
    return app


@asynccontextmanager
async def _lifespan(
    draft: DraftClient | None, backend: Backend | None, surfaces: list[Any], app: FastAPI
) -> AsyncGenerator[None, None]:
    settings = app.state.settings
    serving = app.state.serving = await build_serving(settings, app.state.metrics, draft, backend)
    built: dict[str, Any] = {}
    for surface in surfaces:
        built[surface.NAME] = surface.build(serving, built)
    app.state.surfaces = built
    logger.info(
        "gateway ready: model %r, backend %s",
        serving.model_name,
        ", ".join(settings.backend_url) or "reference engine in-process",
    )
    try:
        yield
    finally:
        await serving.close()
