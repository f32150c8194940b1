"""The backend wire format: OpenAI's completion request, plus token-ID prompts at explicit positions."""

from __future__ import annotations

from typing import Any

from common.protocol import CompletionRequest


class EngineCompletionRequest(CompletionRequest):
    model: str | None = None
    max_tokens: int | None = 16
    """OpenAI's default; null generates as far as the model's position range allows."""
    # --- extensions ---
    position_ids: list[int] | None = None
    """The prompt tokens' positions (strictly increasing); decoding continues at position_ids[-1] + 1."""
    vllm_xargs: dict[str, Any] | None = None
    """vLLM's per-request extension; ``position_ids`` is read from here too, so one body serves both."""
    return_token_ids: bool = False
    """Also return the generated token IDs in each choice (vLLM's name for it)."""
    priority: int = 0
    """vLLM's extension: lower runs first; a running sequence waits while one of a lower value runs."""

    def positions(self) -> list[int] | None:
        if self.position_ids is not None:
            return self.position_ids
        if self.vllm_xargs and "position_ids" in self.vllm_xargs:
            return self.vllm_xargs["position_ids"]
        return None
