"""Coding agents through the gateway, run as their users run them: Claude Code (two turns of one headless session)
and Codex CLI (`codex exec`), installed once from the npm registry at pinned versions (scripts/agent-clis.sh),
against the reference engine and (Claude Code) vLLM. The target is the small pair's with 131,072 positions
(their prompts run to 35,000 tokens and more); its answers are random text, which the agents take as the reply."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from tests.helpers import RecordingApp, gateway_settings, serve

REPO = Path(__file__).resolve().parents[1]
# the names the pinned agents send by default (Claude Code 2.1.332, Codex CLI 0.171.0), served as the target
ALIASES = ["claude-opus-5-5", "gpt-6.2-sol"]


@pytest.fixture(scope="module")
def agents() -> Path:
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: the agents come from the npm registry")
    out = subprocess.run(["bash", str(REPO / "scripts" / "agent-clis.sh")], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"could not install the agents:\n{out.stderr[-3000:]}"
    return Path(out.stdout.strip().splitlines()[-1])


def _settings(pair: Path, **overrides):
    """The gateway as a deployment runs it (the cost planner, warming), serving the agents' model names."""
    return gateway_settings(
        pair,
        **{
            "served_model_name": "tiny",
            "model_alias": ALIASES,
            "planner": "cost",
            "warming": True,
            "min_prompt_tokens": 1024,
            **overrides,
        },
    )


def _workdir(tmp_path: Path) -> Path:
    work = tmp_path / "project"
    work.mkdir(parents=True)
    (work / "hello.py").write_text('print("hello")\n')
    return work


def claude(
    agents: Path, url: str, work: Path, prompt: str, *, again: bool = False, headers: str | None = None
) -> tuple[dict, str]:
    """One headless turn (``again``: the next turn of the same session), as a user runs it; its JSON result and
    its standard error."""
    home = work.parent / "home"
    home.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": "sk-test",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    if headers:
        env["ANTHROPIC_CUSTOM_HEADERS"] = headers
    command = [str(agents / "claude"), *(["-c"] if again else []), "-p", prompt, "--output-format", "json"]
    out = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"claude exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    result = json.loads(out.stdout)
    assert result["subtype"] == "success" and not result["is_error"] and result["api_error_status"] is None, result
    assert result["result"], result
    return result, out.stderr


def _counted(url: str, bodies: list[dict]) -> int:
    """The prompt tokens of these Messages requests, as the gateway counts them (``/v1/messages/count_tokens``)."""
    keep = ("model", "messages", "system", "tools", "tool_choice", "thinking")
    return sum(
        httpx.post(f"{url}/v1/messages/count_tokens", json={k: b[k] for k in keep if k in b}, timeout=60).json()[
            "input_tokens"
        ]
        for b in bodies
    )


def test_a_claude_code_session_of_two_turns_through_the_gateway(agents, long_pair, tmp_path):
    recorder = RecordingApp(create_app(_settings(long_pair)))
    work = _workdir(tmp_path)
    with serve(recorder, timeout=120) as url:
        first, stderr = claude(agents, url, work, "What does hello.py print?")
        sent = [r for r in recorder.requests if r["path"] == "/v1/messages"]
        second, stderr2 = claude(agents, url, work, "And what does it print when run twice?", again=True)
        later = [r for r in recorder.requests if r["path"] == "/v1/messages"][len(sent) :]
        counted = (_counted(url, [r["body"] for r in sent]), _counted(url, [r["body"] for r in later]))
    assert second["session_id"] == first["session_id"]
    assert "unrecognized_model" not in stderr + stderr2  # it sends its default model's name, served (an alias)
    assert sent[0]["body"]["model"] == ALIASES[0]
    body = sent[0]["body"]
    # what Claude Code sends, accepted as sent: its betas, thinking, context management, metadata, tools, a long
    # system prompt in several blocks, the cache markers
    assert "claude-code" in sent[0]["headers"]["anthropic-beta"] and body["thinking"]["type"] in ("enabled", "adaptive")
    assert "context_management" in body and "metadata" in body and len(body["tools"]) >= 10
    assert isinstance(body["system"], list) and len(body["system"]) > 1
    assert sum(len(b.get("text", "")) for b in body["system"]) > 5_000
    for result, tokens in zip((first, second), counted, strict=True):
        usage = result["usage"]  # the input Claude Code reports adds up to the prompt the gateway read
        assert (
            usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"] == tokens
        ), (usage, tokens)
        assert tokens > 30_000


@pytest.mark.parametrize("model", [None, "tiny"], ids=["default-model", "model-named"])
def test_a_codex_exec_turn_through_the_gateway(agents, long_pair, tmp_path, model):
    """docs/using/agents.md's config as it is (Codex asks for its default model, one of the agents' names the
    gateway answers to), and with the line a user of a local model adds, naming the served model: Codex then
    offers its hosted web_search tool too, which the gateway leaves out."""
    work = _workdir(tmp_path)
    codex_home = tmp_path / "codex"
    codex_home.mkdir()
    recorder = RecordingApp(create_app(_settings(long_pair, model_alias=[])))  # no aliases: the defaults only
    with serve(recorder, timeout=120) as url:
        (codex_home / "config.toml").write_text(
            (f'model = "{model}"\n' if model else "")
            + f'model_provider = "specprefill"\n\n[model_providers.specprefill]\nname = "SpecPrefill gateway"\n'
            f'base_url = "{url}/v1"\nwire_api = "responses"\n'
        )
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CODEX_HOME": str(codex_home)}
        out = subprocess.run(
            [str(agents / "codex"), "exec", "--skip-git-repo-check", "What does hello.py print?"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
        )
    assert out.returncode == 0, f"codex exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    assert out.stdout.strip() and "tokens used" in out.stderr
    assert "error" not in out.stderr.lower().replace("stderr", ""), out.stderr[-2000:]
    sent = [r["body"] for r in recorder.requests if r["path"] == "/v1/responses"]
    assert sent and sent[0]["model"] == (model or ALIASES[1])
    if model is None:
        assert "Model metadata" not in out.stderr  # its default model's name, served as the target
    else:  # Codex offers web_search to a model it does not know
        assert any(t.get("type") == "web_search" for t in sent[0]["tools"]), sent[0]["tools"]


@pytest.mark.vllm
def test_a_claude_code_session_answers_through_the_gateway_as_directly_at_vllm(agents, long_pair, tmp_path):
    """Claude Code at vLLM itself and through the gateway in front of it (the plugin), two turns each: greedy
    (the target's generation config), the gateway's plan whole (``x-specprefill: off``, which Claude Code sends
    from ``ANTHROPIC_CUSTOM_HEADERS``), the same answers."""
    from specprefill_lab.launch import README_VLLM_ARGS  # as the README starts vLLM
    from specprefill_lab.vllm_server import VLLMServer
    from tests.vllm_plugin.test_vllm_integration import _vllm_python

    server = VLLMServer(
        _vllm_python(),
        long_pair / "target",
        tmp_path / "vllm.log",
        plugin=True,
        served_name=ALIASES[0],
        max_model_len=131_072,
        pinned=False,
        extra_args=("--disable-log-stats", *README_VLLM_ARGS),
    )
    try:
        server.wait()
        answers = {}
        for path in ("direct", "gateway"):
            # the same folder for both (Claude Code's system prompt names its working directory), emptied between
            shutil.rmtree(tmp_path / "run", ignore_errors=True)
            work = _workdir(tmp_path / "run")
            settings = _settings(long_pair, backend_url=server.url, backend_kind="vllm")
            with serve(create_app(settings), timeout=120) as gateway:
                url, headers = (server.url, None) if path == "direct" else (gateway, "x-specprefill: off")
                first, _ = claude(agents, url, work, "What does hello.py print?", headers=headers)
                second, _ = claude(agents, url, work, "And twice?", again=True, headers=headers)
            answers[path] = [first["result"], second["result"]]
    finally:
        server.stop()
    assert answers["gateway"] == answers["direct"]
