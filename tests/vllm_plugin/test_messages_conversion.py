"""The gateway converts Anthropic Messages requests to chat exactly as vLLM does: vLLM's own conversion
(``AnthropicServingMessages.to_chat_completion_request``, run in the CPU build's venv) and ours give the same
messages, the same tools as the template sees them, and the same sampling fields, on a set of conversations with
system blocks, Claude Code's billing header, tool_use and tool_result turns, inline system messages and thinking.
Equal chats render equally: the chat path's rendering is held equal to vLLM's by the swap tests."""

from __future__ import annotations

import json
import subprocess

import pytest

from common.chat import render_chat, template_tools
from common.messages import MessagesRequest
from common.models import load_tokenizer
from common.protocol import ChatMessage
from tests.vllm_plugin.test_vllm_integration import _vllm_python

pytestmark = pytest.mark.vllm

TOOL = {
    "name": "read_file",
    "description": "Read a file",
    "cache_control": {"type": "ephemeral"},
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}
BARE_TOOL = {"name": "list_files", "input_schema": {"properties": {"dir": {"type": "string"}}}}
CASES = [
    {"system": "Be brief.", "messages": [{"role": "user", "content": "Hello"}]},
    {
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=ab12;"},
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": " Use the tools."},
        ],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}],
            }
        ],
    },
    {
        "system": "Agent.",
        "tools": [TOOL, BARE_TOOL],
        "tool_choice": {"type": "any"},
        "messages": [
            {"role": "user", "content": "Read main.py"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Reading it."},
                    {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "main.py"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "print(1)"},
                    {"type": "text", "text": "And now?"},
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_2", "name": "list_files", "input": {"dir": "."}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "is_error": False,
                        "content": [{"type": "text", "text": "a.py"}, {"type": "text", "text": "b.py"}],
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
        ],
    },
    {
        "tools": [TOOL],
        "tool_choice": {"type": "tool", "name": "read_file", "disable_parallel_tool_use": True},
        "stop_sequences": ["</done>"],
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
        "metadata": {"user_id": "u1"},
        "messages": [
            {"role": "user", "content": "Go"},
            {"role": "system", "content": "Reminder: stay on task."},
            {"role": "user", "content": "Continue"},
        ],
    },
    {
        "messages": [
            {"role": "user", "content": "Think"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Hmm.", "signature": "s"},
                    {"type": "text", "text": "Done."},
                    {"type": "tool_result", "tool_use_id": "t", "content": "x"},
                ],
            },
            {"role": "user", "content": "Again"},
        ],
        "tool_choice": {"type": "none"},
    },
    # Claude Code's advanced tool use: a deferred tool, then tools announced and withdrawn mid-conversation
    {
        "tools": [TOOL, {**BARE_TOOL, "defer_loading": True}],
        "messages": [
            {"role": "user", "content": "Go"},
            {
                "role": "system",
                "content": [
                    {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "list_files"}},
                    {
                        "type": "tool_addition",
                        "tool": {
                            "type": "tool_definition",
                            "definition": {
                                "name": "grep",
                                "description": "Search",
                                "input_schema": {"type": "object"},
                                "defer_loading": True,
                            },
                        },
                    },
                    {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "read_file"}},
                ],
            },
            {"role": "user", "content": "Continue"},
        ],
    },
    {
        "tools": [TOOL],
        "messages": [
            {"role": "user", "content": "Show me"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_9", "name": "read_file", "input": {"path": "plot.png"}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_9",
                        "content": [
                            {"type": "text", "text": "the plot:"},
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                            },
                            {"type": "tool_reference", "tool_name": "read_file"},
                        ],
                    }
                ],
            },
        ],
    },
]

VLLM_SIDE = r"""
import json, sys
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
out = []
for case in json.load(sys.stdin):
    for merge in (False, True):
        chat = AnthropicServingMessages.to_chat_completion_request(
            AnthropicMessagesRequest.model_validate(case), merge_inline_system=merge)
        choice = chat.tool_choice
        out.append({"messages": chat.messages, "tools": [t.model_dump() for t in chat.tools] if chat.tools else None,
                    "tool_choice": choice if isinstance(choice, (str, type(None))) else choice.model_dump(),
                    "parallel_tool_calls": chat.parallel_tool_calls, "stop": chat.stop, "max_tokens": chat.max_tokens,
                    "temperature": chat.temperature, "top_p": chat.top_p, "top_k": chat.top_k})
print(json.dumps(out))
"""


def test_messages_convert_to_chat_as_vllm_converts_them(model_pair):
    cases = [{"model": "m", "max_tokens": 16, **case} for case in CASES]
    done = subprocess.run(
        [_vllm_python(), "-c", VLLM_SIDE], input=json.dumps(cases), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = iter(json.loads(done.stdout.strip().splitlines()[-1]))
    tokenizer = load_tokenizer(model_pair / "target")
    for case in cases:
        for merge in (False, True):
            vllm = next(theirs)
            chat = MessagesRequest.model_validate(case).as_chat(merge)
            fields = chat.model_dump(exclude_unset=True)
            assert fields["messages"] == vllm["messages"]
            assert template_tools(chat.tools) == vllm["tools"]
            assert fields.get("tool_choice") == vllm["tool_choice"]
            assert fields.get("parallel_tool_calls", True) == vllm["parallel_tool_calls"]
            assert fields.get("stop", []) == (vllm["stop"] or [])
            for name in ("max_tokens", "temperature", "top_p", "top_k"):
                assert fields.get(name) == vllm[name], name
            # and both render alike (the demo template takes system messages anywhere; images and tool references
            # are not text: the gateway sends such requests whole)
            if not merge and all(m.has_only_text() for m in chat.messages):
                messages = [ChatMessage.model_validate(m) for m in vllm["messages"]]
                assert (
                    render_chat(tokenizer, chat.messages, tools=chat.tools).token_ids
                    == render_chat(tokenizer, messages, tools=vllm["tools"]).token_ids
                )
