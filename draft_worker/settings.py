"""The draft worker's options as flags and ``SPECPREFILL_<NAME>`` variables.

``ScoringOptions`` is shared by ``serve``, ``score`` and ``draft-worker``; its defaults and its checks are
``ScoringConfig``'s own, so the paper's defaults live in one place.
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings

from common.options import SETTINGS_CONFIG, DeviceOptions, ServerOptions
from draft_worker.config import ScoringConfig

_DEFAULTS = ScoringConfig()


class ScoringOptions(BaseSettings):
    """How the draft scores and selects (the paper's defaults)."""

    model_config = SETTINGS_CONFIG

    look_ahead: int = Field(
        _DEFAULTS.look_ahead, description="draft steps whose queries are scored, the last prompt token's included"
    )
    pool_kernel: int = Field(_DEFAULTS.pool_kernel, description="average-pooling kernel along the sequence (1: off)")
    observation_window: int = Field(
        _DEFAULTS.observation_window,
        description="the prompt's last N tokens' queries scored too, each over the keys before it (SnapKV's "
        "observation window; 1: the last token only, as the paper)",
    )
    local_attention: int = Field(
        _DEFAULTS.local_attention,
        ge=0,
        description="the draft reads the prompt with local attention: each token sees the first 4 tokens and the "
        "N before its block of 512 (linear in the prompt's length; the scored queries still see every key); 0: "
        "full attention, as the paper",
    )
    propagate_layer: int = Field(
        _DEFAULTS.propagate_layer,
        ge=0,
        description="from this decoder layer on, the draft reads only the prompt tokens its lower layers rank "
        "highest (--propagate-rate of them, at their positions; FastKV's token-selective propagation); 0: every "
        "token through every layer, as the paper",
    )
    propagate_rate: float = Field(
        _DEFAULTS.propagate_rate,
        gt=0,
        le=1,
        description="the share of the prompt that goes on from --propagate-layer",
    )
    chunk_size: int = Field(
        _DEFAULTS.chunk_size, description="tokens are kept in contiguous chunks of this size (1: single tokens)"
    )
    max_chunks: int = Field(
        _DEFAULTS.max_chunks,
        ge=0,
        description="a selection keeps at most about this many chunks: where the keep rate buys more chunks of "
        "--chunk-size, the chunks double until it does not (0: off, always --chunk-size, the paper's)",
    )
    min_chunks: int = Field(
        _DEFAULTS.min_chunks,
        ge=0,
        description="a selection keeps at least about this many chunks: where the keep rate buys fewer chunks of "
        "--chunk-size, the chunks halve until it does not (0: off; at most half of --max-chunks)",
    )
    protect_first: int = Field(_DEFAULTS.protect_first, description="the first N tokens are always kept (0: off)")
    protect_last: int = Field(_DEFAULTS.protect_last, description="the last N tokens are always kept (0: off)")
    cuda_graphs: bool = Field(
        True,
        description="on a GPU, the draft's look-ahead steps replay CUDA graphs (off: "
        "plain forwards, 2x the scoring time of an 8k prompt on an H100)",
    )
    draft_layers: int | None = Field(
        None,
        ge=1,
        description="the draft model's first N decoder layers only, then its "
        "final norm and head (default: all); with the target as --draft-model, a "
        "self-draft",
    )

    @model_validator(mode="after")
    def _valid(self) -> Self:
        self.scoring_config()  # ConfigError is a ValueError: a clear message naming the option
        return self

    def scoring_config(self) -> ScoringConfig:
        return ScoringConfig(
            look_ahead=self.look_ahead,
            pool_kernel=self.pool_kernel,
            observation_window=self.observation_window,
            local_attention=self.local_attention,
            propagate_layer=self.propagate_layer,
            propagate_rate=self.propagate_rate,
            chunk_size=self.chunk_size,
            max_chunks=self.max_chunks,
            min_chunks=self.min_chunks,
            protect_first=self.protect_first,
            protect_last=self.protect_last,
        )


class DraftWorkerSettings(ServerOptions, DeviceOptions, ScoringOptions):
    """A standalone draft worker service, for gateways started with --draft-worker-url."""

    model: str = Field(description="draft model: a local folder or a hub id")
    port: int = Field(8002, description="port to listen on")
    max_batch_size: int = Field(8, gt=0, description="prompts scored in one draft forward")
    max_batch_tokens: int = Field(65536, gt=0, description="padded tokens (rows x longest prompt) in one forward")
    max_wait_ms: float = Field(5.0, ge=0, description="how long a request waits for others to batch with")
    prefix_cache_mb: int = Field(1024, ge=0, description="draft KV kept for prefix reuse (0: off)")
