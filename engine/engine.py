"""The reference engine: runs a target model on prompt tokens at explicit positions.

One thread owns the model. Each round it takes the running sequences from the ``Scheduler`` and steps each
once: a prefill chunk of ``prefill_chunk`` tokens, or one decode step, then sampling. A background request's
chunk (priority > 0) stops between two layers when a more urgent request arrives, and runs again after it.
No batching: each sequence has its own KV cache, which keeps positions per sequence trivially right. With a
``PrefixCache`` a sequence starts from the longest cached run of its leading blocks (tokens and positions)
and leaves its own blocks behind when it ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from common.models import eos_token_ids
from engine.prefix_cache import PrefixCache
from engine.runner import DECODE_ROOM, Yielded, decode_one, prefill
from engine.sampling import SamplingParams, TextStream, adjust_logits, make_generator, sample_next
from engine.scheduler import Scheduler
from engine.sequence import Sequence, StepOutput
from engine.structured import StructuredOutputs

logger = logging.getLogger("specprefill.engine")


class ReferenceEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_running: int = 8,
        max_waiting: int = 64,
        prefill_chunk: int = 2048,
        background_prefill_chunk: int = 256,
        prefix_cache: PrefixCache | None = None,
        on_active_change: Callable[[int], None] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.prefill_chunk = prefill_chunk
        # background work (priority > 0, as a gateway's warming) yields to a new request after at most this many
        self.background_prefill_chunk = min(background_prefill_chunk, prefill_chunk)
        self.prefix_cache = prefix_cache
        self.eos_ids = set(eos_token_ids(model))
        self.structured = StructuredOutputs(tokenizer, model.config.vocab_size)
        self.scheduler = Scheduler(max_running=max_running, max_waiting=max_waiting, on_active_change=on_active_change)
        self.on_queued: Callable[[float], None] | None = None  # seconds each request waited for its first step
        self.on_yielded: Callable[[], None] | None = None  # a background chunk stopped for a request
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="reference-engine", daemon=True)
        self._thread.start()

    @property
    def max_positions(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def active(self) -> int:
        return self.scheduler.active

    def cache_shape(self) -> tuple[int, int]:
        """The prefix cache's block size and capacity in tokens (capacity 0: no cache)."""
        if self.prefix_cache is None:
            return 16, 0
        return self.prefix_cache.block_size, self.prefix_cache.max_blocks * self.prefix_cache.block_size

    def close(self) -> None:
        self.scheduler.close()
        self._thread.join(timeout=5)

    async def generate(
        self, token_ids: list[int], position_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> AsyncGenerator[StepOutput, None]:
        """Streams the generated tokens; the last output carries ``finish_reason``. Inputs are validated."""
        seq = Sequence(
            request_id=next(self._ids),
            token_ids=token_ids,
            position_ids=position_ids,
            params=params,
            stream=TextStream(self.tokenizer, params.stop),
            loop=asyncio.get_running_loop(),
            priority=priority,
        )
        self.scheduler.add(seq)
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
            self.scheduler.wake()

    # --- the engine thread ---

    def _loop(self) -> None:
        while (running := self.scheduler.schedule()) is not None:
            for seq in running:
                if seq.cancelled.is_set() or self._step_safely(seq):
                    self._store(seq)
                    self.scheduler.finish(seq)
            self.scheduler.drop_cancelled()

    def _store(self, seq: Sequence) -> None:
        """A finished sequence's blocks into the prefix cache. Keeping them is optional: a failure (the device
        out of memory for the copies, say) is logged, and the engine goes on."""
        if self.prefix_cache is None or seq.cache is None:
            return
        try:
            self.prefix_cache.store(*seq.computed(), seq.cache)
        except Exception:
            logger.exception("could not keep a finished request's blocks in the prefix cache")

    def _step_safely(self, seq: Sequence) -> bool:
        try:
            return self.step(seq)
        except Exception as exc:  # a failing sequence never stops the others
            seq.emit(exc)
            return True

    def step(self, seq: Sequence) -> bool:
        """One prefill chunk, or one token; True when the sequence is finished."""
        try:
            logits = self._run(seq)
        except Yielded:  # a more urgent request came: it steps first, this chunk runs again after it
            if self.on_yielded is not None:
                self.on_yielded()
            return False
        if logits is None:  # more of the prompt to prefill
            return False
        return self._postprocess(seq, logits)

    def _run(self, seq: Sequence) -> torch.Tensor | None:
        """The next forward: a prefill chunk (between chunks others step, a cancelled sequence is dropped), or
        the last generated token at its position. Next-token logits [V], or None mid-prefill."""
        device = self.model.device
        if seq.started_at is None:
            seq.started_at = time.monotonic()
            if self.on_queued is not None:
                self.on_queued(seq.started_at - seq.queued_at)
        if seq.cache is None and self.prefix_cache is not None:
            seq.cache, seq.cached_tokens = self.prefix_cache.lookup(
                seq.token_ids, seq.position_ids, self.model.config, DECODE_ROOM
            )
            seq.prefilled = seq.cached_tokens
        if not seq.prefill_done:
            background = seq.priority > 0
            chunk = self.background_prefill_chunk if background else self.prefill_chunk
            end = min(len(seq.token_ids), seq.prefilled + chunk)
            ids = torch.tensor([seq.token_ids[seq.prefilled : end]], device=device)
            positions = torch.tensor([seq.position_ids[seq.prefilled : end]], device=device)
            urgent = (lambda: self.scheduler.urgent(seq.priority)) if background else None
            logits, seq.cache = prefill(
                self.model, ids, positions, seq.cache, len(seq.token_ids) + DECODE_ROOM, should_yield=urgent
            )
            seq.prefilled = end
            return logits if seq.prefill_done else None
        last = torch.tensor(seq.stream.token_ids[-1], device=device)
        assert seq.cache is not None  # made by its prefill
        return decode_one(self.model, last, seq.next_position() - 1, seq.cache)

    def _postprocess(self, seq: Sequence, logits: torch.Tensor) -> bool:
        """Samples the next token, emits it, and says whether the sequence is finished."""
        params = seq.params
        if seq.generator is None:
            seq.generator = make_generator(params.seed, self.model.device)
        if params.json_parser is not None and seq.constraint is None:
            seq.constraint = self.structured.constraint(params.json_parser)
        chosen = adjust_logits(logits, seq.stream.token_ids, params)
        if seq.constraint is not None:
            chosen = seq.constraint.mask(chosen, seq.stream.token_ids)
        token_id = int(sample_next(chosen, params, seq.generator))
        logprob, top = _logprobs(logits, token_id, params.logprobs)
        finish = None
        if token_id in self.eos_ids and not params.ignore_eos:
            finish = "stop"
        else:
            seq.stream.push(token_id)
            if seq.stream.stopped:
                finish = "stop"
            elif seq.n_generated >= params.max_tokens:
                finish = "length"
        seq.emit(
            StepOutput(token_id, seq.stream.delta(final=finish is not None), logprob, top, finish, seq.cached_tokens)
        )
        return finish is not None


def _logprobs(logits: torch.Tensor, token_id: int, top_n: int | None) -> tuple[float | None, dict[int, float] | None]:
    """The chosen token's log-probability and the ``top_n`` most likely tokens' (None when not asked for)."""
    if top_n is None:
        return None, None
    logprobs = torch.log_softmax(logits, dim=-1)
    top = None
    if top_n > 0:
        values, indices = logprobs.topk(top_n)
        top = dict(zip(indices.tolist(), values.tolist()))
    return float(logprobs[token_id]), top
