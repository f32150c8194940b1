"""A request's prompt as the target reads it: its tokens, a chat's rendering, the tokens to keep whole and where
its last message begins. The surfaces' requests become one (``GatewayServing.prompt``); the planner plans one."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.chat import RenderedChat


@dataclass(slots=True)
class Prompt:
    """A request's prompt as the target reads it."""

    token_ids: list[int]
    rendered: RenderedChat | None = None  # a chat's template text and offsets
    keep: torch.Tensor | None = None  # [S] bool: the system prompt, kept whole where affordable
    boundary: int | None = None  # where a chat's last message begins: another user's request leaves this one there

    def token_array(self) -> np.ndarray:
        """``token_ids`` as an int64 array: the tokenizer's own, where it made one."""
        made = self.rendered.ids if self.rendered is not None else None
        return made if made is not None else np.asarray(self.token_ids, dtype=np.int64)
