"""The real pair made into plain checkpoints (once per machine: about 45 s for the 0.5B, 90 s for the 1.5B on 2
cores), and `make serve`'s defaults answering with it (greedy): Qwen2.5-Coder-1.5B-Instruct as the target, its
family's 0.5B drafting; SmolLM2-135M one flag away."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import openai
import pytest
from transformers import AutoConfig, AutoTokenizer

from common.models import check_same_tokenizer
from specprefill.commands.servers import Serve
from specprefill.real_models import checkpoint
from specprefill.real_models.catalog import DEFAULT_PAIR, PAIRS, QWEN_CODER_05B, QWEN_CODER_15B
from specprefill.real_models.checkpoint import DONE, ensure_checkpoint


def test_the_checkpoints_are_plain_of_one_family_and_made_once(monkeypatch):
    target, draft = ensure_checkpoint(QWEN_CODER_15B), ensure_checkpoint(QWEN_CODER_05B)
    for folder, layers in ((target, 28), (draft, 24)):
        config = AutoConfig.from_pretrained(folder)
        assert (config.model_type, config.num_hidden_layers, config.max_position_embeddings) == ("qwen2", layers, 32768)
        assert not hasattr(config, "quantization_config")  # vLLM refuses the GGUF's
        assert "quantization_config" not in (folder / "config.json").read_text()
        made = json.loads((folder / DONE).read_text())
        assert made["sha256"] in (QWEN_CODER_15B.source.sha256, QWEN_CODER_05B.source.sha256)
        assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]
    check_same_tokenizer(AutoTokenizer.from_pretrained(draft), AutoTokenizer.from_pretrained(target))
    assert len(AutoTokenizer.from_pretrained(target)) == 151936  # the GGUF names every row of the embedding
    monkeypatch.setattr(checkpoint, "convert", lambda *a: pytest.fail("converted again"))
    assert ensure_checkpoint(QWEN_CODER_15B) == target


# a first make whose conversion is under way (faked: the folders' making is what is tested) when a SIGTERM comes
STOPPED_MAKE = """
import contextlib, sys, time
from specprefill.real_models import checkpoint
from specprefill.real_models.catalog import QWEN_CODER_05B

@contextlib.contextmanager
def gguf_file(model, scratch):
    (scratch / "model.gguf").write_bytes(bytes(1 << 20))
    yield scratch / "model.gguf"

def convert(model, source, out):
    (out / "model.safetensors").write_bytes(bytes(1 << 20))
    print("converting", flush=True)
    time.sleep(120)

checkpoint.check_disk, checkpoint.part_files = (lambda *a: None), (lambda model: [])
checkpoint.gguf_file, checkpoint.convert = gguf_file, convert
checkpoint.ensure_checkpoint(QWEN_CODER_05B, sys.argv[1])
"""


def test_a_sigterm_while_a_model_is_made_leaves_nothing_half_made(tmp_path):
    with subprocess.Popen([sys.executable, "-c", STOPPED_MAKE, str(tmp_path)], stdout=subprocess.PIPE) as make:
        assert make.stdout is not None and make.stdout.readline() == b"converting\n"
        assert len(list(tmp_path.iterdir())) == 2  # the staging folder and the GGUF's scratch
        make.send_signal(signal.SIGTERM)
        assert make.wait(timeout=60) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_make_serve_serves_the_pair_under_the_names_clients_send():
    settings = Serve(port=0).with_default_models()
    pair = PAIRS[DEFAULT_PAIR]
    assert settings.target_model == str(ensure_checkpoint(pair.target))
    assert settings.draft_model == str(ensure_checkpoint(pair.draft))
    assert (settings.draft_layers, settings.observation_window) == (pair.draft_layers, pair.observation_window)
    assert settings.served_model_name == "Qwen2.5-Coder-1.5B-Instruct"
    assert {"Qwen/Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder:1.5b"} <= set(settings.model_alias)
    assert settings.max_chunks == pair.max_chunks == 64
    assert Serve(port=0, observation_window=1).with_default_models().observation_window == 1  # asked for: kept
    assert Serve(port=0, max_chunks=0).with_default_models().max_chunks == 0  # the paper's fixed chunks, asked for
    small = Serve(port=0, real_pair="smollm2").with_default_models()
    assert (small.served_model_name, small.draft_layers, small.observation_window) == ("SmolLM2-135M-Instruct", 8, 16)
    assert small.draft_model == small.target_model


def test_an_unknown_pair_is_refused_with_the_choices(capsys):
    from specprefill.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--real-pair", "llama"])
    assert exit_.value.code == 2
    assert "unknown real pair 'llama': choose one of qwen2.5-coder, smollm2" in capsys.readouterr().err


def _ask(client: openai.OpenAI, model: str, question: str) -> str:
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0
    )
    return answer.choices[0].message.content or ""


@pytest.mark.parametrize(
    ("question", "answer"),
    [
        ("What is the capital of France?", "Paris"),
        ("What is the capital of Japan?", "Tokyo"),
        ("What is the chemical symbol for gold?", "Au"),
        ("Who wrote Romeo and Juliet?", "Shakespeare"),
        ("How many days are in a week?", "7"),
    ],
)
def test_make_serve_answers_factual_questions(make_serve_gateway, question, answer):
    with openai.OpenAI(base_url=f"{make_serve_gateway}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        assert answer in _ask(client, "Qwen2.5-Coder-1.5B-Instruct", question)


def test_make_serve_answers_to_a_hub_id_and_writes_code(make_serve_gateway):
    with openai.OpenAI(base_url=f"{make_serve_gateway}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        code = _ask(client, "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Write a Python function that adds two numbers.")
    assert "def " in code and "return" in code
