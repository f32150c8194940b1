"""One request inside the engine, and what each of its steps hands back."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from engine.sampling import SamplingParams, TextStream


@dataclass(slots=True)
class StepOutput:
    """One generated token (or the final flush), as the serving layer needs it."""

    token_id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache served


@dataclass(eq=False)
class Sequence:
    request_id: int
    token_ids: list[int]
    position_ids: list[int]
    params: SamplingParams
    stream: TextStream
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[StepOutput | BaseException] = field(default_factory=asyncio.Queue)
    priority: int = 0  # lower runs first
    cancelled: threading.Event = field(default_factory=threading.Event)
    cache: DynamicCache | None = None
    prefilled: int = 0  # prompt tokens already in the KV cache
    cached_tokens: int = 0  # of which the prefix cache served
    generator: torch.Generator | None = None
    constraint: Any = None  # structured output: an ``engine.structured.JSONConstraint``
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # its first step

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= len(self.token_ids)

    @property
    def n_generated(self) -> int:
        return len(self.stream.token_ids)

    def computed(self) -> tuple[list[int], list[int]]:
        """The tokens whose KV the sequence's cache holds, and their positions (prompt, then generated)."""
        n = self.cache.get_seq_length() if self.cache is not None else 0
        generated = self.stream.token_ids
        last = self.position_ids[-1]
        tokens = (self.token_ids + generated)[:n]
        positions = (self.position_ids + list(range(last + 1, last + 1 + len(generated))))[:n]
        return tokens, positions

    def next_position(self) -> int:
        """Where the next token to be read stands: generated tokens continue after the last prompt position."""
        return self.position_ids[-1] + 1 + self.n_generated

    def emit(self, item: StepOutput | BaseException) -> None:
        """Hands an output to the request's consumer (thread-safe: the engine steps in its own thread)."""
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)
