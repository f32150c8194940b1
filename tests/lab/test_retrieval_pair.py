"""The shipped retrieval pair, end to end: an answer found in ~1,700 tokens survives 10x compression through
a real gateway (in-process reference engine) asked with the OpenAI SDK, and is lost by blind truncation."""

from __future__ import annotations

import random

import openai
import pytest

from gateway.app import create_app
from gateway.settings import GatewaySettings
from specprefill_lab.retrieval import SHIPPED_PAIR, make_sample
from tests.helpers import serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    # the pair's target costs about what its draft does, so the cost planner would send prompts whole
    settings = GatewaySettings(
        target_model=str(SHIPPED_PAIR / "target"),
        draft_model=str(SHIPPED_PAIR / "draft"),
        device="cpu",
        served_model_name="retrieval",
        planner="fresh",
    )
    with serve(create_app(settings)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _ask(client, prompt: str, **headers):
    raw = client.completions.with_raw_response.create(
        model="retrieval", prompt=prompt, max_tokens=1, temperature=0, extra_headers=headers
    )
    return raw.parse().choices[0].text.strip(), raw.headers


def test_answers_survive_ten_x_compression(client):
    rng = random.Random(2024)
    samples = [make_sample(rng, 1500, 37) for _ in range(6)]
    full = [_ask(client, s.text, **{"x-specprefill": "off"})[0] for s in samples]
    compressed = [_ask(client, s.text, **{"x-keep-rate": "0.1"}) for s in samples]
    for sample, answer_full, (answer, headers) in zip(samples, full, compressed):
        assert headers["x-specprefill-status"] == "compressed"
        assert int(headers["x-specprefill-kept-tokens"]) <= 0.15 * int(headers["x-specprefill-original-tokens"])
        assert answer == answer_full, (sample.answer, answer_full, answer)
    assert sum(a == s.answer for s, a in zip(samples, full)) >= 5


def test_a_draft_with_another_tokenizer_finds_the_answers_too():
    """The shipped draft-bpe (a SentencePiece-style BPE, other IDs and spans) in front of the word-level target:
    the gateway maps its scores, and the answers survive 10x compression as with the pair's own draft."""
    settings = GatewaySettings(
        target_model=str(SHIPPED_PAIR / "target"),
        draft_model=str(SHIPPED_PAIR / "draft-bpe"),
        device="cpu",
        served_model_name="retrieval",
        planner="fresh",
    )
    with (
        serve(create_app(settings)) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        rng = random.Random(2024)
        samples = [make_sample(rng, 1500, 37) for _ in range(6)]
        answers = [_ask(client, s.text, **{"x-keep-rate": "0.1"}) for s in samples]
        assert all(headers["x-specprefill-status"] == "compressed" for _, headers in answers)
        assert sum(answer == s.answer for s, (answer, _) in zip(samples, answers)) >= 5
