#!/usr/bin/env bash
# Installs (once) the coding agents the tests run through the gateway, pinned: Claude Code and Codex CLI, from the
# npm registry, into a cached folder of their own. Prints the folder holding their commands (claude, codex).
set -euo pipefail
claude="${CLAUDE_CODE_VERSION:-2.1.332}"
codex="${CODEX_VERSION:-0.171.0}"
root="${SPECPREFILL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specprefill}"
dir="$root/agent-clis-$claude-$codex"
if [ ! -f "$dir/.ready" ]; then
    command -v npm >/dev/null || { echo "agent-clis: npm is not installed (Node.js 20 or later)" >&2; exit 1; }
    echo "agent-clis: installing @anthropic-ai/claude-code@$claude and @openai/codex@$codex into $dir (once)" >&2
    rm -rf "$dir"
    mkdir -p "$dir"
    npm install --no-audit --no-fund --loglevel=error --prefix "$dir" \
        "@anthropic-ai/claude-code@$claude" "@openai/codex@$codex" >&2
    "$dir/node_modules/.bin/claude" --version >&2
    "$dir/node_modules/.bin/codex" --version >&2
    touch "$dir/.ready"
fi
echo "$dir/node_modules/.bin"
