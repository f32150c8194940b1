"""The backend wire format: OpenAI's completion request, with token-ID prompts and their positions."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from specprefill.openai_api import WireModel


class StreamOptions(WireModel):
    include_usage: bool = False


class CompletionRequest(WireModel):
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    logprobs: int | None = Field(None, ge=0, le=20)
    n: int = 1
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # --- extensions ---
    position_ids: list[int] | None = None
    """The prompt tokens' positions (strictly increasing); decoding continues at position_ids[-1] + 1."""
    vllm_xargs: dict[str, Any] | None = None
    """vLLM's per-request extension; ``position_ids`` is read from here too, so one body serves both."""
    ignore_eos: bool = False
    """Keep generating past EOS until max_tokens or a stop string (vLLM's name; for benchmarks and tests)."""
    return_token_ids: bool = False
    """Also return the generated token IDs in each choice (vLLM's name for it)."""

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    def positions(self) -> list[int] | None:
        if self.position_ids is not None:
            return self.position_ids
        if self.vllm_xargs and "position_ids" in self.vllm_xargs:
            return self.vllm_xargs["position_ids"]
        return None
