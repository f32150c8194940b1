"""Next-token choice and incremental detokenisation. Small functions on the hot path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    json_parser: Any = None
    """A structured-output parser (``engine.structured.json_parser``); None for free text."""


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def adjust_logits(logits: torch.Tensor, generated: list[int], params: SamplingParams) -> torch.Tensor:
    """logits [V] -> [V] with OpenAI's logit_bias and presence/frequency penalties (over the generated tokens,
    as vLLM applies them). Log-probabilities stay the model's own."""
    if params.logit_bias:
        logits = logits.clone()
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
    if generated and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(generated, device=logits.device), minlength=logits.shape[-1])
        counts = counts[: logits.shape[-1]].to(logits.dtype)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """logits: [V] float32 -> a 0-d token tensor. temperature 0 is greedy."""
    if params.temperature == 0.0:
        return logits.argmax()
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p  # keep the smallest set reaching top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[0]


class TextStream:
    """Turns generated token IDs into text deltas: never splits a UTF-8 character, holds back possible stops."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stops = stops
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        text = str(self._tokenizer.decode(self.token_ids, skip_special_tokens=True))
        for stop in self._stops:
            at = text.find(stop, max(0, len(self.text) - len(stop)))
            if at != -1:
                text, self.stopped = text[:at], True
        self.text = text

    def delta(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next bytes
                end = len(self.text.rstrip("\ufffd"))
            end = max(self.sent, end - self._holdback)
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out
