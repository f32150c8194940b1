"""Small async-stream helpers shared by the engine and the gateway."""

from __future__ import annotations

from collections.abc import AsyncIterator

from specprefill.chat_format import ChatChunkConverter


async def prepend(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """``first``, then ``rest``; closing this closes ``rest`` (and whatever request it holds open)."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def as_chat_chunks(chunks: AsyncIterator[dict], converter: ChatChunkConverter) -> AsyncIterator[dict]:
    """``text_completion`` chunks as ``chat.completion.chunk`` objects; closing this closes ``chunks``."""
    try:
        async for chunk in chunks:
            for chat_chunk in converter.convert(chunk):
                yield chat_chunk
    finally:
        await chunks.aclose()
