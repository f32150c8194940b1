"""An ASGI request's whole body, read from its ``receive`` before anything else is."""

from __future__ import annotations

from starlette.types import Receive


async def request_body(receive: Receive) -> bytes | None:
    """The body's bytes joined, or None where the client left (``http.disconnect``) before it was all read."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)
