"""vLLM's KV cache events on the wire: both encodings vLLM has used decode, and what the reference engine
publishes is what vLLM 0.32 publishes."""

from __future__ import annotations

import msgpack
import pytest

from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch


def test_tagged_maps_round_trip():
    batch = EventBatch(
        12.5,
        [
            BlockStored([b"h1", b"h2"], None, list(range(32)), 16, [None, ("k",)], "GPU"),
            BlockRemoved([b"h0"], "GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )
    assert decode_batch(encode_batch(batch)) == batch
    fields = msgpack.unpackb(encode_batch(batch))
    assert fields[1][0]["type"] == "BlockStored" and "lora_name" not in fields[1][0]  # None fields left out


def test_vllm_0_32_bytes_decode():
    """The bytes vLLM 0.32's msgspec encoder writes (tagged structs without their defaults, the batch an array
    with the rank appended by the publisher), written out by hand."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [b"\x01" * 32],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [["0123456789abcdef0123456789abcdef"]],
        "group_idx": 0,
    }
    payload = msgpack.packb(
        [1.0, [stored, {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}, {"type": "AllBlocksCleared"}], 0]
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 0
    assert batch.events[0] == BlockStored(
        [b"\x01" * 32], None, list(range(16)), 16, [("0123456789abcdef0123456789abcdef",)], "GPU"
    )
    assert batch.events[1:] == [BlockRemoved([7], "GPU"), AllBlocksCleared()]


def test_positional_arrays_decode():
    """vLLM up to 0.10: events as arrays led by their type's name, fields in order, int block hashes."""
    payload = msgpack.packb(
        [
            2.0,
            [
                ["BlockStored", [11, 12], 10, list(range(32)), 16, None, "GPU"],
                ["BlockRemoved", [10], "GPU"],
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == [
        BlockStored([11, 12], 10, list(range(32)), 16, None, "GPU"),
        BlockRemoved([10], "GPU"),
        AllBlocksCleared(),
    ]


def test_unknown_events_are_skipped_and_garbage_is_refused():
    payload = msgpack.packb([0.0, [{"type": "SomethingNew", "x": 1}, ["AllBlocksCleared"]]])
    assert decode_batch(payload).events == [AllBlocksCleared()]
    for bad in (b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0])):
        with pytest.raises(ValueError):
            decode_batch(bad)
