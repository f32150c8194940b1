"""Gateway settings: one object, from flags (``specprefill serve --keep-rate 0.2``) or ``SPECPREFILL_*`` variables."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from common.options import DeviceOptions, ServerOptions
from common.selection import DEFAULT_KEEP_RATE, AutoKeepRate, KeepRate, validate_keep_rate
from draft_worker.settings import ScoringOptions
from gateway.cost_terms import check_coefficients, coefficients_help

_AUTO = AutoKeepRate()  # the auto rule's default target and bounds

BackendKind = Literal["reference", "vllm", "tokens", "text"]
# the model names coding agents ask for unless told otherwise (Claude Code 2.1.332, Codex CLI 0.171.0): a client
# configured as docs/using/agents.md says, without a model line, sends one of these
AGENT_MODEL_NAMES = ("claude-opus-5-5", "gpt-6.2-sol")


class GatewaySettings(ServerOptions, DeviceOptions, ScoringOptions):
    """The gateway: OpenAI-compatible, compresses long prompts with SpecPrefill."""

    backend_url: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="the backend engine's base URL; repeated (or comma-separated), replicas "
        "of one model, each request routed to where its plan costs least (default: the reference engine "
        "in-process)",
    )
    backend_kind: BackendKind = Field(
        "reference",
        description="reference (positions), vllm (vLLM with the plugin: positions), "
        "tokens (token IDs, no positions), text (kept text to any OpenAI-compatible server)",
    )
    backend_model: str | None = Field(None, description="the model name the backend serves (default: asked from it)")
    backend_kv_events: str = Field(
        "auto",
        description="the backend's KV cache events, which the model of its "
        "prefix cache then follows instead of guessing: auto (where the backend says "
        "it publishes them: vLLM's /kv_event_sources), off, or the ZMQ endpoint "
        "(tcp://HOST:PORT)",
    )
    backend_kv_events_replay: str | None = Field(
        None,
        description="with an endpoint: the events' replay endpoint "
        "(vLLM's replay_endpoint), where missed events are asked for again",
    )
    backend_kv_events_topic: str = Field("", description="with an endpoint: the events' topic (vLLM's topic)")
    backend_health_interval: float = Field(
        2.0,
        gt=0,
        description="with several --backend-url: seconds between "
        "health checks (a replica that fails one is out until it passes)",
    )
    backend_api_key: SecretStr | None = Field(None, description="Bearer token the gateway sends to the backend")
    target_model: str | None = Field(
        None,
        description="the target model (its tokenizer and chat template); "
        "without it and --draft-model, `specprefill serve` runs the real model, "
        "SmolLM2-135M-Instruct, drafting for itself",
    )
    draft_model: str | None = Field(
        None,
        description="the draft model (ideally with the target's tokenizer; "
        "see --draft-tokenizer-mapping), or baseline:random|head|tail (scores "
        "without a model, to compare against in evals)",
    )
    draft_worker_url: list[str] = Field(default_factory=list, description="remote draft workers (repeatable)")
    draft_tokenizer_mapping: Literal["auto", "off"] = Field(
        "auto",
        description="auto: a draft whose tokenizer differs from the target's is scored on its own tokens "
        "of the prompt's text and its scores mapped onto the target's tokens by character overlap; off: refuse "
        "to start with such a draft",
    )
    draft_tokenizer: str | None = Field(
        None,
        description="the draft's tokenizer, for remote draft workers whose "
        "tokenizer differs from the target's (default: --draft-model)",
    )
    served_model_name: str | None = Field(None, description="the model name clients use (default: the target's)")
    model_alias: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="other names clients may send for the served model; repeated (or "
        "comma-separated): coding agents send their own, e.g. claude-sonnet-4-5 (Claude Code) or gpt-5 (Codex CLI)",
    )
    agent_model_names: bool = Field(
        True,
        description="also answer to the model names coding agents send by default ("
        + ", ".join(AGENT_MODEL_NAMES)
        + "), so that their configurations without a model line work",
    )
    redis_url: str | None = Field(None, description="Redis for the shared score cache (default: in-memory)")
    redis_key_prefix: str = Field("specprefill:", description="prefix of every Redis key")
    score_cache_ttl: float = Field(3600.0, gt=0, description="seconds a cached score array lives")
    score_cache_max_entry_kb: int = Field(4096, gt=0, description="larger score arrays are not cached")
    memory_cache_mb: int = Field(256, ge=0, description="in-memory score cache size without Redis (0: off)")
    draft_prefix_cache_mb: int = Field(1024, ge=0, description="in-process draft KV kept for prefix reuse (0: off)")
    keep_rate: float | Literal["auto"] = Field(
        DEFAULT_KEEP_RATE,
        description="default fraction of chunks kept, in (0, 1], or auto: the fewest chunks that hold "
        "--auto-keep-target of the draft's score mass, between --auto-keep-floor and --auto-keep-ceiling",
    )
    auto_keep_target: float = Field(
        _AUTO.target, gt=0, le=1, description="auto keep rate: the share of the score mass the kept chunks reach"
    )
    auto_keep_floor: float = Field(_AUTO.floor, gt=0, le=1, description="auto keep rate: the least rate it applies")
    auto_keep_ceiling: float = Field(
        _AUTO.ceiling, gt=0, le=1, description="auto keep rate: the most (what it is priced at)"
    )
    min_prompt_tokens: int = Field(
        1024, ge=1, description="shorter prompts bypass compression (a floor; above it the cost model decides)"
    )
    plan_after_send: bool = Field(
        True,
        description="a chat that goes whole whatever its tokens (off, keep rate 1, fewer bytes than "
        "--min-prompt-tokens, features the backend cannot take compressed) is sent to the backend first, and "
        "tokenized and planned while the backend reads it (one replica, an engine that takes 2 ms or more to its "
        "first event)",
    )
    # --- planning around the engine's prefix cache ---
    planner: Literal["cost", "fresh"] = Field(
        "cost",
        description="cost: price the whole prompt, a fresh selection "
        "and an extension of an earlier one against the engine's cache; "
        "fresh: a fresh selection for every prompt above --min-prompt-tokens "
        "(the paper's behaviour)",
    )
    keep_system_whole: bool = Field(
        True, description="keep system prompts whole when that costs at most --plan-slack more than compressing them"
    )
    whole_when_cached: float = Field(
        0.9,
        ge=0,
        le=1,
        description="send a prompt whole when the engine holds at least "
        "this share of it (an agent's or a chat's next turn, once warmed) and its new tokens cost "
        "within --plan-slack of what direct's would (all before the last message held): the "
        "target reads all of it at the price of its new tokens, rather than a "
        "compressed part of it a little sooner (0: price it like any plan)",
    )
    max_queue_wait: float | None = Field(
        None,
        gt=0,
        description="shed load: a request the engine would start on "
        "only after this many seconds (the planner's own prediction of the queue "
        "ahead, on the least busy replica) is answered 503 with Retry-After at "
        "once, before any draft work (default: none waits too long to be taken)",
    )
    plan_slack: float = Field(
        0.2,
        ge=0,
        description="a plan that keeps more of the prompt wins while it costs at "
        "most this fraction more than the cheapest",
    )
    reuse_threshold: float = Field(
        0.9,
        ge=0,
        le=1,
        description="an earlier selection is reused only if it keeps "
        "this share of what a fresh one would keep (1.01 "
        "never reuses)",
    )
    warming: bool = Field(
        True,
        description="after a compressed request on a recurring context, send its whole "
        "prompt to the engine in pieces in its idle time, so the next request "
        "on that context can read it whole",
    )
    warming_piece_ms: float = Field(
        100.0,
        gt=0,
        description="engine time of one warming piece (at least one cache "
        "block): a request that arrives during a warm waits "
        "for at most one piece",
    )
    warming_quiet_blocks: int = Field(
        1,
        ge=1,
        description="where one cache block takes the engine longer than a piece (a CPU engine on a long "
        "prompt) and the engine is likely to stay quiet for twice that long, a piece takes this many "
        "blocks' time: fewer requests for a warm, a longer wait for a request that meets one (1: one block)",
    )
    warming_confidence: float = Field(
        0.9,
        gt=0,
        le=1,
        description="a piece starts only where, by the recent idle "
        "gaps between requests, the next request comes "
        "after it ends with this likelihood",
    )
    warming_priority: int = Field(
        10,
        ge=0,
        description="priority of warming pieces (vLLM honours it under "
        "--scheduling-policy priority and ignores it otherwise; the "
        "reference engine always does; 0: none)",
    )
    engine_poll_interval: float = Field(
        1.0,
        ge=0,
        description="seconds between reads of the engine's /metrics for requests it runs for other clients (0: never)",
    )
    engine_cache_tokens: int | None = Field(
        None, ge=0, description="the engine's prefix-cache capacity in tokens (default: asked from the engine)"
    )
    engine_block_size: int | None = Field(
        None, gt=0, description="the engine's prefix-cache block size (default: asked from the engine)"
    )
    calibrate: bool = Field(True, description="time a few probe prompts at start-up to calibrate the cost models")
    reuse_calibration: bool = Field(
        True,
        description="fit the cost models on the probe an earlier start made with the same models, settings and "
        "machine, kept under the cache folder, instead of probing again (an engine and a draft in process only)",
    )
    calibration_dir: str | None = Field(
        None, description="where the probes are kept (default: $SPECPREFILL_CACHE_DIR/calibration)"
    )
    cost_coefficients: dict[str, list[float]] | None = Field(None, description=coefficients_help())
    api_key: SecretStr | None = Field(None, description="clients must send this as a Bearer token")
    draft_timeout: float = Field(30.0, gt=0, description="seconds before a draft falls back to the full prompt")
    backend_connect_timeout: float = Field(5.0, gt=0, description="seconds to connect to the backend")
    backend_read_timeout: float = Field(600.0, gt=0, description="seconds to wait for each backend read")
    max_request_bytes: int = Field(16 << 20, gt=0, description="larger request bodies get 413")
    max_prompt_tokens: int | None = Field(
        None, gt=0, description="longer prompts get 400 (default: the target's limit)"
    )
    max_tokens_limit: int | None = Field(
        None,
        gt=0,
        description="max_tokens above this gets 400 (default: none; "
        "the engine lowers max_tokens to what fits in the model's positions, as "
        "vLLM does, and coding agents ask for 32,000-128,000)",
    )
    max_messages: int = Field(4096, gt=0, description="chats with more messages get 400")
    metrics_public: bool = Field(False, description="serve /metrics without the API key")
    workers: int = Field(
        1,
        ge=1,
        description="worker processes serving on one port (with --backend-url and --redis-url: the workers share "
        "the score cache and the engine-cache model through Redis, as replicas do; /metrics sums them)",
    )

    @field_validator("keep_rate", mode="before")
    @classmethod
    def _keep_rate(cls, value: float | str) -> float | str:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return validate_keep_rate(float(value))

    @model_validator(mode="after")
    def _auto_bounds(self) -> GatewaySettings:
        if self.auto_keep_floor > self.auto_keep_ceiling:
            raise ValueError(
                f"--auto-keep-floor ({self.auto_keep_floor}) is above --auto-keep-ceiling ({self.auto_keep_ceiling})"
            )
        return self

    @model_validator(mode="after")
    def _workers(self) -> GatewaySettings:
        if self.workers > 1 and self.embedded:
            raise ValueError(
                f"--workers {self.workers} needs --backend-url: the embedded engine lives in one process (start "
                "`specprefill engine` and point the gateway's workers at it)"
            )
        if self.workers > 1 and not self.redis_url:
            raise ValueError(
                f"--workers {self.workers} needs --redis-url: the workers share the score cache and what the "
                "engine's prefix cache holds through Redis (alone, each would guess the engine's cache from its own "
                "requests)"
            )
        return self

    @property
    def default_keep_rate(self) -> KeepRate:
        """``--keep-rate``: a fixed rate, or the auto rule with its target and bounds."""
        if self.keep_rate == "auto":
            return AutoKeepRate(self.auto_keep_target, self.auto_keep_floor, self.auto_keep_ceiling)
        return self.keep_rate

    @field_validator("cost_coefficients")
    @classmethod
    def _costs(cls, value: dict[str, list[float]] | None) -> dict[str, list[float]] | None:
        if value is not None:
            check_coefficients(value)  # a ValueError names what is missing
        return value

    @field_validator("model_alias", mode="before")
    @classmethod
    def _aliases(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            value = re.split(r"[,\s]+", value.strip())
        return [name for name in value if name]

    @field_validator("backend_url", mode="before")
    @classmethod
    def _urls(cls, value: str | list[str] | None) -> list[str]:
        """One URL, several (a list, or comma-separated as an environment variable takes them), or none."""
        if value is None:
            return []
        if isinstance(value, str):
            value = re.split(r"[,\s]+", value.strip())
        return [url.rstrip("/") for url in value if url]

    @property
    def embedded(self) -> bool:
        return not self.backend_url
