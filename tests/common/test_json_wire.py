"""The wire's JSON: orjson where it can, the standard library where orjson declines, the same JSON either way."""

from __future__ import annotations

import json

import pytest

from common.json_wire import WireJSONResponse, dumps, loads


def test_what_orjson_writes_is_what_the_standard_library_reads_back():
    event = {"id": "x", "choices": [{"index": 0, "delta": {"content": 'é ✓ \n"q"'}, "finish_reason": None}]}
    assert json.loads(dumps(event)) == event
    assert dumps({"a": [1, 2.5, True]}) == json.dumps({"a": [1, 2.5, True]}, separators=(",", ":")).encode()
    assert "é".encode() in dumps({"t": "é"})  # UTF-8, as vLLM writes it, not \u escapes


def test_what_orjson_declines_the_standard_library_answers():
    assert loads(dumps({"big": 2**70})) == {"big": 2**70}  # past 64 bits
    assert loads(dumps({1: "a"})) == {"1": "a"}  # a key that is not a string
    assert loads(b'{"x": NaN}')["x"] != loads(b'{"x": NaN}')["x"]  # NaN, which vLLM's logprobs can carry
    assert loads('"\\ud800"') == "\ud800"  # an unpaired surrogate escape
    assert loads(memoryview(b"[1]")) == [1]
    with pytest.raises(ValueError):
        loads(b"data: not json")


def test_an_answer_renders_through_the_same_encoder():
    assert WireJSONResponse({"token_ids": [1, 2], "t": "é"}).body == dumps({"token_ids": [1, 2], "t": "é"})
