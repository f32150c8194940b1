"""``specprefill bench sweep``: TTFT through the gateway and directly at the same backend, at each prompt length
and keep rate; ``specprefill bench load``: Poisson arrivals at each offered rate, and the highest rate whose p99
TTFT meets the objective."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from pydantic import Field

from specprefill_lab.commands.bench.stack import Against, cost_coefficients, served_models
from specprefill_lab.launch import Stack


class Sweep(Against):
    """TTFT through the gateway vs directly at the same backend, each length and keep rate (bench.json, plots);
    launches the demo when no URL is given."""

    lengths: list[int] = Field([1024, 4096, 8192, 16384], description="prompt lengths in tokens")
    keep_rates: list[float] = Field([0.1, 0.3, 0.5, 1.0], description="keep rates through the gateway")
    repeats: int = Field(3, description="measured requests per point (after the warm-up)")
    warmup: int = Field(1, description="unmeasured requests per length first")
    warmup_direct: bool = Field(
        True,
        description="the warm-up requests also go directly (off: through the gateway "
        "only, where the draft has first-time costs at a new length and "
        "the engine has none: a 32B target's direct 128k-token prompt "
        "takes most of a minute on a GPU)",
    )

    def min_prompt_tokens(self) -> int:
        return min(self.lengths) // 2

    def cli_cmd(self) -> None:
        raise SystemExit(self.run())

    def run(self) -> int:
        from specprefill_lab.bench import BenchConfig, format_table, run_sweep
        from specprefill_lab.report import write_outputs

        def measure(stack: Stack, prompts: Any, models: tuple[str, str], meta: dict) -> list[Path]:
            config = BenchConfig(
                stack.gateway_url,
                stack.direct_url,
                *models,
                self.lengths,
                self.keep_rates,
                self.repeats,
                self.warmup,
                self.max_tokens,
                self.warmup_direct,
            )
            samples, rows = asyncio.run(run_sweep(config, prompts, stack.idle_urls))
            print(format_table(rows))
            meta |= {
                "lengths": self.lengths,
                "keep_rates": self.keep_rates,
                "repeats": self.repeats,
                "warmup": self.warmup,
                "warmup_direct": self.warmup_direct,
                "cost_coefficients": cost_coefficients(stack.gateway_url),
            }
            return write_outputs(Path(self.out), rows, samples, None, meta)

        return measured(self, measure)


class Load(Against):
    """Poisson arrivals through the gateway and directly at each offered rate, a new document per request; the
    highest rate with p99 TTFT within --ttft-slo (bench.json)."""

    rates: list[float] = Field([0.1, 0.2, 0.4, 0.8], description="offered requests per second")
    duration: float = Field(30.0, description="seconds per rate")
    ttft_slo: float = Field(2.0, description="the p99 TTFT objective in seconds")
    tokens: int = Field(4096, description="prompt length")
    keep_rate: float = Field(0.1, description="keep rate through the gateway")
    direct: bool = Field(
        True, description="also load the engine directly (off: the gateway only, as when comparing gateway settings)"
    )

    def min_prompt_tokens(self) -> int:
        return 512

    def cli_cmd(self) -> None:
        raise SystemExit(self.run())

    def run(self) -> int:
        from specprefill_lab.report import write_outputs

        def measure(stack: Stack, prompts: Any, models: tuple[str, str], meta: dict) -> list[Path]:
            load = self.load(stack, prompts, models)
            meta["cost_coefficients"] = cost_coefficients(stack.gateway_url)
            return write_outputs(Path(self.out), [], [], load, meta)

        return measured(self, measure)

    def load(self, stack: Stack, prompts: Any, models: tuple[str, str]) -> dict:
        """Each path at each offered rate, and the highest rate meeting the objective."""
        from specprefill_lab.load import max_rate_meeting, run_load

        model, direct_model = models
        # a different document per request, as real traffic: no cache hit flatters the gateway
        n_bodies = max(8, int(max(self.rates) * self.duration * 1.5))
        bodies = [
            {"messages": prompts.make(self.tokens), "max_tokens": self.max_tokens, "temperature": 0}
            for _ in range(n_bodies)
        ]
        paths = [("gateway", stack.gateway_url, model, {"x-keep-rate": f"{self.keep_rate:g}"})]
        if self.direct:
            paths.append(("direct", stack.direct_url, direct_model, {}))
        results = {
            name: asyncio.run(
                run_load(
                    f"{url}/v1/chat/completions",
                    [{**b, "model": name_at} for b in bodies],
                    headers,
                    self.rates,
                    self.duration,
                    idle_urls=stack.idle_urls,
                )
            )
            for name, url, name_at, headers in paths
        }
        load = {
            "slo_s": self.ttft_slo,
            "tokens": self.tokens,
            "keep_rate": self.keep_rate,
            "results": results,
            "max_rate": {name: max_rate_meeting(r, self.ttft_slo) for name, r in results.items()},
        }
        for name, result in results.items():
            for r in result:
                print(
                    f"load {name:>7} {r['rate']:>6g} req/s: p50 {r['p50_s']:.3f} s, p99 {r['p99_s']:.3f} s, "
                    f"{r['errors']} errors"
                )
        print(f"highest rate with p99 TTFT <= {self.ttft_slo:g} s: {load['max_rate']}")
        return load


def measured(options: Against, measure: Callable[[Stack, Any, tuple[str, str], dict], list[Path]]) -> int:
    """``measure(stack, prompts, models, meta)`` on the options' stack (given or launched), its files named."""
    context = options.stack()
    if context is None:
        return 2
    Path(options.out).mkdir(parents=True, exist_ok=True)
    with context as stack, httpx.Client(timeout=60) as client:
        from specprefill_lab.bench import PromptMaker

        models = served_models(client, stack, options)
        prompts = PromptMaker(client, stack.gateway_url, models[0], options.nonce)
        written = measure(stack, prompts, models, options.meta(stack, models[0]))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
