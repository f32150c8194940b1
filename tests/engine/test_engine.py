"""The reference engine over real HTTP: positions honoured, OpenAI shapes, bad input, concurrency, disconnects."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch

from common.models import load_causal_lm, load_tokenizer
from engine.engine import ReferenceEngine
from engine.prefix_cache import PrefixCache
from engine.sampling import SamplingParams
from tests.helpers import disconnects_release_the_engine, engine_app, reference_logits, serve


@pytest.fixture(scope="module")
def target(model_pair):
    return load_causal_lm(model_pair / "target", device="cpu", attn_implementation="eager")


@pytest.fixture(scope="module")
def engine_url(model_pair):
    with serve(engine_app(model_pair)) as url:
        yield url


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=g).tolist()


def _gapped(n_total: int = 400, seed: int = 0) -> tuple[list[int], list[int]]:
    """Kept tokens of a longer prompt at their original positions, ending with the last one."""
    prompt = _prompt(n_total, seed)
    positions = list(range(0, 50)) + list(range(170, 230)) + list(range(n_total - 40, n_total))
    return [prompt[p] for p in positions], positions


def _complete(url: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_first_token_logprobs_match_a_plain_forward_at_the_same_positions(engine_url, target, model_pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_pair / "target")
    ids, positions = _gapped()
    answer = _complete(
        engine_url, prompt=ids, position_ids=positions, max_tokens=1, temperature=0, logprobs=20, return_token_ids=True
    )
    choice = answer["choices"][0]
    expected = torch.log_softmax(reference_logits(target, ids, positions), -1)
    assert choice["token_ids"] == [int(expected.argmax())]
    assert abs(choice["logprobs"]["token_logprobs"][0] - float(expected.max())) <= 1e-4
    by_text: dict[str, list[float]] = {}
    for token_id, value in enumerate(expected.tolist()):
        by_text.setdefault(tokenizer.decode([token_id]), []).append(value)
    top = choice["logprobs"]["top_logprobs"][0]
    assert len(top) >= 10
    for text, value in top.items():
        assert min(abs(value - v) for v in by_text[text]) <= 1e-4, text
    # positions matter: the same tokens at contiguous positions give other log-probabilities
    contiguous = torch.log_softmax(reference_logits(target, ids, list(range(len(ids)))), -1)
    assert (contiguous - expected).abs().max() > 1e-2


def test_vllm_xargs_positions_are_read_too(engine_url):
    ids, positions = _gapped(seed=1)
    top_level = _complete(
        engine_url, prompt=ids, position_ids=positions, max_tokens=4, temperature=0, return_token_ids=True
    )
    xargs = _complete(
        engine_url,
        prompt=ids,
        vllm_xargs={"position_ids": positions},
        max_tokens=4,
        temperature=0,
        return_token_ids=True,
    )
    assert top_level["choices"][0]["token_ids"] == xargs["choices"][0]["token_ids"]


def test_the_swap_equals_sending_the_kept_tokens(engine_url, model_pair):
    """A swap on the engine's own tokenisation of a text prompt runs exactly the kept tokens at their positions."""
    text = "Bafu anbe zadubu " * 30
    ids = load_tokenizer(model_pair / "target")(text).input_ids  # with BOS, as the engine adds it
    positions = list(range(5)) + list(range(40, len(ids)))
    kept = [ids[p] for p in positions]
    swapped = _complete(
        engine_url,
        prompt=text,
        max_tokens=4,
        temperature=0,
        return_token_ids=True,
        vllm_xargs={"kept_token_ids": kept, "position_ids": positions},
    )
    direct = _complete(
        engine_url, prompt=kept, position_ids=positions, max_tokens=4, temperature=0, return_token_ids=True
    )
    whole = _complete(engine_url, prompt=text, max_tokens=4, temperature=0, return_token_ids=True)
    assert swapped["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
    assert swapped["usage"]["prompt_tokens"] == len(kept) < whole["usage"]["prompt_tokens"] == len(ids)


def test_n_penalties_and_logit_bias(engine_url):
    base = {"prompt": _prompt(40), "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    greedy = _complete(engine_url, **base)["choices"][0]["token_ids"]
    # negative penalties reward what was generated: greedy output that did not repeat now does
    rewarded = _complete(engine_url, **base, presence_penalty=-2.0, frequency_penalty=-2.0)["choices"][0]["token_ids"]
    assert len(set(rewarded)) < len(set(greedy)) and rewarded[0] == greedy[0]
    forced = _complete(engine_url, **base, logit_bias={"7": 100})["choices"][0]["token_ids"]
    assert forced == [7] * 8
    two = _complete(engine_url, **{**base, "temperature": 1.0, "seed": 3}, n=2)["choices"]
    assert [c["index"] for c in two] == [0, 1] and two[0]["token_ids"] != two[1]["token_ids"]


def test_greedy_generation_continues_after_the_last_kept_position(engine_url, target):
    ids, positions = _gapped(seed=2)
    n_new = 12
    answer = _complete(
        engine_url, prompt=ids, position_ids=positions, max_tokens=n_new, temperature=0, return_token_ids=True
    )
    generated: list[int] = []
    next_position = positions[-1] + 1
    eos = set(target.generation_config.eos_token_id)
    for step in range(n_new):  # step by step, full recompute, generated tokens at L, L+1, ...
        all_positions = positions + list(range(next_position, next_position + step))
        token = int(reference_logits(target, ids + generated, all_positions).argmax())
        generated.append(token)
        if token in eos:
            break
    assert answer["choices"][0]["token_ids"] == generated


def test_without_positions_greedy_equals_generate(engine_url, target):
    ids = _prompt(120, seed=3)
    answer = _complete(engine_url, prompt=ids, max_tokens=10, temperature=0, return_token_ids=True)
    expected = target.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids) :].tolist()
    eos = set(target.generation_config.eos_token_id)
    expected = expected[: next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))]
    assert answer["choices"][0]["token_ids"] == expected
    assert answer["usage"] == {
        "prompt_tokens": 120,
        "completion_tokens": len(expected),
        "prompt_tokens_details": {"cached_tokens": 0},
        "total_tokens": 120 + len(expected),
    }


def test_text_prompt_stream_usage_and_logprobs(engine_url):
    body = {
        "prompt": "Bafu anbe zadubu",
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 2,
    }
    with httpx.stream("POST", f"{engine_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(chunks) - 1
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(len(c["choices"][0]["logprobs"]["tokens"]) == 1 for c in chunks[:-1])
    plain = _complete(engine_url, prompt="Bafu anbe zadubu", max_tokens=6, temperature=0)
    assert plain["choices"][0]["text"] == "".join(c["choices"][0]["text"] for c in chunks[:-1])


def test_seeded_sampling_is_reproducible_and_stop_strings_cut(engine_url):
    body = {"prompt": _prompt(50), "max_tokens": 20, "temperature": 1.0, "top_p": 0.9, "seed": 7}
    first, second = _complete(engine_url, **body), _complete(engine_url, **body)
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    text = first["choices"][0]["text"]
    assert len(text) > 4, "pick another seed: the sample is too short to cut"
    stop = text[2:4]
    cut = _complete(engine_url, **body, stop=[stop])
    assert cut["choices"][0]["text"] == text[: text.find(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


BAD_REQUESTS = [
    ({"prompt": [5, 10**6]}, "prompt"),
    ({"prompt": [5, -1]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [5, 6, 7], "position_ids": [0, 1]}, "position_ids"),
    ({"prompt": [5, 6, 7], "position_ids": [0, 2, 2]}, "position_ids"),
    ({"prompt": [5, 6, 7], "position_ids": [3, 2, 5]}, "position_ids"),
    ({"prompt": [5, 6, 7], "position_ids": [-1, 2, 5]}, "position_ids"),
    ({"prompt": [5, 6, 7], "position_ids": [0, 1, 4096]}, "position_ids"),
    ({"prompt": [5, 6, 7], "position_ids": [0, 1, 4095]}, "max_tokens"),
    ({"prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [5, 6], "max_tokens": -3}, "max_tokens"),
    ({"prompt": [5, 6], "temperature": -1}, "temperature"),
    ({"prompt": [5, 6], "n": 0}, "n"),
    ({"prompt": [5, 6], "suffix": "x"}, "suffix"),
    ({"prompt": [5, 6], "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": [5, 6], "response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    (
        {"prompt": [5, 6, 7], "vllm_xargs": {"kept_token_ids": [5, 8], "position_ids": [0, 2]}},
        "vllm_xargs.kept_token_ids",
    ),
    (
        {"prompt": [5, 6, 7], "vllm_xargs": {"kept_token_ids": [5, 6], "position_ids": [0, 1]}},
        "vllm_xargs.kept_token_ids",
    ),
    ({"prompt": [5, 6, 7], "vllm_xargs": {"kept_token_ids": [5, 7], "position_ids": [0]}}, "vllm_xargs.kept_token_ids"),
    ({"prompt": [[5, 6], [7]]}, "prompt"),
    ({"prompt": [5, 6], "model": "nope"}, "model"),
    ({}, "prompt"),
]


def test_max_tokens_past_the_positions_is_lowered_to_what_fits(engine_url):
    """As vLLM does: coding agents ask for 32,000-128,000 tokens whatever the context left."""
    answer = _complete(
        engine_url, prompt=[5, 6, 7], position_ids=[0, 1, 4090], max_tokens=100, ignore_eos=True, return_token_ids=True
    )
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("body,param", BAD_REQUESTS)
def test_bad_input_is_a_4xx_in_openai_shape_and_the_engine_keeps_serving(engine_url, body, param):
    response = httpx.post(f"{engine_url}/v1/completions", json=body, timeout=30)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    assert _complete(engine_url, prompt=[5, 6, 7], max_tokens=1)["choices"][0]["finish_reason"]


def test_malformed_json_is_a_400(engine_url):
    response = httpx.post(
        f"{engine_url}/v1/completions", content=b"{not json", timeout=30, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


async def test_concurrent_requests_do_not_corrupt_each_other(engine_url):
    prompts = [_gapped(seed=s) for s in range(6)]
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(ids, positions):
            r = await client.post(
                f"{engine_url}/v1/completions",
                json={
                    "prompt": ids,
                    "position_ids": positions,
                    "max_tokens": 8,
                    "temperature": 0,
                    "return_token_ids": True,
                },
            )
            return r.json()["choices"][0]["token_ids"]

        together = await asyncio.gather(*(one(*p) for p in prompts))
        alone = [await one(*p) for p in prompts]
    assert together == alone


def test_models_and_health(engine_url):
    assert httpx.get(f"{engine_url}/v1/models").json()["data"][0]["id"] == "target"
    assert httpx.get(f"{engine_url}/health").json()["status"] == "ok"


async def test_disconnects_stop_generation(engine_url):
    body = {"prompt": _prompt(64), "max_tokens": 3000, "temperature": 0.8, "ignore_eos": True}
    await disconnects_release_the_engine(f"{engine_url}/v1/completions", body, engine_url)


async def test_a_full_queue_answers_503_with_retry_after(model_pair):
    app = engine_app(model_pair, max_running=1, max_waiting=1)
    with serve(app) as url:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"prompt": _prompt(64), "max_tokens": 300, "temperature": 0.8, "ignore_eos": True}
            responses = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body) for _ in range(4)))
        statuses = sorted(r.status_code for r in responses)
        assert statuses[0] == 200 and statuses[-1] == 503
        rejected = next(r for r in responses if r.status_code == 503)
        assert rejected.headers["retry-after"] == "1" and rejected.json()["error"]["code"] == "queue_full"
        assert httpx.post(f"{url}/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code == 200


def test_ignore_eos_generates_exactly_max_tokens(engine_url):
    answer = _complete(engine_url, prompt=_prompt(30, seed=9), max_tokens=40, temperature=1.0, seed=1, ignore_eos=True)
    assert answer["usage"]["completion_tokens"] == 40 and answer["choices"][0]["finish_reason"] == "length"


async def test_chunked_prefill_equals_one_prefill(model_pair, target):
    ids, positions = _gapped(seed=11)
    results = []
    for chunk in (7, 4096):
        engine = ReferenceEngine(target, load_tokenizer(model_pair / "target"), prefill_chunk=chunk)
        steps = [
            s async for s in engine.generate(ids, positions, SamplingParams(max_tokens=6, temperature=0, logprobs=0))
        ]
        engine.close()
        results.append(([s.token_id for s in steps], [s.logprob for s in steps]))
    assert results[0][0] == results[1][0]
    assert max(abs(a - b) for a, b in zip(results[0][1], results[1][1])) <= 1e-4


async def test_background_requests_prefill_in_small_chunks(model_pair, target, monkeypatch):
    """A background request (priority > 0, as warming) prefills in small chunks, so that a new request waits at
    most one of them; a foreground one in full chunks. Either way the answer is the same."""
    import engine.engine as engine_module

    chunks: list[int] = []
    real = engine_module.prefill

    def counting(model, ids, *args, **kwargs):
        chunks.append(ids.shape[1])
        return real(model, ids, *args, **kwargs)

    monkeypatch.setattr(engine_module, "prefill", counting)
    ids, positions = _gapped(seed=12)
    engine = ReferenceEngine(
        target, load_tokenizer(model_pair / "target"), prefill_chunk=4096, background_prefill_chunk=64
    )
    answers = {}
    for priority in (0, 1):
        chunks.clear()
        params = SamplingParams(max_tokens=1, temperature=0, logprobs=0)
        answers[priority] = [s.logprob async for s in engine.generate(ids, positions, params, priority=priority)]
        assert max(chunks) == (len(ids) if priority == 0 else 64)
    engine.close()
    assert answers[0] == pytest.approx(answers[1], abs=1e-4)


def test_a_prefill_that_yields_leaves_the_cache_as_it_was(target):
    """Stopped between layers, a chunk's keys and values come out of the layers that ran; run again, it gives
    what one uninterrupted prefill gives."""
    from engine.runner import Yielded, prefill

    ids, positions = _gapped(seed=13)
    ids, positions = torch.tensor([ids]), torch.tensor([positions])
    whole, _ = prefill(target, ids, positions)
    logits, cache = prefill(target, ids[:, :100], positions[:, :100])
    asked = []
    with pytest.raises(Yielded):
        prefill(target, ids[:, 100:], positions[:, 100:], cache, should_yield=lambda: asked.append(1) or len(asked) > 1)
    assert len(asked) == 2  # the first layer ran, the second did not
    assert [layer.get_seq_length() for layer in cache.layers] == [100] * len(cache.layers)
    resumed, cache = prefill(target, ids[:, 100:], positions[:, 100:], cache, should_yield=lambda: False)
    assert cache.get_seq_length() == ids.shape[1]
    assert torch.allclose(resumed, whole, atol=1e-4)


async def test_a_background_chunk_yields_to_a_new_request_between_layers(model_pair, target, monkeypatch):
    """A request that arrives while a background chunk (warming) runs waits for one layer, not the chunk: the
    chunk stops, the request runs, the chunk runs again. Both answers are what each gets alone."""
    import engine.engine as engine_module

    real = engine_module.prefill
    started = threading.Event()

    def waits_for_a_request(model, ids, *args, should_yield=None, **kwargs):
        if should_yield is not None and not started.is_set():  # the background chunk: hold it until one comes
            started.set()
            deadline = time.monotonic() + 10
            while not should_yield() and time.monotonic() < deadline:
                time.sleep(0.005)
        return real(model, ids, *args, should_yield=should_yield, **kwargs)

    params = SamplingParams(max_tokens=3, temperature=0, logprobs=0)
    background, foreground = _gapped(seed=14), _gapped(seed=15)
    engine = ReferenceEngine(
        target, load_tokenizer(model_pair / "target"), prefill_chunk=4096, background_prefill_chunk=4096
    )
    alone = [[(s.token_id, s.logprob) async for s in engine.generate(*p, params)] for p in (background, foreground)]
    monkeypatch.setattr(engine_module, "prefill", waits_for_a_request)
    yields, order = [], []
    engine.on_yielded = lambda: yields.append(1)

    async def run(prompt, priority, name):
        steps = [(s.token_id, s.logprob) async for s in engine.generate(*prompt, params, priority=priority)]
        order.append(name)
        return steps

    task = asyncio.ensure_future(run(background, 10, "background"))
    await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
    together = [await run(foreground, 0, "foreground"), await task]
    engine.close()
    assert yields and order == ["foreground", "background"]
    for got, want in zip(together, alone[::-1]):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)


async def test_a_prefix_cache_that_cannot_keep_the_blocks_stops_nothing(model_pair, target, monkeypatch, caplog):
    """Keeping a finished request's blocks is optional: a store that fails (the device out of memory for the
    copies) is logged, and the next request is served."""
    engine = ReferenceEngine(target, load_tokenizer(model_pair / "target"), prefix_cache=PrefixCache(4096))

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (a test)")

    monkeypatch.setattr(engine.prefix_cache, "store", out_of_memory)
    params = SamplingParams(max_tokens=2, temperature=0)

    async def answer(seed: int) -> list:
        return [s async for s in engine.generate(*_gapped(seed=seed), params)]

    for seed in (16, 17):  # without the engine thread the second would wait for ever
        steps = await asyncio.wait_for(answer(seed), 60)
        assert steps[-1].finish_reason == "length"
    engine.close()
    assert "could not keep a finished request's blocks" in caplog.text
