"""How many tokens a request may ask for: the model's context less the prompt's tokens. A compressed prompt
counts as the whole one, since its kept tokens keep their original positions and generation continues after
the last. OpenAI's surfaces answer a request past it with vLLM's 400 (naming the field the client sent: an engine
would otherwise run toward the end of the context); Anthropic's Messages lowers it to the room left, with a debug
log, since Claude Code asks for 32,000 tokens or more whatever the model."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from common.errors import InvalidRequestError

logger = logging.getLogger("specprefill")


@dataclass(frozen=True, slots=True)
class OutputLimit:
    """The client's field for the tokens it asks for, and whether one past the room is lowered or refused."""

    field: str = "max_tokens"  # max_tokens, max_completion_tokens (chat), max_output_tokens (Responses)
    clamp: bool = False  # lowered to the room left (Messages), else a 400

    def never_fits(self, requested: int | None, context: int | None) -> None:
        """A 400 before any tokenizing for a request that asks for the whole context or more: no prompt leaves
        room for it."""
        if not self.clamp and requested is not None and context is not None and requested >= context:
            raise self._error(requested, context, None)

    def fit(self, requested: int | None, prompt_tokens: int, context: int | None) -> int | None:
        """``requested`` where it fits beside ``prompt_tokens`` in ``context`` positions (or either is unknown);
        else the room left (``clamp``) or a 400."""
        if requested is None or context is None or requested <= (room := context - prompt_tokens):
            return requested
        if self.clamp and room > 0:
            logger.debug(
                "%s %d lowered to %d, the room the prompt leaves in %d positions", self.field, requested, room, context
            )
            return room
        raise self._error(requested, context, prompt_tokens)

    def _error(self, requested: int, context: int, prompt_tokens: int | None) -> InvalidRequestError:
        has = (
            f"and your request has {prompt_tokens} input tokens ({requested} > {context} - {prompt_tokens}): ask for "
            f"at most {context - prompt_tokens}"
            if prompt_tokens is not None
            else "and every prompt takes at least one"
        )
        return InvalidRequestError(
            f"'{self.field}' is too large: {requested}. This model's maximum context length is {context} tokens {has}",
            param=self.field,
        )
