"""LongBench/RULER-style JSONL datasets against any OpenAI endpoint: through the gateway at each keep rate and
directly (``x-specprefill: off``, or ``--direct-url``), scored by exact match, substring, F1 or ROUGE-L."""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm


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


def evaluate_dataset(
    rows: list[DatasetRow],
    base_url: str,
    model: str,
    keep_rates: list[float],
    *,
    direct_url: str | None = None,
    direct_model: str | None = None,
    max_tokens: int = 64,
    api_key: str | None = None,
) -> dict:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    variants = [
        ("direct", direct_url or base_url, direct_model or model, {} if direct_url else {"x-specprefill": "off"})
    ]
    variants += [(f"keep {k:g}", base_url, model, {"x-keep-rate": f"{k:g}"}) for k in keep_rates]
    scores = {name: [] for name, *_ in variants}
    kept = {name: [] for name, *_ in variants}
    with httpx.Client(timeout=600, headers=headers) as client:
        for row in tqdm(rows, desc="dataset eval", unit="row"):
            messages = row.messages or [{"role": "user", "content": row.prompt}]
            for name, url, model_name, extra in variants:
                response = client.post(
                    f"{url}/v1/chat/completions",
                    headers=extra,
                    json={"model": model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0},
                )
                response.raise_for_status()
                text = response.json()["choices"][0]["message"]["content"] or ""
                scores[name].append(METRICS[row.metric](text, row.answers))
                if "x-specprefill-kept-tokens" in response.headers:
                    kept[name].append(
                        int(response.headers["x-specprefill-kept-tokens"])
                        / int(response.headers["x-specprefill-original-tokens"])
                    )
    return {
        name: {"score": sum(v) / len(v), "kept_fraction": (sum(kept[name]) / len(kept[name]) if kept[name] else None)}
        for name, v in scores.items()
    }
