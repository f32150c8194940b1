from __future__ import annotations

import io
import json
import subprocess
import sys

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from common.models import compute_dtype, load_causal_lm
from engine.server import create_app as create_engine_app
from engine.settings import EngineSettings
from gateway.app import create_app
from specprefill.cli import main
from specprefill_lab.demo_models import SHAPES, flops_per_token, llama_config, write_demo_models
from tests.helpers import LONG_DOC, gateway_settings, serve


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


def test_score_text_marks_dropped_spans_at_the_servers_default_rate(model_pair):
    out = _run("score", "--model", str(model_pair / "draft"), "-", stdin="Cadupa anbe bora je lipa ancuci. " * 80)
    assert out.returncode == 0, out.stderr
    assert "dropped:" in out.stdout and "kept " in out.stderr
    assert "(auto)" in out.stderr  # the default keep rate, as the gateway's


def test_score_token_ids_and_a_bad_list(model_pair):
    ids = json.dumps(list(range(5, 205)))
    out = _run(
        "score",
        "--model",
        str(model_pair / "draft"),
        "--token-ids",
        "--json",
        "--chunk-size",
        "1",
        "--protect-first",
        "0",
        "--protect-last",
        "0",
        "--keep-rate",
        "0.1",
        "-",
        stdin=ids,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kept_tokens"] == 20
    bad = _run("score", "--model", str(model_pair / "draft"), "--token-ids", "-", stdin="[1, 'a']")
    assert bad.returncode == 2 and "JSON list of integers" in bad.stderr


def test_demo_models_are_loadable_and_the_target_costs_10x(tmp_path):
    main(["demo-models", str(tmp_path)])
    tokenizers = [AutoTokenizer.from_pretrained(tmp_path / name) for name in ("draft", "target")]
    assert tokenizers[0].get_vocab() == tokenizers[1].get_vocab()
    ids = tokenizers[1].apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False
    )
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


def test_demo_models_at_named_shapes(tmp_path, capsys):
    """Random weights at real models' shapes, for timing on a GPU: the configs are the real ones but for the
    vocabulary (the demo tokenizer's), and the weights are saved in bf16."""
    main(
        [
            "demo-models",
            str(tmp_path),
            "--draft-shape",
            "demo-draft",
            "--target-shape",
            "demo-target",
            "--device",
            "cpu",
        ]
    )
    info = json.loads((tmp_path / "demo.json").read_text())
    assert (info["draft"], info["target"], info["dtype"]) == ("demo-draft", "demo-target", "bfloat16")
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    assert target.dtype == torch.bfloat16 and target.config.max_position_embeddings == 65536
    assert AutoTokenizer.from_pretrained(tmp_path / "target").model_max_length == 65536

    def billions(shape: str) -> float:
        config = llama_config(SHAPES[shape], AutoTokenizer.from_pretrained(tmp_path / "target"))
        with torch.device("meta"):
            return sum(p.numel() for p in LlamaForCausalLM(config).parameters()) / 1e9

    # the real counts (1.24B, 8.03B) less the embedding rows a 128,256-token vocabulary adds
    assert 0.95 < billions("llama-3.2-1b") < 1.0 and 6.9 < billions("llama-3.1-8b") < 7.1

    with pytest.raises(SystemExit) as excinfo:
        main(["demo-models", str(tmp_path / "x"), "--draft-shape", "llama-9b", "--target-shape", "llama-3.1-8b"])
    assert excinfo.value.code == 2 and "unknown shape 'llama-9b'" in capsys.readouterr().err


def test_a_shaped_pair_without_weights_makes_the_same_weights_at_every_load(tmp_path):
    """``--no-weights``: configs and the tokenizer on disk, the weights made by each loader from the seed (a
    32B shape on a GPU, where 64 GB of weights could not be written); the engine serves it as any folder."""
    main(
        [
            "demo-models",
            str(tmp_path),
            "--draft-shape",
            "demo-draft",
            "--target-shape",
            "demo-target",
            "--device",
            "cpu",
            "--no-weights",
            "--max-positions",
            "131072",
        ]
    )
    assert not list(tmp_path.glob("*/*.safetensors"))
    assert json.loads((tmp_path / "demo.json").read_text())["weights"] == "made at load"
    first, again = (load_causal_lm(tmp_path / "target", device="cpu") for _ in range(2))
    # bfloat16 as made, or float32 where this CPU has no fast bfloat16 kernels (common.models.compute_dtype)
    assert first.dtype == compute_dtype(torch.bfloat16, torch.device("cpu"))
    assert first.config.max_position_embeddings == 131072
    assert first.config.num_hidden_layers == SHAPES["demo-target"].num_hidden_layers
    for (name, a), b in zip(first.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert load_causal_lm(tmp_path / "draft", device="cpu", dtype="float32").dtype == torch.float32
    assert load_causal_lm(tmp_path / "draft", device="cpu", dtype="bfloat16").dtype == torch.bfloat16  # as asked
    with serve(create_engine_app(EngineSettings(model=str(tmp_path / "target"), device="cpu"))) as url:
        answer = httpx.post(
            f"{url}/v1/completions",
            json={"model": str(tmp_path / "target"), "prompt": [5, 6, 7], "max_tokens": 2},
            timeout=60,
        )
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1

    config = llama_config(SHAPES["qwen2.5-32b"], AutoTokenizer.from_pretrained(tmp_path / "target"))
    with torch.device("meta"):
        billions = sum(p.numel() for p in LlamaForCausalLM(config).parameters()) / 1e9
    assert 31.0 < billions < 31.5  # Qwen2.5-32B's 32.8B less its 152,064-row embedding and head


def test_unknown_subcommand_fails_cleanly(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["no-such-command"])
    assert excinfo.value.code == 2 and "invalid choice: 'no-such-command'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["score", "--model", "m", "--keep-rate", "2", "-"], "--keep-rate: keep rate must be a number in (0, 1]"),
        (["serve", "--look-ahead", "0"], "look_ahead must be >= 1"),
        (["engine"], "--model: Field required"),
        (["serve", "--workers", "2"], "--workers 2 needs --backend-url"),
        (["serve", "--workers", "2", "--backend-url", "http://127.0.0.1:9"], "--workers 2 needs --redis-url"),
        (["serve", "--workers", "0"], "--workers: Input should be greater than or equal to 1"),
    ],
)
def test_bad_options_are_one_clear_line(args, message, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(args)
    err = capsys.readouterr().err
    assert excinfo.value.code == 2 and err.startswith("specprefill: error: ") and message in err
    assert "Traceback" not in err


PROMPT_WITH_MARKUP = (
    "<|start_header_id|>system<|end_header_id|>\n\nAnswer briefly.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n" + LONG_DOC + "<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)
SCORING_OPTIONS = [
    {},
    {"protect_last": 0},
    {"protect_first": 0, "protect_last": 0, "chunk_size": 1},
    {"look_ahead": 1, "pool_kernel": 1, "chunk_size": 8, "protect_first": 16},
]


@pytest.mark.parametrize(
    "options", SCORING_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults"
)
def test_score_reports_exactly_what_the_gateway_sends(
    model_pair, engine_backend, tmp_path, capsys, monkeypatch, options
):
    """One selection rule: the last token always goes and the template's special tokens are kept, in both; an
    auto keep rate is chosen alike by both, and by the gateway's own answer."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    settings = gateway_settings(model_pair, backend_url=engine_backend[0], memory_cache_mb=0, **options)
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT_WITH_MARKUP)
    tokenizer = AutoTokenizer.from_pretrained(model_pair / "target")
    special = set(tokenizer.all_special_ids)
    with serve(create_app(settings)) as gateway:
        for keep in ("0.2", "0.5", "auto"):
            for body, source in (
                ({"prompt": PROMPT_WITH_MARKUP}, [str(prompt_file)]),
                ({"prompt": tokenizer(PROMPT_WITH_MARKUP).input_ids}, ["--token-ids", "-"]),
            ):
                response = httpx.post(
                    f"{gateway}/v1/specprefill/compress",
                    json={"model": "tiny", **body},
                    headers={"x-keep-rate": keep},
                    timeout=60,
                ).json()
                assert response["status"] == "compressed"
                monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(body["prompt"])))
                with pytest.raises(SystemExit) as excinfo:
                    main(
                        [
                            "score",
                            "--model",
                            str(model_pair / "draft"),
                            "--device",
                            "cpu",
                            "--keep-rate",
                            keep,
                            "--json",
                            *flags,
                            *source,
                        ]
                    )
                assert excinfo.value.code == 0
                scored = json.loads(capsys.readouterr().out)
                assert scored["original_tokens"] == response["original_tokens"]
                assert scored["kept_indices"] == response["position_ids"]
                ids = tokenizer(PROMPT_WITH_MARKUP).input_ids
                assert {i for i, t in enumerate(ids) if t in special} <= set(scored["kept_indices"])
                assert scored["kept_indices"][-1] == len(ids) - 1  # the last token, even with --protect-last 0
                answered = httpx.post(
                    f"{gateway}/v1/completions",
                    json={"model": "tiny", **body, "max_tokens": 1},
                    headers={"x-keep-rate": keep},
                    timeout=60,
                )
                assert answered.headers["x-specprefill-kept-tokens"] == str(response["kept_tokens"])
                assert float(answered.headers["x-specprefill-keep-rate"]) == pytest.approx(
                    response["keep_rate"], rel=1e-5
                )


@pytest.mark.parametrize(
    "bench_args,expected",
    [
        ([], {"planner": "cost", "warming": True, "keep_system_whole": True}),
        (["--baseline"], {"planner": "fresh", "warming": False, "keep_system_whole": False}),
        (["--no-gateway-warming"], {"planner": "cost", "warming": False, "keep_system_whole": True}),
        (["--no-gateway-keep-system-whole"], {"planner": "cost", "warming": True, "keep_system_whole": False}),
    ],
)
def test_bench_launches_the_gateway_its_options_name(bench_args, expected):
    """The bench's gateway options reach the launched gateway, read by the gateway's own settings parser."""
    from gateway.settings import GatewaySettings
    from specprefill_lab.commands.bench import Workloads

    options = Workloads(_cli_parse_args=bench_args)
    settings = GatewaySettings(_cli_parse_args=options.gateway_args())
    assert {name: getattr(settings, name) for name in expected} == expected
    assert settings.min_prompt_tokens == 1024
