"""Options shared by several commands: flags and ``SPECPREFILL_<NAME>`` environment variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from draft_worker.config import ScoringConfig

SETTINGS_CONFIG = SettingsConfigDict(
    env_prefix="SPECPREFILL_", cli_kebab_case=True, cli_implicit_flags=True, cli_hide_none_type=True
)


class ScoringOptions(BaseSettings):
    """The scoring options shared by ``serve``, ``score`` and ``draft-worker`` (the paper's defaults)."""

    model_config = SETTINGS_CONFIG

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
