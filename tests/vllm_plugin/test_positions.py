"""The plugin's position logic, pure (no vLLM needed)."""

from __future__ import annotations

import pytest

from specprefill_vllm.positions import PositionError, block_key, check_positions, expand, requested_positions


class Params:
    def __init__(self, extra_args):
        self.extra_args = extra_args


def test_requested_positions():
    assert requested_positions(Params({"position_ids": [0, 5]})) == [0, 5]
    assert requested_positions(Params(None)) is None and requested_positions(None) is None


@pytest.mark.parametrize(
    "positions,n,max_tokens,match",
    [
        ([0, 1], 3, 1, "2 entries for 3"),
        ([0, 2, 2], 3, 1, "strictly increasing"),
        ([-1, 2, 3], 3, 1, "non-negative"),
        ([0, 1, 100], 3, 1, "below the model's"),
        ([0, 1, 95], 3, 10, "at most 4 tokens"),
        ([0, 1.5, 3], 3, 1, "integers"),
        ([0, True, 3], 3, 1, "integers"),
    ],
)
def test_bad_positions(positions, n, max_tokens, match):
    with pytest.raises(PositionError, match=match):
        check_positions(positions, n, 100, max_tokens)


def test_good_positions_and_expansion():
    check_positions([0, 1, 50, 51], 4, 100, 48)
    assert expand(None, 3) == ([0, 1, 2], 0)
    # after a preemption the "prompt" holds earlier outputs too: they continue after the last position
    assert expand([0, 1, 50, 51], 6) == ([0, 1, 50, 51, 52, 53], 48)


def test_block_keys_only_where_positions_differ():
    positions = list(range(32)) + list(range(100, 132))
    assert block_key(positions, 0, 16) is None and block_key(positions, 16, 32) is None
    assert block_key(positions, 32, 48) is not None
    assert block_key(positions, 32, 48) != block_key(list(range(32)) + list(range(101, 133)), 32, 48)
    assert block_key(positions, 64, 80) is not None  # generated tokens after the prompt
    assert block_key(None, 32, 48) is None


def test_the_engines_block_key_is_the_plugins():
    """The gateway matches blocks from vLLM's KV events by the key the plugin adds to vLLM's block hash; the
    plugin imports nothing of ours, so the rule is written twice and held equal here."""
    from common.blocks import block_keys

    positions = list(range(20)) + list(range(57, 101)) + list(range(400, 444))
    tokens = list(range(len(positions)))
    for index, (_, extra) in enumerate(block_keys(tokens, positions, 16)):
        key = block_key(positions, 16 * index, 16 * (index + 1))
        assert extra == (None if key is None else (key,))
    assert [e for _, e in block_keys(tokens[16:], positions[16:], 16, offset=16)] == [
        e for _, e in block_keys(tokens, positions, 16)
    ][1:]
