"""What a backend can do, by its kind (``--backend-kind``): the one place a kind's name is read.

- ``reference``: the project's engine; renders requests itself and takes the swap, reads kept tokens at their
  positions (its own ``position_ids`` field and vLLM's), yields background work to foreground at once.
- ``vllm``: vLLM with the plugin; the swap and positions (``vllm_xargs``).
- ``tokens``: any server that takes token IDs (stock vLLM, SGLang): kept tokens run contiguously.
- ``text``: any OpenAI-compatible server: the kept text, which it tokenizes again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Kind:
    name: str
    takes_swap: bool  # renders each request itself and reads the kept token IDs in its place
    reads_positions: bool  # kept tokens at their original positions (else they run contiguously)
    reads_tokens: bool  # token IDs (else text): a prompt it holds is one the gateway can model
    positions_field: bool = False  # the reference engine's own ``position_ids`` beside ``vllm_xargs``
    background_yields: bool = False  # a background request makes way for a foreground one at once

    def __str__(self) -> str:
        return self.name

    def token_body(self, model: str, token_ids: list[int], position_ids: list[int] | None, params: dict) -> dict:
        """A ``/v1/completions`` body carrying token IDs, and their positions where this kind reads them."""
        body: dict[str, Any] = {"model": model, "prompt": token_ids, **params}
        if position_ids is not None and self.reads_positions:
            body["vllm_xargs"] = {"position_ids": position_ids}
            if self.positions_field:
                body["position_ids"] = position_ids
        return body


KINDS = {
    "reference": Kind("reference", True, True, True, positions_field=True, background_yields=True),
    "vllm": Kind("vllm", True, True, True),
    "tokens": Kind("tokens", False, False, True),
    "text": Kind("text", False, False, False),
}
