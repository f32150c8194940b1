"""Structured outputs (``response_format`` JSON schema or JSON object): which tokens may come next.

lm-format-enforcer walks a character-level JSON parser over the tokenizer's prefix tree; the per-tokenizer tree
is built once per engine, on the first structured request (in the engine thread, never at import).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from common.errors import InvalidRequestError


def json_schema_of(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The schema a ``response_format`` asks for (``{}`` for any JSON object), or None for free text."""
    if not response_format or response_format.get("type") in (None, "text"):
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                "response_format.json_schema.schema must be a JSON schema object", param="response_format"
            )
        return schema
    raise InvalidRequestError(
        f"response_format type {kind!r} is not supported; use text, json_object or json_schema", param="response_format"
    )


class JSONConstraint:
    """One request's constraint: the tokens allowed after the ones generated so far."""

    def __init__(self, enforcer: Any) -> None:  # lm-format-enforcer's TokenEnforcer
        self._enforcer = enforcer

    def mask(self, logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
        """logits [V] with every token the schema does not allow next at -inf."""
        allowed = self._enforcer.get_allowed_tokens([-1, *generated]).allowed_tokens  # -1: a fixed root
        masked = torch.full_like(logits, float("-inf"))
        index = torch.tensor(allowed, dtype=torch.long, device=logits.device)
        index = index[index < logits.shape[-1]]
        masked[index] = logits[index]
        return masked


class StructuredOutputs:
    """Makes constraints for one tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._data: Any = None

    def constraint(self, parser: Any) -> JSONConstraint:
        from lmformatenforcer import TokenEnforcer

        if self._data is None:
            self._data = _tokenizer_data(self._tokenizer, self._vocab_size)
        return JSONConstraint(TokenEnforcer(self._data, parser))


def _tokenizer_data(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> Any:
    """lm-format-enforcer's per-tokenizer data, built as its transformers integration builds it (that module
    does not import under transformers 5): each regular token's text, and whether it starts a word."""
    from lmformatenforcer import TokenEnforcerTokenizerData

    size = min(vocab_size, len(tokenizer))
    zero = tokenizer.encode("0", add_special_tokens=False)[-1]
    special = set(tokenizer.all_special_ids)
    regular = []
    for token in range(size):
        if token in special:
            continue
        after_zero = tokenizer.decode([zero, token])[1:]  # a word-start token decodes with its leading space here
        regular.append((token, after_zero, len(after_zero) > len(tokenizer.decode([token]))))

    def decode(tokens: list[int]) -> str:
        return str(tokenizer.decode(tokens)).rstrip("\ufffd")

    return TokenEnforcerTokenizerData(regular, decode, tokenizer.eos_token_id, False, size)


def json_parser(response_format: dict[str, Any] | None) -> Any:
    """A request's JSON parser (its schema checked here, so a bad one is a 400), or None for free text."""
    schema = json_schema_of(response_format)
    if schema is None:
        return None
    from lmformatenforcer import JsonSchemaParser

    try:
        return JsonSchemaParser(schema)
    except Exception as exc:  # the library raises whatever its schema model raises
        raise InvalidRequestError(
            f"response_format's JSON schema is not usable: {exc}", param="response_format"
        ) from None
