"""The reference engine: runs a target model on prompt tokens at explicit positions.

One scheduler thread owns the model. Admitted sequences are prefilled as they arrive, in chunks of
``prefill_chunk`` tokens, and their steps are interleaved round-robin, so a new request waits for at most
one step (a decode step or a prefill chunk) of each running one (no batching: each sequence has its own
KV cache, which keeps positions per sequence trivially right).
Waiting requests sit in a bounded queue; past it, ``submit`` raises ``OverloadedError`` (503).
A consumer that stops listening (client disconnect) marks its sequence cancelled, and the scheduler
drops it before its next step.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from draft_worker.loader import eos_token_ids
from engine.runner import decode_one, prefill
from engine.sampling import SamplingParams, TextStream, make_generator, sample_next
from specprefill.openai_api import OverloadedError


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
    prefilled: int = 0
    next_logits: torch.Tensor | None = None
    generator: torch.Generator | None = None

    def emit(self, item: StepOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


class ReferenceEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_running: int = 8,
        max_waiting: int = 64,
        prefill_chunk: int = 2048,
        name: str = "target",
        on_active_change=None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        self.eos_ids = set(eos_token_ids(model))
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._closed = False
        self._on_active_change = on_active_change
        self._thread = threading.Thread(target=self._loop, name="reference-engine", daemon=True)
        self._thread.start()

    @property
    def max_positions(self) -> int:
        return self.model.config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._waiting) + len(self._running)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    async def generate(
        self, token_ids: list[int], position_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[StepOutput]:
        """Streams the generated tokens; the last output carries ``finish_reason``. Inputs are validated."""
        seq = Sequence(
            request_id=next(self._ids),
            token_ids=token_ids,
            position_ids=position_ids,
            params=params,
            stream=TextStream(self.tokenizer, params.stop),
            loop=asyncio.get_running_loop(),
        )
        with self._cond:
            if len(self._waiting) >= self.max_waiting:
                raise OverloadedError(
                    "the engine's queue is full; retry shortly", headers={"Retry-After": "1"}, code="queue_full"
                )
            self._waiting.append(seq)
            self._cond.notify_all()
        self._active_changed()
        try:
            while True:
                item = await seq.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            seq.cancelled.set()
            with self._cond:
                self._cond.notify_all()

    # --- scheduler thread ---

    def _active_changed(self) -> None:
        if self._on_active_change is not None:
            self._on_active_change(self.active)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not self._running:
                    self._cond.wait()
                if self._closed:
                    return
                while self._waiting and len(self._running) < self.max_running:
                    self._running.append(self._waiting.popleft())
                running = list(self._running)
            for seq in running:
                finished = True
                if not seq.cancelled.is_set():
                    try:
                        finished = self._step(seq)
                    except Exception as exc:  # a failing sequence never stops the others
                        seq.emit(exc)
                if finished:
                    with self._cond:
                        self._running.remove(seq)
                    seq.cache = None
                    self._active_changed()
            with self._cond:  # drop waiting sequences whose consumer went away
                dropped = [s for s in self._waiting if s.cancelled.is_set()]
                for seq in dropped:
                    self._waiting.remove(seq)
            if dropped:
                self._active_changed()

    def _step(self, seq: Sequence) -> bool:
        """Prefill or one decode step; returns True when the sequence is finished."""
        device = self.model.device
        if seq.prefilled < len(seq.token_ids):
            # prefill in chunks: between them, other sequences step and a cancelled one is dropped
            end = min(len(seq.token_ids), seq.prefilled + self.prefill_chunk)
            ids = torch.tensor([seq.token_ids[seq.prefilled:end]], device=device)
            positions = torch.tensor([seq.position_ids[seq.prefilled:end]], device=device)
            seq.next_logits, seq.cache = prefill(self.model, ids, positions, seq.cache)
            seq.prefilled = end
            if end < len(seq.token_ids):
                return False
            seq.generator = make_generator(seq.params.seed, device)
        logits = seq.next_logits
        token = sample_next(logits, seq.params, seq.generator)
        token_id = int(token)
        logprob, top = None, None
        if seq.params.logprobs is not None:
            logprobs = torch.log_softmax(logits, dim=-1)
            logprob = float(logprobs[token_id])
            if seq.params.logprobs > 0:
                values, indices = logprobs.topk(seq.params.logprobs)
                top = dict(zip(indices.tolist(), values.tolist()))
        n_generated = len(seq.stream.token_ids) + 1
        finish = None
        if token_id in self.eos_ids and not seq.params.ignore_eos:
            finish = "stop"
        else:
            seq.stream.push(token_id)
            if seq.stream.stopped:
                finish = "stop"
            elif n_generated >= seq.params.max_tokens:
                finish = "length"
        text = seq.stream.delta(final=finish is not None)
        seq.emit(StepOutput(token_id, text, logprob, top, finish))
        if finish is not None:
            return True
        position = seq.position_ids[-1] + n_generated
        seq.next_logits = decode_one(self.model, token, position, seq.cache)
        return False

