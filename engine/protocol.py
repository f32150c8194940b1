"""The backend wire format: OpenAI's completion request, plus token-ID prompts at explicit positions."""

from __future__ import annotations

from typing import cast

from common.protocol import CompletionRequest


class EngineCompletionRequest(CompletionRequest):
    model: str | None = None  # type: ignore[assignment]  # the engine answers requests that name no model
    max_tokens: int | None = 16
    """OpenAI's default; null generates as far as the model's position range allows."""
    # --- extensions ---
    position_ids: list[int] | None = None
    """The prompt tokens' positions (strictly increasing); decoding continues at position_ids[-1] + 1."""
    return_token_ids: bool = False
    """Also return the generated token IDs in each choice (vLLM's name for it)."""
    priority: int = 0
    """vLLM's extension: lower runs first; a running sequence waits while one of a lower value runs."""

    def sent_position_ids(self) -> list[int] | None:
        """The token-ID wire format's positions (top-level, or in ``vllm_xargs`` so one body serves both)."""
        if self.position_ids is not None:
            return self.position_ids
        if self.vllm_xargs and "position_ids" in self.vllm_xargs:
            return cast("list[int]", self.vllm_xargs["position_ids"])  # checked where it is read
        return None
