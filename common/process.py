"""Helpers for services started as separate processes: free ports, waiting until they answer, their memory; and
this process's own end on SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While the block runs, a SIGTERM raises ``SystemExit(143)`` in it, as Ctrl-C raises ``KeyboardInterrupt``:
    its ``finally`` and ``with`` blocks run (temporary folders removed, launched servers stopped). Python's default
    ends the process at once and leaves them. The handler before it is back after the block (a server's own, such
    as uvicorn's graceful drain, is untouched); only the main thread can set one, elsewhere the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_signal(number: int, _frame: object) -> None:
    sys.exit(128 + number)


def quiet_openmp() -> dict[str, str]:
    """This environment with OpenMP threads that sleep between requests instead of spinning: where several
    servers share a small machine (the bench's engines, gateway and draft), one's spinning threads would slow
    another's next request."""
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


def free_port() -> int:
    """A port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_healthy(url: str, process: subprocess.Popen[bytes] | None = None, timeout: float = 600) -> None:
    """Polls ``url/health`` until it answers 200; raises if ``process`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy within {timeout:.0f} s")


def rss_mib(pid: int) -> float:
    """A process's resident memory in MiB (NaN where /proc does not say)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")
