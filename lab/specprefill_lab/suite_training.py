"""Training the suite's draft/target pair (``suite``) on the CPU, reproducibly: the retrieval pair's recipe
(``training.train``: answer loss, the two circuit losses, a length curriculum) on a mix of every family,
starting from the shipped retrieval pair (the suite's vocabulary extends its, with the same IDs).

From scratch, the 2 x 128 draft stayed at the unigram plateau on the mix (answer loss ~6.3, accuracy 0 after 600
steps), and on ``single`` alone with 512 value words (0 after 400); the retrieval pair's copying circuits carry
over, so the suite starts where it left off.

``lab/benchmarks/train_suite_pair.py`` runs ``train_suite_pair``; the pair ships in
``lab/specprefill_lab/data/suite-pair``.
"""

from __future__ import annotations

import functools
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common.models import load_causal_lm
from specprefill_lab.retrieval import SHIPPED_PAIR
from specprefill_lab.suite import FAMILIES, SUITE_VERSION, make_task, make_tokenizer
from specprefill_lab.training import Batch, save, train


@dataclass(frozen=True, slots=True)
class Stage:
    steps: int
    lr: float
    schedule: tuple[tuple[float, int], ...]  # (fraction of the steps, words of context)
    family_weights: tuple[int, ...]  # how often each of ``FAMILIES`` is drawn


CURRICULUM = ((0.2, 128), (0.2, 512), (0.25, 1024), (0.35, 2048))
STAGES = {
    # single recall is what the retrieval pair already does; the rest is new
    "draft": (Stage(2400, 1e-3, CURRICULUM, (1, 2, 2, 2, 2)),),
    # the wider target takes ~1.7x as long a step: half the steps, then more on the families it had not got
    # (after stage 1, teacher-forced at 1,024 words: single 92%, variables 48%, multivalue, multiquery and
    # aggregation 0-3%: it copied a key's value but not the word after a value, nor the next key asked)
    "target": (Stage(1200, 5e-4, CURRICULUM, (1, 2, 2, 2, 2)), Stage(1400, 5e-4, ((1.0, 1024),), (1, 3, 3, 2, 3))),
}
QUESTIONS = 4  # asked in a row about one context (aggregation asks one)


def suite_batch(
    rng: random.Random,
    tokenizer,
    tokens_per_batch: int,
    n_words: int,
    family_weights: tuple[int, ...] = (1,) * len(FAMILIES),
) -> Batch:
    """Rows of random families; each row is a context, then its questions, each answer followed by EOS."""
    rows, answers, ends = [], [], []
    for _ in range(max(2, tokens_per_batch // n_words)):
        sample = make_task(rng.choices(FAMILIES, family_weights)[0], rng, n_words, QUESTIONS)
        words, row_answers, row_ends = list(sample.context), [], []
        for question, answer in sample.qa:
            words += question
            row_answers += range(len(words) + 1, len(words) + 1 + len(answer))  # +1: BOS comes first
            words += answer
            row_ends.append(len(words) + 1)
            words.append(tokenizer.eos_token)
        rows.append([tokenizer.bos_token_id, *tokenizer.convert_tokens_to_ids(words)])
        answers.append(row_answers)
        ends.append(row_ends)
    ids = torch.full((len(rows), max(len(r) for r in rows)), tokenizer.pad_token_id)
    for row, r in enumerate(rows):
        ids[row, : len(r)] = torch.tensor(r)

    def flat(per_row: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.tensor([row for row, positions in enumerate(per_row) for _ in positions]),
            torch.tensor([p for positions in per_row for p in positions]),
        )

    return Batch(ids, *flat(answers), *flat(ends))


def starting_point(model_dir: Path, tokenizer, seed: int):
    """A retrieval model with room for the suite's new words (their embeddings drawn around the others')."""
    torch.manual_seed(seed)
    model = load_causal_lm(model_dir, device="cpu", dtype="float32")
    model.resize_token_embeddings(len(tokenizer))
    return model


def train_suite_model(
    name: str, out_dir: Path, *, seed: int = 0, start: Path = SHIPPED_PAIR, stages: tuple[Stage, ...] | None = None
) -> float:
    """Trains the suite's ``name`` ("draft" or "target") from the retrieval pair's through its ``STAGES``, writes
    ``out_dir/name``; returns the seconds it took."""
    tokenizer = make_tokenizer()
    offset = {"draft": 1, "target": 2}[name]
    began = time.perf_counter()
    model = starting_point(start / name, tokenizer, seed + offset)
    for index, stage in enumerate(stages or STAGES[name]):
        print(f"training the suite {name}, stage {index + 1}: {stage} ({torch.get_num_threads()} threads)", flush=True)
        model = train(
            None,
            tokenizer,
            steps=stage.steps,
            seed=seed + offset + 10 * index,
            lr=stage.lr,
            schedule=stage.schedule,
            init=model,
            batch_fn=functools.partial(suite_batch, family_weights=stage.family_weights),
        )
        save(model, tokenizer, out_dir / name)
    return time.perf_counter() - began


def write_provenance(out_dir: Path, seconds: dict[str, float], *, seed: int = 0, start: Path = SHIPPED_PAIR) -> None:
    provenance = {
        "version": SUITE_VERSION,
        "seed": seed,
        "families": FAMILIES,
        "questions_per_context": QUESTIONS,
        "start": "retrieval-pair " + json.loads((start / "retrieval.json").read_text())["version"],
        "seconds": {name: round(s) for name, s in seconds.items()},
        "stages": {name: [asdict(stage) for stage in stages] for name, stages in STAGES.items()},
    }
    (out_dir / "suite.json").write_text(json.dumps(provenance, indent=2))


def train_suite_pair(out_dir: Path, *, seed: int = 0, start: Path = SHIPPED_PAIR) -> Path:
    """Trains and writes ``out_dir/draft`` and ``out_dir/target`` (one tokenizer) and ``suite.json``, from the
    retrieval pair in ``start``."""
    seconds = {name: train_suite_model(name, out_dir, seed=seed, start=start) for name in STAGES}
    write_provenance(out_dir, seconds, seed=seed, start=start)
    return out_dir
