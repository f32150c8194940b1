"""Helpers for services started as separate processes: free ports, waiting until they answer, their memory."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx


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
