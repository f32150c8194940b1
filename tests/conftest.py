"""Session-wide fixtures: tiny random models made here, never downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.app import create_app
from specprefill_lab.demo_models import ModelShape, train_tokenizer, write_model
from tests.helpers import OPEN_CLIENTS, RecordingApp, engine_app, gateway_settings, serve


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
def long_pair(tmp_path_factory, tokenizer) -> Path:
    """The small pair's shapes with 131,072 positions (a coding agent's prompt: 35,000+ tokens), for the agents'
    sessions. The target's end-of-turn row is doubled, so its random answers end within tens of tokens (agents ask
    for 32,000), and its generation config is greedy (vLLM's default sampling for requests that set none)."""
    import copy
    import json

    from safetensors.torch import load_file, save_file

    from specprefill_lab.demo_models import eos_ids

    root = tmp_path_factory.mktemp("long-pair")
    long = copy.deepcopy(tokenizer)
    long.model_max_length = 131_072
    write_model(root / "draft", ModelShape(64, 128, 2, 4, 2), long, seed=1, max_positions=131_072, init_std=0.2)
    write_model(root / "target", ModelShape(128, 256, 2, 4, 2), long, seed=2, max_positions=131_072, init_std=0.2)
    weights = load_file(root / "target" / "model.safetensors")
    weights["lm_head.weight"][eos_ids(tokenizer)[0]] *= 2.0
    save_file(
        {k: v.contiguous() for k, v in weights.items()},
        root / "target" / "model.safetensors",
        metadata={"format": "pt"},
    )
    generation = json.loads((root / "target" / "generation_config.json").read_text())
    (root / "target" / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.0}))
    return root


@pytest.fixture(scope="session", autouse=True)
def _probes_of_this_session(tmp_path_factory):
    """Gateways started here keep their start-up probes for this session only: a run never fits its cost models on
    timings another run took (on a machine then busier or idler)."""
    previous = os.environ.get("SPECPREFILL_CALIBRATION_DIR")
    os.environ["SPECPREFILL_CALIBRATION_DIR"] = str(tmp_path_factory.mktemp("probes"))
    yield
    if previous is None:
        os.environ.pop("SPECPREFILL_CALIBRATION_DIR", None)
    else:
        os.environ["SPECPREFILL_CALIBRATION_DIR"] = previous


@pytest.fixture(scope="session", autouse=True)
def _close_sdk_clients():
    yield
    while OPEN_CLIENTS:
        OPEN_CLIENTS.pop().close()


@pytest.fixture(scope="session")
def redis_url() -> str:
    return os.environ.get("SPECPREFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def engine_backend(model_pair):
    recorder = RecordingApp(engine_app(model_pair))
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


@pytest.fixture(scope="session")
def make_serve_gateway():
    """The gateway as `make serve` starts it: the default real pair (made on first use), in process."""
    from specprefill.commands.servers import Serve

    with serve(create_app(Serve(port=0).with_default_models()), timeout=600) as url:
        yield url
