"""Draft clients: what the gateway asks for token scores. In-process here; remote workers plug in the same way."""

from __future__ import annotations

import asyncio
from typing import Protocol

import torch

from draft_worker import DraftWorker, ScoringConfig


class DraftClient(Protocol):
    config: ScoringConfig
    max_prompt_tokens: int

    async def score(self, token_ids: list[int]) -> torch.Tensor: ...

    async def ready(self) -> bool: ...

    async def close(self) -> None: ...


class LocalDraft:
    """The draft worker in this process; forwards run in a thread so the event loop keeps serving."""

    def __init__(self, worker: DraftWorker) -> None:
        self.worker = worker
        self.config = worker.config
        self.max_prompt_tokens = worker.max_prompt_tokens

    async def score(self, token_ids: list[int]) -> torch.Tensor:
        return await asyncio.to_thread(self.worker.score, token_ids)

    async def ready(self) -> bool:
        return True

    async def close(self) -> None:
        return None
