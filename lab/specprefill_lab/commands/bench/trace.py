"""``specprefill bench trace FILE``: a production trace (Mooncake's JSONL) replayed at its times through the
gateway, then directly, each path on its own engine; at several clocks, the max-QPS ratio."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
from pydantic import Field
from pydantic_settings import CliPositionalArg

from specprefill_lab.commands.bench.stack import Launch, gateway_counters, pair_description
from specprefill_lab.launch import Stack, launched


class Trace(Launch):
    """A production trace replayed through the gateway and directly, each path on its own engine (trace.json; with
    --clocks, one replay per clock and max-qps.json). Each hash ID is one block of text wherever it appears."""

    file: CliPositionalArg[str] = Field(
        description="the trace: Mooncake's JSONL (timestamp ms, input_length, output_length, hash_ids)"
    )
    requests: int = Field(100, ge=1, description="its first N requests (after the two below)")
    seconds: float | None = Field(None, gt=0, description="only its first S seconds (its own clock)")
    conversations_every: int = Field(
        1,
        ge=1,
        description="one conversation in N, each whole (all its turns: what recurs still recurs, at a "
        "load this machine can serve)",
    )
    block_tokens: int = Field(64, ge=1, description="tokens per hash ID (the trace's are 512)")
    clock: float = Field(1.0, gt=0, description="how many times faster than the trace's time")
    clocks: list[float] = Field(
        [],
        description="one replay (both paths, fresh engines) at each of these clocks instead, and the "
        "max-QPS ratio: the fastest clock at which each path's p90 TTFT stays under --slo (max-qps.json)",
    )
    slo: float = Field(10.0, gt=0, description="the p90 TTFT objective in seconds for the max-QPS ratio")
    max_output: int = Field(32, ge=1, description="each answer's tokens at most")
    foreign_tokens: int = Field(
        0,
        ge=0,
        description="a second client sends prompts of this many random token IDs straight to each path's "
        "engine during its replay (0: none)",
    )
    foreign_every: float = Field(10.0, gt=0, description="seconds between the second client's prompts")
    vllm_flags: str = Field(
        "readme",
        description="launched vLLM: readme (the README's flags: prompt-token details; the gateway's with KV "
        "events) or stock (prefix caching only, as an existing deployment runs it; the gateway's keeps the plugin)",
    )

    def cli_cmd(self) -> None:
        raise SystemExit(self.run())

    def run(self) -> int:
        """The trace's requests at their times (scaled), through the gateway, then directly, each path on its own
        engine, the same texts for both; with ``--clocks``, one such replay at each clock and the max-QPS ratio."""
        from specprefill_lab.trace import format_trace, load_trace, max_qps, plot_trace, select

        try:
            requests = load_trace(Path(self.file))
        except (OSError, ValueError) as exc:
            print(f"specprefill bench: {exc}", file=sys.stderr)
            return 2
        if self.vllm_flags not in ("readme", "stock"):
            print("specprefill bench: --vllm-flags is readme or stock", file=sys.stderr)
            return 2
        out = Path(self.out)
        requests = select(requests, seconds=self.seconds, every=self.conversations_every, limit=self.requests)
        if not self.clocks:
            summary, written = self.replay(requests, self.clock, out)
            print(format_trace(summary))
            print(f"wrote {written}, {plot_trace(json.loads(written.read_text()), out / 'trace.png')}")
            return 0
        runs = {}
        for clock in self.clocks:
            runs[clock], written = self.replay(requests, clock, out / f"clock-{clock:g}")
            print(f"clock x{clock:g}:\n{format_trace(runs[clock])}")
            plot_trace(json.loads(written.read_text()), written.parent / "trace.png")
            result = max_qps(runs, self.slo)
            (out / "max-qps.json").write_text(json.dumps(result, indent=1))  # after each clock: a stop keeps what ran
        print(f"max-QPS: {json.dumps(result)}\nwrote {out / 'max-qps.json'}")
        return 0

    def meta(self, requests: int, clock: float) -> dict:
        """What a replay measured, written beside its results."""
        return {
            "trace": str(self.file),
            "requests": requests,
            "seconds": self.seconds,
            "conversations_every": self.conversations_every,
            "block_tokens": self.block_tokens,
            "clock": clock,
            "max_output": self.max_output,
            "foreign": {"tokens": self.foreign_tokens, "every_s": self.foreign_every} if self.foreign_tokens else None,
            "engine": "vllm" if self.vllm_python else "reference",
            "vllm_flags": self.vllm_flags if self.vllm_python else None,
            "pair": pair_description(self.pair),
        }

    def schedule(self, stack: Stack, requests: list, clock: float) -> tuple[list, list]:
        """The trace's requests as the stack's chats (texts made through its gateway), and the two paths."""
        from specprefill_lab.bench import PromptMaker
        from specprefill_lab.trace import replay_schedule
        from specprefill_lab.workloads import PathTarget

        with httpx.Client(timeout=120) as client:
            urls = (stack.gateway_url, stack.direct_url)
            models = [client.get(f"{url}/v1/models").json()["data"][0]["id"] for url in urls]
            prompts = PromptMaker(client, stack.gateway_url, models[0])
            scaling = {"clock": clock, "max_output": self.max_output}
            schedule = replay_schedule(requests, prompts, block_tokens=self.block_tokens, **scaling)
        paths = [
            PathTarget("gateway", stack.gateway_url, models[0], {}, stack.gateway_engine_url),
            PathTarget("direct", stack.direct_url, models[1], {}, stack.direct_url),
        ]
        return schedule, paths

    def replay(self, requests: list, clock: float, out: Path) -> tuple[dict, Path]:
        """One replay at ``clock``: both paths, each on its own freshly launched engine."""
        from specprefill_lab.trace import Foreign, TraceReport, replay

        out.mkdir(parents=True, exist_ok=True)  # the engines' logs go there before any result does
        target, draft = self.models()
        meta = self.meta(len(requests), clock)
        report = TraceReport(meta)
        pair = Path(self.pair) if self.pair else None
        readme = self.vllm_flags == "readme"
        foreign = Foreign(self.foreign_tokens, self.foreign_every) if self.foreign_tokens else None
        launch = {"target": target, "draft": draft, "kv_events": readme, "readme_flags": readme}
        with launched(2, self.draft_args(), self.vllm_python, out, pair, **launch) as stack:
            schedule, paths = self.schedule(stack, requests, clock)
            for path in paths:
                print(f"trace: {len(schedule)} requests through {path.name} (clock x{clock:g})", flush=True)
                samples, sent = asyncio.run(replay(path, schedule, foreign, paths[1].model))
                report.samples += samples
                if foreign is not None:
                    meta.setdefault("foreign_sent", {})[path.name] = sent
                report.write(out)
            meta["gateway_counters"] = gateway_counters(stack.gateway_url)
        return report.summary(), report.write(out)
