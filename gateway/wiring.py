"""Building the gateway's parts from its settings: tokenizer, draft, backend, score cache, planner."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from common.models import TokenizerMismatchError, check_same_tokenizer, load_tokenizer, tokenizer_fingerprint
from draft_worker.baselines import BaselineScorer, baseline_kind
from draft_worker.worker import DraftWorker
from gateway.backends import Backend, HTTPBackend, InProcessBackend, token_body
from gateway.cache import MemoryScoreCache, RedisScoreCache, ScoreCache
from gateway.costs import cost_models
from gateway.draft import DraftClient, LocalDraft, RemoteDraft
from gateway.engine_cache import EngineCacheModel, EventEngineCache, MemoryEngineCache, RedisEngineCache
from gateway.engine_load import EngineLoad
from gateway.kv_events import EventSubscriber
from gateway.metrics import GatewayMetrics
from gateway.planner import Planner
from gateway.scores import ScoreProvider
from gateway.serving import GatewayServing, prompt_limit
from gateway.settings import GatewaySettings
from gateway.token_mapping import MappedDraft, TokenMapping
from gateway.warming import Warmer

logger = logging.getLogger("specprefill.gateway")


class MissingModelError(ValueError):
    """The gateway was started without the models it needs."""


async def build_serving(settings: GatewaySettings, metrics: GatewayMetrics, draft: DraftClient | None = None,
                        backend: Backend | None = None) -> GatewayServing:
    """``draft`` and ``backend`` replace the configured ones (embedding, tests)."""
    if settings.target_model is None or (settings.draft_model is None and not settings.draft_worker_url
                                         and draft is None):
        raise MissingModelError("set --target-model and --draft-model (or --draft-worker-url); "
                                "`specprefill serve` without either serves the demo pair")
    tokenizer = load_tokenizer(settings.target_model)
    draft = draft or await _draft(settings, tokenizer, metrics)
    served = settings.served_model_name or settings.target_model
    backend = backend or _backend(settings, served)
    names = list(dict.fromkeys(n for n in (served, settings.target_model, settings.backend_model) if n))
    scores = ScoreProvider(draft, score_cache(settings), metrics, settings.redis_key_prefix)
    source = await _kv_events(settings, backend) if backend.kind != "text" else None
    engine_cache = await _engine_cache(settings, backend, source is not None) if backend.kind != "text" else None
    events = None
    if source is not None and isinstance(engine_cache, EventEngineCache):
        endpoint, replay, topic = source
        events = EventSubscriber(engine_cache, endpoint, replay_endpoint=replay, topic=topic, metrics=metrics)
        events.start()
    costs = cost_models(settings.cost_coefficients)
    metrics.expose_costs({"target": costs[0], "draft": costs[1]})
    load = EngineLoad()
    planner = Planner(settings, draft, scores, metrics, tokenizer.all_special_ids, engine_cache, costs,
                      positional=backend.kind in ("reference", "vllm"), load=load)
    warmer = None
    if settings.warming and engine_cache is not None and engine_cache.max_blocks > 0:
        warmer = Warmer(lambda ids, priority: _one_token(backend, ids, priority), planner.completed, load,
                        engine_cache, planner.target_cost, metrics, piece_s=settings.warming_piece_ms / 1e3,
                        priority=settings.warming_priority, confidence=settings.warming_confidence)
    if settings.calibrate and settings.cost_coefficients is None:
        vocab = sorted(set(range(len(tokenizer))) - set(tokenizer.all_special_ids))
        await planner.calibrate(lambda ids: _one_token(backend, ids, None), vocab,
                                limit=prompt_limit(settings, tokenizer))
    if settings.engine_poll_interval > 0 and backend.kind != "text":
        load.watch(backend.load, settings.engine_poll_interval)
    return GatewayServing(settings, tokenizer, draft, backend, metrics, names, planner, warmer, events)


async def _one_token(backend: Backend, token_ids: list[int], priority: int | None) -> dict:
    """The prompt through the target, one greedy token (a warm, a probe); the completion answer."""
    params = {"max_tokens": 1, "temperature": 0.0, "stream": False, **({"priority": priority} if priority else {})}
    return await backend.completion(token_body(backend.kind, await backend.model_name(), token_ids, None, params))


async def _kv_events(settings: GatewaySettings, backend: Backend) -> tuple[str, str | None, str] | None:
    """Where to follow the backend's KV cache events (endpoint, replay endpoint, topic): the settings', or,
    with ``auto``, where the backend says it publishes them; None: nowhere (the model then guesses)."""
    if settings.backend_kv_events == "off":
        return None
    if settings.backend_kv_events != "auto":
        return settings.backend_kv_events, settings.backend_kv_events_replay, settings.backend_kv_events_topic
    sources = await backend.kv_event_sources()
    source = sources.get("0") or next(iter(sources.values()), None)
    if not isinstance(source, dict) or not source.get("endpoint"):
        return None
    host = urlsplit(getattr(backend, "base_url", "")).hostname or "127.0.0.1"
    endpoint, replay = (_reachable(source.get(key), host) for key in ("endpoint", "replay_endpoint"))
    if endpoint is None:
        return None
    logger.info("the backend publishes its KV cache events: following %s", endpoint)
    return endpoint, replay, source.get("topic") or ""


def _reachable(endpoint: str | None, host: str) -> str | None:
    """A publisher's endpoint as a subscriber here reaches it: a wildcard host (it binds every interface, as
    vLLM does with ``tcp://*:PORT``) is the backend's host."""
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    address, _, port = endpoint[len("tcp://"):].rpartition(":")
    return f"tcp://{host}:{port}" if address in ("*", "0.0.0.0", "[::]", "::") else endpoint


async def _engine_cache(settings: GatewaySettings, backend: Backend, events: bool) -> EngineCacheModel:
    """The model of the engine's prefix cache, shaped as the engine says (or as the settings override);
    followed from the engine's KV events where it publishes them."""
    shape = await backend.cache_shape()
    block_size = settings.engine_block_size or (shape[0] if shape else 16)
    capacity = settings.engine_cache_tokens if settings.engine_cache_tokens is not None else (shape[1] if shape else 0)
    logger.info("engine prefix cache: %s tokens in blocks of %d%s", capacity, block_size,
                "" if shape or settings.engine_cache_tokens is not None else
                " (the engine did not say: set --engine-cache-tokens; until then no cache hit is expected)")
    if events:
        return EventEngineCache(block_size, capacity)
    if settings.redis_url and not settings.embedded:
        key = f"{settings.redis_key_prefix}engine-cache:{settings.backend_url}:{await backend.model_name()}"
        return RedisEngineCache(settings.redis_url, key, block_size, capacity)
    return MemoryEngineCache(block_size, capacity)


async def _draft(settings: GatewaySettings, tokenizer, metrics: GatewayMetrics) -> DraftClient:
    if settings.draft_worker_url:
        draft = RemoteDraft(settings.draft_worker_url, settings.scoring_config(), timeout=settings.draft_timeout)
        if await _remote_tokenizer_matches(draft, tokenizer):
            return draft
        source = settings.draft_tokenizer or settings.draft_model
        if settings.draft_tokenizer_mapping == "off" or source is None:
            await draft.close()
            raise TokenizerMismatchError(
                "the draft workers use another tokenizer than the target: "
                + ("set --draft-tokenizer-mapping auto to map their scores onto the target's tokens"
                   if source is not None else "set --draft-tokenizer (the workers' tokenizer) to map their scores "
                   "onto the target's tokens, or use a draft from the target's model family"))
        return _mapped(draft, tokenizer, load_tokenizer(source), metrics)
    if kind := baseline_kind(settings.draft_model):
        logger.info("the draft is the %s baseline: scores without a model (for evals)", kind)
        return LocalDraft(BaselineScorer(kind, settings.scoring_config()))
    worker = DraftWorker.from_pretrained(settings.draft_model, settings.scoring_config(), device=settings.device,
                                         dtype=settings.dtype, prefix_cache_bytes=settings.draft_prefix_cache_mb << 20,
                                         cuda_graphs=settings.cuda_graphs)
    try:
        check_same_tokenizer(worker.tokenizer, tokenizer)
    except TokenizerMismatchError as exc:
        if settings.draft_tokenizer_mapping == "off":
            raise TokenizerMismatchError(f"{exc} (or set --draft-tokenizer-mapping auto)") from None
        return _mapped(LocalDraft(worker), tokenizer, worker.tokenizer, metrics)
    return LocalDraft(worker)


def _mapped(draft: DraftClient, target_tokenizer, draft_tokenizer, metrics: GatewayMetrics) -> MappedDraft:
    mapping = TokenMapping(target_tokenizer, draft_tokenizer)
    logger.info("the draft's tokenizer differs from the target's: it scores its own tokens of the prompt's text, "
                "and each target token takes the highest score of the draft tokens it overlaps (%s)", mapping.identity)
    return MappedDraft(draft, mapping, on_mapped=metrics.mapping_latency.observe)


def _backend(settings: GatewaySettings, served_name: str) -> Backend:
    if settings.embedded:
        from engine.serving import EngineServing
        from engine.settings import EngineSettings

        engine = EngineSettings(model=settings.target_model, device=settings.device, dtype=settings.dtype,
                                served_model_name=served_name)
        return InProcessBackend(EngineServing.from_settings(engine))
    api_key = settings.backend_api_key.get_secret_value() if settings.backend_api_key else None
    return HTTPBackend(settings.backend_url, settings.backend_kind, model=settings.backend_model, api_key=api_key,
                       connect_timeout=settings.backend_connect_timeout, read_timeout=settings.backend_read_timeout)


def score_cache(settings: GatewaySettings) -> ScoreCache | None:
    max_entry = settings.score_cache_max_entry_kb << 10
    if settings.redis_url:
        return RedisScoreCache(settings.redis_url, settings.score_cache_ttl, max_entry)
    if settings.memory_cache_mb > 0:
        return MemoryScoreCache(settings.memory_cache_mb << 20, settings.score_cache_ttl, max_entry)
    return None


async def _remote_tokenizer_matches(draft: RemoteDraft, tokenizer) -> bool:
    """Whether the draft workers that answer share the target's tokenizer (they must all share one)."""
    expected = tokenizer_fingerprint(tokenizer)
    found = {info.get("tokenizer_fingerprint") for info in (await draft.infos()).values()} - {None}
    if len(found) > 1:
        await draft.close()
        raise TokenizerMismatchError(f"the draft workers use {len(found)} different tokenizers: give them one draft")
    return not found or found == {expected}
