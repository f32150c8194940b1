"""The look-ahead's decode steps as CUDA graphs, on a GPU.

Each look-ahead step is one token through the draft: on a GPU its kernels take microseconds and launching
them from Python takes milliseconds (a Llama-3.2-1B shape on an H100: about 20 ms a step, so the 7 steps
cost 0.14 s against 0.055 s for the whole 8k-token prefill). As vLLM and SGLang do for decoding, the step
is captured once as a CUDA graph and replayed.

A graph replays fixed kernels on fixed memory, so everything a step reads or writes lives in static
buffers: the token, its position and the cache slot it writes (device tensors set before each replay), the
KV cache (one buffer per layer, ``capacity`` tokens, which the prompt's prefill also writes into), an
additive attention mask over the cache (0 up to the token, -inf after: a step reads the keys of one
*bucket*, the prompt plus its look-ahead rounded up by at most an eighth), the logits and each layer's
recorded queries (one slot per step, handed to the scorer once after the last step). One graph per bucket,
all over the same buffers; a prompt longer than the buffers reallocates them and drops the graphs.

Only single prompts use graphs (a batch runs the plain steps). Any failure to capture turns graphs off
for the worker, with a warning: the plain steps compute the same thing, only slower. Off CUDA (tests), the
same static-buffer steps run without capture.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from common.models import with_cache
from draft_worker.capture import QueryRecorder

logger = logging.getLogger("specprefill.draft")
MIN_BUCKET = 1024
QUERY_SLOTS = 31  # generated look-ahead tokens a graph records (the paper's 8 queries need 7; more: plain steps)


class _SlotLayer(DynamicLayer):
    """A layer of the static KV buffers that writes a step's key and value at the slot ``at`` (a device
    tensor) and hands the attention the bucket's first ``width`` entries."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, at: torch.Tensor, width: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._all_keys, self._all_values, self._at, self._width = keys, values, at, width

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._all_keys.index_copy_(2, self._at, key_states)
        self._all_values.index_copy_(2, self._at, value_states)
        return self._all_keys[:, :, : self._width], self._all_values[:, :, : self._width]

    def get_seq_length(self) -> int:
        return self._width  # never consulted for positions or masks: both are given


class _StaticRecorder(QueryRecorder):
    """Writes each layer's query into its static buffer [1, H, slots, D], at the slot ``at`` (a device tensor:
    the step), so that a look-ahead hands the scorer each layer's queries once, not once per step."""

    def __init__(self, buffers: list[torch.Tensor], at: torch.Tensor) -> None:
        super().__init__()
        self.buffers, self._at = buffers, at

    def record(self, layer_idx: int, query: torch.Tensor, scaling: float) -> None:
        self.buffers[layer_idx].index_copy_(2, self._at, query)
        self.scaling[layer_idx] = scaling


class LookAheadGraphs:
    """Static buffers and one captured decode step per bucket, for one draft model on CUDA."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.enabled = True
        self.capacity = 0
        self.storage: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._graphs: dict[int, tuple[Callable[[], object], torch.Tensor]] = {}

    def storage_for(self, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """KV buffers with room for ``tokens`` (a prompt and its look-ahead), for the prefill to write into;
        None when graphs are off."""
        if not self.enabled:
            return None
        if tokens > self.capacity:
            self._allocate(_bucket(tokens))
        return self.storage

    def _allocate(self, capacity: int) -> None:
        config, device, dtype = self.model.config, self.model.device, self.model.dtype
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (1, config.num_key_value_heads, capacity, head_dim)
        self._graphs.clear()
        self.storage = []  # the old buffers go before the new ones are made
        # zeros, not empty: masked keys get no weight, but a NaN in fresh memory would still poison the sum
        self.storage = [
            (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            for _ in range(config.num_hidden_layers)
        ]
        self.capacity = capacity
        n_heads = config.num_attention_heads
        self.ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)  # which query slot a step writes
        self.mask = torch.zeros(1, 1, 1, capacity, dtype=dtype, device=device)
        self.queries = [
            torch.zeros(1, n_heads, QUERY_SLOTS, head_dim, dtype=dtype, device=device)
            for _ in range(config.num_hidden_layers)
        ]

    def look_ahead(
        self, logits: torch.Tensor, length: int, recorder: QueryRecorder, steps: int, eos: torch.Tensor
    ) -> torch.Tensor | None:
        """The ``steps - 1`` greedy steps after a single prompt of ``length`` tokens whose prefill wrote
        ``storage`` and gave ``logits`` [1, V]; queries go to ``recorder``. Which queries count [1, Q] (as
        ``scorer.look_ahead``), or None if no graph could be made (the caller runs the plain steps)."""
        if steps - 1 > QUERY_SLOTS:
            return None
        width = _bucket(length + steps)
        entry = self._graphs.get(width) or self._capture(width)
        if entry is None:
            return None
        replay, out_logits = entry
        valid = torch.ones(1, steps, dtype=torch.bool, device=logits.device)
        self.mask[..., :length].fill_(0.0)
        self.mask[..., length:].fill_(float("-inf"))
        for step in range(1, steps):
            token = logits.argmax(-1, keepdim=True)  # [1, 1]
            valid[:, step] = valid[:, step - 1] & ~torch.isin(token[:, 0], eos)
            position = length + step - 1
            self.ids.copy_(token)
            self.position.fill_(position)
            self.slot.fill_(position)
            self.step.fill_(step - 1)
            self.mask[..., position] = 0.0
            replay()
            logits = out_logits
        if steps > 1:
            for layer_idx, queries in enumerate(self.queries):
                recorder.record(layer_idx, queries[:, :, : steps - 1], self._scaling[layer_idx])
        return valid

    def _capture(self, width: int) -> tuple[Callable[[], object], torch.Tensor] | None:
        cache = DynamicCache(config=self.model.config)
        cache.layers = [_SlotLayer(k, v, self.slot, width) for k, v in self.storage]
        recorder = _StaticRecorder(self.queries, self.step)
        mask = self.mask[..., :width]

        def step() -> torch.Tensor:
            out = self.model(
                input_ids=self.ids,
                position_ids=self.position,
                attention_mask=mask,
                **with_cache(self.model, cache),
                use_cache=True,
                logits_to_keep=1,
                specprefill_recorder=recorder,
            )
            logits: torch.Tensor = out.logits
            return logits[:, -1]

        # warm-up and capture write their key and value into the last slot, which no prompt reads before its
        # own step writes it
        self.slot.fill_(self.capacity - 1)
        self.step.fill_(QUERY_SLOTS - 1)
        if self.model.device.type != "cuda":
            with torch.inference_mode():
                out_logits = step()
            self._scaling = dict(recorder.scaling)
            self._graphs[width] = (lambda: out_logits.copy_(step()), out_logits)
            return self._graphs[width]
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.inference_mode():
                out_logits = step()
        except Exception as exc:  # the plain steps still work
            logger.warning(
                "CUDA graphs for the draft's look-ahead are off: capture failed (%s: %s)", type(exc).__name__, exc
            )
            self.enabled = False
            self._graphs.clear()
            return None
        self._scaling = dict(recorder.scaling)
        self._graphs[width] = (graph.replay, out_logits)
        return self._graphs[width]


def _bucket(tokens: int) -> int:
    """``tokens`` rounded up to a multiple of an eighth of the power of two below it (at least ``MIN_BUCKET``):
    a step reads at most 1/8 more keys than it needs, and lengths share eight graphs per doubling."""
    step = max(MIN_BUCKET, (1 << (tokens.bit_length() - 1)) // 8)
    return -(-tokens // step) * step
