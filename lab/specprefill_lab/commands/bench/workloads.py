"""``specprefill bench workloads``: repeated contexts (a document asked again, a chat, an agent's steps, a shared
system prompt) through the gateway and directly, each path on its own engine, as the requests arrive: back to
back, after a think time, or as Poisson mixed sessions."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import httpx
from pydantic import Field

from specprefill_lab.commands.bench.stack import Against, cost_coefficients, gateway_counters
from specprefill_lab.commands.bench.sweep import measured
from specprefill_lab.launch import Stack
from specprefill_lab.workloads import EXTRA_WORKLOADS, MODES, WORKLOADS


class Workloads(Against):
    """Repeated contexts through the gateway and directly, each arrival mode one run (workloads.json, plots)."""

    arrivals: list[str] = Field(
        ["back-to-back", "think", "poisson"],
        description="how requests "
        "arrive, one run each: back-to-back (the next request when the previous answer "
        "ends), think (after --think-time), poisson (mixed sessions at --session-rates), "
        "idle (after the engines and the gateway are idle, warming included: flatters "
        "warming, for comparison only)",
    )
    think_time: float = Field(1.0, description="seconds between an answer and the next request (think)")
    names: list[str] = Field(
        list(WORKLOADS),
        description="which workloads (also: " + ", ".join(EXTRA_WORKLOADS) + ", which disturb the engine on purpose)",
    )
    requests: int = Field(7, description="requests per workload")
    tokens: int = Field(8000, description="prompt tokens of each workload's context")
    step_tokens: int = Field(1000, description="tokens an agent step adds")
    keep_rate: float = Field(0.3, description="keep rate through the gateway")
    session_rates: list[float] = Field(
        [0.04, 0.08, 0.12, 0.2, 0.3], description="poisson: sessions started per second, one run each"
    )
    sessions_per_rate: int = Field(18, description="poisson: sessions per rate (kinds in equal shares)")
    shared_engine: bool = Field(
        False,
        description="one engine for both paths, the direct path's "
        "requests over other documents of the same length (neither "
        "warms the other's cache, and no two instances differ)",
    )
    foreign_tokens: int = Field(
        16000,
        description="workload foreign: tokens another client sends straight to the "
        "engine before each later turn, in prompts of --tokens",
    )

    def engines(self) -> int:
        return 1 if self.shared_engine else 2

    def cli_cmd(self) -> None:
        raise SystemExit(self.run())

    def run(self) -> int:
        unknown = sorted(set(self.arrivals) - {*MODES, "poisson"})
        if unknown:
            raise SystemExit(
                f"specprefill bench: unknown arrival mode {unknown[0]!r}: use {', '.join(MODES)} or poisson"
            )
        return measured(self, self.measure)

    def measure(self, stack: Stack, prompts: Any, models: tuple[str, str], meta: dict) -> list[Path]:
        from specprefill_lab.report import write_workloads
        from specprefill_lab.sessions import format_sessions
        from specprefill_lab.workloads import (
            build_workloads,
            format_workloads,
            last_whole_request,
            run_workloads,
            summarize_workloads,
        )

        paths = self.paths(stack, models)
        modes: dict[str, list[dict]] = {}
        samples, last = [], None
        sizes = (self.names, self.requests, self.tokens, self.step_tokens)
        for number, mode in enumerate(m for m in self.arrivals if m != "poisson"):
            # new documents for every mode (the engines have seen none of them); the direct path's over other
            # documents when both paths share one engine
            workloads = build_workloads(prompts, *sizes)
            direct = build_workloads(prompts, *sizes) if self.shared_engine else workloads
            mode_samples = asyncio.run(
                run_workloads(
                    mode,
                    {"gateway": workloads, "direct": direct},
                    paths,
                    stack.idle_urls,
                    think_s=self.think_time,
                    max_tokens=self.max_tokens,
                    first="gateway" if number % 2 == 0 else "direct",
                    act=self.engine_actions(stack, models[1]),
                )
            )
            modes[mode] = summarize_workloads(mode_samples)
            print(f"arrivals: {mode}\n" + format_workloads(modes[mode]))
            samples += mode_samples
            # the engine check's request: one both engines hold whole, else the last one sent
            last = (
                last_whole_request(workloads, mode_samples)
                or last
                or next((w.requests[-1] for w in reversed(workloads) if w.api == "chat"), None)
            )
        sessions = None
        if "poisson" in self.arrivals:
            sessions = self.poisson(stack, prompts, paths)
            print("arrivals: poisson, mixed sessions\n" + format_sessions(sessions["summary"]))
        if stack.gateway_engine_url is not None and last is not None and "kill" not in self.names:
            meta["engines"] = self.engines_compared(stack, models[1], last)
        meta |= {
            "workload_tokens": self.tokens,
            "step_tokens": self.step_tokens,
            "keep_rate": self.keep_rate,
            "baseline": self.baseline,
            "shared_engine": self.shared_engine,
            "arrivals": self.arrivals,
            "think_time": self.think_time,
            "vllm_scheduling": self.vllm_scheduling if self.vllm_python else None,
            "cost_coefficients": cost_coefficients(stack.gateway_url),
            "gateway_counters": gateway_counters(stack.gateway_url),
        }
        return write_workloads(Path(self.out), modes, samples, sessions, meta)

    def paths(self, stack: Stack, models: tuple[str, str]) -> list:
        """The two paths the workloads go through: the gateway (at the workloads' keep rate) and the engine."""
        from specprefill_lab.workloads import PathTarget

        return [
            PathTarget(
                "gateway",
                stack.gateway_url,
                models[0],
                {"x-keep-rate": f"{self.keep_rate:g}"},
                stack.gateway_engine_url,
            ),
            PathTarget("direct", stack.direct_url, models[1], {}, stack.direct_url),
        ]

    def engines_compared(self, stack: Stack, model: str, last: Any) -> dict:
        """The last request sent whole straight to each path's engine, alternating: the engines' own difference."""
        from specprefill_lab.workloads import compare_engines

        engines = asyncio.run(
            compare_engines(
                {"gateway's engine": stack.gateway_engine_url, "direct's engine": stack.direct_url},
                model,
                last,
                stack.idle_urls,
                max_tokens=self.max_tokens,
            )
        )
        print(
            "the last request sent whole, with a new last line each time, directly to each engine (alternating, "
            "8 each): median "
            + ", ".join(f"{name} {s * 1e3:.0f} ms" for name, s in engines["medians_s"].items())
            + f"; ratio {engines['ratio']:.2f} (the engines' difference, no gateway in it)"
        )
        return engines

    def engine_actions(self, stack: Stack, model: str) -> Any:
        """The workloads' actions at a path's engine: another client's long prompts straight to it (random token
        IDs, a new prompt each time), a restart, or killing the replica that served the path's last request
        (launched engines only)."""
        rng = random.Random(0)

        async def act(action: str, path: Any, last: Any) -> None:
            if action == "kill":
                urls = (stack.replicas or {}).get(path.name)
                if stack.kill is None or not urls or last is None or last.replica is None:
                    raise SystemExit("specprefill bench: workload kill needs replicas the bench launched (--replicas)")
                await asyncio.to_thread(stack.kill, urls[last.replica])
                return
            if action == "restart":
                if stack.restart is None or path.engine_url is None:
                    raise SystemExit("specprefill bench: workload restart needs engines the bench launched")
                await asyncio.to_thread(stack.restart, path.engine_url)
                return
            async with httpx.AsyncClient(timeout=3600) as client:
                for _ in range(max(1, self.foreign_tokens // self.tokens)):
                    prompt = [rng.randrange(100, 4000) for _ in range(self.tokens)]
                    r = await client.post(
                        f"{path.engine_url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1}
                    )
                    r.raise_for_status()

        return act

    def poisson(self, stack: Stack, prompts: Any, paths: list) -> dict:
        """Each rate's schedule through both paths, one after the other (which first alternating), each once
        everything is idle: the boundary between two systems under test. The rates done so far are summarised
        in ``sessions-partial.json`` after each one (a run stopped early keeps them)."""
        from specprefill_lab.bench import wait_idle
        from specprefill_lab.sessions import as_dicts, run_sessions, session_schedule, summarize_sessions

        async def run() -> list:
            samples = []
            async with httpx.AsyncClient(timeout=60) as client:
                for number, rate in enumerate(self.session_rates):
                    schedule = session_schedule(
                        prompts, rate, self.sessions_per_rate, self.tokens, self.step_tokens, seed=number
                    )
                    for path in paths if number % 2 == 0 else paths[::-1]:
                        await wait_idle(client, stack.idle_urls)
                        print(
                            f"poisson: {rate:g} sessions/s through {path.name} "
                            f"({schedule[-1].start_s:.0f} s of arrivals)",
                            flush=True,
                        )
                        samples += await run_sessions(path, schedule, rate, self.max_tokens)
                    (Path(self.out) / "sessions-partial.json").write_text(
                        json.dumps({"summary": summarize_sessions(samples), "samples": as_dicts(samples)})
                    )
            return samples

        samples = asyncio.run(run())
        return {"summary": summarize_sessions(samples), "samples": as_dicts(samples)}
