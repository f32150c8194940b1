"""The ``specprefill`` command: every option is a flag and an environment variable ``SPECPREFILL_<NAME>``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, CliApp, CliPositionalArg, CliSubCommand, SettingsConfigDict

from draft_worker.config import ScoringConfig

_SETTINGS = SettingsConfigDict(
    env_prefix="SPECPREFILL_", cli_kebab_case=True, cli_implicit_flags=True, cli_hide_none_type=True
)


class ScoringOptions(BaseSettings):
    """The scoring options shared by ``serve``, ``score`` and ``draft-worker`` (the paper's defaults)."""

    model_config = _SETTINGS

    look_ahead: int = Field(8, description="draft steps whose queries are scored, the last prompt token's included")
    pool_kernel: int = Field(13, description="average-pooling kernel along the sequence (1: off)")
    chunk_size: int = Field(32, description="tokens are kept in contiguous chunks of this size (1: single tokens)")
    protect_first: int = Field(4, description="the first N tokens are always kept (0: off)")
    protect_last: int = Field(32, description="the last N tokens are always kept (0: off)")

    def scoring_config(self) -> ScoringConfig:
        return ScoringConfig(
            look_ahead=self.look_ahead,
            pool_kernel=self.pool_kernel,
            chunk_size=self.chunk_size,
            protect_first=self.protect_first,
            protect_last=self.protect_last,
        )


class Score(ScoringOptions):
    """Score one prompt with a draft model and show what the target would read."""

    file: CliPositionalArg[str] = Field(description="a text file, or - for standard input")
    model: str = Field(description="draft model: a local folder or a hub id")
    keep_rate: float = Field(0.3, description="fraction of chunks kept, in (0, 1]")
    token_ids: bool = Field(False, description="read a JSON list of token IDs instead of text")
    json_output: bool = Field(
        False, validation_alias=AliasChoices("json", "json_output"), description="print the numbers as JSON"
    )
    device: str | None = Field(None, description="torch device (default: cuda when available)")
    dtype: str = Field("auto", description="auto, float32, bfloat16 or float16")

    def cli_cmd(self) -> None:
        from specprefill.score_cmd import run_score

        raise SystemExit(run_score(self))


class Engine(BaseSettings):
    """The reference backend engine: honours prompt token IDs at explicit positions (OpenAI completions)."""

    model_config = _SETTINGS
    model: str = Field(description="target model: a local folder or a hub id")
    host: str = "127.0.0.1"
    port: int = 8001
    device: str | None = Field(None, description="torch device (default: cuda when available)")
    dtype: str = Field("auto", description="auto, float32, bfloat16 or float16")
    served_model_name: str | None = Field(None, description="the model name clients send (default: --model)")
    max_running: int = Field(8, description="sequences decoded concurrently (interleaved)")
    max_waiting: int = Field(64, description="queued requests beyond which the engine answers 503")
    log_level: str = "info"

    def cli_cmd(self) -> None:
        import uvicorn

        from engine.server import create_app

        app = create_app(self.model, device=self.device, dtype=self.dtype, served_name=self.served_model_name,
                         max_running=self.max_running, max_waiting=self.max_waiting)
        uvicorn.run(app, host=self.host, port=self.port, log_level=self.log_level)


class DemoModels(BaseSettings):
    """Write the demo draft/target pair into DIR (DIR/draft, DIR/target), made locally."""

    model_config = _SETTINGS
    dir: CliPositionalArg[Path]
    seed: int = 0

    def cli_cmd(self) -> None:
        from specprefill.demo_models import write_demo_models

        out = write_demo_models(self.dir, seed=self.seed)
        print(f"wrote {out / 'draft'} and {out / 'target'}")


class Main(BaseSettings, cli_prog_name="specprefill", cli_kebab_case=True, cli_implicit_flags=True):
    """SpecPrefill gateway: lower time-to-first-token for long prompts."""

    engine: CliSubCommand[Engine]
    score: CliSubCommand[Score]
    demo_models: CliSubCommand[DemoModels]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> None:
    CliApp.run(Main, cli_args=sys.argv[1:] if argv is None else argv)


def dumps(payload: object) -> str:
    return json.dumps(payload, separators=(",", ":"))
