"""The planner's choices, in process: a draft whose scores a test sets, fixed cost models, the engine-cache model.

Costs are a 30x-the-draft target, as for a large model, so that compression pays on these prompt sizes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import numpy as np
import pytest
import torch

from common.models import load_causal_lm, load_tokenizer
from common.selection import select_tokens
from draft_worker import ScoringConfig
from engine.engine import ReferenceEngine
from engine.sampling import SamplingParams
from gateway.app import create_app
from gateway.engines.cache import MemoryEngineCache
from gateway.engines.load import EngineLoad
from gateway.engines.replicas import Replica
from gateway.metrics import GatewayMetrics
from gateway.planning.calibration import calibrate
from gateway.planning.costs import cost_models
from gateway.planning.plan import Plan
from gateway.planning.planner import Planner
from gateway.planning.policy import RequestOptions
from gateway.planning.scores import ScoreProvider
from gateway.planning.warming import Warmer
from gateway.settings import GatewaySettings
from specprefill_lab.bench import parse_server_timing
from tests.gateway.planning import plan_prompt
from tests.helpers import (
    LONG_DOC,
    FCFSEngine,
    RecordingApp,
    engine_app,
    eventually,
    gateway_settings,
    gateway_settled,
    requests_with_gaps,
    serve,
)

COSTS = {"target": [0.01, 1e-3, 1e-6, 3e-8], "draft": [0.002, 3e-5, 1e-9, 1e-6]}
CHUNK = 16


class FakeDraft:
    config = ScoringConfig(chunk_size=CHUNK, protect_first=0, protect_last=1)
    score_params = (8, 13)
    max_prompt_tokens = 10**6

    def __init__(self) -> None:
        self.calls = 0
        self.peaks: list[int] = []  # chunks that score high; the rest score low
        self.values: dict[int, float] = {}  # chunks with a score of their own

    async def identity(self) -> str:
        return "fake"

    async def score(self, token_ids: list[int]) -> torch.Tensor:
        self.calls += 1
        scores = torch.full((len(token_ids),), 0.01)
        scores += torch.linspace(0, 0.001, len(token_ids))  # ties broken, stably
        for chunk in self.peaks:
            scores[chunk * CHUNK : (chunk + 1) * CHUNK] = 1.0
        for chunk, value in self.values.items():
            scores[chunk * CHUNK : (chunk + 1) * CHUNK] = value
        return scores

    def reusable_prefix(self, token_ids: list[int]) -> int:
        return 0

    async def close(self) -> None:
        return None


def _planner(**settings) -> tuple[Planner, FakeDraft]:
    values = dict(target_model="t", draft_model="d", min_prompt_tokens=64, cost_coefficients=COSTS)
    values.update(settings)
    draft = FakeDraft()
    metrics = GatewayMetrics()
    settings = GatewaySettings(**values)
    replica = Replica(0, "in-process", None, EngineLoad(), MemoryEngineCache(16, 1 << 20))
    planner = Planner(
        settings,
        draft,
        ScoreProvider(draft, None, metrics),
        metrics,
        (),
        cost_models(settings.cost_coefficients),
        replicas=[replica],
    )
    return planner, draft


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(10, 5000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


OPTIONS = RequestOptions(keep_rate=0.3, enabled=True)


async def test_a_cold_prompt_is_compressed_afresh():
    planner, draft = _planner()
    plan = await plan_prompt(planner, _ids(4000, 1), OPTIONS, [])
    assert (plan.status, plan.kind, draft.calls) == ("compressed", "fresh", 1)
    assert 0.25 < plan.kept_tokens / plan.original_tokens < 0.35 and plan.engine_cached == 0


async def test_a_prompt_the_engine_holds_goes_whole_without_the_draft():
    planner, draft = _planner()
    document = _ids(4000, 2)
    await planner.replicas[0].cache.record(document, None)  # a warm, say
    plan = await plan_prompt(planner, document + _ids(30, 3), OPTIONS, [])
    assert (plan.status, plan.reason, plan.kind, draft.calls) == ("bypassed", "cached", "whole", 0)
    assert plan.engine_cached == 4000
    # without --whole-when-cached it is priced like any plan, and whole is cheapest here too
    priced, _ = _planner(whole_when_cached=0.0)
    await priced.replicas[0].cache.record(document, None)
    plan = await plan_prompt(priced, document + _ids(30, 3), OPTIONS, [])
    assert (plan.reason, plan.kind) == ("cheaper_whole", "whole")
    # the paper's planner compresses it anyway
    fresh, _ = _planner(planner="fresh")
    await fresh.replicas[0].cache.record(document, None)
    assert (await plan_prompt(fresh, document + _ids(30, 3), OPTIONS, [])).kind == "fresh"


async def test_only_contexts_likely_to_come_back_are_marked_for_warming():
    """A new document is not worth warming (it would cost the engine a whole prefill for nothing); a prompt
    with a system prompt, or one that begins with most of an earlier prompt, is."""
    planner, _ = _planner()
    document = _ids(4000, 30)
    first = await plan_prompt(planner, document, OPTIONS, [])
    await planner.completed(first, None, 1.0)
    assert first.status == "compressed" and not first.recurring
    again = await plan_prompt(planner, document + _ids(40, 31), OPTIONS, [])
    assert again.status == "compressed" and again.recurring
    other = await plan_prompt(planner, _ids(4000, 32), OPTIONS, [])
    assert other.status == "compressed" and not other.recurring
    system = torch.zeros(4000, dtype=torch.bool)
    system[:500] = True
    assert (await plan_prompt(planner, _ids(4000, 33), OPTIONS, [], system)).recurring


async def test_a_growing_context_extends_the_earlier_selection():
    planner, _ = _planner()
    first_prompt = _ids(4000, 4)
    first = await plan_prompt(planner, first_prompt, OPTIONS, [])
    await planner.completed(first, None, 1.0)
    second = await plan_prompt(planner, first_prompt + _ids(1500, 5), OPTIONS, [])
    assert second.kind == "extend" and second.status == "compressed"
    start = (4000 // CHUNK) * CHUNK
    assert [i for i in second.position_ids if i < start] == [i for i in first.position_ids if i < start]
    assert second.engine_cached >= 0.9 * sum(1 for i in first.position_ids if i < start) - 16
    assert second.kept_tokens >= 0.29 * second.original_tokens  # never fewer than the keep rate asks


async def test_an_earlier_selection_that_misses_what_matters_now_is_not_reused():
    planner, draft = _planner()
    first_prompt = _ids(4000, 6)
    draft.peaks = [10, 20]
    first = await plan_prompt(planner, first_prompt, OPTIONS, [])
    await planner.completed(first, None, 1.0)
    assert all(10 * CHUNK + i in first.position_ids for i in range(CHUNK))
    draft.peaks = [150, 200]  # the new last token attends elsewhere: chunks the first selection dropped
    assert 150 * CHUNK not in first.position_ids
    second = await plan_prompt(planner, first_prompt + _ids(1500, 7), OPTIONS, [])
    assert second.kind == "fresh"
    assert 150 * CHUNK in second.position_ids and 200 * CHUNK in second.position_ids
    # reused below a lower keep rate would keep fewer tokens than asked: never
    lower, _ = _planner()
    first = await plan_prompt(lower, first_prompt, RequestOptions(keep_rate=0.1, enabled=True), [])
    await lower.completed(first, None, 1.0)
    assert (await plan_prompt(lower, first_prompt + _ids(1500, 7), OPTIONS, [])).kind == "fresh"


async def test_a_system_prompt_stays_whole_where_affordable():
    planner, _ = _planner()
    prompt = _ids(4000, 8)
    short = torch.zeros(4000, dtype=torch.bool)
    short[:200] = True
    plan = await plan_prompt(planner, prompt, OPTIONS, [], short)
    assert plan.kind == "fresh" and plan.protected and set(range(200)) <= set(plan.position_ids)
    long = torch.zeros(4000, dtype=torch.bool)
    long[:3500] = True  # a long system prompt the engine has not seen: keeping it whole costs far more
    plan = await plan_prompt(planner, prompt, OPTIONS, [], long)
    assert plan.kind == "fresh" and not plan.protected and plan.kept_tokens < 0.5 * 4000
    await planner.replicas[0].cache.record(prompt[:3520], None)  # warmed: the system prompt now stays whole
    plan = await plan_prompt(planner, prompt, OPTIONS, [], long)
    assert plan.kind == "fresh" and plan.protected and set(range(3500)) <= set(plan.position_ids)
    assert plan.engine_cached >= 3488 and plan.kept_tokens < 3500 + 0.5 * 500


async def test_the_outcome_teaches_the_cost_model_and_the_cache_model():
    planner, _ = _planner(cost_coefficients=None)
    prompt = _ids(3000, 9)
    plan = await plan_prompt(planner, prompt, OPTIONS, [])
    before = planner.target_cost.coefficients.copy()
    sent = plan.kept_token_ids()
    await planner.completed(plan, {"prompt_tokens_details": {"cached_tokens": 0}}, 0.5)
    assert await planner.replicas[0].cache.cached_tokens(sent, plan.position_ids) == (len(sent) - 1) // 16 * 16
    for seconds in (0.6, 0.7, 0.8):
        await planner.completed(plan, None, seconds)
    assert not (planner.target_cost.coefficients == before).all()
    fixed, _ = _planner()
    for seconds in (0.6, 0.7, 0.8):
        await fixed.completed(plan, None, seconds)
    assert fixed.target_cost.coefficients.tolist() == COSTS["target"]  # given coefficients stay


async def test_a_plan_carries_the_array_it_was_priced_with():
    """The prompt is converted to an array once a request (1-2 ms of the event loop for an agent's 35,000
    tokens): what the planner priced is what the cache model records, and what any later step reads."""
    planner, _ = _planner()
    prompt = _ids(3000, 10)
    plan = await plan_prompt(planner, prompt, OPTIONS, [])
    assert plan.tokens is not None and plan.token_array() is plan.tokens
    assert plan.token_array().tolist() == prompt and plan.kept_array().tolist() == plan.kept_token_ids()
    assert plan.but(status="x") == plan.but(status="x", tokens=None)  # the array is no part of what a plan is
    made = plan.but(tokens=None)  # a plan made elsewhere (a warm's piece): converted where asked
    assert made.token_array().tolist() == prompt and made.kept_array().tolist() == plan.kept_token_ids()


async def test_a_plan_holds_only_immutable_values():
    """Frozen, and nothing inside it changes either: token IDs and kept positions as tuples, whatever sequence
    they came from; its token array read-only, while the prompt's own array stays writable; a plan hashes."""
    planner, _ = _planner()
    prompt = _ids(3000, 10)
    plan = await plan_prompt(planner, prompt, OPTIONS, [])
    assert plan.status == "compressed" and isinstance(plan.position_ids, tuple)
    assert isinstance(plan.token_ids, tuple) and list(plan.token_ids) == prompt
    assert plan.tokens is not None and not plan.tokens.flags.writeable
    with pytest.raises(ValueError):
        plan.tokens[0] = 1
    made = Plan([1, 2, 3], position_ids=[0, 2], tokens=(array := np.arange(1, 4)))
    assert (made.token_ids, made.position_ids) == ((1, 2, 3), (0, 2)) and array.flags.writeable
    assert made.kept_array().tolist() == [1, 3] and hash(made) == hash(made.but())
    mutable = [f.name for f in dataclasses.fields(Plan) if any(k in str(f.type) for k in ("list", "dict", "set"))]
    assert not mutable, f"Plan fields of a mutable type: {mutable}"


def test_no_plan_changes_an_answer(model_pair, tmp_path):
    """Through a live gateway (cost planner, warming, an engine with its prefix cache): a fresh selection, an
    extension, the whole prompt after warming, and an extension again each answer exactly as a fresh engine
    without a cache does when fed the same tokens at the same positions."""
    engine = RecordingApp(engine_app(model_pair, block_size=16))
    oracle = ReferenceEngine(load_causal_lm(model_pair / "target", device="cpu"), load_tokenizer(model_pair / "target"))
    with serve(engine) as engine_url:
        settings = gateway_settings(
            model_pair,
            backend_url=engine_url,
            planner="cost",
            warming=True,
            cost_coefficients=COSTS,
            reuse_threshold=0.0,
        )
        with serve(create_app(settings)) as gw:
            requests_with_gaps(gw)
            document = LONG_DOC * 2  # about 3,000 tokens of the 4,096 positions
            body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "logprobs": 3, "ignore_eos": True}
            # the second turn begins like the first: a context that comes back, so it is warmed
            turns = [
                document,
                document + " And one more question?",
                document + " And another one?",
                document + " " + LONG_DOC[:1200],
            ]
            plans = []
            for prompt in turns:
                raw = httpx.post(f"{gw}/v1/completions", json={**body, "prompt": prompt}, timeout=120)
                assert raw.status_code == 200, raw.text
                plans.append(raw.headers["x-specprefill-plan"])
                sent = next(
                    r["body"]
                    for r in reversed(engine.requests)  # the request, not its warm
                    if r["path"] == "/v1/completions" and "priority" not in r["body"]
                )
                swap = sent.get("vllm_xargs") or {}  # the client's body, plus the kept tokens when compressed
                tokens = swap.get("kept_token_ids") or oracle.tokenizer(sent["prompt"]).input_ids
                positions = swap.get("position_ids") or list(range(len(tokens)))
                expected = asyncio.run(_oracle(oracle, tokens, positions))
                answer = raw.json()["choices"][0]["logprobs"]
                assert answer["token_logprobs"] == pytest.approx(expected, abs=1e-4)
                assert asyncio.run(eventually(lambda: gateway_settled(gw), within=60))  # the warm, if any
    oracle.close()
    assert plans == ["fresh", "extend", "whole", "extend"]


def test_a_client_that_leaves_after_the_first_token_still_teaches_the_planner(model_pair):
    """A streaming client that drops the stream at its first token (as a TTFT probe does): the engine holds the
    prompt all the same, so the planner records it and offers it for warming, and once the warm has landed the
    next request on it goes whole."""
    engine = RecordingApp(engine_app(model_pair, block_size=16))
    with serve(engine) as engine_url:
        settings = gateway_settings(
            model_pair, backend_url=engine_url, planner="cost", warming=True, cost_coefficients=COSTS
        )
        with serve(create_app(settings)) as gw:
            requests_with_gaps(gw)
            body = {"model": "tiny", "prompt": LONG_DOC * 2, "max_tokens": 8, "temperature": 0, "stream": True}
            first = httpx.post(f"{gw}/v1/completions", json={**body, "stream": False}, timeout=120)
            assert first.headers["x-specprefill-plan"] == "fresh"  # seen once: not warmed
            assert 'specprefill_warming_total{outcome="offered"}' not in httpx.get(f"{gw}/metrics").text
            body["prompt"] += " A question?"  # it comes back: worth warming
            with httpx.stream("POST", f"{gw}/v1/completions", json=body, timeout=120) as response:
                assert response.headers["x-specprefill-status"] == "compressed"
                next(line for line in response.iter_lines() if line.startswith("data:"))
            assert asyncio.run(eventually(lambda: gateway_settled(gw), within=60))
            text = httpx.get(f"{gw}/metrics").text
            assert 'specprefill_warming_total{outcome="done"} 1.0' in text
            again = httpx.post(f"{gw}/v1/completions", json={**body, "stream": False}, timeout=120)
            assert again.headers["x-specprefill-plan"] == "whole"


def test_back_to_back_requests_never_meet_warming_and_think_time_gaps_take_it(model_pair):
    """Requests on a recurring context that follow each other at once: no warming piece ever starts, so none
    is found at the engine by a request (Server-Timing ``background``). With a think time between requests the
    warm goes in pieces within the gaps and lands."""
    engine = RecordingApp(engine_app(model_pair, block_size=16))
    with serve(engine) as engine_url:
        settings = gateway_settings(
            model_pair, backend_url=engine_url, planner="cost", warming=True, cost_coefficients=COSTS
        )
        with serve(create_app(settings)) as gw:
            body = {"model": "tiny", "max_tokens": 1, "temperature": 0}
            timings = []
            for i in range(8):
                raw = httpx.post(
                    f"{gw}/v1/completions", json={**body, "prompt": LONG_DOC * 2 + f" Question {i}?"}, timeout=120
                )
                timings.append(parse_server_timing(raw.headers["server-timing"]))
            text = httpx.get(f"{gw}/metrics").text
            assert 'specprefill_warming_total{outcome="offered"}' in text
            assert 'specprefill_warming_total{outcome="piece"}' not in text
            assert all(t["background"] == 0 for t in timings)
            assert "specprefill_foreground_behind_background_seconds_count 0.0" in text
            for i in range(4):  # the same context with a user's think time
                time.sleep(1.0)
                httpx.post(f"{gw}/v1/completions", json={**body, "prompt": LONG_DOC * 2 + f" Later {i}?"}, timeout=120)
            assert asyncio.run(eventually(lambda: gateway_settled(gw), within=60))
            assert 'specprefill_warming_total{outcome="done"}' in httpx.get(f"{gw}/metrics").text


async def _oracle(engine: ReferenceEngine, ids: list[int], positions: list[int]) -> list[float]:
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
    return [s.logprob async for s in engine.generate(ids, positions, params)]


async def test_a_system_prompt_the_engine_holds_stays_whole_and_the_draft_is_skipped():
    """A long system prompt is compressed on its first, cold request; once warmed, plans that would compress
    it are off the table, and with only a short question left to decide, so is the draft."""
    planner, draft = _planner()
    system = torch.zeros(4030, dtype=torch.bool)
    system[:4000] = True
    prompt = _ids(4030, 10)
    first = await plan_prompt(planner, prompt, OPTIONS, [], system)
    assert first.kind == "fresh" and not first.protected
    await planner.completed(first, None, 1.0)
    await planner.replicas[0].cache.record(prompt, None)  # the warm
    calls = draft.calls
    second = await plan_prompt(planner, prompt[:4000] + _ids(30, 11), OPTIONS, [], system)
    assert second.kind == "whole" and second.reason == "cached" and draft.calls == calls


async def test_a_system_prompt_the_engine_does_not_hold_extends_the_earlier_selection_of_it():
    """Users of a long system prompt the engine does not hold yet: the first request compresses it; the next
    user's question moves the fresh selection a little (here one chunk near the start), which would leave
    the engine's cache behind from there on. The earlier selection still keeps what matters, so it is
    extended. (It was checked against a selection that keeps the system prompt whole, which no compressed
    selection covers: every request was compressed afresh, and the engine re-read most of it each time.)"""
    planner, draft = _planner()
    system = torch.zeros(4000, dtype=torch.bool)
    system[:3968] = True
    prompt = _ids(3968, 14)
    draft.values = {5: 0.02}
    first = await plan_prompt(planner, prompt + _ids(32, 15), OPTIONS, [], system)
    assert (first.kind, first.protected) == ("fresh", False) and 5 * CHUNK in first.position_ids
    await planner.completed(first, None, 1.0)
    draft.values = {6: 0.02}  # the next question: another chunk of the system prompt a little higher
    second = await plan_prompt(planner, prompt + _ids(32, 16), OPTIONS, [], system)
    assert (second.kind, second.protected) == ("extend", False)
    reused = tuple(i for i in first.position_ids if i < 3968)
    assert second.position_ids[: len(reused)] == reused and second.engine_cached >= len(reused) - CHUNK


async def test_kept_tokens_fill_whole_engine_blocks_up_to_where_the_next_user_leaves():
    """An engine caches whole blocks (vLLM's CPU build: 128 tokens). The kept part of a shared system prompt is
    filled to whole blocks, so the next user's request finds all of it cached and the engine reads only the new
    question, not also the last part-filled block of the system prompt again."""
    planner, draft = _planner()
    planner.replicas[0].cache = MemoryEngineCache(64, 1 << 20)
    system = torch.zeros(3040, dtype=torch.bool)
    system[:3000] = True
    prompt = _ids(3000, 17)
    # an earlier request that shares only the chat template's first tokens: not one this prompt began like
    other = await plan_prompt(planner, prompt[:5] + _ids(2500, 20), OPTIONS, [])
    await planner.completed(other, None, 1.0)
    first = await plan_prompt(planner, prompt + _ids(40, 18), OPTIONS, [], system, boundary=3000)
    unfilled = select_tokens(prompt + _ids(40, 18), await draft.score(prompt + _ids(40, 18)), 0.3, draft.config)
    below = sum(i < 3000 for i in first.position_ids)
    assert below % 64 == 0 and sum(i < 3000 for i in unfilled) % 64 != 0  # it took filling
    await planner.completed(first, None, 1.0)
    second = await plan_prompt(planner, prompt + _ids(40, 19), OPTIONS, [], system, boundary=3000)
    assert second.kind == "extend" and second.engine_cached == below
    assert second.kept_tokens - second.engine_cached <= 40  # the question alone is read anew


async def test_filling_blocks_never_moves_tokens_the_engine_already_holds():
    """The same document with another question: the next plan extends the first one's selection and fills the
    kept tokens below where the questions part to whole engine blocks. The document's last chunks, next to the
    question, score high and are kept, so the nearest free positions lie before them: filled there, they moved
    every kept token after them and the engine re-read those blocks (in a Poisson run, 2,048 of ~2,400 kept
    tokens reused; the rest read anew). Fill goes only after what the engine holds."""
    planner, draft = _planner()
    planner.replicas[0].cache = MemoryEngineCache(64, 1 << 20)
    document = _ids(3000, 21)
    draft.peaks = [186, 187]  # the document's last whole chunks (2976-3007 and on): kept
    first = await plan_prompt(planner, document + _ids(40, 22), OPTIONS, [])
    assert first.kind == "fresh"
    await planner.completed(first, None, 1.0)
    second = await plan_prompt(planner, document + _ids(40, 23), OPTIONS, [])
    head = tuple(i for i in first.position_ids if i < 3000)
    assert second.kind == "extend" and second.position_ids[: len(head)] == head
    assert second.engine_cached >= len(head) // 64 * 64


def test_where_the_next_request_leaves_follows_how_this_one_left_the_last():
    from gateway.planning.selections import Selection

    system = torch.zeros(3040, dtype=torch.bool)
    system[:3000] = True
    earlier = Selection((0, 1, 2), 0.3, False, length=3040)
    assert Planner._divergence(system, 3005, None) == 3005  # a new system prompt: its next user asks anew
    assert Planner._divergence(None, 3005, None) is None  # a new document: no one knows
    assert Planner._divergence(system, 3005, (earlier, 3008)) == 3005  # another question under it: the message
    assert Planner._divergence(None, 5, (earlier, 3008)) == 3008  # the same document, another question
    assert Planner._divergence(system, 3005, (earlier, 2000)) == 2000  # it replaced part of the system prompt
    grown = Selection((0, 1, 2), 0.3, False, length=2900)
    assert Planner._divergence(system, 3005, (grown, 2900)) is None  # a chat's next turn: it leaves at the end
    # only an earlier prompt this one shares most of counts: not one that shares the chat template's head
    assert Planner.began_like((earlier, 5), 3040) is None
    assert Planner.began_like((earlier, 2000), 3040) == (earlier, 2000)


async def test_a_held_system_prompt_that_ends_inside_a_block_does_not_wake_the_draft():
    """The engine caches whole blocks, so the system prompt's last few tokens are read anew whatever the plan:
    the lower bound of a compressed plan counts them too, and a short question goes whole without the draft
    even where new tokens are dear (here 10 ms each)."""
    planner, draft = _planner(cost_coefficients={"target": [0.0, 1e-2, 0.0, 0.0], "draft": COSTS["draft"]})
    system = torch.zeros(4037, dtype=torch.bool)
    system[:4007] = True  # ends 7 tokens into a 16-token block
    prompt = _ids(4007, 12)
    await planner.replicas[0].cache.record(prompt, None)  # the warm
    plan = await plan_prompt(planner, prompt + _ids(30, 13), OPTIONS, [], system)
    assert plan.engine_cached == 4000
    assert (plan.kind, plan.reason, draft.calls) == ("whole", "cached", 0)


def _timed_engine(planner: Planner, lengths: list[int]):
    """An engine that takes 20 ms, 0.2 ms per new token and 10 µs per cached token, and says what it cached."""

    async def complete(token_ids: list[int]) -> dict:
        cached = await planner.replicas[0].cache.cached_tokens(token_ids, None)
        lengths.append(len(token_ids))
        await asyncio.sleep(0.02 + 2e-4 * (len(token_ids) - cached) + 1e-5 * cached)
        return {"usage": {"prompt_tokens_details": {"cached_tokens": cached}}}

    return complete


async def test_the_start_up_probe_prices_cached_reads():
    planner, _ = _planner(cost_coefficients=None)
    lengths: list[int] = []
    await calibrate(planner, _timed_engine(planner, lengths), list(range(10, 5000)))
    assert lengths[0] == 64  # the warm-up, not measured
    assert lengths[1:4] == [256, 1024, 4096]  # 4,096 tokens take 0.84 s: no larger probe
    assert lengths[4:] == [4096 + 32, 4096 + 32 + 512, 1024 + 16, 1024 + 16, 4096 + 16, 4096 + 16]
    assert len(planner.target_cost._probe) == len(lengths) - 1
    per_cached = planner.target_cost.describe()["per_cached_token"]
    assert 3e-6 < per_cached < 3e-5, planner.target_cost.describe()


async def test_the_start_up_probe_grows_while_the_engine_answers_fast():
    """On a GPU a 4,096-token prompt takes a fraction of a second: prices for the prompts users send come from
    probes of their size, not from an eightfold extrapolation."""
    planner, _ = _planner(cost_coefficients=None)
    lengths: list[int] = []

    async def fast(token_ids: list[int]) -> dict:
        lengths.append(len(token_ids))
        await asyncio.sleep(0.005 + 1e-5 * len(token_ids))
        return {"usage": None}

    await calibrate(planner, fast, list(range(10, 5000)), limit=20_000)
    room = 20_000 - 32 - 512
    assert lengths[:7] == [64, 256, 1024, 4096, 8192, 16384, room]
    assert lengths[7:9] == [room + 32, room + 32 + 512]


async def test_the_start_up_probe_stops_growing_where_the_draft_is_slow():
    """An engine that answers at once before a draft on CPU cores: the probe stops where the draft takes longer
    than the growth allows (it once scored up to the draft's 131,072 positions: minutes of start-up)."""

    class CPUDraft(FakeDraft):
        async def score(self, token_ids: list[int]) -> torch.Tensor:
            await asyncio.sleep(1e-4 * len(token_ids))  # 0.4 s at 4,096 tokens, 0.8 s at 8,192
            return await super().score(token_ids)

    planner, _ = _planner(cost_coefficients=None)
    planner.draft = planner.scores.draft = CPUDraft()
    lengths: list[int] = []

    async def instant(token_ids: list[int]) -> dict:
        lengths.append(len(token_ids))
        return {"usage": None}

    await calibrate(planner, instant, list(range(10, 5000)), limit=200_000)
    assert lengths[:6] == [64, 256, 1024, 4096, 8192, 8192 + 32]


async def test_the_start_up_probe_fits_the_prompt_limit_and_a_refused_probe_does_not_stop_the_gateway():
    planner, _ = _planner(cost_coefficients=None)
    lengths: list[int] = []
    await calibrate(planner, _timed_engine(planner, lengths), list(range(10, 5000)), limit=2048)
    assert max(lengths) == 2048 and len(lengths) == 10

    async def refuses_long_prompts(token_ids: list[int]) -> dict:
        if len(token_ids) > 1024:
            raise RuntimeError("prompt too long")
        return {"usage": None}

    refusing, _ = _planner(cost_coefficients=None)
    await calibrate(refusing, refuses_long_prompts, list(range(10, 5000)))  # returns: the gateway starts
    assert len(refusing.target_cost._probe) == 2  # the two prompts it took


# --- the engine as it is now: the wait ahead, contended timings, warms that land between requests ---


async def test_timings_that_shared_the_engine_never_enter_the_fit():
    """A burst of requests queued behind other work measures 2-6x their cost. Fitted in, they would price a cold
    prefill at over twice what it takes; flagged as contended (``EngineLoad`` tickets), they change nothing."""
    import copy
    import random

    planner, _ = _planner(cost_coefficients=None)
    engine = FCFSEngine(fixed=0.005, per_token=2e-5, per_cached=1e-6)
    await calibrate(planner, lambda ids: engine.complete(ids), list(range(10, 5000)), limit=8192)
    truth = engine.seconds(8000, 0)
    assert planner.target_cost.predict(8000, 0) == pytest.approx(truth, rel=0.2)
    before = planner.target_cost.coefficients.copy()
    unfiltered = copy.deepcopy(planner.target_cost)
    rng = random.Random(0)
    for _ in range(256):
        new, cached = rng.randrange(100, 2000), rng.randrange(0, 8000)
        seconds = engine.seconds(new, cached) * rng.uniform(2, 6)
        plan = Plan(list(range(new + cached)), engine_cached=cached)
        await planner.completed(plan, {"prompt_tokens_details": {"cached_tokens": cached}}, seconds, contended=True)
        unfiltered.observe(new, cached, seconds)
    assert planner.target_cost.coefficients.tolist() == before.tolist()
    assert unfiltered.predict(8000, 0) > 2 * truth  # what the filter keeps out


async def test_the_draft_costs_only_what_outlasts_the_wait_ahead():
    """With the engine idle, a slow draft makes the whole prompt the cheaper plan; with the engine busy for
    longer than the draft takes, the draft runs during the wait, and compressing wins. Predictions carry the wait."""
    planner, draft = _planner(cost_coefficients={"target": COSTS["target"], "draft": [3.0, 0.0, 0.0, 0.0]})
    prompt = _ids(4000, 40)
    idle = await plan_prompt(planner, prompt, OPTIONS, [])
    load = planner.replicas[0].load
    assert (idle.kind, idle.reason, draft.calls) == ("whole", "cheaper_whole", 0)
    assert load.estimate(idle.target_s)[:2] == (0, pytest.approx(idle.target_s))
    ahead = load.begin(4.0)  # another request's prefill, 4 s of it left
    busy = await plan_prompt(planner, prompt, OPTIONS, [])
    assert (busy.kind, busy.status, draft.calls) == ("fresh", "compressed", 1)
    # what the trace carries when it is sent: the wait, then the target's time
    wait, predicted, _ = load.estimate(busy.target_s)
    assert wait == pytest.approx(4.0, rel=0.01) and predicted == pytest.approx(wait + busy.target_s)
    planner.replicas[0].load.end(ahead)


async def test_a_shared_system_prompt_warmed_between_requests_lands_and_then_stays_whole():
    """Users of one long system prompt, a short think time apart: the first request compresses it; the warm goes
    in pieces within the gaps, each recorded as it lands, until the gateway knows the engine holds the system
    prompt, which then stays whole. (Before, each request cancelled the warm before it had landed, and every
    request compressed the system prompt afresh.)"""
    costs = {"target": [0.005, 5e-5, 1e-6, 0.0], "draft": [0.001, 1e-6, 0.0, 1e-7]}
    planner, _ = _planner(cost_coefficients=costs)
    engine = FCFSEngine(fixed=0.005, per_token=5e-5, per_cached=1e-6)
    warmer = Warmer(
        lambda ids, priority: engine.complete(ids, priority),
        planner.completed,
        planner.replicas[0].load,
        planner.replicas[0].cache,
        planner.target_cost,
        planner.metrics,
        piece_s=0.03,
        recheck_s=0.01,
    )
    system, n_system = _ids(3000, 41), 3000
    keep = torch.zeros(n_system + 30, dtype=torch.bool)
    keep[:n_system] = True
    plans = []
    for i in range(12):
        load = planner.replicas[0].load
        load.enter()
        plan = await plan_prompt(planner, system + _ids(30, 100 + i), OPTIONS, [], keep)
        ticket = load.begin(plan.target_s)
        answer = await engine.complete(plan.kept_token_ids(), None, plan.position_ids)
        load.answered(ticket), load.end(ticket)
        await planner.completed(plan, answer["usage"], 0.01, contended=ticket.contended)
        if plan.status == "compressed" and plan.recurring:
            warmer.offer(plan.token_ids)
        load.leave()
        plans.append((plan.kind, plan.protected))
        await asyncio.sleep(0.25)  # the user's think time: warming's window
    await warmer.close()
    assert plans[0] == ("fresh", False)  # the system prompt compressed with the rest, on its first request
    held = next(i for i, (kind, protected) in enumerate(plans) if kind == "whole" or protected)
    assert held < 10 and all(kind == "whole" or protected for kind, protected in plans[held:])
    assert planner.metrics.warming.labels("piece")._value.get() >= 3  # it landed in pieces


async def test_an_engine_that_does_not_report_its_cache_hits_is_named(caplog):
    planner, _ = _planner(cost_coefficients=None)

    async def silent(token_ids: list[int]) -> dict:
        return {"usage": {"prompt_tokens": len(token_ids)}}

    with caplog.at_level("WARNING", logger="specprefill.gateway"):
        await calibrate(planner, silent, list(range(10, 5000)), limit=1024)
    assert any("--enable-prompt-tokens-details" in r.message for r in caplog.records)


async def test_a_prompt_the_engine_holds_nine_tenths_of_goes_whole_though_compressing_it_costs_less():
    """Reading cached tokens is not free (here 1 ms each, as a 2-core CPU reads them), so a compressed plan that
    reads fewer of them is cheaper; but the engine holds 90% of the prompt, and the target then reads all of it
    at the price of its new tokens (an agent's next turn once warmed). Below 90% it is priced as always."""
    costs = {"target": [0.0, 1e-3, 1e-3, 0.0], "draft": COSTS["draft"]}
    planner, draft = _planner(cost_coefficients=costs)
    prompt = _ids(4000, 40)
    await planner.replicas[0].cache.record(prompt[:3616], None)
    plan = await plan_prompt(planner, prompt, OPTIONS, [])
    assert (plan.kind, plan.reason, draft.calls) == ("whole", "cached", 0)
    other, _ = _planner(cost_coefficients=costs)
    await other.replicas[0].cache.record(prompt[:3200], None)
    assert (await plan_prompt(other, prompt, OPTIONS, [])).status == "compressed"


async def test_a_cached_prompt_goes_whole_on_that_rule_only_at_about_direct_s_cost():
    """A Claude Code replay's fifth turn: the engine held 93% of the prompt (earlier turns went compressed, so
    not all their text was in it) and the rule sent it whole: 2,501 new tokens took 66 s, where vLLM alone, which
    served every turn whole and so held all before the last message, took 6.5 s. The rule now holds only where
    whole costs about what direct would; else whole is priced like any plan."""
    costs = {"target": [0.0, 1e-2, 1e-4, 0.0], "draft": COSTS["draft"]}  # new tokens dear, cached ones cheap
    prompt = _ids(4000, 40)
    planner, draft = _planner(cost_coefficients=costs)
    await planner.replicas[0].cache.record(prompt[:3616], None)
    plan = await plan_prompt(planner, prompt, OPTIONS, [], boundary=3980)  # direct: 20 new tokens, whole: 384
    assert plan.reason == "cheaper_whole"  # priced: here whole is still the cheapest plan, but not on the rule
    planner, draft = _planner(cost_coefficients=costs)
    await planner.replicas[0].cache.record(prompt[:3616], None)
    plan = await plan_prompt(planner, prompt, OPTIONS, [], boundary=3616)  # the last message is what the engine lacks
    assert (plan.kind, plan.reason, draft.calls) == ("whole", "cached", 0)


async def test_a_late_draft_is_waited_for_while_it_can_still_save_time():
    """``--draft-timeout`` is a floor: a draft still scoring a long prompt then (a burst of drafts on a busy
    CPU) is waited for while compressing can still save time, since giving up sends the whole prompt, the
    dearest plan (seen in the trace replay: a 26,000-token prompt sent whole after a 30 s draft timeout held
    the engine for 80 s). A short prompt, whose compression saves less than the floor, goes whole at it."""

    class SlowDraft(FakeDraft):
        async def score(self, token_ids: list[int]) -> torch.Tensor:
            await asyncio.sleep(0.3)
            return await super().score(token_ids)

    planner, _ = _planner(draft_timeout=0.1)
    planner.draft = planner.scores.draft = SlowDraft()
    long = await plan_prompt(planner, _ids(4000, 1), OPTIONS, [])  # whole ~4.3 s, compressed ~1.2 s: worth 0.3 s
    assert (long.status, long.reason) == ("compressed", None) and long.draft_ms >= 300
    short = await plan_prompt(planner, _ids(100, 2), OPTIONS, [])  # whole ~0.11 s, compressed ~0.04 s
    assert (short.status, short.reason) == ("bypassed", "draft_error") and short.draft_ms < 300
