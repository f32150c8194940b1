"""The shared wire models: one stop rule, one prompt rule, and the unsupported-feature list."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from common.errors import InvalidRequestError, parse_body
from common.protocol import ChatCompletionRequest, CompletionRequest
from engine.protocol import EngineCompletionRequest


@pytest.mark.parametrize("model", [CompletionRequest, EngineCompletionRequest])
def test_stop_reads_back_as_a_list(model):
    assert model(model="m", prompt="x").stop == []
    assert model(model="m", prompt="x", stop="END").stop == ["END"]
    assert model(model="m", prompt="x", stop=["a", "b"]).stop == ["a", "b"]
    for bad in (["a", "b", "c", "d", "e"], [""]):
        with pytest.raises(ValidationError, match="at most 4 non-empty strings"):
            model(model="m", prompt="x", stop=bad)


def test_unset_stop_and_sampling_fields_are_not_forwarded():
    """A compressed request's completion leaves the engine's defaults where the client did (vLLM samples with the
    model's generation_config.json when the body has no temperature), as the client's body sent whole does."""
    request = CompletionRequest(model="m", prompt="x")
    assert "stop" not in request.model_dump(exclude_unset=True)
    assert not {"stop", "temperature", "top_p"} & set(request.completion_params())
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], temperature=0, top_p=0.5)
    assert {"temperature": 0, "top_p": 0.5}.items() <= chat.completion_params().items()


def test_prompt_token_ids(tokenizer):
    text = CompletionRequest(model="m", prompt="Bafu anbe")
    assert text.prompt_token_ids(tokenizer) == tokenizer("Bafu anbe").input_ids
    assert CompletionRequest(model="m", prompt=[[5, 6]]).prompt_token_ids(tokenizer) == [5, 6]  # a batch of one
    for prompt, message in (([5, 10**6], "must be in"), ([[5], [6]], "one prompt"), ([], "empty"), ("", "empty")):
        with pytest.raises(InvalidRequestError, match=message):
            CompletionRequest(model="m", prompt=prompt).prompt_token_ids(tokenizer)
    with pytest.raises(InvalidRequestError, match=r"\[0, 7\)"):  # the model's vocabulary, when smaller
        CompletionRequest(model="m", prompt=[5, 9]).prompt_token_ids(tokenizer, vocab_size=7)


def test_unsupported_features_and_completion_params():
    chat = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        n=2,
        presence_penalty=1,
        tools=[{"type": "function"}],
        response_format={"type": "json_object"},
        max_completion_tokens=5,
        logprobs=True,
        top_logprobs=3,
    )
    assert chat.unsupported_features() == ["n", "penalties", "response_format", "tools"]
    assert chat.completion_params()["max_tokens"] == 5 and chat.completion_params()["logprobs"] == 3
    completion = CompletionRequest(model="m", prompt="x", echo=True, suffix="s", best_of=2, logit_bias={"1": 1})
    assert completion.unsupported_features() == ["logit_bias", "echo", "suffix", "best_of"]
    assert CompletionRequest(model="m", prompt="x").completion_params()["max_tokens"] == 16  # OpenAI's default


def test_parse_body_names_the_field():
    with pytest.raises(InvalidRequestError) as excinfo:
        parse_body(ChatCompletionRequest, {"model": "m", "messages": []})
    assert excinfo.value.param == "messages" and excinfo.value.status_code == 400
