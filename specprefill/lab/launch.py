"""Launching the demo stack as local processes: engines (reference or vLLM) and a gateway in front of one."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from common.process import free_port, quiet_openmp, wait_healthy

CLI = [sys.executable, "-m", "specprefill"]


@dataclass
class Stack:
    gateway_url: str
    direct_url: str  # the engine the direct path talks to
    idle_urls: list[str]  # whose /metrics say when nothing runs (workload mode)
    gateway_engine_url: str | None = None  # the engine behind the gateway, where the bench launched it


# as the README's deployment section starts vLLM: cached-token counts in every answer, tool calls as without the
# gateway (a Messages request with tools asks for automatic tool choice)
README_VLLM_ARGS = ("--enable-prompt-tokens-details", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")


@contextlib.contextmanager
def launched(engines: int, gateway_args: list[str], vllm_python: str | None, out: Path,
             pair: Path | None = None, vllm_args: tuple[str, ...] = ()) -> Iterator[Stack]:
    """The pair's target (``pair/target``; default: the demo pair) on ``engines`` engines (reference engines, or
    vLLM: the gateway's with the plugin, the direct one stock, both with ``vllm_args``) and a gateway in front
    of the first with ``pair/draft``, as local processes. With two, the direct path has its own engine, so
    neither warms the other's prefix cache."""
    from specprefill.lab.demo_models import ensure_demo_models
    from specprefill.lab.vllm_server import VLLMServer

    root = pair or ensure_demo_models()
    processes, vllm_servers, urls = [], [], []
    try:
        for index in range(engines):
            if vllm_python:
                server = VLLMServer(vllm_python, root / "target", out / f"vllm-{index}.log", plugin=index == 0,
                                    served_name="specprefill-demo", max_model_len=32768, kv_cache_gib=4,
                                    extra_args=(*README_VLLM_ARGS, *vllm_args))
                vllm_servers.append(server)
                urls.append(server.url)
            else:
                port = free_port()
                urls.append(f"http://127.0.0.1:{port}")
                processes.append(subprocess.Popen(CLI + ["engine", "--model", str(root / "target"), "--port",
                                                         str(port), "--log-level", "warning"], env=quiet_openmp()))
        for server in vllm_servers:
            server.wait()
        for url, process in zip(urls, processes):
            wait_healthy(url, process)
        with launched_gateway(["--backend-url", urls[0], "--backend-kind", "vllm" if vllm_python else "reference",
                               "--target-model", str(root / "target"), "--draft-model", str(root / "draft"),
                               "--served-model-name", "specprefill-demo", *gateway_args]) as gateway_url:
            yield Stack(gateway_url, urls[-1], [gateway_url, *urls], urls[0] if engines > 1 else None)
    finally:
        _stop(processes)
        for server in vllm_servers:
            server.stop()


@contextlib.contextmanager
def launched_gateway(args: list[str]) -> Iterator[str]:
    """``specprefill serve ARGS`` on a free port; its base URL once it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(CLI + ["serve", "--port", str(port), "--log-level", "warning", *args],
                               env=quiet_openmp())
    try:
        wait_healthy(url, process)
        yield url
    finally:
        _stop([process])


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(timeout=30)
