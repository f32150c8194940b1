"""The gateway's own time on a request it sends whole: one vLLM instance, directly and through the gateway.

The workload bench gives each path its own engine, so its ratios for whole requests mix the gateway's time
with the difference between two engine instances. Here both paths reach the same vLLM (the CPU build with
the plugin, prefix caching on): one long system prompt is read once, then the same request with a short
question goes directly and through the gateway in turn, the order alternating, after both are idle.

    .venv/bin/python benchmarks/gateway_overhead.py [--words 3600] [--rounds 14]
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from pathlib import Path

import httpx
from vllm_plugin_ab import options, system_prompt  # beside this script

from specprefill.lab.bench import parse_server_timing, stream_ttft, wait_idle
from specprefill.lab.demo_models import DEMO_NAME, ensure_demo_models
from specprefill.lab.launch import launched_gateway
from specprefill.lab.vllm_server import VLLMServer


async def alternate(urls: dict[str, str], system: str, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in urls}
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(rounds):
            order = list(urls.items())
            for name, url in order if i % 2 == 0 else order[::-1]:
                await wait_idle(client, list(urls.values()))
                body = {"model": DEMO_NAME, "max_tokens": 1, "temperature": 0,
                        "messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": f"Question {i}: which number comes last?"}]}
                ttft, headers = await stream_ttft(client, f"{url}/v1/chat/completions", body, {"x-keep-rate": "0.3"})
                times[name].append(ttft)
                plan = ""
                if name == "gateway":
                    plan = f"  {headers.get('x-specprefill-plan')} {parse_server_timing(headers.get('server-timing'))}"
                print(f"round {i:2d} {name:8s} {ttft * 1e3:7.1f} ms{plan}", flush=True)
    return times


def main() -> None:
    args = options(__doc__, "requests per path; the first two are not counted")
    system = system_prompt(args.words)
    root = ensure_demo_models()
    server = VLLMServer(args.vllm_python, root / "target", Path(tempfile.mkdtemp(prefix="gw-overhead-")) / "vllm.log",
                        plugin=True, served_name=DEMO_NAME, max_model_len=32768, kv_cache_gib=4,
                        extra_args=("--enable-prompt-tokens-details",))
    try:
        server.wait()
        with launched_gateway(["--backend-url", server.url, "--backend-kind", "vllm", "--target-model",
                               str(root / "target"), "--draft-model", str(root / "draft"),
                               "--served-model-name", DEMO_NAME, "--min-prompt-tokens", "1024"]) as gateway:
            times = asyncio.run(alternate({"direct": server.url, "gateway": gateway}, system, args.rounds))
    finally:
        server.stop()
    for name, seconds in times.items():
        counted = [s * 1e3 for s in seconds[2:]]  # the first reads the system prompt; the second follows it
        print(f"{name}: {min(counted):.1f}–{max(counted):.1f} ms, median {statistics.median(counted):.1f} ms")


if __name__ == "__main__":
    main()
