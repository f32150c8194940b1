"""Launching the demo stack as local processes: engines (reference or vLLM) and a gateway in front of one, or of
several replicas (the direct path's replicas then behind a router: ``specprefill_lab.router``)."""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
from collections.abc import Callable, Iterator
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
    restart: Callable[[str], None] | None = None  # restarts the launched engine at this URL (its cache empty)
    kill: Callable[[str], None] | None = None  # kills the launched engine at this URL (SIGKILL), for good
    replicas: dict[str, list[str]] | None = None  # each path's engine URLs, where it has several


# as the README's deployment section starts vLLM: cached-token counts in every answer, tool calls as without the
# gateway (a Messages request with tools asks for automatic tool choice)
README_VLLM_ARGS = ("--enable-prompt-tokens-details", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
TOOL_MARKER = "<|python_tag|>"  # what vLLM's llama3_json tool parser needs in the tokenizer


HERMES_MARKER = "<tool_call>"  # Qwen2.5's tool calls, which vLLM's hermes parser reads


def readme_vllm_args(target: Path | str) -> tuple[str, ...]:
    """The README's flags for this target: its tool-call parser only where the target's tokenizer has the parser's
    marker (vLLM refuses to start otherwise: SmolLM2 has none, and no tool parser of vLLM's fits it); Qwen2.5's
    tool calls take vLLM's hermes parser, as its model card starts vLLM."""
    tokens = Path(target) / "tokenizer.json"
    text = tokens.read_text() if tokens.exists() else TOOL_MARKER
    if TOOL_MARKER in text:
        return README_VLLM_ARGS
    if HERMES_MARKER in text:
        return (*README_VLLM_ARGS[:3], "hermes")
    return README_VLLM_ARGS[:1]


def kv_events_config() -> str:
    """vLLM's ``--kv-events-config`` (the reference engine takes the same JSON), as the README starts vLLM: events
    and their replay on free ports, bound on every interface (the gateway finds them: ``/kv_event_sources``)."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{free_port()}",
            "replay_endpoint": f"tcp://*:{free_port()}",
        }
    )


class Engine:
    """One launched reference engine, restartable on its port."""

    def __init__(self, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(
            CLI + ["engine", "--port", str(self.port), "--log-level", "warning", *self.args], env=quiet_openmp()
        )

    def wait(self) -> None:
        wait_healthy(self.url, self.process)

    def restart(self) -> None:
        _stop([self.process])
        self.process = self._start()
        self.wait()

    def stop(self) -> None:
        _stop([self.process])

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@contextlib.contextmanager
def launched(
    engines: int,
    gateway_args: list[str],
    vllm_python: str | None,
    out: Path,
    pair: Path | None = None,
    vllm_args: tuple[str, ...] = (),
    *,
    kv_events: bool = False,
    cache_tokens: int | None = None,
    replicas: int = 1,
    router: str = "round-robin",
    target: Path | None = None,
    draft: str | None = None,
    max_model_len: int | None = None,
    engine_args: tuple[str, ...] = (),
    readme_flags: bool = True,
) -> Iterator[Stack]:
    """The target on ``engines`` engines (reference engines, or vLLM: the gateway's with the plugin, the direct one
    without, both with ``vllm_args`` after the README's flags where ``readme_flags``) and a gateway in front of
    the first, as local processes; with two, neither path warms the other's cache. ``kv_events``: the gateway
    follows its engine's; ``cache_tokens``: each prefix cache's size; ``replicas`` per path (the direct path's
    behind a ``router``); ``pair``, ``target``, ``draft``, ``max_model_len``: ``_pair``."""
    target, draft, max_len = _pair(pair, target, draft, max_model_len)
    servers: list = []
    size = ("--kv-cache-tokens", str(cache_tokens)) if cache_tokens else ()
    assert not (vllm_python and cache_tokens), "vLLM's cache is sized in GiB here (VLLM_CPU_KVCACHE_SPACE)"
    try:
        for index in range(engines * replicas):
            events = ("--kv-events-config", kv_events_config()) if index < replicas and kv_events else ()
            if vllm_python:  # the gateway's with the plugin, the direct path's stock
                log = out / f"vllm-{index}.log"
                flags = (*(readme_vllm_args(target) if readme_flags else ()), *vllm_args, *events)
                servers.append(_vllm(vllm_python, target, log, index < replicas, max_len, replicas, flags))
            else:
                servers.append(Engine(["--model", str(target), *events, *size, *engine_args]))
        for server in servers:
            server.wait()
        urls = [server.url for server in servers]
        mine, direct = urls[:replicas], urls[-replicas:]
        kind = "vllm" if vllm_python else "reference"
        command = [*(a for url in mine for a in ("--backend-url", url)), "--backend-kind", kind, "--target-model"]
        command += [str(target), "--draft-model", draft, "--served-model-name", "specprefill-demo"]
        command += [] if kv_events else ["--backend-kv-events", "off"]
        with contextlib.ExitStack() as stack:
            gateway_url = stack.enter_context(launched_gateway([*command, *gateway_args]))
            direct_url = direct[0] if replicas == 1 else stack.enter_context(launched_router(direct, router))
            by_url = {server.url: server for server in servers}
            yield Stack(
                gateway_url,
                direct_url,
                [gateway_url, *urls],
                mine[0] if engines > 1 else None,
                restart=lambda url: by_url[url].restart(),
                kill=lambda url: by_url[url].kill(),
                replicas={"gateway": mine, "direct": direct} if replicas > 1 else None,
            )
    finally:
        for server in servers:
            server.stop()


def _pair(
    pair: Path | None, target: Path | None, draft: str | None, max_model_len: int | None
) -> tuple[Path, str, int]:
    """The target's folder, the draft, and the longest sequence vLLM takes (default: the target's positions, at
    most 32,768): the pair's (default: the demo pair) where not given."""
    from specprefill_lab.demo_models import ensure_demo_models

    root = pair or ensure_demo_models()
    target = target or root / "target"
    max_len = max_model_len or min(32768, json.loads((target / "config.json").read_text())["max_position_embeddings"])
    return target, draft or str(root / "draft"), max_len


def _vllm(python: str, target: Path, log: Path, plugin: bool, max_len: int, replicas: int, args: tuple[str, ...]):
    """One vLLM server with ``args`` (the README's flags among them, where asked) and ``plugin``: the gateway's,
    with the project's plugin (else without)."""
    from specprefill_lab.vllm_server import VLLMServer

    return VLLMServer(
        python,
        target,
        log,
        plugin=plugin,
        served_name="specprefill-demo",
        max_model_len=max_len,
        kv_cache_gib=_kv_cache_gib(target, max_len, replicas),
        extra_args=args,
    )


def _kv_cache_gib(target: Path, max_len: int, replicas: int) -> int:
    """vLLM's KV cache space: 4 GiB (2 for replicas); for a model of more than 2 GB of weights, no more than room
    for two of its longest sequences. Two instances of Qwen2.5-Coder-1.5B with 4 GiB each ran a 24 GiB machine
    out of memory at a 16,000-token prefill; room for two 32,768-token sequences takes 1.75 GiB in bfloat16."""
    default = 4 if replicas == 1 else 2
    if sum(p.stat().st_size for p in target.glob("*.safetensors")) <= 2 << 30:
        return default
    from specprefill_lab.vllm_server import vllm_dtype

    config = json.loads((target / "config.json").read_text())
    layers, heads = config["num_hidden_layers"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    width = 4 if vllm_dtype(target) == "float32" else 2
    bytes_per_token = layers * 2 * heads * head_dim * width  # keys and values, in the dtype vLLM runs
    return max(1, min(default, math.ceil(2 * max_len * bytes_per_token / 2**30)))


@contextlib.contextmanager
def launched_router(urls: list[str], policy: str) -> Iterator[str]:
    """``specprefill_lab.router`` over ``urls`` on a free port; its base URL once it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "specprefill_lab.router", "--policy", policy, "--port", str(port), *urls]
    )
    try:
        wait_healthy(url, process)
        yield url
    finally:
        _stop([process])


@contextlib.contextmanager
def launched_gateway(args: list[str]) -> Iterator[str]:
    """``specprefill serve ARGS`` on a free port; its base URL once it answers."""
    with launched_gateway_process(args) as (url, _):
        yield url


@contextlib.contextmanager
def launched_gateway_process(args: list[str], cwd: Path | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``specprefill serve ARGS`` on a free port; its base URL and process once it answers. ``cwd``: another
    checkout, whose code then serves (``python -m`` imports from the folder it starts in)."""
    with served(lambda port: CLI + ["serve", "--port", str(port), "--log-level", "warning", *args], cwd) as both:
        yield both


@contextlib.contextmanager
def launched_instant_backend(chunks: int = 8, first_ms: float = 0.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """A backend that answers every request at once (``specprefill_lab.fast_backend``): what a load test then
    measures is the gateway and the client. ``first_ms``: its streams wait that long before their first event."""
    command = [sys.executable, "-m", "specprefill_lab.fast_backend"]
    with served(lambda port: [*command, str(port), str(chunks), str(first_ms)]) as both:
        yield both


@contextlib.contextmanager
def launched_bare_proxy(backend_url: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """The floor of a Python streaming proxy (``specprefill_lab.bare_proxy``) in front of ``backend_url``."""
    command = [sys.executable, "-m", "specprefill_lab.bare_proxy"]
    with served(lambda port: [*command, str(port), backend_url]) as both:
        yield both


@contextlib.contextmanager
def served(command: Callable[[int], list[str]], cwd: Path | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``command(port)`` started on a free port (in ``cwd``); its base URL and process once it answers
    ``/health``."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(command(port), env=quiet_openmp(), cwd=cwd)
    try:
        wait_healthy(url, process)
        yield url, process
    finally:
        _stop([process])


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(timeout=30)
