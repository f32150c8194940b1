"""What a backend can do, by its kind (``--backend-kind``): the one place a kind's name is read.

- ``reference``: the project's engine; renders requests itself and takes the swap, reads kept tokens at their
  positions (its own ``position_ids`` field and vLLM's), yields background work to foreground at once.
- ``vllm``: vLLM with the plugin; the swap and positions (``vllm_xargs``).
- ``tokens``: any server that takes token IDs (stock vLLM, SGLang): kept tokens run contiguously.
- ``text``: any OpenAI-compatible server: the kept text, which it tokenizes again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from common.chat import RenderedChat
from common.protocol import ChatMessage
from gateway.engines.text_kind import kept_messages, kept_text


@dataclass(frozen=True, slots=True)
class Kept:
    """A compressed prompt, for a backend that does not take the swap."""

    token_ids: Sequence[int]  # the whole prompt
    position_ids: Sequence[int]  # the kept tokens' positions
    params: dict[str, Any]  # the request's sampling fields, as a completion takes them
    messages: list[ChatMessage] | None = None  # a chat's messages and their rendering (a text backend's chat
    rendered: RenderedChat | None = None  # gets each message cut to its kept tokens)


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

    def token_body(
        self, model: str, token_ids: Sequence[int], position_ids: Sequence[int] | None, params: dict[str, Any]
    ) -> dict[str, Any]:
        """A ``/v1/completions`` body carrying token IDs, and their positions where this kind reads them (as lists,
        as JSON has them: an in-process backend reads the body as it is)."""
        body: dict[str, Any] = {"model": model, "prompt": list(token_ids), **params}
        if position_ids is not None and self.reads_positions:
            position_ids = list(position_ids)
            body["vllm_xargs"] = {"position_ids": position_ids}
            if self.positions_field:
                body["position_ids"] = position_ids
        return body

    def kept_body(
        self, body: dict[str, Any], kept: Kept, tokenizer: PreTrainedTokenizerBase
    ) -> tuple[dict[str, Any], bool]:
        """The backend body for ``kept``, made from the client's ``body`` as the backend takes it, and whether it
        is a chat body (else a completion's): token IDs at their positions where this kind reads them; for a
        text backend, a chat's messages cut to their kept tokens, or the kept text."""
        if self.reads_tokens:
            ids = [kept.token_ids[i] for i in kept.position_ids]
            return self.token_body(body["model"], ids, kept.position_ids, kept.params), False
        if kept.messages is not None and kept.rendered is not None:
            messages = kept_messages(tokenizer, kept.messages, kept.rendered, kept.position_ids)
            return {**body, "messages": messages}, True
        text = kept_text(tokenizer, kept.token_ids, kept.position_ids)
        return {"model": body["model"], "prompt": text, **kept.params}, False


KINDS = {
    "reference": Kind("reference", True, True, True, positions_field=True, background_yields=True),
    "vllm": Kind("vllm", True, True, True),
    "tokens": Kind("tokens", False, False, True),
    "text": Kind("text", False, False, False),
}
