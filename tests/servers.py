"""Real uvicorn servers on free ports, in a background thread, for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from specprefill.server import GuardMiddleware


@contextlib.contextmanager
def serve(app, *, timeout: float = 60.0, port: int = 0, max_body_bytes: int = 16 << 20) -> Iterator[str]:
    """Runs ``app`` on 127.0.0.1 at a free port (or ``port``) behind the production guard middleware and header
    limit; yields its base URL; stops it on exit."""
    config = uvicorn.Config(GuardMiddleware(app, max_body_bytes=max_body_bytes), host="127.0.0.1", port=port,
                            log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def free_port() -> int:
    """A port nothing listens on right now (for servers started as separate processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
