"""Gateway settings: one object, from flags (``specprefill serve --keep-rate 0.2``) or ``SPECPREFILL_*`` variables."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator

from common.options import DeviceOptions, ServerOptions
from draft_worker.config import validate_keep_rate
from draft_worker.settings import ScoringOptions

BackendKind = Literal["reference", "vllm", "tokens", "text"]


class GatewaySettings(ServerOptions, DeviceOptions, ScoringOptions):
    """The gateway: OpenAI-compatible, compresses long prompts with SpecPrefill."""

    backend_url: str | None = Field(
        None, description="the backend engine's base URL (default: the reference engine in-process)"
    )
    backend_kind: BackendKind = Field(
        "reference",
        description="reference (positions), vllm (vLLM with the plugin: positions), "
        "tokens (token IDs, no positions), text (kept text to any OpenAI-compatible server)",
    )
    backend_model: str | None = Field(None, description="the model name the backend serves (default: asked from it)")
    backend_api_key: SecretStr | None = Field(None, description="Bearer token the gateway sends to the backend")
    target_model: str | None = Field(None, description="the target model (its tokenizer and chat template); "
                                     "without it and --draft-model, `specprefill serve` runs the demo pair")
    draft_model: str | None = Field(None, description="the draft model (same tokenizer as the target)")
    draft_worker_url: list[str] = Field(default_factory=list, description="remote draft workers (repeatable)")
    served_model_name: str | None = Field(None, description="the model name clients use (default: the target's)")
    redis_url: str | None = Field(None, description="Redis for the shared score cache (default: in-memory)")
    redis_key_prefix: str = Field("specprefill:", description="prefix of every Redis key")
    score_cache_ttl: float = Field(3600.0, gt=0, description="seconds a cached score array lives")
    score_cache_max_entry_kb: int = Field(4096, gt=0, description="larger score arrays are not cached")
    memory_cache_mb: int = Field(256, ge=0, description="in-memory score cache size without Redis (0: off)")
    draft_prefix_cache_mb: int = Field(1024, ge=0, description="in-process draft KV kept for prefix reuse (0: off)")
    keep_rate: float = Field(0.3, description="default fraction of chunks kept, in (0, 1]")
    min_prompt_tokens: int = Field(1024, ge=1, description="shorter prompts bypass compression")
    api_key: SecretStr | None = Field(None, description="clients must send this as a Bearer token")
    draft_timeout: float = Field(30.0, gt=0, description="seconds before a draft falls back to the full prompt")
    backend_connect_timeout: float = Field(5.0, gt=0, description="seconds to connect to the backend")
    backend_read_timeout: float = Field(600.0, gt=0, description="seconds to wait for each backend read")
    max_request_bytes: int = Field(16 << 20, gt=0, description="larger request bodies get 413")
    max_prompt_tokens: int | None = Field(None, gt=0, description="longer prompts get 400 (default: the target's limit)")
    max_tokens_limit: int = Field(32768, gt=0, description="max_tokens above this gets 400")
    max_messages: int = Field(4096, gt=0, description="chats with more messages get 400")
    metrics_public: bool = Field(False, description="serve /metrics without the API key")

    @field_validator("keep_rate")
    @classmethod
    def _keep_rate(cls, value: float) -> float:
        return validate_keep_rate(value)

    @field_validator("backend_url")
    @classmethod
    def _strip_slash(cls, value: str | None) -> str | None:
        return value.rstrip("/") if value else value

    @property
    def embedded(self) -> bool:
        return self.backend_url is None
