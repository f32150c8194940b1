"""Tools that run on the API provider's own servers (OpenAI's web search, file search, code interpreter;
Anthropic's server tools and the tools whose schemas Anthropic defines), and the one rule for a request that
names them: a tool a client merely offers is left out of what the model sees and of the body the backend gets,
with a debug log and the response header ``x-specprefill-tools-left-out`` (Codex CLI offers ``web_search`` to
every model it does not know: the model here would never call it); a request that requires one (its
``tool_choice`` names it, or requires a tool when there is no other) gets a 400 that names it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from common.errors import InvalidRequestError

logger = logging.getLogger("specprefill")

LEFT_OUT_HEADER = "x-specprefill-tools-left-out"
OPENAI_HOSTED = ("web_search", "file_search", "code_interpreter", "image_generation", "computer_use", "mcp")


def openai_hosted(tool: Any) -> str | None:
    """An OpenAI hosted tool's type (``web_search_preview``, ``file_search``, ...), or None for a client's own."""
    kind = str(tool.get("type")) if isinstance(tool, dict) else ""
    return kind if kind.startswith(OPENAI_HOSTED) else None


def anthropic_server(tool: Any) -> str | None:
    """An Anthropic tool with a ``type`` (``web_search_20250305``, ``code_execution_...``, ``bash_...``): its name,
    or None for a client tool (a name and an ``input_schema``)."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    return str(tool.get("name") or kind) if kind not in (None, "custom") else None


def openai_forced(choice: Any) -> tuple[str | None, bool]:
    """What an OpenAI ``tool_choice`` requires: a hosted tool it names (``{"type": "web_search_preview"}``), and
    whether it requires some tool call (``required``)."""
    named = openai_hosted(choice) if isinstance(choice, dict) else None
    return named, choice == "required"


def anthropic_forced(choice: Any) -> tuple[str | None, bool]:
    """What an Anthropic ``tool_choice`` requires: the tool it names, and whether it requires some tool (``any``)."""
    if not isinstance(choice, dict):
        return None, False
    return (choice.get("name") if choice.get("type") == "tool" else None), choice.get("type") == "any"


def leave_out_offered(
    data: Any,
    hosted: Callable[[Any], str | None],
    forced: Callable[[Any], tuple[str | None, bool]],
    owner: str,
) -> tuple[Any, list[str]]:
    """A request body (as sent) without the hosted tools it merely offers, and their names; a 400 where the
    request requires one (raised from inside validation, it reaches the client as it is)."""
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        return data, []
    tools = data["tools"]
    left = [name for tool in tools if (name := hosted(tool)) is not None]
    if not left:
        return data, []
    kept = [tool for tool in tools if hosted(tool) is None]
    named, any_tool = forced(data.get("tool_choice"))
    needed = named if named in left else left[0] if any_tool and not kept else None
    if needed is not None:
        raise InvalidRequestError(
            f"tool_choice requires the {needed} tool, which runs on {owner}'s servers; this gateway's model calls "
            "the client's own tools only: leave the tool out, or let the model choose",
            param="tool_choice",
        )
    logger.debug("left out the tools %s: they run on %s's servers, and the request only offers them", left, owner)
    data = {**data, "tools": kept}
    if not kept:  # as if none were sent (an engine may refuse an empty list, or an "auto" choice of nothing)
        data.pop("tools")
        if data.get("tool_choice") in ("auto", {"type": "auto"}):
            data.pop("tool_choice")
    return data, left
