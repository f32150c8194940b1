"""Coding agents' sessions through the gateway and directly (``specprefill bench agents``).

Claude Code and Codex CLI run headless as their users run them (``claude -p``, then ``claude -c -p`` for each next
turn of the session; ``codex exec``, then ``codex exec resume --last``), each with a home of its own, against one
path's base URL. A timing proxy in front of each path forwards their requests unchanged and records, per request,
the time to the first content event, the plan the gateway chose, and the usage the answer reports (prompt tokens
and those served from the engine's cache), so both paths are timed the same way at the client's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from gateway.settings import AGENT_MODEL_NAMES

# the names the pinned agents send for their default models (scripts/agent-clis.sh), served as the target
AGENT_MODELS = AGENT_MODEL_NAMES
FIRST_EVENTS = (b'"content_block_start"', b'"response.output_text.delta"', b'"response.output_item.added"')
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
QUESTIONS = (
    "What does hello.py print?",
    "What would it print if run twice?",
    "Is there a bug in it?",
    "How would you make it print the date too?",
    "Summarise what we discussed.",
)


@dataclass
class Exchange:
    """One request an agent sent, as the proxy saw it."""

    path: str
    started: float
    ttft_s: float | None = None
    status: int = 0
    plan: str | None = None
    reason: str | None = None  # why the gateway sent it whole, where it did
    kept_tokens: int | None = None
    prompt_tokens: int | None = None  # the whole prompt (input + cache read + cache creation)
    cached_tokens: int | None = None
    ended: float | None = None  # the answer's last byte


@dataclass(frozen=True)
class Sent:
    """A request as the agent sent it (to send it again elsewhere)."""

    method: str
    path_qs: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Turn:
    agent: str
    path: str
    session: int
    turn: int
    exchanges: list[Exchange] = field(default_factory=list)
    reported: dict = field(default_factory=dict)  # the agent's own account (Claude Code's JSON result)
    seconds: float = 0.0  # the command's wall time


class TimingProxy:
    """Forwards every request to ``upstream`` as it came and streams the answer back, timing each one."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self.sent: list[Sent] = []  # each exchange's request, in the same order
        self._session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        exchange = Exchange(request.path, time.perf_counter())
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as answer:
            response = web.StreamResponse(
                status=answer.status,
                headers={
                    k: v for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}
                },
            )
            await response.prepare(request)
            seen = b""
            async for chunk in answer.content.iter_any():
                if exchange.ttft_s is None and any(marker in chunk for marker in FIRST_EVENTS):
                    exchange.ttft_s = time.perf_counter() - exchange.started
                seen += chunk
                await response.write(chunk)
            exchange.ended = time.perf_counter()
            exchange.status = answer.status
            exchange.plan = answer.headers.get("x-specprefill-plan")
            exchange.reason = answer.headers.get("x-specprefill-reason")
            kept = answer.headers.get("x-specprefill-kept-tokens")
            exchange.kept_tokens = int(kept) if kept else None
            if request.path.endswith(("/messages", "/responses")):
                exchange.prompt_tokens, exchange.cached_tokens = _usage(seen)
                # recorded before the answer's end goes out, so a client that has read the whole answer finds
                # its exchange here: nobody polls for it
                self.exchanges.append(exchange)
                self.sent.append(Sent(request.method, request.path_qs, headers, body))
            await response.write_eof()
        return response

    @contextlib.contextmanager
    def serving(self) -> Iterator[str]:
        """The proxy on a free loopback port, in a thread of its own; its base URL."""
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        state: dict = {}

        async def start() -> None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
            app = web.Application(client_max_size=64 << 20)
            app.router.add_route("*", "/{tail:.*}", self.handle)
            state["runner"] = runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            state["port"] = site._server.sockets[0].getsockname()[1]
            ready.set()

        thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
        thread.start()
        ready.wait(30)
        try:
            yield f"http://127.0.0.1:{state['port']}"
        finally:

            async def stop() -> None:
                await state["runner"].cleanup()
                await self._session.close()

            asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)
            loop.close()


def _usage(stream: bytes) -> tuple[int | None, int | None]:
    """The prompt's tokens and those read from the cache, from an answer (Messages or Responses; streamed or not)."""
    usage: dict = {}
    for line in stream.decode(errors="replace").splitlines():
        line = line.removeprefix("data: ").strip()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        found = (
            event.get("usage")
            or (event.get("message") or {}).get("usage")
            or (event.get("response") or {}).get("usage")
        )
        if found:
            usage.update({k: v for k, v in found.items() if v is not None})
    if "input_tokens" not in usage:
        return None, None
    if "cache_read_input_tokens" in usage:  # Anthropic: input_tokens excludes what the cache served
        cached = usage.get("cache_read_input_tokens") or 0
        return usage["input_tokens"] + cached + (usage.get("cache_creation_input_tokens") or 0), cached
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
    return usage["input_tokens"], cached


def ending_target(target: Path, out: Path, factor: float = 2.0) -> Path:
    """A copy of a random-weight target whose end-of-turn row of the output layer is ``factor`` times as long, so
    that its answers end within tens of tokens, as a real model's do (an agent reads an answer cut at its
    max_tokens as an error, and asks for 32,000-128,000). Written once into ``out``."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    copy = out / "ending-target"
    if (copy / "model.safetensors").exists():
        return copy
    shutil.copytree(target, copy, dirs_exist_ok=True)
    weights = load_file(copy / "model.safetensors")
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    end = AutoTokenizer.from_pretrained(target).eos_token_id
    weights[head][end] *= factor
    save_file({k: v.contiguous() for k, v in weights.items()}, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def agent_env(agent: str, url: str, home: Path) -> dict[str, str]:
    """The environment an agent runs in: its own home, the path's base URL, no traffic elsewhere."""
    env = {"PATH": os.environ["PATH"], "HOME": str(home)}
    if agent == "claude":
        return env | {
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": "unused",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
        }
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model_provider = "specprefill"\n\n[model_providers.specprefill]\nname = "SpecPrefill gateway"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\n'
    )
    return env | {"CODEX_HOME": str(codex_home)}


class AgentFailed(RuntimeError):
    """An agent's turn ended in an error (its message ends with what the agent printed)."""


def agent_turn(
    agent: str, bin_dir: Path, url: str, work: Path, home: Path, prompt: str, first: bool
) -> tuple[dict, float]:
    """One headless turn; the agent's JSON result (Claude Code) or its last lines (Codex), and the wall time."""
    if agent == "claude":
        command = [str(bin_dir / "claude"), *([] if first else ["-c"]), "-p", prompt, "--output-format", "json"]
    else:
        command = [
            str(bin_dir / "codex"),
            "exec",
            *([] if first else ["resume", "--last"]),
            "--skip-git-repo-check",
            prompt,
        ]
    start = time.perf_counter()
    out = subprocess.run(
        command,
        cwd=work,
        env=agent_env(agent, url, home),
        capture_output=True,
        text=True,
        timeout=3600,
        stdin=subprocess.DEVNULL,
    )
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise AgentFailed(f"{agent} exited {out.returncode}: {(out.stdout + out.stderr)[-2000:]}")
    if agent == "claude":
        result = json.loads(out.stdout)
        keep = ("duration_ms", "duration_api_ms", "num_turns", "usage", "is_error", "subtype", "session_id")
        return {k: result.get(k) for k in keep}, seconds
    return {"tail": out.stderr[-300:]}, seconds


def run_session(
    agent: str,
    bin_dir: Path,
    path: str,
    url: str,
    proxy: TimingProxy,
    root: Path,
    session: int,
    turns: int,
    think_s: float,
) -> tuple[list[Turn], str | None]:
    """One session of ``turns`` turns through ``url`` (the path's proxy), a think time between turns; the turns
    done, and the error that ended the session early, if one did."""
    work, home = root / f"{agent}-{path}-{session}" / "project", root / f"{agent}-{path}-{session}" / "home"
    work.mkdir(parents=True)
    home.mkdir(parents=True)
    (work / "hello.py").write_text('print("hello")\n')
    out = []
    for number in range(turns):
        if number:
            time.sleep(think_s)
        before = len(proxy.exchanges)
        try:
            reported, seconds = agent_turn(
                agent, bin_dir, url, work, home, QUESTIONS[number % len(QUESTIONS)], first=number == 0
            )
        except AgentFailed as exc:
            return out, f"turn {number + 1}: {exc}"
        out.append(Turn(agent, path, session, number + 1, proxy.exchanges[before:], reported, seconds))
    return out, None


def replay_session(turns: list[Turn], sent: list[Sent], path: str, url: str, proxy: TimingProxy) -> list[Turn]:
    """Another path gets the requests one path's session sent, as the agent sent them: each after the answer
    before it ends and the pause the agent left there (its tools, the user's think time), through ``url`` (that
    path's timing proxy). The same prompts on both paths, whatever the answers: an agent's next request depends
    on its last answer, and a compressed prompt's answer differs."""
    import httpx

    requests = iter(sent)
    out, previous_end = [], None
    with httpx.Client(timeout=httpx.Timeout(3600.0)) as client:
        for turn in turns:
            before, start = len(proxy.exchanges), time.perf_counter()
            for exchange in turn.exchanges:
                request = next(requests)
                if previous_end is not None and exchange.ended is not None:
                    time.sleep(max(0.0, exchange.started - previous_end))
                previous_end = exchange.ended
                with client.stream(
                    request.method, url + request.path_qs, content=request.body, headers=request.headers
                ) as answer:
                    for _ in answer.iter_bytes():
                        pass
            seconds = time.perf_counter() - start
            out.append(Turn(turn.agent, path, turn.session, turn.turn, proxy.exchanges[before:], {}, seconds))
    return out


def as_dicts(turns: list[Turn]) -> list[dict]:
    return [asdict(t) for t in turns]


def summarize_turns(turns: list[Turn]) -> list[dict]:
    """Per agent and turn: each path's TTFT (the turn's first request), the gateway's over direct's, the plans,
    and the share of the prompt the engine's cache served."""
    import statistics

    rows = []
    for agent in dict.fromkeys(t.agent for t in turns):
        for number in sorted({t.turn for t in turns if t.agent == agent}):
            row: dict = {"agent": agent, "turn": number}
            for path in ("direct", "gateway"):
                mine = [t for t in turns if t.agent == agent and t.turn == number and t.path == path and t.exchanges]
                if not mine:
                    continue
                firsts = [t.exchanges[0] for t in mine]
                row[path] = {
                    "ttft_s": statistics.median(e.ttft_s for e in firsts if e.ttft_s is not None),
                    "prompt_tokens": statistics.median(e.prompt_tokens or 0 for e in firsts),
                    "cached_share": statistics.median(
                        (e.cached_tokens or 0) / e.prompt_tokens for e in firsts if e.prompt_tokens
                    ),
                    "plans": [e.plan for e in firsts],
                    "requests": statistics.median(len(t.exchanges) for t in mine),
                    "reported_ms": statistics.median((t.reported.get("duration_api_ms") or 0) for t in mine),
                }
            if "direct" in row and "gateway" in row:
                row["ratio"] = row["gateway"]["ttft_s"] / row["direct"]["ttft_s"]
            rows.append(row)
    return rows


def format_turns(rows: list[dict]) -> str:
    lines = [
        f"{'agent':>7} {'turn':>4} {'direct s':>9} {'gateway s':>10} {'ratio':>6} {'prompt':>7} "
        f"{'cached (direct/gateway)':>24}  plans"
    ]
    for r in rows:
        d, g = r.get("direct", {}), r.get("gateway", {})
        lines.append(
            f"{r['agent']:>7} {r['turn']:>4} {d.get('ttft_s', float('nan')):>9.2f} "
            f"{g.get('ttft_s', float('nan')):>10.2f} {r.get('ratio', float('nan')):>6.2f} "
            f"{int(g.get('prompt_tokens') or d.get('prompt_tokens') or 0):>7} "
            f"{d.get('cached_share', 0):>11.0%} / {g.get('cached_share', 0):>9.0%}  {g.get('plans')}"
        )
    return "\n".join(lines)
