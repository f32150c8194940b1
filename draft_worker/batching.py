"""Batching concurrent scoring requests into one draft forward: bounded wait, bounded batch size and tokens."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draft_worker.worker import DraftWorker


@dataclass(slots=True)
class _Pending:
    token_ids: Sequence[int]
    future: asyncio.Future[torch.Tensor]


class ScoreBatcher:
    """Collects requests for up to ``max_wait_s`` after the first, then runs them as one left-padded batch.

    A batch holds at most ``max_batch_size`` prompts and ``max_batch_tokens`` padded tokens (rows × longest
    prompt), so one long prompt never drags many short ones into a huge padded forward. One batch runs at a
    time, in a thread (the model is shared). Prompts are validated one by one first, so one bad prompt
    fails only its own request.
    """

    def __init__(
        self, worker: DraftWorker, *, max_batch_size: int = 8, max_batch_tokens: int = 65536, max_wait_s: float = 0.005
    ) -> None:
        self.worker = worker
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self._queue: collections.deque[_Pending] = collections.deque()
        self._wakeup = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self.batches = 0

    async def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        self.worker.validate(token_ids)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(token_ids, future))
        self._wakeup.set()
        return await future

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._queue:
                continue
            if len(self._queue) < self.max_batch_size:
                await asyncio.sleep(self.max_wait_s)  # let concurrent requests join
            while self._queue:
                batch = self._take_batch()
                if not batch:
                    continue
                self.batches += 1
                try:
                    results = await asyncio.to_thread(self.worker.score_many, [p.token_ids for p in batch])
                except Exception as exc:
                    for pending in batch:
                        if not pending.future.done():
                            pending.future.set_exception(exc)
                    continue
                for pending, scores in zip(batch, results):
                    if not pending.future.done():
                        pending.future.set_result(scores)

    def _take_batch(self) -> list[_Pending]:
        batch: list[_Pending] = []
        longest = 0
        while self._queue and len(batch) < self.max_batch_size:
            candidate = self._queue[0]
            if candidate.future.done():  # its client went away
                self._queue.popleft()
                continue
            new_longest = max(longest, len(candidate.token_ids))
            if batch and new_longest * (len(batch) + 1) > self.max_batch_tokens:
                break
            batch.append(self._queue.popleft())
            longest = new_longest
        return batch
