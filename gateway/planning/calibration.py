"""The start-up probe that calibrates the cost models: the target (one token: its completion answer) and the
draft timed on random prompts, both models fitted on the timings.

First an unmeasured warm-up (a GPU's first forwards load kernels and libraries: timed, they made the draft
look seconds slow and the gateway forward every prompt whole). Then random prompts of ``sizes`` tokens,
doubling on while the target answers the largest within ``grow_below_s`` (a GPU reads 4,096 tokens in a
fraction of that, and prices met in traffic should be interpolated, not extrapolated eightfold) and the draft
scores it within that too (an engine that answers at once, before a draft on CPU cores, had the probe score
prompts up to the draft's 131,072 positions: minutes before the gateway was up); then the
largest extended by each of ``extensions`` in turn (few new tokens after many cached ones, as a chat's next
turn). Then ``reads`` short reads (16 new tokens) after each prompt but the smallest: the same few new tokens
after 1,024 and after 4,096 cached ones are what tells the cost of reading cached tokens apart from a
request's fixed part. (Without them, and with 2,048 tokens at most, the fit priced reading 12,000 cached
tokens at nothing.) Sizes are cut to fit ``limit``. A probe the backend refuses ends the probe; the models keep
what they learnt so far and learn from traffic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from gateway.planning.planner import Planner, cached_tokens

logger = logging.getLogger("specprefill.gateway")
Complete = Callable[[list[int]], Awaitable[dict[str, Any]]]


class Probe:
    def __init__(self, planner: Planner, complete: Complete, vocab: list[int]) -> None:
        self.planner = planner
        self.complete = complete
        self.pool = torch.as_tensor(vocab)
        self.generator = torch.Generator().manual_seed(0)
        self.reports: list[bool] = []  # whether each answer said how many tokens the engine's cache served

    def tokens(self, n: int) -> list[int]:
        return self.pool[torch.randint(len(self.pool), (n,), generator=self.generator)].tolist()

    async def timed(self, prompt: list[int], cached: int, measured: bool = True) -> float:
        """``prompt`` through the draft and the target (``cached``: its leading tokens the engine holds); the
        slower one's seconds."""
        planner = self.planner
        reused = planner.draft.reusable_prefix(prompt)
        start = time.perf_counter()
        await planner.draft.score(prompt)
        drafted = time.perf_counter() - start
        if measured:
            planner.draft_cost.observe(len(prompt) - reused, reused, drafted, probe=True)
        start = time.perf_counter()
        answer = await self.complete(prompt)
        seconds = time.perf_counter() - start
        served = cached_tokens(answer.get("usage"))
        self.reports.append(served is not None)
        served = cached if served is None else served  # an engine that does not say: as sent
        if measured:
            planner.target_cost.observe(len(prompt) - served, served, seconds, probe=True)
        logger.debug(
            "probe: %d tokens (%d cached): the draft %.2f s, the target %.2f s", len(prompt), served, drafted, seconds
        )
        if (cache := planner.replicas[0].cache) is not None:
            await cache.record(prompt, None)
        return max(seconds, drafted)

    async def run(
        self, sizes: list[int], extensions: tuple[int, ...], reads: int, room: int, grow_below_s: float
    ) -> None:
        """The probe's prompts in turn (the module's docstring); ``sizes`` grows in place."""
        await self.timed(self.tokens(min(64, room)), 0, measured=False)
        bases: list[list[int]] = []  # the probed prompts but the smallest
        largest: list[int] = []
        index = 0
        while index < len(sizes):
            largest = self.tokens(sizes[index])
            seconds = await self.timed(largest, 0)
            if index:
                bases.append(largest)
            if index == len(sizes) - 1 and seconds < grow_below_s and sizes[-1] < room:
                sizes.append(min(2 * sizes[-1], room))
            index += 1
        previous = largest
        for n in extensions:
            prompt = previous + self.tokens(n)
            await self.timed(prompt, len(previous))
            previous = prompt
        for base in bases:
            for _ in range(reads):
                await self.timed(base + self.tokens(16), len(base))


async def calibrate(
    planner: Planner,
    complete: Complete,
    vocab: list[int],
    sizes: tuple[int, ...] = (256, 1024, 4096),
    extensions: tuple[int, ...] = (32, 512),
    reads: int = 2,
    limit: int | None = None,
    grow_below_s: float = 0.5,
) -> bool:
    """The planner's cost models calibrated through ``complete(token_ids)`` (the target, one token: its completion
    answer) and its draft (the module's docstring). Whether the probe ran to its end."""
    room = max(1, min(planner.draft.max_prompt_tokens, limit or 1 << 31) - sum(extensions))
    probed = sorted({min(n, room) for n in sizes})
    probe = Probe(planner, complete, vocab)
    logger.info(
        "timing the cost models' start-up probe: prompts of %s tokens (longer where both read those within %g s) "
        "through the draft and the target: seconds on a GPU, minutes on CPU cores",
        ", ".join(f"{n:,}" for n in probed),
        grow_below_s,
    )
    started = time.perf_counter()
    whole = True
    try:
        await probe.run(probed, extensions, reads, room, grow_below_s)
    except Exception as exc:  # a refused probe never stops the gateway from starting
        whole = False
        logger.warning("cost-model probe stopped: %s", type(exc).__name__ + (f": {exc}" if str(exc) else ""))
    logger.info(
        "cost models calibrated on prompts up to %d tokens in %.1f s: target %s, draft %s",
        probed[-1],
        time.perf_counter() - started,
        planner.target_cost.describe(),
        planner.draft_cost.describe(),
    )
    if probe.reports and not any(probe.reports):
        logger.warning(
            "the backend's answers do not say how many prompt tokens its prefix cache served "
            "(usage.prompt_tokens_details.cached_tokens; vLLM: --enable-prompt-tokens-details): the "
            "gateway then learns the engine's costs from its own guesses of what the cache held, "
            "and cannot tell how good they are"
        )
    return whole
