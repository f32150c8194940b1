"""``specprefill bench``: runs the sweep (and the load mode) against URLs, or against servers it launches."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings

from common.options import SETTINGS_CONFIG
from common.process import free_port, wait_healthy


class Bench(BaseSettings):
    """TTFT through the gateway vs directly at the same backend; launches the demo when no URL is given."""

    model_config = SETTINGS_CONFIG
    base_url: str | None = Field(None, description="the gateway (default: launch the demo gateway and engine)")
    backend_url: str | None = Field(None, description="the same backend, measured directly")
    model: str | None = Field(None, description="model name at the gateway (default: its first)")
    backend_model: str | None = Field(None, description="model name at the backend (default: its first)")
    lengths: list[int] = Field([1024, 4096, 8192, 16384], description="prompt lengths in tokens")
    keep_rates: list[float] = Field([0.1, 0.3, 0.5, 1.0], description="keep rates through the gateway")
    repeats: int = Field(3, description="measured requests per point (after the warm-up)")
    warmup: int = Field(1, description="unmeasured requests per length first")
    max_tokens: int = Field(1, description="tokens generated per request")
    out: str = Field("bench_results", description="folder for bench.json and the plots")
    load: bool = Field(False, description="also run the Poisson load mode")
    load_only: bool = Field(False, description="only the load mode")
    rates: list[float] = Field([0.1, 0.2, 0.4, 0.8], description="load mode: offered requests per second")
    duration: float = Field(30.0, description="load mode: seconds per rate")
    ttft_slo: float = Field(2.0, description="load mode: the p99 TTFT objective in seconds")
    load_tokens: int = Field(4096, description="load mode: prompt length")
    load_keep_rate: float = Field(0.1, description="load mode: keep rate through the gateway")

    def cli_cmd(self) -> None:
        raise SystemExit(run_bench(self))


@contextlib.contextmanager
def launched_demo(extra_gateway_args: list[str]) -> Iterator[tuple[str, str]]:
    """The demo target on the reference engine, and a gateway in front of it, as local processes."""
    from specprefill.lab.demo_models import ensure_demo_models

    root = ensure_demo_models()
    engine_port, gateway_port = free_port(), free_port()
    engine_url, gateway_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"
    cli = [sys.executable, "-m", "specprefill"]
    processes = [subprocess.Popen(cli + ["engine", "--model", str(root / "target"), "--port", str(engine_port),
                                         "--log-level", "warning"])]
    try:
        wait_healthy(engine_url, processes[0])
        processes.append(subprocess.Popen(cli + [
            "serve", "--port", str(gateway_port), "--backend-url", engine_url,
            "--target-model", str(root / "target"), "--draft-model", str(root / "draft"),
            "--served-model-name", "specprefill-demo", "--log-level", "warning", *extra_gateway_args]))
        wait_healthy(gateway_url, processes[1])
        yield gateway_url, engine_url
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


def run_bench(options: Bench) -> int:
    from specprefill.lab.bench import BenchConfig, PromptMaker, format_table, run_sweep
    from specprefill.lab.load import max_rate_meeting, run_load
    from specprefill.lab.report import write_outputs

    launch = options.base_url is None
    if launch and options.backend_url is not None:
        print("specprefill bench: give --base-url with --backend-url (or neither, to launch the demo)", file=sys.stderr)
        return 2
    context = (launched_demo(["--min-prompt-tokens", str(min(options.lengths) // 2)]) if launch
               else contextlib.nullcontext((options.base_url.rstrip("/"), options.backend_url.rstrip("/"))))
    with context as (gateway_url, backend_url):
        with httpx.Client(timeout=60) as client:
            model = options.model or client.get(f"{gateway_url}/v1/models").json()["data"][0]["id"]
            backend_model = options.backend_model or client.get(f"{backend_url}/v1/models").json()["data"][0]["id"]
            prompts = PromptMaker(client, gateway_url, model)
            config = BenchConfig(gateway_url, backend_url, model, backend_model, options.lengths, options.keep_rates,
                                 options.repeats, options.warmup, options.max_tokens)
            load = None
            if not options.load_only:
                samples, rows = asyncio.run(run_sweep(config, prompts))
                print(format_table(rows))
            else:
                samples, rows = [], []
            if options.load or options.load_only:
                # a different document per request, as real traffic: no cache hit flatters the gateway
                n_bodies = max(8, int(max(options.rates) * options.duration * 1.5))
                bodies = [{"messages": prompts.make(options.load_tokens), "max_tokens": options.max_tokens,
                           "temperature": 0} for _ in range(n_bodies)]
                results = {
                    "gateway": asyncio.run(run_load(f"{gateway_url}/v1/chat/completions",
                                                    [{**b, "model": model} for b in bodies],
                                                    {"x-keep-rate": f"{options.load_keep_rate:g}"},
                                                    options.rates, options.duration)),
                    "direct": asyncio.run(run_load(f"{backend_url}/v1/chat/completions",
                                                   [{**b, "model": backend_model} for b in bodies], {},
                                                   options.rates, options.duration)),
                }
                load = {"slo_s": options.ttft_slo, "tokens": options.load_tokens, "keep_rate": options.load_keep_rate,
                        "results": results,
                        "max_rate": {name: max_rate_meeting(r, options.ttft_slo) for name, r in results.items()}}
                for name, result in results.items():
                    for r in result:
                        print(f"load {name:>7} {r['rate']:>6g} req/s: p50 {r['p50_s']:.3f} s, p99 {r['p99_s']:.3f} s, "
                              f"{r['errors']} errors")
                print(f"highest rate with p99 TTFT <= {options.ttft_slo:g} s: {load['max_rate']}")
    meta = {"gateway_url": gateway_url, "backend_url": backend_url, "model": model, "launched_demo": launch,
            "lengths": options.lengths, "keep_rates": options.keep_rates, "repeats": options.repeats}
    written = write_outputs(Path(options.out), rows, samples, load, meta)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
