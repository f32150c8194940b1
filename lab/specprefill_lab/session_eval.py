"""Answer quality across requests: one document, several questions, through a live gateway.

Two forms of the retrieval task (``retrieval.make_session``): the questions asked in successive turns (each
prompt the transcript so far: the document, the earlier questions with the answers the gateway gave, the
new question) and as separate requests (the document and one question each). Every answer is checked, and
so is the full prompt's answer to the very same prompt (the target in process, reading it whole); the report
gives both turn by turn, and which plan each request took, with warming on (the default) and off.

The retrieval pair's target costs about what its draft does, so the planner left to itself would send every
prompt whole and the eval would measure nothing. The gateway runs with fixed cost models of a large target
(``REALISTIC_COSTS``: the demo pair's start-up calibration on a 2-core CPU, a target 32x the draft per
token), so it plans as it would in a real deployment while the retrieval pair answers.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from tqdm import tqdm

from common.models import load_causal_lm, load_tokenizer
from engine.runner import prefill
from specprefill_lab.bench import wait_idle
from specprefill_lab.launch import launched_gateway
from specprefill_lab.retrieval import make_session, question

REALISTIC_COSTS = {"target": [0.0425, 9.17e-4, 0.0, 1.33e-07], "draft": [0.035, 7.0e-07, 5.76e-08, 7.76e-06]}
FORMS = ("turns", "requests")


@dataclass
class SessionResult:
    form: str
    warming: bool
    correct: list[int] = field(default_factory=list)  # per turn
    full_correct: list[int] = field(default_factory=list)
    asked: list[int] = field(default_factory=list)
    plans: list[dict[str, int]] = field(default_factory=list)  # per turn: plan -> requests
    kept_fraction: list[float] = field(default_factory=list)

    def record(self, turn: int, correct: bool, full_correct: bool, plan: str, kept: float) -> None:
        while len(self.asked) <= turn:
            self.correct.append(0), self.full_correct.append(0), self.asked.append(0), self.plans.append({})
            self.kept_fraction.append(0.0)
        self.correct[turn] += correct
        self.full_correct[turn] += full_correct
        self.asked[turn] += 1
        self.plans[turn] = dict(Counter(self.plans[turn]) + Counter({plan: 1}))
        self.kept_fraction[turn] += (kept - self.kept_fraction[turn]) / self.asked[turn]


class FullPrompt:
    """The target reading a prompt whole, in process: the reference answer."""

    def __init__(self, pair: Path) -> None:
        self.tokenizer = load_tokenizer(pair / "target")
        self.model = load_causal_lm(pair / "target", device="cpu", dtype="float32")

    @torch.inference_mode()
    def answer(self, prompt: str) -> str:
        ids = self.tokenizer(prompt).input_ids
        logits, _ = prefill(self.model, torch.tensor([ids]), torch.arange(len(ids))[None])
        return self.tokenizer.convert_ids_to_tokens(int(logits.argmax()))


def evaluate_sessions(
    pair: Path, *, samples: int = 30, words: int = 1500, questions: int = 4, keep_rate: float = 0.1, seed: int = 99
) -> list[SessionResult]:
    full = FullPrompt(pair)
    results = []
    for warming in (True, False):
        args = [
            "--target-model",
            str(pair / "target"),
            "--draft-model",
            str(pair / "draft"),
            "--served-model-name",
            "retrieval",
            "--device",
            "cpu",
            "--min-prompt-tokens",
            "512",
            "--cost-coefficients",
            json.dumps(REALISTIC_COSTS),
            *([] if warming else ["--no-warming"]),
        ]
        for form in FORMS:  # each in a gateway of its own: its engine's cache starts empty
            with launched_gateway(args) as url:
                result = SessionResult(form, warming)
                rng = random.Random(seed)
                sessions = [make_session(rng, words, max(2, words // 40), questions) for _ in range(samples)]
                label = f"sessions: {form}, warming {'on' if warming else 'off'}"
                asyncio.run(_run_sessions(url, sessions, form, keep_rate, full, result, label))
                results.append(result)
    return results


async def _run_sessions(
    url: str, sessions: list, form: str, keep_rate: float, full: FullPrompt, result: SessionResult, label: str
) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for session in tqdm(sessions, desc=label):
            await _run_session(client, url, session, form, keep_rate, full, result)


async def _run_session(
    client: httpx.AsyncClient, url: str, session, form: str, keep_rate: float, full: FullPrompt, result: SessionResult
) -> None:
    transcript = session.context
    for turn, (key, value) in enumerate(session.questions):
        prompt = f"{transcript if form == 'turns' else session.context} {question(key)}"
        await wait_idle(client, [url])  # a user's think time: the warm of the previous request, if any, is done
        response = await client.post(
            "/v1/completions",
            headers={"x-keep-rate": f"{keep_rate:g}"},
            json={"model": "retrieval", "prompt": prompt, "max_tokens": 1, "temperature": 0},
        )
        response.raise_for_status()
        answer = response.json()["choices"][0]["text"].strip()
        kept = int(response.headers["x-specprefill-kept-tokens"]) / int(
            response.headers["x-specprefill-original-tokens"]
        )
        result.record(turn, answer == value, full.answer(prompt) == value, response.headers["x-specprefill-plan"], kept)
        transcript = f"{prompt} {answer} <eos>"


def format_sessions(results: list[SessionResult]) -> str:
    turns = max(len(r.asked) for r in results)
    lines = [
        f"{'form':>9} {'warming':>7}  " + "  ".join(f"{'turn ' + str(t + 1):>22}" for t in range(turns)),
        f"{'':>9} {'':>7}  " + "  ".join(f"{'keep0.1 / full (ratio)':>22}" for _ in range(turns)),
    ]
    for r in results:
        cells = []
        for t in range(len(r.asked)):
            ratio = r.correct[t] / r.full_correct[t] if r.full_correct[t] else float("nan")
            cells.append(f"{r.correct[t] / r.asked[t]:>6.0%} / {r.full_correct[t] / r.asked[t]:>4.0%} ({ratio:.2f})")
        lines.append(f"{r.form:>9} {'on' if r.warming else 'off':>7}  " + "  ".join(f"{c:>22}" for c in cells))
        lines.append(
            f"{'':>9} {'plans':>7}  "
            + "  ".join(f"{', '.join(f'{k} {v}' for k, v in sorted(p.items())):>22}" for p in r.plans)
        )
    return "\n".join(lines)
