"""Where a whole streamed chat's time goes inside one gateway process, stage by stage.

``gateway_overhead.py`` says how much time the gateway adds; this says where it goes. The gateway runs as its own
process (``specprefill serve``, the flags of ``gateway_overhead.py``) with clocks put on the stages of the request
path, in front of the backend that answers at once; one client sends ``--rounds`` streamed chats one after
another (a ``--words`` system prompt and a new question each, ``--think`` seconds apart), then the gateway prints,
for each stage boundary, the median milliseconds since the request reached the ASGI app (after uvicorn parsed
its headers). The clocks are wrappers around the gateway's own methods, so each adds about a microsecond.

    .venv/bin/python lab/benchmarks/gateway_timeline.py [--words 100] [--rounds 200] [--think 0.01]

Stages: ``handler`` (FastAPI's routing, the body read, parsed and validated, the key checked), ``checks`` (the
model's name, the request's options, the bound on its length, admission), ``prompt`` (the chat template and the
tokens), ``plan`` (routing and pricing), ``first event`` (the backend call, up to its first event: the backend's
own time included), ``headers sent`` (the answer's status line and headers written to the client), ``done`` (the
answer's last byte written, and what runs after it: the engine-cache record, the cost model's refit).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from vllm_plugin_ab import system_prompt  # beside this script

from specprefill_lab.demo_models import DEMO_NAME, ensure_demo_models
from specprefill_lab.launch import launched_instant_backend, served

STAGES = [  # (label, the mark at its end)
    ("handler", "handler"),
    ("checks: model, options, bounds, admission", "prompt_in"),
    ("prompt: template and tokens", "prompt_out"),
    ("plan", "planned_out"),
    ("first event from the backend", "first_event"),
    ("headers sent to the client", "start_sent"),
    ("done", "done"),
]


class Clocks:
    """The marks of the request in progress (one at a time), and every finished request's."""

    def __init__(self) -> None:
        self.marks: list[dict[str, float]] = []
        self.now: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.now.setdefault(name, time.perf_counter())

    def around(self, owner: object, name: str, before: str | None, after: str) -> None:
        """``owner.name`` (a method, async or not) marking ``before`` as it starts and ``after`` as it returns."""
        function = getattr(owner, name)
        mark = self.mark

        if asyncio.iscoroutinefunction(function):

            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                if before:
                    mark(before)
                result = await function(*args, **kwargs)
                mark(after)
                return result
        else:

            def wrapper(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
                if before:
                    mark(before)
                result = function(*args, **kwargs)
                mark(after)
                return result

        setattr(owner, name, functools.wraps(function)(wrapper))

    def medians(self) -> dict[str, Any]:
        counted = self.marks[len(self.marks) // 10 :]  # the first tenth warms up
        names = {name for m in counted for name in m}
        ms = {name: statistics.median((m[name] - m["asgi"]) * 1e3 for m in counted if name in m) for name in names}
        return {"requests": len(counted), "ms": ms}


def clocked_gateway(out: Path) -> None:
    """Runs in the gateway's process (``--serve OUT ARGS``): ``specprefill serve ARGS`` with the clocks on; at
    exit, each mark's median over the counted requests to ``out`` (JSON)."""
    import atexit

    import common.telemetry as telemetry
    import gateway.dispatch.dispatcher as dispatcher
    import gateway.entrypoints.chat as chat
    import gateway.serving as serving

    clocks = Clocks()
    outermost = telemetry.RequestTelemetry.__call__

    async def timed(self: Any, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") != "/v1/chat/completions":
            return await outermost(self, scope, receive, send)
        clocks.now = {}
        clocks.mark("asgi")

        async def sent(message: Any) -> None:
            if message["type"] == "http.response.start":
                clocks.mark("start_sent")
            await send(message)

        await outermost(self, scope, receive, sent)
        clocks.mark("done")
        clocks.marks.append(clocks.now)

    telemetry.RequestTelemetry.__call__ = timed  # type: ignore[method-assign]
    clocks.around(chat, "respond", "handler", "responded")
    clocks.around(serving.GatewayServing, "prompt", "prompt_in", "prompt_out")
    clocks.around(serving.GatewayServing, "planned", None, "planned_out")
    clocks.around(dispatcher.Dispatcher, "_sent", None, "first_event")
    atexit.register(lambda: out.write_text(json.dumps(clocks.medians())))
    from specprefill.cli import main

    main()


async def send_chats(url: str, system: str, rounds: int, think: float) -> list[float]:
    """Time to the first content event of each streamed chat (ms), each answer read to its end."""
    times = []
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(rounds):
            body = {
                "model": DEMO_NAME,
                "max_tokens": 1,
                "stream": True,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}],
            }
            start, first = time.perf_counter(), None
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if first is None and '"choices":[{' in line.replace(" ", ""):
                        first = (time.perf_counter() - start) * 1e3
            times.append(first or float("nan"))
            await asyncio.sleep(think)
    return times


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        out = Path(sys.argv[2])
        sys.argv = ["specprefill", *sys.argv[3:]]
        clocked_gateway(out)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--words", type=int, default=100, help="words of the system prompt")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--think", type=float, default=0.01, help="seconds between requests")
    args = parser.parse_args()
    root = ensure_demo_models()
    flags = ["--target-model", str(root / "target"), "--draft-model", str(root / "draft")]
    flags += ["--served-model-name", DEMO_NAME, "--min-prompt-tokens", "1024", "--backend-kind", "vllm"]
    out = Path(tempfile.mkdtemp(prefix="gw-timeline-")) / "marks.json"
    with launched_instant_backend() as (backend_url, _):
        command = [sys.executable, __file__, "--serve", str(out), "serve", "--log-level", "warning"]
        with served(lambda port: [*command, "--port", str(port), "--backend-url", backend_url, *flags]) as (url, _):
            direct = asyncio.run(send_chats(backend_url, system_prompt(args.words), args.rounds, args.think))
            through = asyncio.run(send_chats(url, system_prompt(args.words), args.rounds, args.think))
    marks = json.loads(out.read_text())
    skip = args.rounds // 10
    direct_ms, gateway_ms = statistics.median(direct[skip:]), statistics.median(through[skip:])
    print(f"{args.words}-word system prompt, {marks['requests']} requests counted (medians)")
    print(f"client's time to the first content event: direct {direct_ms:.2f} ms, gateway {gateway_ms:.2f} ms")
    print("inside the gateway, from the ASGI app's start:")
    last = 0.0
    for label, name in STAGES:
        at = marks["ms"].get(name)
        if at is not None:
            print(f"  {label:42s} at {at:6.2f} ms  (+{at - last:5.2f})")
            last = at


if __name__ == "__main__":
    main()
