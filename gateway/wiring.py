"""Building the gateway's parts from its settings: tokenizer, draft, replicas (backend, cache model, KV events,
load, warming), score cache, planner."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from transformers import AutoConfig, PreTrainedTokenizerBase

from common.models import TokenizerMismatchError, check_same_tokenizer, load_tokenizer, tokenizer_fingerprint
from draft_worker.baselines import BaselineScorer, baseline_kind
from draft_worker.worker import DraftWorker
from gateway.engines.backends import Backend, HTTPBackend, InProcessBackend
from gateway.engines.cache import EngineCacheModel, EventEngineCache, MemoryEngineCache, RedisEngineCache
from gateway.engines.kv_events import EventSubscriber
from gateway.engines.load import EngineLoad
from gateway.engines.replicas import HealthWatch, Replica
from gateway.metrics import GatewayMetrics
from gateway.planning.calibration import calibrate
from gateway.planning.costs import cost_models
from gateway.planning.draft import DraftClient, LocalDraft, RemoteDraft
from gateway.planning.plan import Plan
from gateway.planning.planner import Planner
from gateway.planning.probe_record import ProbeRecord
from gateway.planning.score_cache import MemoryScoreCache, RedisScoreCache, ScoreCache
from gateway.planning.scores import ScoreProvider
from gateway.planning.token_mapping import MappedDraft, TokenMapping
from gateway.planning.warming import Warmer
from gateway.serving import GatewayServing, prompt_limit
from gateway.settings import AGENT_MODEL_NAMES, GatewaySettings

logger = logging.getLogger("specprefill.gateway")


class MissingModelError(ValueError):
    """The gateway was started without the models it needs."""


async def build_serving(
    settings: GatewaySettings, metrics: GatewayMetrics, draft: DraftClient | None = None, backend: Backend | None = None
) -> GatewayServing:
    """``draft`` and ``backend`` replace the configured ones (embedding, tests; ``backend`` the only replica)."""
    if settings.target_model is None or (
        settings.draft_model is None and not settings.draft_worker_url and draft is None
    ):
        raise MissingModelError(
            "set --target-model and --draft-model (or --draft-worker-url); "
            "`specprefill serve` without either serves the default real pair"
        )
    tokenizer = load_tokenizer(settings.target_model)
    own_parts = draft is None and backend is None  # as the settings say: a probe of them can be kept
    draft = draft or await _draft(settings, tokenizer, metrics)
    served = settings.served_model_name or settings.target_model
    backends = [backend] if backend is not None else _backends(settings, served)
    agents = AGENT_MODEL_NAMES if settings.agent_model_names else ()
    names = list(
        dict.fromkeys(
            n for n in (served, settings.target_model, settings.backend_model, *settings.model_alias, *agents) if n
        )
    )
    scores = ScoreProvider(draft, score_cache(settings), metrics, settings.redis_key_prefix)
    replicas = await _replicas(settings, backends, metrics)
    costs = cost_models(settings.cost_coefficients)
    metrics.expose_costs({"target": costs[0], "draft": costs[1]})
    metrics.expose_replicas(replicas)
    kind = replicas[0].backend.kind
    planner = Planner(
        settings,
        draft,
        scores,
        metrics,
        tokenizer.all_special_ids,
        costs,
        positional=kind.reads_positions,
        replicas=replicas,
    )
    for replica in replicas:
        replica.warmer = _warmer(settings, planner, replica, metrics)
    if settings.calibrate and settings.cost_coefficients is None:  # replicas of one model: the first stands for all
        record = ProbeRecord.for_settings(settings) if own_parts else None
        if record is None or not record.restore(planner):
            vocab = sorted(set(range(len(tokenizer))) - set(tokenizer.all_special_ids))
            first = _sender(replicas[0].backend)
            limit = prompt_limit(settings, tokenizer)
            if await calibrate(planner, lambda ids: first(ids, None), vocab, limit=limit) and record is not None:
                record.save(planner)
    if settings.engine_poll_interval > 0 and kind.reads_tokens:
        for replica in replicas:
            replica.load.watch(replica.backend.load, settings.engine_poll_interval)
    health = None
    if len(replicas) > 1:
        health = HealthWatch(replicas, settings.backend_health_interval)
        health.start()
    context = _context(str(settings.target_model), tokenizer)
    return GatewayServing(settings, tokenizer, draft, metrics, names, planner, health, context)


def _context(target: str, tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The target's positions: its config's, or its tokenizer's limit where smaller (or the config is not here)."""
    limits = [getattr(tokenizer, "model_max_length", None)]
    try:
        limits.append(getattr(AutoConfig.from_pretrained(target), "max_position_embeddings", None))
    except (OSError, ValueError):  # a tokenizer without the model's config beside it
        pass
    known = [n for n in limits if isinstance(n, int) and 0 < n < 10**9]
    return min(known) if known else None


def _warmer(settings: GatewaySettings, planner: Planner, replica: Replica, metrics: GatewayMetrics) -> Warmer | None:
    """The replica's warmer, where warming is on and the replica's cache is modelled."""
    cache = replica.cache
    if not settings.warming or cache is None or cache.max_blocks <= 0:
        return None
    return Warmer(
        _sender(replica.backend),
        _landed_at(planner, replica),
        replica.load,
        cache,
        planner.target_cost,
        metrics,
        piece_s=settings.warming_piece_ms / 1e3,
        priority=settings.warming_priority,
        confidence=settings.warming_confidence,
        quiet_blocks=settings.warming_quiet_blocks,
    )


async def _replicas(settings: GatewaySettings, backends: list[Backend], metrics: GatewayMetrics) -> list[Replica]:
    """One replica per backend, or per data-parallel rank of a backend whose events say it has several."""
    replicas: list[Replica] = []
    for url, backend in zip(settings.backend_url or ["in-process"], backends):
        sources = await _kv_events(settings, backend) if backend.kind.reads_tokens else {}
        ranks: list[tuple[int | None, tuple[str, str | None, str] | None]] = [
            (None, next(iter(sources.values()), None))
        ]
        if len(sources) > 1 and isinstance(backend, HTTPBackend):  # vLLM's data parallelism: one replica per rank
            ranks = [(rank, source) for rank, source in sources.items()]
            logger.info(
                "%s runs %d data-parallel ranks: each is a replica, its requests sent with X-data-parallel-rank",
                url,
                len(ranks),
            )
        for rank, source in ranks:
            each = backend.for_rank(rank) if rank is not None and isinstance(backend, HTTPBackend) else backend
            name = url if rank is None else f"{url} rank {rank}"
            replicas.append(await _replica(settings, len(replicas), name, each, source, metrics))
        if ranks[0][0] is not None:
            await backend.close()  # the ranks' backends stand for it
    return replicas


async def _replica(
    settings: GatewaySettings,
    index: int,
    url: str,
    backend: Backend,
    source: tuple[str, str | None, str] | None,
    metrics: GatewayMetrics,
) -> Replica:
    """One engine: its backend, the model of its prefix cache (followed from its KV events, ``source``, where it
    publishes them) and its load."""
    replica = Replica(index, url, backend, EngineLoad(background_yields=backend.kind.background_yields))
    if not backend.kind.reads_tokens:  # a text backend: plan as if it kept nothing
        return replica
    replica.cache = await _engine_cache(settings, backend, url, source is not None)
    if source is not None and isinstance(replica.cache, EventEngineCache):
        endpoint, replay, topic = source
        replica.events = EventSubscriber(replica.cache, endpoint, replay_endpoint=replay, topic=topic, metrics=metrics)
        replica.events.start()
    return replica


def _sender(backend: Backend) -> Callable[[Sequence[int], int | None], Awaitable[dict[str, Any]]]:
    return lambda ids, priority: _one_token(backend, ids, priority)


def _landed_at(planner: Planner, replica: Replica) -> Callable[..., Awaitable[None]]:
    """``Planner.completed`` for a warming piece that landed at ``replica``."""

    async def landed(plan: Plan, usage: dict[str, Any] | None, seconds: float, *, contended: bool = False) -> None:
        await planner.completed(plan.but(replica=replica), usage, seconds, contended=contended)

    return landed


async def _one_token(backend: Backend, token_ids: Sequence[int], priority: int | None) -> dict[str, Any]:
    """The prompt through the target, one greedy token (a warm, a probe); the completion answer."""
    params = {"max_tokens": 1, "temperature": 0.0, "stream": False, **({"priority": priority} if priority else {})}
    return await backend.completion(backend.kind.token_body(await backend.model_name(), token_ids, None, params))


async def _kv_events(settings: GatewaySettings, backend: Backend) -> dict[int, tuple[str, str | None, str]]:
    """Where to follow the backend's KV cache events (endpoint, replay endpoint, topic), by data-parallel rank:
    the settings' (one), or, with ``auto``, where the backend says it publishes them; none: the model guesses."""
    if settings.backend_kv_events == "off":
        return {}
    if settings.backend_kv_events != "auto":
        return {0: (settings.backend_kv_events, settings.backend_kv_events_replay, settings.backend_kv_events_topic)}
    found: dict[int, tuple[str, str | None, str]] = {}
    host = urlsplit(getattr(backend, "base_url", "")).hostname or "127.0.0.1"
    for key, source in (await backend.kv_event_sources()).items():
        if not str(key).isdigit() or not isinstance(source, dict) or not source.get("endpoint"):
            continue
        endpoint, replay = (_reachable(source.get(key), host) for key in ("endpoint", "replay_endpoint"))
        if endpoint is not None:
            found[int(key)] = (endpoint, replay, source.get("topic") or "")
    for rank in sorted(found)[1:]:  # each rank publishes at the first's ports plus its rank, as vLLM offsets them
        if 0 in found and found[rank][:2] == found[0][:2]:
            first, replay_first, topic = found[rank]
            found[rank] = (_offset(first, rank) or first, _offset(replay_first, rank), topic)
    for rank, (endpoint, _, _) in sorted(found.items()):
        logger.info(
            "the backend publishes its KV cache events%s: following %s",
            f" (rank {rank})" if len(found) > 1 else "",
            endpoint,
        )
    return dict(sorted(found.items()))


def _offset(endpoint: str | None, rank: int) -> str | None:
    """A tcp endpoint's port plus ``rank`` (vLLM's ``ZmqEventPublisher.offset_endpoint_port``)."""
    if endpoint is None:
        return None
    address, _, port = endpoint.rpartition(":")
    return f"{address}:{int(port) + rank}" if port.isdigit() and int(port) else endpoint


def _reachable(endpoint: str | None, host: str) -> str | None:
    """A publisher's endpoint as a subscriber here reaches it: a wildcard host (it binds every interface, as
    vLLM does with ``tcp://*:PORT``) is the backend's host."""
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    address, _, port = endpoint[len("tcp://") :].rpartition(":")
    return f"tcp://{host}:{port}" if address in ("*", "0.0.0.0", "[::]", "::") else endpoint


async def _engine_cache(settings: GatewaySettings, backend: Backend, url: str, events: bool) -> EngineCacheModel:
    """The model of the engine's prefix cache, shaped as the engine says (or as the settings override);
    followed from the engine's KV events where it publishes them."""
    shape = await backend.cache_shape()
    block_size = settings.engine_block_size or (shape[0] if shape else 16)
    capacity = settings.engine_cache_tokens if settings.engine_cache_tokens is not None else (shape[1] if shape else 0)
    logger.info(
        "engine prefix cache: %s tokens in blocks of %d%s",
        capacity,
        block_size,
        ""
        if shape or settings.engine_cache_tokens is not None
        else " (the engine did not say: set --engine-cache-tokens; until then no cache hit is expected)",
    )
    if events:
        return EventEngineCache(block_size, capacity)
    if settings.redis_url and not settings.embedded:
        key = f"{settings.redis_key_prefix}engine-cache:{url}:{await backend.model_name()}"
        return RedisEngineCache(settings.redis_url, key, block_size, capacity)
    return MemoryEngineCache(block_size, capacity)


async def _draft(settings: GatewaySettings, tokenizer: PreTrainedTokenizerBase, metrics: GatewayMetrics) -> DraftClient:
    if settings.draft_worker_url:
        draft = RemoteDraft(settings.draft_worker_url, settings.scoring_config(), timeout=settings.draft_timeout)
        if await _remote_tokenizer_matches(draft, tokenizer):
            return draft
        source = settings.draft_tokenizer or settings.draft_model
        if settings.draft_tokenizer_mapping == "off" or source is None:
            await draft.close()
            raise TokenizerMismatchError(
                "the draft workers use another tokenizer than the target: "
                + (
                    "set --draft-tokenizer-mapping auto to map their scores onto the target's tokens"
                    if source is not None
                    else "set --draft-tokenizer (the workers' tokenizer) to map their scores "
                    "onto the target's tokens, or use a draft from the target's model family"
                )
            )
        return _mapped(draft, tokenizer, load_tokenizer(source), metrics)
    if kind := baseline_kind(settings.draft_model):
        logger.info("the draft is the %s baseline: scores without a model (for evals)", kind)
        return LocalDraft(BaselineScorer(kind, settings.scoring_config()))
    assert settings.draft_model is not None  # build_serving checked it
    worker = DraftWorker.from_pretrained(
        settings.draft_model,
        settings.scoring_config(),
        device=settings.device,
        dtype=settings.dtype,
        prefix_cache_bytes=settings.draft_prefix_cache_mb << 20,
        cuda_graphs=settings.cuda_graphs,
        layers=settings.draft_layers,
    )
    if worker.tokenizer is None:
        raise MissingModelError(f"the draft model {settings.draft_model} has no tokenizer: save one beside it")
    try:
        check_same_tokenizer(worker.tokenizer, tokenizer)
    except TokenizerMismatchError as exc:
        if settings.draft_tokenizer_mapping == "off":
            raise TokenizerMismatchError(f"{exc} (or set --draft-tokenizer-mapping auto)") from None
        return _mapped(LocalDraft(worker), tokenizer, worker.tokenizer, metrics)
    return LocalDraft(worker)


def _mapped(
    draft: DraftClient,
    target_tokenizer: PreTrainedTokenizerBase,
    draft_tokenizer: PreTrainedTokenizerBase,
    metrics: GatewayMetrics,
) -> MappedDraft:
    mapping = TokenMapping(target_tokenizer, draft_tokenizer)
    logger.info(
        "the draft's tokenizer differs from the target's: it scores its own tokens of the prompt's text, "
        "and each target token takes the highest score of the draft tokens it overlaps (%s)",
        mapping.identity,
    )
    return MappedDraft(draft, mapping, on_mapped=metrics.mapping_latency.observe)


def _backends(settings: GatewaySettings, served_name: str) -> list[Backend]:
    if settings.embedded:
        from engine.serving import EngineServing
        from engine.settings import EngineSettings

        engine = EngineSettings(
            model=settings.target_model, device=settings.device, dtype=settings.dtype, served_model_name=served_name
        )
        return [InProcessBackend(EngineServing.from_settings(engine))]
    api_key = settings.backend_api_key.get_secret_value() if settings.backend_api_key else None
    return [
        HTTPBackend(
            url,
            settings.backend_kind,
            model=settings.backend_model,
            api_key=api_key,
            connect_timeout=settings.backend_connect_timeout,
            read_timeout=settings.backend_read_timeout,
        )
        for url in settings.backend_url
    ]


def score_cache(settings: GatewaySettings) -> ScoreCache | None:
    max_entry = settings.score_cache_max_entry_kb << 10
    if settings.redis_url:
        return RedisScoreCache(settings.redis_url, settings.score_cache_ttl, max_entry)
    if settings.memory_cache_mb > 0:
        return MemoryScoreCache(settings.memory_cache_mb << 20, settings.score_cache_ttl, max_entry)
    return None


async def _remote_tokenizer_matches(draft: RemoteDraft, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the draft workers that answer share the target's tokenizer (they must all share one)."""
    expected = tokenizer_fingerprint(tokenizer)
    found = {info.get("tokenizer_fingerprint") for info in (await draft.infos()).values()} - {None}
    if len(found) > 1:
        await draft.close()
        raise TokenizerMismatchError(f"the draft workers use {len(found)} different tokenizers: give them one draft")
    return not found or found == {expected}
