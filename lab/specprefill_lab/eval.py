"""Answer quality vs keep rate on the synthetic retrieval task (``retrieval``), with its trained pair, in process.

For each keep rate, SpecPrefill's selection is compared with baselines that keep the same number of chunks
under the same rule (``select_tokens`` on synthetic scores: same chunk size, same protected tokens):
random chunks, the head of the prompt, the tail of the prompt. The full prompt is the reference; at keep 1
every method is the full prompt.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from common.models import load_causal_lm, load_tokenizer
from common.selection import select_tokens
from draft_worker import DraftWorker, ScoringConfig
from draft_worker.baselines import baseline_scores
from engine.runner import prefill
from specprefill_lab.retrieval import make_sample

METHODS = ("specprefill", "random", "head", "tail")


# --- selection baselines: the same chunk budget and protection as SpecPrefill ---


def baseline_indices(
    method: str,
    token_ids: Sequence[int],
    keep_rate: float,
    config: ScoringConfig,
    rng: random.Random,
    special_ids: Collection[int] = (),
) -> list[int]:
    """Kept indices for a baseline: SpecPrefill's own selection rule on the baseline's scores."""
    return select_tokens(token_ids, baseline_scores(method, len(token_ids), rng), keep_rate, config, special_ids)


@dataclass
class RetrievalResult:
    samples: int
    tokens_mean: float
    full_accuracy: float
    accuracy: dict[str, dict[float, float]] = field(default_factory=dict)  # method -> keep rate -> accuracy
    kept_fraction: dict[float, float] = field(default_factory=dict)


@torch.inference_mode()
def evaluate_retrieval(
    pair_dir: Path,
    *,
    samples: int = 100,
    words: int = 1500,
    keep_rates=(0.1, 0.3, 0.5, 1.0),
    seed: int = 1234,
    config: ScoringConfig | None = None,
) -> RetrievalResult:
    config = config or ScoringConfig()
    tokenizer = load_tokenizer(pair_dir / "target")
    target = load_causal_lm(pair_dir / "target", device="cpu", dtype="float32")
    draft = DraftWorker.from_pretrained(pair_dir / "draft", config, device="cpu", prefix_cache_bytes=0)
    special = tokenizer.all_special_ids
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
            kept = select_tokens(ids, scores, keep, config, special)
            kept_total[keep] += len(kept) / len(ids)
            correct["specprefill"][keep] += answer(ids, kept) == gold
            for method in METHODS[1:]:
                chosen = baseline_indices(method, ids, keep, config, baseline_rng, special) if keep < 1 else kept
                correct[method][keep] += answer(ids, chosen) == gold
    return RetrievalResult(
        samples=samples,
        tokens_mean=token_total / samples,
        full_accuracy=full_correct / samples,
        accuracy={m: {k: c / samples for k, c in by_keep.items()} for m, by_keep in correct.items()},
        kept_fraction={k: v / samples for k, v in kept_total.items()},
    )


def format_retrieval(result: RetrievalResult) -> str:
    keeps = sorted(result.kept_fraction)
    lines = [
        f"retrieval eval: {result.samples} samples, {result.tokens_mean:.0f} tokens on average; "
        f"full prompt accuracy {result.full_accuracy:.1%}",
        f"{'method':>12} " + " ".join(f"{'keep ' + format(k, 'g'):>10}" for k in keeps),
        f"{'(kept)':>12} " + " ".join(f"{result.kept_fraction[k]:>10.1%}" for k in keeps),
    ]
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
    ax.set(
        xlabel="keep rate",
        ylabel="accuracy",
        ylim=(0, 1.05),
        title=f"Retrieval over ~{result.tokens_mean:.0f} tokens: accuracy vs keep rate",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
