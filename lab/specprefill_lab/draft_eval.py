"""Drafts with another tokenizer, measured: the retrieval task through live gateways, one per draft, asked with the
OpenAI SDK; and what mapping a prompt costs next to scoring it.

Each gateway serves the retrieval pair's target (in-process reference engine) with one draft: the pair's own
(same tokenizer), or one with another tokenizer, whose scores the gateway maps onto the target's tokens
(``gateway.planning.token_mapping``). Planner ``fresh``: this target costs about what its draft does, so the cost
planner would send every prompt whole and measure nothing.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from tqdm import tqdm

from common.models import load_tokenizer
from specprefill_lab.launch import launched_gateway
from specprefill_lab.retrieval import make_sample


@dataclass
class DraftAccuracy:
    draft: str
    tokenizer: str  # "shared" or "mapped"
    accuracy: dict[str, float] = field(default_factory=dict)  # keep rate (or "full") -> fraction correct
    kept_fraction: dict[str, float] = field(default_factory=dict)
    draft_ms: float = 0.0  # median draft time per prompt (score cache misses)


def evaluate_drafts(
    target: Path, drafts: list[Path], *, samples: int, words: int, keep_rates: list[float], seed: int = 1234
) -> list[DraftAccuracy]:
    rng = random.Random(seed)
    prompts = [make_sample(rng, words, 37) for _ in range(samples)]
    results = []
    for draft in drafts:
        args = [
            "--target-model",
            str(target),
            "--draft-model",
            str(draft),
            "--served-model-name",
            "retrieval",
            "--planner",
            "fresh",
            "--min-prompt-tokens",
            "64",
            "--memory-cache-mb",
            "0",
            "--device",
            "cpu",
        ]
        with (
            launched_gateway(args) as url,
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
        ):
            mode = httpx.get(f"{url}/health").json()["draft"]["tokenizer"]
            result = DraftAccuracy(str(draft), mode)
            variants = [("full", {"x-specprefill": "off"})] + [
                (f"{k:g}", {"x-keep-rate": f"{k:g}"}) for k in keep_rates
            ]
            draft_ms = []
            for name, headers in variants:
                correct, kept = 0, 0.0
                for sample in tqdm(prompts, desc=f"{draft.name} {name}", unit="prompt", leave=False):
                    raw = client.completions.with_raw_response.create(
                        model="retrieval", prompt=sample.text, max_tokens=1, temperature=0, extra_headers=headers
                    )
                    correct += raw.parse().choices[0].text.strip() == sample.answer
                    kept += int(raw.headers["x-specprefill-kept-tokens"]) / int(
                        raw.headers["x-specprefill-original-tokens"]
                    )
                    if raw.headers["x-specprefill-status"] == "compressed":
                        draft_ms.append(float(raw.headers["x-specprefill-draft-ms"]))
                result.accuracy[name] = correct / len(prompts)
                result.kept_fraction[name] = kept / len(prompts)
            result.draft_ms = statistics.median(draft_ms) if draft_ms else 0.0
        results.append(result)
    return results


def format_drafts(results: list[DraftAccuracy]) -> str:
    names = list(results[0].accuracy)
    lines = [f"{'draft':>12} {'tokenizer':>9} " + " ".join(f"{n:>7}" for n in names) + f" {'draft ms':>9}"]
    for r in results:
        lines.append(
            f"{Path(r.draft).name:>12} {r.tokenizer:>9} "
            + " ".join(f"{r.accuracy[n]:>7.1%}" for n in names)
            + f" {r.draft_ms:>9.1f}"
        )
    lines.append(f"{'(kept)':>22} " + " ".join(f"{results[0].kept_fraction[n]:>7.1%}" for n in names))
    return "\n".join(lines)


def mapping_cost(target: Path, draft: Path, *, tokens: int = 4096, repeats: int = 5, seed: int = 7) -> dict:
    """Seconds to map one ~``tokens``-token prompt onto the draft and its scores back (``TokenMapping``),
    against the draft's scoring of it, medians of ``repeats`` runs in this process."""
    from draft_worker import DraftWorker
    from gateway.planning.token_mapping import TokenMapping

    target_tokenizer = load_tokenizer(target)
    worker = DraftWorker.from_pretrained(draft, device="cpu", prefix_cache_bytes=0)
    mapping = TokenMapping(target_tokenizer, worker.tokenizer)
    words = tokens
    while True:  # the target's tokens of a sample near the size asked
        text = make_sample(random.Random(seed), words, 37).text
        ids = target_tokenizer(text).input_ids
        if len(ids) <= tokens or words < 64:
            break
        words = int(words * tokens / len(ids)) - 1
    map_s, score_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        mapped = mapping.draft_input(ids)
        middle = time.perf_counter()
        scores = worker.score(mapped.draft_ids)
        end = time.perf_counter()
        mapping.project(scores, mapped)
        map_s.append(middle - start + time.perf_counter() - end)
        score_s.append(end - middle)
    mapped_ms, scored_ms = statistics.median(map_s) * 1e3, statistics.median(score_s) * 1e3
    return {
        "target_tokens": len(ids),
        "draft_tokens": len(mapped.draft_ids),
        "mapping_ms": mapped_ms,
        "draft_ms": scored_ms,
        "ratio": mapped_ms / scored_ms,
    }
