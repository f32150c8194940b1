"""What the plugin patches or relies on in vLLM, checked in vLLM's sources (no import, so it also runs on a
release that is downloaded but not installed, and before anything is patched).

The gate is these symbols, not a version string: a vLLM whose sources have every patch point with the expected
parameters is one the plugin can patch. Model classes are optional (a missing one is simply not patched).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class PatchPoint:
    path: str  # inside the vllm package
    owner: str | None  # a class, or None for a module-level function
    name: str  # a function, or a field (``fields``) or class (``kind="class"``)
    params: tuple[str, ...] = ()  # the leading parameters it must take, in order (self excluded)
    kind: str = "function"  # "function", "field" (an annotated class attribute) or "class"
    required: bool = True


PATCH_POINTS: tuple[PatchPoint, ...] = (
    # positions through the V1 runner's M-RoPE path
    PatchPoint("v1/worker/gpu_model_runner.py", "GPUModelRunner", "__init__", ("vllm_config", "device")),
    PatchPoint("v1/worker/gpu_model_runner.py", "GPUModelRunner", "_init_mrope_positions", ("req_state",)),
    PatchPoint("v1/worker/gpu_model_runner.py", "GPUModelRunner", "_calc_mrope_positions", ("scheduler_output",)),
    PatchPoint("v1/worker/gpu_model_runner.py", "GPUModelRunner", "_make_buffer"),
    PatchPoint("v1/worker/gpu_input_batch.py", "CachedRequestState", "prompt_token_ids", kind="field"),
    PatchPoint("v1/worker/gpu_input_batch.py", "CachedRequestState", "sampling_params", kind="field"),
    PatchPoint("v1/worker/gpu_input_batch.py", "CachedRequestState", "mrope_positions", kind="field"),
    PatchPoint("v1/worker/gpu_input_batch.py", "CachedRequestState", "mrope_position_delta", kind="field"),
    # prefix caching: positions in the block hash
    PatchPoint(
        "v1/core/kv_cache_utils.py",
        None,
        "generate_block_hash_extra_keys",
        ("request", "start_token_idx", "end_token_idx", "start_mm_idx"),
    ),
    # the swap and position checks, after vLLM rendered and tokenised the request
    PatchPoint("v1/engine/input_processor.py", "InputProcessor", "process_inputs", ("request_id", "prompt", "params")),
    PatchPoint("v1/engine/__init__.py", "EngineCoreRequest", "prompt_token_ids", kind="field"),
    PatchPoint("exceptions.py", None, "VLLMValidationError", kind="class"),
    # vllm_xargs reaches SamplingParams.extra_args
    PatchPoint("sampling_params.py", "SamplingParams", "extra_args", kind="field"),
    PatchPoint("entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest", "vllm_xargs", kind="field"),
    PatchPoint("entrypoints/openai/completion/protocol.py", "CompletionRequest", "vllm_xargs", kind="field"),
    PatchPoint("entrypoints/openai/responses/protocol.py", "ResponsesRequest", "vllm_xargs", kind="field"),
    PatchPoint("entrypoints/anthropic/protocol.py", "AnthropicMessagesRequest", "vllm_xargs", kind="field"),
    # the models whose forward takes the positions (1-D from the [1, T] buffer)
    *(
        PatchPoint(f"model_executor/models/{module}.py", cls, "forward", ("input_ids", "positions"), required=False)
        for module, cls in (
            ("llama", "LlamaForCausalLM"),
            ("mistral", "MistralForCausalLM"),
            ("qwen2", "Qwen2ForCausalLM"),
            ("qwen3", "Qwen3ForCausalLM"),
        )
    ),
)


def missing_patch_points(vllm_root: str | Path, points: tuple[PatchPoint, ...] = PATCH_POINTS) -> list[str]:
    """The required patch points absent from the vLLM sources under ``vllm_root`` (the ``vllm`` package folder),
    each as a sentence naming the file, the symbol and what is wrong. Empty: the plugin can patch this vLLM."""
    root, trees, problems = Path(vllm_root), {}, []
    for point in points:
        if point.path not in trees:
            source = root / point.path
            trees[point.path] = ast.parse(source.read_text()) if source.is_file() else None
        problem = _check(trees[point.path], point)
        if problem and point.required:
            problems.append(f"vllm/{point.path}: {problem}")
    return problems


def _check(tree: ast.Module | None, point: PatchPoint) -> str | None:
    if tree is None:
        return "the file is missing"
    scope: list[ast.stmt] = tree.body
    where = point.name
    if point.owner is not None:
        owner = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == point.owner), None)
        if owner is None:
            return f"class {point.owner} is missing"
        scope, where = owner.body, f"{point.owner}.{point.name}"
    if point.kind == "class":
        found = any(isinstance(n, ast.ClassDef) and n.name == point.name for n in scope)
        return None if found else f"class {where} is missing"
    if point.kind == "field":
        found = any(
            isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == point.name for n in scope
        )
        return None if found else f"field {where} is missing"
    function = next(
        (n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == point.name), None
    )
    if function is None:
        return f"{where}() is missing"
    names = [a.arg for a in function.args.posonlyargs + function.args.args]
    if point.owner is not None and names[:1] == ["self"]:
        names = names[1:]
    if tuple(names[: len(point.params)]) != point.params:
        return f"{where}() takes ({', '.join(names)}), expected ({', '.join(point.params)}, ...)"
    return None
