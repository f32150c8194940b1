from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from specprefill.cli import main
from specprefill.demo_models import flops_per_token, write_demo_models


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specprefill", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


def test_score_json_on_text(model_pair, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Bafu anbe zadubu ancuci focahe bacene. " * 60)
    out = _run("score", "--model", str(model_pair / "draft"), "--keep-rate", "0.25", "--json", str(prompt))
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert set(payload) == {"original_tokens", "kept_tokens", "kept_indices", "scores"}
    assert len(payload["scores"]) == payload["original_tokens"]
    assert len(payload["kept_indices"]) == payload["kept_tokens"] < payload["original_tokens"]


def test_score_text_marks_dropped_spans(model_pair):
    out = _run("score", "--model", str(model_pair / "draft"), "--keep-rate", "0.2", "-",
               stdin="Cadupa anbe bora je lipa ancuci. " * 80)
    assert out.returncode == 0, out.stderr
    assert "dropped:" in out.stdout and "kept " in out.stderr


def test_score_token_ids_and_a_bad_list(model_pair):
    ids = json.dumps(list(range(5, 205)))
    out = _run("score", "--model", str(model_pair / "draft"), "--token-ids", "--json", "--chunk-size", "1",
               "--protect-first", "0", "--protect-last", "0", "--keep-rate", "0.1", "-", stdin=ids)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kept_tokens"] == 20
    bad = _run("score", "--model", str(model_pair / "draft"), "--token-ids", "-", stdin="[1, 'a']")
    assert bad.returncode == 2 and "JSON list of integers" in bad.stderr


def test_demo_models_are_loadable_and_the_target_costs_10x(tmp_path):
    main(["demo-models", str(tmp_path)])
    tokenizers = [AutoTokenizer.from_pretrained(tmp_path / name) for name in ("draft", "target")]
    assert tokenizers[0].get_vocab() == tokenizers[1].get_vocab()
    ids = tokenizers[1].apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                            return_dict=False)
    assert ids[0] == tokenizers[1].bos_token_id
    draft, target = (AutoModelForCausalLM.from_pretrained(tmp_path / name) for name in ("draft", "target"))
    assert draft.config.model_type == target.config.model_type == "llama"
    assert draft.config.num_key_value_heads < draft.config.num_attention_heads  # GQA
    assert flops_per_token(target.config) >= 10 * flops_per_token(draft.config)


def test_demo_models_are_deterministic(tmp_path):
    write_demo_models(tmp_path / "a")
    write_demo_models(tmp_path / "b")
    for name in ("draft/model.safetensors", "draft/tokenizer.json", "target/model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_unknown_subcommand_fails_cleanly():
    with pytest.raises(SystemExit):
        main(["no-such-command"])
