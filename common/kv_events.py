"""vLLM's KV cache events on the wire: what an engine's prefix cache stored and removed, as vLLM publishes them
(``--kv-events-config``: ZMQ PUB, one multipart message per batch: topic, an 8-byte big-endian sequence number,
a msgpack ``EventBatch``; a ROUTER socket replays buffered batches from a sequence number on request).

An ``EventBatch`` is an array ``[ts, events, data_parallel_rank?]``. Its events have had two encodings: positional
arrays led by their type's name (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, ...]``, vLLM up to 0.10) and maps tagged with a ``type`` field (vLLM 0.11 on). Both decode
here; the reference engine publishes the maps, as vLLM now does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message
BlockHash = bytes | int  # vLLM's ExternalBlockHash: bytes, or a 64-bit int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    extra_keys: list[tuple[Any, ...] | None] | None = None  # one per block: the positions' key (``common.blocks``), ...
    medium: str | None = None  # "GPU" (the engine's own cache), or an offloading tier's "CPU" / "STORAGE"
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[Event] = field(default_factory=list)
    data_parallel_rank: int | None = None


# the fields of each event in vLLM's order: the positional encoding, and the names of the tagged one
_ORDER = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def encode_batch(batch: EventBatch) -> bytes:
    """The batch as vLLM 0.11+ publishes it: an array, its events tagged maps (fields left at None omitted)."""
    events = []
    for event in batch.events:
        body = {"type": type(event).__name__}
        body.update(
            {
                name: getattr(event, name)
                for name in _ORDER[type(event).__name__]
                if getattr(event, name, None) is not None
            }
        )
        events.append(body)
    fields: list[Any] = [batch.ts, events]
    if batch.data_parallel_rank is not None:
        fields.append(batch.data_parallel_rank)
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed


def decode_batch(payload: bytes) -> EventBatch:
    """A published batch, in either encoding; events of types this does not know are skipped. Raises
    ``ValueError`` for what is not a batch."""
    try:
        fields = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ValueError(f"not a KV event batch: {exc}") from exc
    if not isinstance(fields, list) or len(fields) < 2 or not isinstance(fields[1], list):
        raise ValueError("not a KV event batch: expected [ts, events, data_parallel_rank?]")
    events = [e for raw in fields[1] if (e := _event(raw)) is not None]
    return EventBatch(float(fields[0]), events, fields[2] if len(fields) > 2 else None)


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        kind, values = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        values = dict(zip(_ORDER.get(kind, ()), raw[1:]))
    else:
        return None
    if kind == "BlockStored":
        extra = values.get("extra_keys")
        return BlockStored(
            list(values["block_hashes"]),
            values.get("parent_block_hash"),
            list(values["token_ids"]),
            int(values["block_size"]),
            [tuple(k) if isinstance(k, list) else k for k in extra] if extra is not None else None,
            values.get("medium"),
            values.get("lora_name"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(list(values["block_hashes"]), values.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None
