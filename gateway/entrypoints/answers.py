"""What a client sees of an answer: this gateway's model name, and usage that counts the original prompt's tokens
(with the kept ones beside them under ``usage.specprefill``), in OpenAI's shapes and in Anthropic's."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

from gateway.dispatch.answer import Answer
from gateway.planning.plan import Plan

Rewrite = Callable[[dict[str, Any], Plan, str], dict[str, Any]]


def openai(body: dict[str, Any], plan: Plan, model: str) -> dict[str, Any]:
    """A chat or completion answer or chunk, a Response or a Responses stream event."""
    if isinstance(body.get("response"), dict):  # a Responses stream event
        openai(body["response"], plan, model)
        return body
    if "model" in body:
        body["model"] = model
    usage = body.get("usage")
    if usage and not plan.passthrough:  # a request passed through unread: the backend's count stands
        responses = "input_tokens" in usage
        completion_tokens = usage.get("output_tokens" if responses else "completion_tokens", 0)
        usage["input_tokens" if responses else "prompt_tokens"] = plan.original_tokens
        usage["total_tokens"] = plan.original_tokens + completion_tokens
        usage["specprefill"] = _kept(plan)
    return body


def anthropic(body: dict[str, Any], plan: Plan, model: str) -> dict[str, Any]:
    """A Messages answer or stream event. Anthropic's ``input_tokens`` are those not read from the cache: the
    original prompt's, less what the engine served from its prefix cache (``cache_read_input_tokens``)."""
    if isinstance(body.get("message"), dict):  # message_start
        anthropic(body["message"], plan, model)
        return body
    if "model" in body:
        body["model"] = model
    usage = body.get("usage")
    if isinstance(usage, dict) and not plan.passthrough:
        read = usage.get("cache_read_input_tokens") or 0
        created = usage.get("cache_creation_input_tokens") or 0
        usage["input_tokens"] = max(0, plan.original_tokens - read - created)
        usage["specprefill"] = _kept(plan)
    return body


def shaped(answer: Answer, rewrite: Rewrite, model: str, *, ping: bool = False) -> Answer:
    """The answer rewritten for the client; ``ping``: an Anthropic stream's ``ping`` after ``message_start``."""
    plan = answer.plan
    return answer.map(
        lambda body: rewrite(body, plan, model), lambda stream: _stream(stream, rewrite, plan, model, ping)
    )


async def _stream(
    stream: AsyncGenerator[dict[str, Any], None], rewrite: Rewrite, plan: Plan, model: str, ping: bool
) -> AsyncGenerator[dict[str, Any], None]:
    pinged = False
    try:
        async for event in stream:
            if pinged and event.get("type") == "ping":  # the backend's own, right after ours
                pinged = False
                continue
            pinged = False
            yield rewrite(event, plan, model)
            if ping and event.get("type") == "message_start":
                yield {"type": "ping"}
                pinged = True
    finally:
        await stream.aclose()


def _kept(plan: Plan) -> dict[str, Any]:
    return {"original_prompt_tokens": plan.original_tokens, "kept_prompt_tokens": plan.kept_tokens}
