"""The TTFT sweep: time to first token through the gateway vs directly at the same backend.

For each prompt length S and keep rate, in one run:
  measured speedup = TTFT_direct(S) / TTFT_gateway(S, keep)
  ideal speedup    = TTFT_direct(S) / (t_draft(S) + TTFT_direct(K))   with K the tokens actually kept
  efficiency       = measured / ideal
Every measurement uses a fresh prompt (another document), so no cache or prefix reuse flatters it.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import secrets
import statistics
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from specprefill_lab.demo_models import synthetic_corpus


@dataclass
class Sample:
    path: str  # "direct", "direct_kept" or "gateway"
    tokens: int
    keep_rate: float
    ttft_s: float
    kept_tokens: int | None = None
    timing_ms: dict[str, float] = field(default_factory=dict)
    status: str | None = None
    reason: str | None = None  # why the gateway sent the prompt whole, if it did


@dataclass
class Row:
    tokens: int
    keep_rate: float
    kept_tokens: int
    direct_s: float
    gateway_s: float
    gateway_spread_s: float
    draft_s: float
    direct_kept_s: float
    speedup: float
    ideal: float
    efficiency: float
    breakdown_ms: dict[str, float]


def ideal_speedup(full_s: float, draft_s: float, kept_s: float) -> float:
    return full_s / (draft_s + kept_s)


def parse_server_timing(header: str | None) -> dict[str, float]:
    """The durations in a ``Server-Timing`` header, in ms."""
    out = {}
    for part in (header or "").split(","):
        name, _, dur = part.strip().partition(";dur=")
        if name and dur:
            out[name] = float(dur)
    return out


def predicted_cached(header: str | None) -> int | None:
    """The plan's predicted engine cache hit in a ``Server-Timing`` header (its ``cached`` entry), in tokens."""
    found = re.search(r'(?:^|,)\s*cached;desc="(\d+)"', header or "")
    return int(found.group(1)) if found else None


class PromptMaker:
    """Chat prompts of a requested token length, each from a different document.

    Lengths are calibrated against the gateway's /v1/specprefill/compress (the target's own template and
    tokenizer), so it works for any deployment without a local tokenizer. Every document begins with this
    maker's ``nonce`` (new for each maker unless given): the text after it is drawn from the same seeds in every
    run, so without it a second run against the same engine would send the first run's documents again (their
    starts cached at the engine, and recurring contexts to the gateway's planner).
    """

    def __init__(self, client: httpx.Client, gateway: str, model: str, nonce: str | None = None) -> None:
        self.client, self.gateway, self.model = client, gateway, model
        self.nonce = nonce if nonce is not None else secrets.token_hex(4)
        self._seed = 1000
        self._sentences: list[str] = []
        self._chars_per_token: float | None = None

    def count(self, messages: list[dict]) -> int:
        response = self.client.post(
            f"{self.gateway}/v1/specprefill/compress",
            json={"model": self.model, "messages": messages},
            headers={"x-keep-rate": "1"},
        )
        response.raise_for_status()
        return response.json()["original_tokens"]

    def text(self, tokens: int) -> str:
        """About ``tokens`` tokens of text (the chat template's few tokens aside), from a new place each call."""
        self._seed += 1
        rng = random.Random(self._seed)
        if len(self._sentences) < 50_000:
            self._sentences = synthetic_corpus(seed=7, n_sentences=50_000)
        if self._chars_per_token is None:
            probe = " ".join(self._sentences[:100])  # about 2,500 tokens: within a small model's positions
            self._chars_per_token = len(probe) / self.count([{"role": "user", "content": probe}])
        start = rng.randrange(len(self._sentences) // 2)
        text, chars = [f"Record {self.nonce}-{self._seed}."], 0
        target_chars = int(tokens * self._chars_per_token)
        for sentence in self._sentences[start:] + self._sentences[:start]:
            if chars >= target_chars:
                break
            text.append(sentence)
            chars += len(sentence) + 1
        return " ".join(text)

    def make(self, tokens: int) -> list[dict]:
        """A one-message chat of ``tokens`` tokens: a document and a question about it."""
        question = "\n\nWhich number appears first in the text above?"
        body = self.text(tokens)
        # one correction step against the real count keeps lengths within a few percent. The count reads a copy
        # that begins otherwise: the text itself would stay in the gateway's tokenization cache
        # (``common.tokenize``), and the measured request would skip the tokenizing a new document costs
        # (15-30 ms at 16k-32k tokens)
        actual = self.count([{"role": "user", "content": f"(count {self._seed}) " + body + question}])
        body = body[: max(1, int(len(body) * tokens / actual))]
        return [{"role": "user", "content": body + question}]


ACTIVITY_METRICS = (
    "specprefill_engine_active_requests",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "specprefill_backend_requests_in_flight",
    "specprefill_warming_pending_contexts",
)


async def wait_idle(
    client: httpx.AsyncClient, urls: list[str], timeout: float = 600.0, *, report_after: float = 30.0
) -> None:
    """Until no engine or gateway in ``urls`` reports a request running, waiting or in flight, or a context
    waiting to be warmed (their /metrics). What keeps them busy is printed once after ``report_after`` seconds,
    and named in the error at ``timeout``."""
    start = time.monotonic()
    reported = False
    while True:
        busy = []
        for url in urls:
            try:
                response = await client.get(f"{url}/metrics")
            except httpx.TransportError:  # not there (a replica the bench killed): it runs nothing
                continue
            if response.status_code != 200:  # nothing to read (behind an API key, say): take it as idle
                continue
            busy += [
                f"{url} {line}"
                for line in response.text.splitlines()
                if line.split("{")[0].split(" ")[0] in ACTIVITY_METRICS and float(line.rsplit(" ", 1)[1])
            ]
        if not busy:
            return
        waited = time.monotonic() - start
        if waited > timeout:
            raise RuntimeError(f"busy for {timeout:.0f} s: " + "; ".join(busy))
        if waited > report_after and not reported:
            print(f"waiting for idle for {waited:.0f} s: " + "; ".join(busy), flush=True)
            reported = True
        await asyncio.sleep(0.1)


FIRST_MESSAGES_EVENTS = ("content_block_start", "content_block_delta", "message_delta")  # after the prefill


async def stream_ttft(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict, usage: dict | None = None
) -> tuple[float, httpx.Headers]:
    """Seconds from sending the request to the first streamed event with content. The stream is then dropped, or,
    given ``usage``, read to its end with the answer's usage (the prompt tokens served from the engine's cache:
    ``usage["prompt_tokens_details"]["cached_tokens"]``; an Anthropic stream's ``cache_read_input_tokens``) put into
    ``usage``. A URL ending in ``/v1/messages`` is read as Anthropic's Messages stream."""
    start = time.perf_counter()
    messages = url.endswith("/v1/messages")  # Anthropic's stream: content in content_block_delta, usage at the end
    if usage is not None and not messages:
        body = {**body, "stream_options": {"include_usage": True}}
    ttft = None
    async with client.stream("POST", url, json={**body, "stream": True}, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            compact = line.replace(" ", "")
            if (
                ttft is None
                and line.startswith("data:")
                and (
                    any(f'"type":"{kind}"' in compact for kind in FIRST_MESSAGES_EVENTS)
                    if messages
                    else '"choices":[{' in compact
                )
            ):
                ttft = time.perf_counter() - start
                if usage is None:
                    return ttft, response.headers
            if usage is not None and line.startswith("data: {") and '"usage"' in line:
                usage.update(json.loads(line[len("data: ") :]).get("usage") or {})
        if ttft is not None:
            return ttft, response.headers
    raise RuntimeError(f"{url}: the stream ended without an answer")


@dataclass
class BenchConfig:
    gateway_url: str
    backend_url: str
    model: str
    backend_model: str
    lengths: list[int]
    keep_rates: list[float]
    repeats: int = 3
    warmup: int = 1
    max_tokens: int = 1
    warmup_direct: bool = True  # the warm-up requests also go directly (and the kept tokens' own request)


async def run_sweep(
    config: BenchConfig, prompts: PromptMaker, idle_urls: list[str] = ()
) -> tuple[list[Sample], list[Row]]:
    """Each measurement waits until the engines and the gateway in ``idle_urls`` are idle (warming included)."""
    samples: list[Sample] = []
    total = len(config.lengths) * (config.warmup + config.repeats)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        progress = tqdm(total=total, desc="bench", unit="prompt")
        for length in config.lengths:
            for repeat in range(config.warmup + config.repeats):
                measured = repeat >= config.warmup
                messages = prompts.make(length)
                direct_body = {
                    "model": config.backend_model,
                    "messages": messages,
                    "max_tokens": config.max_tokens,
                    "temperature": 0,
                }
                direct = measured or config.warmup_direct
                if direct:
                    await wait_idle(client, idle_urls)
                    ttft, _ = await stream_ttft(client, f"{config.backend_url}/v1/chat/completions", direct_body, {})
                    if measured:
                        samples.append(Sample("direct", length, 1.0, ttft))
                for keep in config.keep_rates:
                    body = {**direct_body, "model": config.model, "messages": prompts.make(length)}
                    await wait_idle(client, idle_urls)
                    ttft, headers = await stream_ttft(
                        client, f"{config.gateway_url}/v1/chat/completions", body, {"x-keep-rate": f"{keep:g}"}
                    )
                    kept = int(headers.get("x-specprefill-kept-tokens", length))
                    if measured:
                        samples.append(
                            Sample(
                                "gateway",
                                length,
                                keep,
                                ttft,
                                kept,
                                parse_server_timing(headers.get("server-timing")),
                                headers.get("x-specprefill-status"),
                                headers.get("x-specprefill-reason"),
                            )
                        )
                    if keep < 1.0 and direct:  # the target reading only the kept tokens, directly
                        kept_body = {**direct_body, "messages": prompts.make(kept)}
                        await wait_idle(client, idle_urls)
                        ttft, _ = await stream_ttft(client, f"{config.backend_url}/v1/chat/completions", kept_body, {})
                        if measured:
                            samples.append(Sample("direct_kept", length, keep, ttft, kept))
                progress.update(1)
        progress.close()
    return samples, summarize(samples, config.keep_rates)


def summarize(samples: list[Sample], keep_rates: list[float]) -> list[Row]:
    rows = []
    for length in sorted({s.tokens for s in samples}):
        direct = [s.ttft_s for s in samples if s.path == "direct" and s.tokens == length]
        for keep in keep_rates:
            gateway = [s for s in samples if s.path == "gateway" and s.tokens == length and s.keep_rate == keep]
            if not direct or not gateway:
                continue
            kept_direct = [
                s.ttft_s for s in samples if s.path == "direct_kept" and s.tokens == length and s.keep_rate == keep
            ]
            direct_s = statistics.median(direct)
            gateway_s = statistics.median(s.ttft_s for s in gateway)
            draft_s = statistics.median(s.timing_ms.get("draft", 0.0) for s in gateway) / 1e3
            kept_s = statistics.median(kept_direct) if kept_direct else direct_s
            ideal = ideal_speedup(direct_s, draft_s, kept_s) if keep < 1.0 else 1.0
            breakdown = {
                name: statistics.median(s.timing_ms.get(name, 0.0) for s in gateway)
                for name in ("tokenize", "draft", "select", "backend")
            }
            breakdown["gateway_overhead"] = max(0.0, gateway_s * 1e3 - sum(breakdown.values()))
            speedup = direct_s / gateway_s
            rows.append(
                Row(
                    tokens=length,
                    keep_rate=keep,
                    kept_tokens=int(statistics.median(s.kept_tokens or 0 for s in gateway)),
                    direct_s=direct_s,
                    gateway_s=gateway_s,
                    gateway_spread_s=max(s.ttft_s for s in gateway) - min(s.ttft_s for s in gateway),
                    draft_s=draft_s,
                    direct_kept_s=kept_s,
                    speedup=speedup,
                    ideal=ideal,
                    efficiency=speedup / ideal,
                    breakdown_ms=breakdown,
                )
            )
    return rows


def format_table(rows: list[Row]) -> str:
    head = (
        f"{'tokens':>7} {'keep':>5} {'kept':>6} {'direct s':>9} {'gateway s':>10} {'draft s':>8} "
        f"{'kept s':>7} {'speedup':>8} {'ideal':>6} {'eff.':>5}  breakdown ms (tokenize/draft/select/backend/other)"
    )
    lines = [head]
    for r in rows:
        b = r.breakdown_ms
        lines.append(
            f"{r.tokens:>7} {r.keep_rate:>5g} {r.kept_tokens:>6} {r.direct_s:>9.3f} {r.gateway_s:>10.3f} "
            f"{r.draft_s:>8.3f} {r.direct_kept_s:>7.3f} {r.speedup:>7.2f}x {r.ideal:>5.2f}x {r.efficiency:>5.2f}  "
            f"{b['tokenize']:.0f}/{b['draft']:.0f}/{b['select']:.0f}/{b['backend']:.0f}/{b['gateway_overhead']:.0f}"
        )
    return "\n".join(lines)
