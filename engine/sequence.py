"""One request inside the engine, and what each of its steps hands back."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

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


@dataclass(eq=False)
class Sequence:
    request_id: int
    token_ids: list[int]
    position_ids: list[int]
    params: SamplingParams
    stream: TextStream
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cache: DynamicCache | None = None
    prefilled: int = 0  # prompt tokens already in the KV cache
    generator: torch.Generator | None = None

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= len(self.token_ids)

    @property
    def n_generated(self) -> int:
        return len(self.stream.token_ids)

    def next_position(self) -> int:
        """Where the next token to be read stands: generated tokens continue after the last prompt position."""
        return self.position_ids[-1] + 1 + self.n_generated

    def emit(self, item: StepOutput | BaseException) -> None:
        """Hands an output to the request's consumer (thread-safe: the engine steps in its own thread)."""
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)
