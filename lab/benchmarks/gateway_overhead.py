"""The gateway's own time on a request it sends whole: one backend, directly and through the gateway.

The workload bench gives each path its own engine, so its ratios for whole requests mix the gateway's time
with the difference between two engine instances. Here both paths reach the same backend: one long system
prompt, then the same request with a short question each round, directly and through the gateway in turn,
the order alternating, after both are idle; each answer read to its end, as the workload bench reads them.
Backends: ``vllm`` (the CPU build with the plugin, prefix caching on: the system prompt read once, then
served from its cache), or ``fast`` (``specprefill_lab.fast_backend``, which answers at once: what is left is the
gateway's own time and the client's). ``--agent N`` makes each request an agent's later turn: N tool schemas
and N tool calls with their results between the system prompt and the question. ``--tracing`` adds a second
gateway, the same but for its OpenTelemetry traces sent to a collector on this machine (one that takes every
batch and answers at once), and a third, untraced, as a yardstick (two identical gateways differ by a few tenths
of a millisecond), in the same rounds, each path in each place of the round and after each other path equally
often (``balanced_orders``): the cost of tracing on the gateway's own time, as the difference of medians and as
the median of the rounds' differences with its 95% bootstrap interval. ``--against DIR`` adds another checkout's
gateway (``git worktree add DIR REV``) to the same rounds, in front of the same backend: before and after, measured
in one run, each path in each place of the round equally often.

    .venv/bin/python lab/benchmarks/gateway_overhead.py [--backend vllm|fast] [--rounds 14] [--think 0.1] [--agent N]
        [--first-event-ms MS] [--tracing] [--profile SVG] [--against DIR]
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
from vllm_plugin_ab import options, system_prompt  # beside this script

from specprefill_lab.bench import parse_server_timing, stream_ttft, wait_idle
from specprefill_lab.demo_models import DEMO_NAME, ensure_demo_models
from specprefill_lab.launch import launched_gateway, launched_gateway_process, launched_instant_backend

COUNTED_FROM = 2  # the first reads the system prompt; the second follows it


def agent_turns(n: int) -> tuple[list[dict], list[dict]]:
    """An agent's conversation after ``n`` tool calls, and its tools: ``n`` tool schemas, then for each call the
    assistant's call and the tool's result (about 600 characters), as a coding agent's later turns look."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Tool {i}: " + " ".join(f"does step {j} of the work" for j in range(40)),
                "parameters": {
                    "type": "object",
                    "properties": {f"arg_{j}": {"type": "string", "description": f"argument {j}"} for j in range(8)},
                },
            },
        }
        for i in range(n)
    ]
    messages: list[dict] = [{"role": "user", "content": "Fix the failing test."}]
    for i in range(n):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": f"tool_{i}", "arguments": '{"arg_0": "x"}'}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"line {i}: " + "ok " * 200})
    return messages, tools


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` paths in which each takes each place in the round equally often and follows each other
    path equally often (a Williams design; with an odd ``n``, every order and its reverse): whatever one path's
    request leaves behind it (a process's work after its answer is sent) lands on every other path alike."""
    first = [0]
    for k in range(1, n):
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    rows = [[(x + i) % n for x in first] for i in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


async def alternate(
    urls: dict[str, str], system: str, rounds: int, think: float, verbose: bool, agent: int = 0
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in urls}
    async with httpx.AsyncClient(timeout=600) as client:
        paths, orders = list(urls.items()), balanced_orders(len(urls))
        for i in range(rounds):
            for name, url in (paths[k] for k in orders[i % len(orders)]):
                await wait_idle(client, list(urls.values()))
                await asyncio.sleep(think)  # a user's pause: caches and the CPU cool down, as between real requests
                body = {
                    "model": DEMO_NAME,
                    "max_tokens": 1,
                    "temperature": 0,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"Question {i}: which number comes last?"},
                    ],
                }
                if agent:  # the conversation so far, then this round's question
                    turns, body["tools"] = agent_turns(agent)
                    body["messages"] = [body["messages"][0], *turns, body["messages"][1]]
                ttft, headers = await stream_ttft(
                    client, f"{url}/v1/chat/completions", body, {"x-keep-rate": "0.3"}, usage={}
                )
                times[name].append(ttft)
                if verbose:
                    plan = ""
                    if name in ("gateway", "before"):
                        plan = (
                            f"  {headers.get('x-specprefill-plan')} {parse_server_timing(headers.get('server-timing'))}"
                        )
                    print(f"round {i:2d} {name:8s} {ttft * 1e3:7.1f} ms{plan}", flush=True)
    return times


@contextlib.contextmanager
def backend(kind: str, vllm_python: str, target: Path, first_ms: float = 0.0) -> Iterator[str]:
    """The backend's base URL while it runs (``first_ms``: the instant backend's wait before a first event)."""
    if kind == "vllm":
        from specprefill_lab.vllm_server import VLLMServer

        server = VLLMServer(
            vllm_python,
            target,
            Path(tempfile.mkdtemp(prefix="gw-overhead-")) / "vllm.log",
            plugin=True,
            served_name=DEMO_NAME,
            max_model_len=32768,
            kv_cache_gib=4,
            extra_args=("--enable-prompt-tokens-details",),
        )
        try:
            server.wait()
            yield server.url
        finally:
            server.stop()
        return
    with launched_instant_backend(first_ms=first_ms) as (url, _):
        yield url


@contextlib.contextmanager
def collector(received: dict[str, int]) -> Iterator[str]:
    """An OTLP/HTTP collector that takes every batch and answers at once (counting them, and their bytes, in
    ``received``): its base URL while it runs."""
    import socket
    import threading

    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        received["batches"] += 1
        while True:
            message = await receive()
            received["bytes"] += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-protobuf")]}
        )
        await send({"type": "http.response.body", "body": b""})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def profiled(pid: int, svg: Path) -> Iterator[None]:
    """py-spy sampling process ``pid`` (every thread, idle ones left out) while the block runs, its flame graph
    written to ``svg`` at the end (py-spy's collapsed stacks instead where the name ends in ``.txt``)."""
    import signal
    import subprocess
    import sys

    spy = Path(sys.executable).with_name("py-spy")
    fmt = "raw" if svg.suffix == ".txt" else "flamegraph"
    command = [str(spy), "record", "--pid", str(pid), "--rate", "1000", "--format", fmt, "-o", str(svg)]
    recorder = subprocess.Popen([*command, "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield
    finally:
        recorder.send_signal(signal.SIGINT)
        recorder.wait(timeout=60)
        print(f"flame graph: {svg}")


def main() -> None:
    parser = options(__doc__, f"requests per path; the first {COUNTED_FROM} are not counted")
    parser.add_argument("--backend", choices=("vllm", "fast"), default="vllm")
    parser.add_argument("--think", type=float, default=0.1, help="seconds between requests, once both are idle")
    parser.add_argument(
        "--agent",
        type=int,
        default=0,
        help="an agent's turn: this many tools and tool calls so far between the system prompt and the question",
    )
    parser.add_argument(
        "--first-event-ms",
        type=float,
        default=0.0,
        help="--backend fast: its streams wait this long before their first event (an engine's time to it)",
    )
    parser.add_argument("--tracing", action="store_true", help="also a gateway with its traces sent to a collector")
    parser.add_argument(
        "--profile", metavar="SVG", help="py-spy's flame graph of the gateway (the first) over the rounds, to SVG"
    )
    parser.add_argument(
        "--against", type=Path, help="another checkout (git worktree add DIR REV), its gateway in the same rounds"
    )
    args = parser.parse_args()
    system = system_prompt(args.words)
    root = ensure_demo_models()
    flags = ["--target-model", str(root / "target"), "--draft-model", str(root / "draft")]
    flags += ["--served-model-name", DEMO_NAME, "--min-prompt-tokens", "1024", "--backend-kind", "vllm"]
    received = {"batches": 0, "bytes": 0}
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(backend(args.backend, args.vllm_python, root / "target", args.first_event_ms))
        gateway_url, process = stack.enter_context(launched_gateway_process(["--backend-url", url, *flags]))
        urls = {"direct": url, "gateway": gateway_url}
        if args.profile:
            stack.enter_context(profiled(process.pid, Path(args.profile)))
        if args.against:
            urls["before"], _ = stack.enter_context(
                launched_gateway_process(["--backend-url", url, *flags], cwd=args.against)
            )
        if args.tracing:
            sink = stack.enter_context(collector(received))
            traced = ["--backend-url", url, "--otlp-endpoint", sink, *flags]
            urls["traced"] = stack.enter_context(launched_gateway(traced))
            urls["twin"] = stack.enter_context(launched_gateway(["--backend-url", url, *flags]))  # the yardstick
        times = asyncio.run(
            alternate(urls, system, args.rounds, args.think, verbose=args.backend == "vllm", agent=args.agent)
        )
    report(args, times, received)


def report(args, times: dict[str, list[float]], received: dict[str, int]) -> None:
    """Each path's spread and median, the gateway's own time, and the comparisons the options asked for."""
    for name, seconds in times.items():
        counted = [s * 1e3 for s in seconds[COUNTED_FROM:]]
        print(f"{name}: {min(counted):.1f}–{max(counted):.1f} ms, median {statistics.median(counted):.1f} ms")
    direct, gateway = (statistics.median(times[name][COUNTED_FROM:]) * 1e3 for name in ("direct", "gateway"))
    print(
        f"the gateway's own: {gateway - direct:.2f} ms (difference of medians over {args.rounds - COUNTED_FROM} rounds)"
    )
    if args.against:
        before = statistics.median(times["before"][COUNTED_FROM:]) * 1e3
        print(f"the other checkout's ({args.against}): {before - direct:.2f} ms")
        for label, a, b in (
            ("this checkout's gateway over direct", times["gateway"], times["direct"]),
            ("the other checkout's over direct", times["before"], times["direct"]),
            ("this checkout's against the other's", times["gateway"], times["before"]),
        ):
            low, mid, high = paired(a[COUNTED_FROM:], b[COUNTED_FROM:])
            print(f"round by round, {label}: median {mid:+.2f} ms (95% interval {low:+.2f} to {high:+.2f})")
    if args.tracing:
        traced = statistics.median(times["traced"][COUNTED_FROM:]) * 1e3
        twin = statistics.median(times["twin"][COUNTED_FROM:]) * 1e3
        print(f"with tracing on: {traced - direct:.1f} ms, {traced - gateway:+.2f} ms against tracing off")
        print(
            f"the untraced twin: {twin - gateway:+.2f} ms against the first gateway (two identical processes: "
            f"the noise); tracing against both: {traced - (gateway + twin) / 2:+.2f} ms"
        )
        print(f"the collector received {received['batches']} batches of spans, {received['bytes']:,} bytes")
        base = [(g + t) / 2 for g, t in zip(times["gateway"], times["twin"], strict=True)]
        for label, a, b in (
            ("tracing against both", times["traced"], base),
            ("twin against first", times["twin"], times["gateway"]),
        ):
            low, mid, high = paired(a[COUNTED_FROM:], b[COUNTED_FROM:])
            print(f"round by round, {label}: median {mid:+.2f} ms (95% interval {low:+.2f} to {high:+.2f})")


def paired(a: list[float], b: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """The median of the rounds' differences (ms; each round's paths measured back to back, so a slow stretch
    of the machine lands on both) and its 95% bootstrap interval."""
    import random

    differences = [(x - y) * 1e3 for x, y in zip(a, b, strict=True)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(differences, k=len(differences))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], statistics.median(differences), medians[int(0.975 * resamples)]


if __name__ == "__main__":
    main()
