"""The patches, each small and idempotent: vLLM's V1 model runner, block hashing and input processing (the patch
points are listed, and checked before anything is patched, in ``patch_points.py``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from vllm.logger import init_logger

from specprefill_vllm.positions import PositionError, block_key, check_positions, expand, requested_positions
from specprefill_vllm.supported import SUPPORTED_ARCHITECTURES
from specprefill_vllm.swap import KEPT_KEY, SWAP_PARAM, SwapError, requested_kept, swap_prompt

logger = init_logger("vllm.specprefill")
_MARK = "_specprefill_patched"


def _once(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return
    patched = make(original)
    setattr(patched, _MARK, True)
    setattr(owner, name, patched)


def supported(model_config: Any) -> bool:
    architectures = getattr(model_config, "architectures", None) or []
    return bool(set(architectures) & set(SUPPORTED_ARCHITECTURES)) and not model_config.uses_mrope


def apply() -> None:
    _patch_model_forward()
    _patch_model_runner()
    _patch_block_hashes()
    _patch_input_processor()


# --- the models: the single position channel reaches the compiled model as the usual 1-D positions ---

_MODEL_CLASSES = (
    ("vllm.model_executor.models.llama", "LlamaForCausalLM"),
    ("vllm.model_executor.models.mistral", "MistralForCausalLM"),
    ("vllm.model_executor.models.qwen2", "Qwen2ForCausalLM"),
    ("vllm.model_executor.models.qwen3", "Qwen3ForCausalLM"),
)


def _patch_model_forward() -> None:
    import importlib

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def forward(self: Any, input_ids: Any = None, positions: Any = None, *args: Any, **kwargs: Any) -> Any:
            # [1, T] from the runner's M-RoPE buffer -> [T]; 1-D (stock) and [3, T] (real M-RoPE) pass unchanged
            if positions is not None and positions.dim() == 2 and positions.shape[0] == 1:
                positions = positions[0]
            return original(self, input_ids, positions, *args, **kwargs)

        return forward

    for module_name, class_name in _MODEL_CLASSES:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        _once(cls, "forward", make)


# --- the model runner: per-request positions through the M-RoPE path ---


def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make_init(original: Any) -> Any:
        @functools.wraps(original)
        def __init__(self: Any, vllm_config: Any, device: Any, *args: Any, **kwargs: Any) -> None:
            original(self, vllm_config, device, *args, **kwargs)
            self._specprefill_positions = supported(self.model_config)
            if self._specprefill_positions:
                # one position channel; positions reach the model as [1, num_tokens] (RoPE flattens them)
                self.uses_mrope = True
                self.mrope_num_dims = 1
                self.mrope_positions = self._make_buffer((1, self.max_num_tokens + 1), dtype=torch.int64)
                logger.info(
                    "specprefill-vllm: per-request position_ids enabled for %s", self.model_config.architectures
                )

        return __init__

    def make_init_positions(original: Any) -> Any:
        @functools.wraps(original)
        def _init_mrope_positions(self: Any, req_state: Any) -> Any:
            if not getattr(self, "_specprefill_positions", False):
                return original(self, req_state)
            if req_state.prompt_token_ids is not None:
                n_tokens = len(req_state.prompt_token_ids)
            else:
                n_tokens = req_state.prompt_embeds.shape[0]
            positions, delta = expand(requested_positions(req_state.sampling_params), n_tokens)
            req_state.mrope_positions = torch.tensor(positions, dtype=torch.int64)[None, :]
            req_state.mrope_position_delta = delta

        return _init_mrope_positions

    _once(GPUModelRunner, "__init__", make_init)
    _once(GPUModelRunner, "_init_mrope_positions", make_init_positions)


# --- prefix caching: blocks at non-default positions get their positions in the hash ---


def _patch_block_hashes() -> None:
    import importlib

    from vllm.v1.core import kv_cache_utils

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def generate_block_hash_extra_keys(
            request: Any, start_token_idx: int, end_token_idx: int, start_mm_idx: int
        ) -> tuple[Any, int]:
            extra, next_mm_idx = original(request, start_token_idx, end_token_idx, start_mm_idx)
            key = block_key(requested_positions(request.sampling_params), start_token_idx, end_token_idx)
            if key is not None:
                extra = (*(extra or ()), ("specprefill_positions", key))
            return extra, next_mm_idx

        return generate_block_hash_extra_keys

    _once(kv_cache_utils, "generate_block_hash_extra_keys", make)
    patched = getattr(kv_cache_utils, "generate_block_hash_extra_keys")
    for module_name in ("vllm.v1.core.block_pool", "vllm.v1.simple_kv_offload.manager"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, "generate_block_hash_extra_keys"):
            setattr(module, "generate_block_hash_extra_keys", patched)


# --- input processing: the swap, and bad positions as a 400, never an engine crash ---


def _patch_input_processor() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def process_inputs(self: Any, request_id: Any, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
            request = original(self, request_id, prompt, params, *args, **kwargs)
            sampling_params: Any = getattr(request, "sampling_params", None)
            positions = requested_positions(sampling_params)
            kept = requested_kept(sampling_params)
            if positions is None and kept is None:
                return request
            model_config = self.vllm_config.model_config
            if not supported(model_config):
                raise VLLMValidationError(
                    f"position_ids are supported for {', '.join(SUPPORTED_ARCHITECTURES)}, not "
                    f"{model_config.architectures}",
                    parameter="vllm_xargs.position_ids",
                )
            if self.vllm_config.use_v2_model_runner:
                raise VLLMValidationError(
                    "position_ids need vLLM's V1 model runner: unset VLLM_USE_V2_MODEL_RUNNER",
                    parameter="vllm_xargs.position_ids",
                )
            if kept is not None:  # vLLM rendered the request as usual; the target reads the kept tokens instead
                if request.prompt_embeds is not None or request.mm_features:
                    raise VLLMValidationError(
                        "the swap takes token prompts without images or embeddings", parameter=SWAP_PARAM
                    )
                try:
                    request.prompt_token_ids = swap_prompt(request.prompt_token_ids or [], kept, positions)
                except SwapError as exc:
                    raise VLLMValidationError(str(exc), parameter=SWAP_PARAM) from None
                sampling_params.extra_args.pop(KEPT_KEY, None)  # this request's own copy; the engine needs positions
            max_positions = model_config.hf_text_config.max_position_embeddings
            n_prompt = len(request.prompt_token_ids or [])
            try:
                check_positions(positions or [], n_prompt, max_positions, sampling_params.max_tokens)
            except PositionError as exc:
                raise VLLMValidationError(str(exc), parameter="vllm_xargs.position_ids") from None
            return request

        return process_inputs

    _once(InputProcessor, "process_inputs", make)
