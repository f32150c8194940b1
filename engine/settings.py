"""The reference engine's options as flags and ``SPECPREFILL_<NAME>`` variables."""

from __future__ import annotations

from pydantic import Field

from common.options import DeviceOptions, ServerOptions


class EngineSettings(ServerOptions, DeviceOptions):
    """The reference backend engine: honours prompt token IDs at explicit positions (OpenAI completions)."""

    model: str = Field(description="target model: a local folder or a hub id")
    port: int = Field(8001, description="port to listen on")
    served_model_name: str | None = Field(None, description="the model name clients send (default: --model)")
    model_alias: list[str] = Field(
        default_factory=list,
        description="other names clients may send for the model (repeatable), as coding agents send their own",
    )
    max_running: int = Field(8, gt=0, description="sequences decoded concurrently (interleaved)")
    max_waiting: int = Field(64, ge=0, description="queued requests beyond which the engine answers 503")
    prefill_chunk: int = Field(2048, gt=0, description="prompt tokens per prefill step (cancellation and fairness)")
    background_prefill_chunk: int = Field(
        256,
        gt=0,
        description="the same for background requests (priority > 0, as warming): a new request waits at most one",
    )
    max_new_tokens: int | None = Field(
        None,
        gt=0,
        description="at most this many generated tokens a request, "
        "whatever its max_tokens (as vLLM's --override-generation-config "
        "'{\"max_new_tokens\": N}'; default: what fits in the positions)",
    )
    kv_cache_tokens: int = Field(65536, ge=0, description="tokens of KV kept for prefix reuse, LRU (0: off)")
    block_size: int = Field(16, gt=0, description="tokens per prefix-cache block (only full blocks are reused)")
    kv_events_config: str | None = Field(
        None,
        description="publish the prefix cache's KV events as vLLM does: "
        "vLLM's JSON, e.g. '{\"enable_kv_cache_events\": true, "
        '"endpoint": "tcp://*:5557", "replay_endpoint": '
        '"tcp://*:5558"}\'',
    )
