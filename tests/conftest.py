"""Session-wide fixtures: tiny random models made here, never downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from engine.server import create_app as create_engine_app
from specprefill.demo_models import ModelShape, train_tokenizer, write_model
from gateway.app import create_app
from tests.helpers import RecordingApp, gateway_settings
from tests.servers import serve


def tiny_llama(
    *, layers: int = 2, heads: int = 4, kv_heads: int = 2, hidden: int = 64, vocab: int = 256, seed: int = 0,
    max_positions: int = 2048, eos: list[int] | None = None,
) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        pad_token_id=0, eos_token_id=eos if eos is not None else [1],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # larger weights than the default init, so attention is far from uniform and greedy tokens vary
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.2)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=0)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer(vocab_size=1024)


@pytest.fixture(scope="session")
def model_pair(tmp_path_factory, tokenizer) -> Path:
    """A small draft/target pair on disk sharing one tokenizer (demo layout, smaller shapes).

    A larger init range than the default makes attention peaked and outputs depend on positions.
    """
    root = tmp_path_factory.mktemp("pair")
    write_model(root / "draft", ModelShape(64, 128, 2, 4, 2), tokenizer, seed=1, max_positions=4096, init_std=0.2)
    write_model(root / "target", ModelShape(128, 256, 2, 4, 2), tokenizer, seed=2, max_positions=4096, init_std=0.2)
    return root


@pytest.fixture(scope="session")
def redis_url() -> str:
    return os.environ.get("SPECPREFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def engine_backend(model_pair):
    recorder = RecordingApp(create_engine_app(str(model_pair / "target"), device="cpu", served_name="target"))
    with serve(recorder) as url:
        yield url, recorder


@pytest.fixture(scope="session")
def gateway_url(model_pair, engine_backend):
    settings = gateway_settings(model_pair, backend_url=engine_backend[0], backend_kind="reference")
    with serve(create_app(settings)) as url:
        yield url


def pytest_collection_modifyitems(config, items):
    """SPECPREFILL_SKIP_VLLM=1 leaves out the tests that install and start real vLLM (offline machines)."""
    if os.environ.get("SPECPREFILL_SKIP_VLLM") != "1":
        return
    kept = [item for item in items if "vllm" not in item.keywords]
    config.hook.pytest_deselected(items=[item for item in items if "vllm" in item.keywords])
    items[:] = kept
