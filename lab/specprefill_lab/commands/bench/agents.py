"""``specprefill bench agents``: coding agents' sessions (Claude Code, Codex CLI, headless) turn after turn
through the gateway and directly, each path on its own engine."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import Field

from specprefill_lab.commands.bench.stack import Gateway, gateway_counters, pair_description
from specprefill_lab.launch import Stack, launched

SCRIPTS = Path(__file__).resolve().parents[4] / "scripts"  # the repository's scripts/


class Agents(Gateway):
    """Coding agents' sessions through the gateway and directly, each path on its own engine (agents.json); the
    demo pair (131,072 positions), or --pair."""

    names: list[str] = Field(["claude", "codex"], description="which agents (claude, codex)")
    sessions: int = Field(1, ge=1, description="sessions per agent and path")
    turns: int = Field(5, ge=1, description="turns per session")
    think: float = Field(5.0, ge=0, description="seconds between an answer and the next turn")
    direct: str = Field(
        "session",
        description="the direct path's requests: session (the agent's own session against the engine) or "
        "replay (the requests the agent sent through the gateway, as it sent them: the same prompts on both paths)",
    )
    max_new_tokens: int = Field(
        512,
        gt=0,
        description="the engines' cap on each answer (a safety net: "
        "the target's end-of-turn row is doubled so its random answers end by "
        "themselves; an agent takes an answer cut at the cap for an error)",
    )

    def cli_cmd(self) -> None:
        raise SystemExit(self.run())

    def run(self) -> int:
        """Each agent's sessions through each path's timing proxy: the direct path's engine stock, the gateway's
        with the plugin (vLLM), the same turns in the same order, one path after the other (which first
        alternating)."""
        from specprefill_lab.agents import AGENT_MODELS, as_dicts, ending_target, format_turns, summarize_turns
        from specprefill_lab.demo_models import ensure_demo_models

        if (refused := self.refused()) is not None:
            print(f"specprefill bench: {refused}", file=sys.stderr)
            return 2
        bin_dir = agent_clis()
        if bin_dir is None:
            return 1
        out = Path(self.out)
        out.mkdir(parents=True, exist_ok=True)
        target, draft = self.models()
        pair = Path(self.pair) if self.pair else ensure_demo_models()
        target = ending_target(target or pair / "target", out)
        cap = self.max_new_tokens
        args = self.gateway_args() + ["--model-alias", ",".join(AGENT_MODELS)]
        turns: list = []
        failures: list[dict] = []
        meta = self.meta()

        def write() -> list[dict]:  # after every session: a run cut short keeps what it measured
            rows = summarize_turns(turns)
            (out / "agents.json").write_text(
                json.dumps({"meta": meta, "summary": rows, "failures": failures, "turns": as_dicts(turns)}, indent=1)
            )
            return rows

        served = ("--served-model-name", "specprefill-demo")
        with launched(
            2,
            args,
            self.vllm_python,
            out,
            pair,
            vllm_args=("--override-generation-config", json.dumps({"max_new_tokens": cap}), *served, *AGENT_MODELS),
            kv_events=self.kv_events,
            target=target,
            draft=draft,
            max_model_len=131_072,
            engine_args=(
                "--max-new-tokens",
                str(cap),
                *served,
                *(a for n in AGENT_MODELS for a in ("--model-alias", n)),
            ),
        ) as stack:
            self.sessions_through(stack, bin_dir, out, turns, failures, write)
            meta["gateway_counters"] = gateway_counters(stack.gateway_url)
        print(format_turns(write()))
        print(f"wrote {out / 'agents.json'}")
        return 0 if not failures else 1

    def refused(self) -> str | None:
        """What is wrong with these options, if anything."""
        unknown = sorted(set(self.names) - {"claude", "codex"})
        if unknown:
            return f"unknown agent {unknown[0]!r}: use claude or codex"
        if self.direct not in ("session", "replay"):
            return "--direct is session or replay"
        return None

    def meta(self) -> dict:
        """What the run measured, written beside its results."""
        return {
            "engine": "vllm" if self.vllm_python else "reference",
            "think_s": self.think,
            "direct": self.direct,
            "turns": self.turns,
            "sessions": self.sessions,
            "max_new_tokens": self.max_new_tokens,
            "pair": pair_description(self.pair),
        }

    def sessions_through(
        self, stack: Stack, bin_dir: Path, out: Path, turns: list, failures: list, write: Callable[[], object]
    ) -> None:
        """Every agent's sessions, each through both paths' timing proxies (which first alternating; with
        ``--direct replay``, the gateway's session, then its requests again directly); ``write`` after each."""
        from specprefill_lab.agents import TimingProxy, replay_session, run_session

        proxies = {"gateway": TimingProxy(stack.gateway_url), "direct": TimingProxy(stack.direct_url)}
        replay = self.direct == "replay"
        with contextlib.ExitStack() as running:
            urls = {name: running.enter_context(proxy.serving()) for name, proxy in proxies.items()}
            for agent in self.names:
                for session in range(self.sessions):
                    order = ("direct", "gateway") if session % 2 == 0 else ("gateway", "direct")
                    for path in ("gateway",) if replay else order:
                        print(f"agents: {agent} session {session + 1} through {path}", flush=True)
                        first = len(proxies[path].sent)
                        done, error = run_session(
                            agent, bin_dir, path, urls[path], proxies[path], out / "sessions", session,
                            self.turns, self.think,
                        )  # fmt: skip
                        turns += done
                        if error is not None:
                            print(f"agents: {agent} session {session + 1} through {path} failed at {error[:600]}")
                            failures.append({"agent": agent, "path": path, "session": session, "error": error})
                        if replay:
                            print(f"agents: {agent} session {session + 1}: its requests again, directly", flush=True)
                            sent = proxies[path].sent[first:]
                            turns += replay_session(done, sent, "direct", urls["direct"], proxies["direct"])
                        write()


def agent_clis() -> Path | None:
    """The agent CLIs' bin folder, installed once (``scripts/agent-clis.sh``); None where they cannot be."""
    installed = subprocess.run(["bash", str(SCRIPTS / "agent-clis.sh")], capture_output=True, text=True, timeout=1800)
    if installed.returncode != 0:
        print(f"specprefill bench: the agents could not be installed:\n{installed.stderr[-2000:]}", file=sys.stderr)
        return None
    return Path(installed.stdout.strip().splitlines()[-1])
