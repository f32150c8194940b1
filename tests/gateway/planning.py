"""The planner asked as the tests ask it: a prompt's tokens and what to keep whole, as ``Prompt``."""

from __future__ import annotations

from gateway.planning.prompt import Prompt


async def plan_prompt(planner, token_ids, options, unsupported, keep=None, *, boundary=None, **kwargs):
    """``planner.plan`` of the prompt ``token_ids`` (``keep``: its tokens to keep whole; ``boundary``: where
    its last message begins)."""
    return await planner.plan(Prompt(token_ids, keep=keep, boundary=boundary), options, unsupported, **kwargs)
