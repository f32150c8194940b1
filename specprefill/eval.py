"""``specprefill eval``: answer quality vs keep rate.

Built-in: the synthetic retrieval task (specprefill/retrieval.py) on its trained draft/target pair, in
process. For each keep rate, SpecPrefill's selection is compared with baselines that keep the same number
of chunks (same chunk size, same protected first and last chunks): random chunks, the head of the prompt,
the tail of the prompt. The full prompt is the reference; at keep 1 every method is the full prompt.

With ``--dataset FILE.jsonl --base-url URL``: LongBench/RULER-style rows against any OpenAI endpoint,
through the gateway at each keep rate and directly (``x-specprefill: off``, or ``--direct-url``).
"""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from draft_worker import DraftWorker, ScoringConfig
from draft_worker.loader import load_causal_lm, load_tokenizer
from draft_worker.selector import protected_mask, select_chunks
from engine.runner import prefill
from specprefill.retrieval import make_sample

METHODS = ("specprefill", "random", "head", "tail")


# --- selection baselines: the same chunk budget and protection as SpecPrefill ---

def baseline_indices(method: str, length: int, keep_rate: float, config: ScoringConfig, rng: random.Random) -> list[int]:
    """Kept indices for a baseline, built with SpecPrefill's own selector from synthetic scores."""
    if method == "random":
        scores = torch.tensor([rng.random() for _ in range(length)])
    elif method == "head":
        scores = torch.linspace(1.0, 0.0, length)
    elif method == "tail":
        scores = torch.linspace(0.0, 1.0, length)
    else:
        raise ValueError(method)
    protected = protected_mask(length, config.protect_first, max(config.protect_last, 1))
    return select_chunks(scores, keep_rate, config.chunk_size, protected).tolist()


@dataclass
class RetrievalResult:
    samples: int
    tokens_mean: float
    full_accuracy: float
    accuracy: dict[str, dict[float, float]] = field(default_factory=dict)  # method -> keep rate -> accuracy
    kept_fraction: dict[float, float] = field(default_factory=dict)


@torch.inference_mode()
def evaluate_retrieval(pair_dir: Path, *, samples: int = 100, words: int = 1500, keep_rates=(0.1, 0.3, 0.5, 1.0),
                       seed: int = 1234, config: ScoringConfig | None = None) -> RetrievalResult:
    config = config or ScoringConfig()
    tokenizer = load_tokenizer(pair_dir / "target")
    target = load_causal_lm(pair_dir / "target", device="cpu", dtype="float32")
    draft = DraftWorker.from_pretrained(pair_dir / "draft", config, device="cpu", prefix_cache_bytes=0)
    rng, baseline_rng = random.Random(seed), random.Random(seed + 1)
    correct = {m: {k: 0 for k in keep_rates} for m in METHODS}
    kept_total = {k: 0.0 for k in keep_rates}
    full_correct, token_total = 0, 0

    def answer(ids: list[int], kept: list[int]) -> int:
        kept_ids = torch.tensor([[ids[i] for i in kept]])
        logits, _ = prefill(target, kept_ids, torch.tensor([kept]))
        return int(logits.argmax())

    for _ in tqdm(range(samples), desc="retrieval eval", unit="sample"):
        sample = make_sample(rng, words, max(2, words // 40))
        ids = tokenizer(sample.text).input_ids
        gold = tokenizer.convert_tokens_to_ids(sample.answer)
        token_total += len(ids)
        full_correct += answer(ids, list(range(len(ids)))) == gold
        scores = draft.score(ids)
        for keep in keep_rates:
            kept = draft.select(scores, keep, extra_protected=None).kept_indices if keep < 1 else list(range(len(ids)))
            kept_total[keep] += len(kept) / len(ids)
            correct["specprefill"][keep] += answer(ids, kept) == gold
            for method in METHODS[1:]:
                chosen = baseline_indices(method, len(ids), keep, config, baseline_rng) if keep < 1 else kept
                correct[method][keep] += answer(ids, chosen) == gold
    return RetrievalResult(
        samples=samples, tokens_mean=token_total / samples, full_accuracy=full_correct / samples,
        accuracy={m: {k: c / samples for k, c in by_keep.items()} for m, by_keep in correct.items()},
        kept_fraction={k: v / samples for k, v in kept_total.items()},
    )


def format_retrieval(result: RetrievalResult) -> str:
    keeps = sorted(result.kept_fraction)
    lines = [f"retrieval eval: {result.samples} samples, {result.tokens_mean:.0f} tokens on average; "
             f"full prompt accuracy {result.full_accuracy:.1%}",
             f"{'method':>12} " + " ".join(f"{'keep ' + format(k, 'g'):>10}" for k in keeps),
             f"{'(kept)':>12} " + " ".join(f"{result.kept_fraction[k]:>10.1%}" for k in keeps)]
    for method, by_keep in result.accuracy.items():
        lines.append(f"{method:>12} " + " ".join(f"{by_keep[k]:>10.1%}" for k in keeps))
    return "\n".join(lines)


def plot_retrieval(result: RetrievalResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    keeps = sorted(result.kept_fraction)
    for method, by_keep in result.accuracy.items():
        ax.plot(keeps, [by_keep[k] for k in keeps], "-o", label=method, lw=2.5 if method == "specprefill" else 1.2)
    ax.axhline(result.full_accuracy, color="k", ls="--", lw=1, label="full prompt")
    ax.set(xlabel="keep rate", ylabel="accuracy", ylim=(0, 1.05),
           title=f"Retrieval over ~{result.tokens_mean:.0f} tokens: accuracy vs keep rate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- JSONL datasets against any OpenAI endpoint ---

def normalize(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: list[str]) -> float:
    return float(any(normalize(prediction) == normalize(a) for a in answers))


def substring(prediction: str, answers: list[str]) -> float:
    return float(any(normalize(a) in normalize(prediction) for a in answers))


def f1(prediction: str, answers: list[str]) -> float:
    def one(pred: str, gold: str) -> float:
        p, g = normalize(pred).split(), normalize(gold).split()
        common = sum((Counter(p) & Counter(g)).values())
        if not p or not g or not common:
            return float(p == g)
        precision, recall = common / len(p), common / len(g)
        return 2 * precision * recall / (precision + recall)

    return max(one(prediction, a) for a in answers)


def rouge_l(prediction: str, answers: list[str]) -> float:
    def lcs(a: list[str], b: list[str]) -> int:
        row = [0] * (len(b) + 1)
        for x in a:
            previous = 0
            for j, y in enumerate(b, 1):
                previous, row[j] = row[j], previous + 1 if x == y else max(row[j], row[j - 1])
        return row[-1]

    def one(pred: str, gold: str) -> float:
        p, g = normalize(pred).split(), normalize(gold).split()
        common = lcs(p, g)
        if not common:
            return 0.0
        precision, recall = common / len(p), common / len(g)
        return 2 * precision * recall / (precision + recall)

    return max(one(prediction, a) for a in answers)


METRICS = {"exact_match": exact_match, "substring": substring, "f1": f1, "rouge_l": rouge_l}


@dataclass
class DatasetRow:
    messages: list[dict] | None
    prompt: str | None
    answers: list[str]
    metric: str


def load_dataset(path: Path, default_metric: str = "substring") -> list[DatasetRow]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        answers = row.get("answers") or ([row["answer"]] if "answer" in row else None)
        if not answers or not ("messages" in row or "prompt" in row or "input" in row):
            raise ValueError(f"{path}:{number}: a row needs 'messages' or 'prompt', and 'answers'")
        metric = row.get("metric", default_metric)
        if metric not in METRICS:
            raise ValueError(f"{path}:{number}: metric {metric!r} is not one of {sorted(METRICS)}")
        rows.append(DatasetRow(row.get("messages"), row.get("prompt") or row.get("input"), list(answers), metric))
    return rows


def evaluate_dataset(rows: list[DatasetRow], base_url: str, model: str, keep_rates: list[float], *,
                     direct_url: str | None = None, direct_model: str | None = None, max_tokens: int = 64,
                     api_key: str | None = None) -> dict:
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    variants = [("direct", direct_url or base_url, direct_model or model,
                 {} if direct_url else {"x-specprefill": "off"})]
    variants += [(f"keep {k:g}", base_url, model, {"x-keep-rate": f"{k:g}"}) for k in keep_rates]
    scores = {name: [] for name, *_ in variants}
    kept = {name: [] for name, *_ in variants}
    with httpx.Client(timeout=600, headers=headers) as client:
        for row in tqdm(rows, desc="dataset eval", unit="row"):
            messages = row.messages or [{"role": "user", "content": row.prompt}]
            for name, url, model_name, extra in variants:
                response = client.post(f"{url}/v1/chat/completions", headers=extra, json={
                    "model": model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
                response.raise_for_status()
                text = response.json()["choices"][0]["message"]["content"] or ""
                scores[name].append(METRICS[row.metric](text, row.answers))
                if "x-specprefill-kept-tokens" in response.headers:
                    kept[name].append(int(response.headers["x-specprefill-kept-tokens"])
                                      / int(response.headers["x-specprefill-original-tokens"]))
    return {name: {"score": sum(v) / len(v), "kept_fraction": (sum(kept[name]) / len(kept[name])
                                                               if kept[name] else None)}
            for name, v in scores.items()}
