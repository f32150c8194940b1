"""The commands that start services: ``serve`` (the gateway), ``engine``, ``draft-worker``."""

from __future__ import annotations

import json
import sys

from pydantic import Field, field_validator

from draft_worker.settings import DraftWorkerSettings
from engine.settings import EngineSettings
from gateway.settings import GatewaySettings
from specprefill.real_models.catalog import DEFAULT_PAIR, PAIRS, real_pair


class Serve(GatewaySettings):
    """The gateway: OpenAI-compatible, compresses long prompts with SpecPrefill."""

    real_pair: str = Field(
        DEFAULT_PAIR,
        description="without --target-model: the real pair served, made on first use from PyPI packages: "
        f"{', '.join(PAIRS)} (smollm2: 135M parameters, for small machines)",
    )

    @field_validator("real_pair")
    @classmethod
    def _pair(cls, value: str) -> str:
        real_pair(value)  # a ValueError names the pairs
        return value

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
        if settings.workers > 1:
            from common.workers import run_workers

            raise SystemExit(
                run_workers(
                    create_app,
                    settings,
                    settings.workers,
                    service="specprefill-gateway",
                    max_body_bytes=settings.max_request_bytes,
                )
            )
        run_server(
            create_app(settings), settings, service="specprefill-gateway", max_body_bytes=settings.max_request_bytes
        )

    def with_default_models(self) -> GatewaySettings:
        """Without --target-model and --draft-model: the real pair that --real-pair names, each model made on
        first use from the GGUF files PyPI packages ship (``specprefill.real_models``), served under its name
        and the names clients send for it, with the pair's draft layers, observation window and cap on the
        count of chunks (where not set)."""
        if self.target_model is not None or self.draft_model is not None:
            return self
        from specprefill.real_models.catalog import real_pair
        from specprefill.real_models.checkpoint import ensure_checkpoint
        from specprefill.real_models.gguf_files import RealModelError

        pair = real_pair(self.real_pair)
        try:
            target, draft = (str(ensure_checkpoint(m)) for m in (pair.target, pair.draft))
        except RealModelError as exc:
            print(f"specprefill serve: error: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        name = self.served_model_name or pair.target.name
        aliases = [a for a in (pair.target.name, *pair.target.aliases) if a != name]
        return self.model_copy(
            update={
                "target_model": target,
                "draft_model": draft,
                "draft_layers": self.draft_layers or pair.draft_layers,
                "observation_window": self.observation_window
                if "observation_window" in self.model_fields_set
                else pair.observation_window,
                "max_chunks": self.max_chunks if "max_chunks" in self.model_fields_set else pair.max_chunks,
                "served_model_name": name,
                "model_alias": [*self.model_alias, *(a for a in aliases if a not in self.model_alias)],
            }
        )


class Engine(EngineSettings):
    """The reference backend engine: honours prompt token IDs at explicit positions (OpenAI completions)."""

    def cli_cmd(self) -> None:
        from common.server import run_server
        from engine.server import create_app

        run_server(create_app(self), self, service="specprefill-engine")


class DraftWorker(DraftWorkerSettings):
    """A standalone draft worker service, for gateways started with --draft-worker-url."""

    def cli_cmd(self) -> None:
        from common.server import run_server
        from draft_worker.service import create_app

        _check_draft_layers("draft-worker", self.model, self.draft_layers)
        run_server(create_app(self), self, service="specprefill-draft-worker")


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
