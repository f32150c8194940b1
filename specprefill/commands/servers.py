"""The commands that start services: ``serve`` (the gateway), ``engine``, ``draft-worker``."""

from __future__ import annotations

import json

from draft_worker.settings import DraftWorkerSettings
from engine.settings import EngineSettings
from gateway.settings import GatewaySettings


class Serve(GatewaySettings):
    """The gateway: OpenAI-compatible, compresses long prompts with SpecPrefill."""

    def cli_cmd(self) -> None:
        from common.server import run_server
        from gateway.app import create_app

        settings = self.with_demo_models()
        base = f"http://{settings.host}:{settings.port}/v1"
        model = settings.served_model_name or settings.target_model
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16},
                          separators=(",", ":"))
        print(f"SpecPrefill gateway: base URL {base}", flush=True)
        print(f"  try: curl -s {base}/chat/completions -H 'content-type: application/json' "
              f"-H 'x-keep-rate: 0.3' -d '{body}'", flush=True)
        run_server(create_app(settings), settings, max_body_bytes=settings.max_request_bytes)

    def with_demo_models(self) -> GatewaySettings:
        """Without --target-model and --draft-model: the demo pair, written on first use."""
        if self.target_model is not None or self.draft_model is not None:
            return self
        from specprefill.lab.demo_models import DEMO_NAME, ensure_demo_models

        root = ensure_demo_models()
        return self.model_copy(update={"target_model": str(root / "target"), "draft_model": str(root / "draft"),
                                       "served_model_name": self.served_model_name or DEMO_NAME})


class Engine(EngineSettings):
    """The reference backend engine: honours prompt token IDs at explicit positions (OpenAI completions)."""

    def cli_cmd(self) -> None:
        from common.server import run_server
        from engine.server import create_app

        run_server(create_app(self), self)


class DraftWorker(DraftWorkerSettings):
    """A standalone draft worker service, for gateways started with --draft-worker-url."""

    def cli_cmd(self) -> None:
        from common.server import run_server
        from draft_worker.service import create_app

        run_server(create_app(self), self)
