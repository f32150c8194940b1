"""``specprefill demo-models DIR``."""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, CliPositionalArg

from common.options import SETTINGS_CONFIG


class DemoModels(BaseSettings):
    """Write the demo draft/target pair into DIR (DIR/draft, DIR/target), made locally. With --draft-shape and
    --target-shape, random weights at real models' shapes instead, for timing (say llama-3.2-1b and llama-3.1-8b
    on a GPU)."""

    model_config = SETTINGS_CONFIG
    dir: CliPositionalArg[Path]
    seed: int = 0
    draft_shape: str | None = Field(None, description="a real draft's shape: llama-3.2-1b, llama-3.2-3b, ...")
    target_shape: str | None = Field(None, description="a real target's shape: llama-3.1-8b, ...")
    device: str | None = Field(None, description="where shaped weights are made (default: cuda if available)")
    dtype: str = Field("bfloat16", description="shaped weights' dtype: bfloat16, float16 or float32")
    weights: bool = Field(
        True,
        description="shaped pairs: write the weights (off: the configs and the tokenizer "
        "only; each load makes the same random weights on its device, as for "
        "a 32B shape that would take 64 GB on disk)",
    )
    max_positions: int = Field(65536, gt=0, description="shaped pairs: the models' max_position_embeddings")

    def cli_cmd(self) -> None:
        from common.models import default_device, resolve_dtype
        from specprefill_lab.demo_models import SHAPES, write_demo_models, write_shaped_pair

        if (self.draft_shape is None) != (self.target_shape is None):
            _fail("give --draft-shape with --target-shape (or neither)")
        if self.draft_shape is None:
            out = write_demo_models(self.dir, seed=self.seed)
        else:
            unknown = [s for s in (self.draft_shape, self.target_shape) if s not in SHAPES]
            if unknown:
                _fail(f"unknown shape {unknown[0]!r}; known: {', '.join(SHAPES)}")
            out = write_shaped_pair(
                self.dir,
                self.draft_shape,
                self.target_shape,
                seed=self.seed,
                device=self.device or default_device(),
                dtype=resolve_dtype(self.dtype),
                max_positions=self.max_positions,
                weights=self.weights,
            )
        print(f"wrote {out / 'draft'} and {out / 'target'}")


def _fail(message: str) -> None:
    print(f"specprefill demo-models: {message}", file=sys.stderr)
    raise SystemExit(2)
