"""Training the suite's draft/target pair (``suite``) on the CPU, reproducibly: the retrieval pair's recipe
(``training.train``: answer loss, the two circuit losses, a length curriculum) on a mix of every family,
starting from the shipped retrieval pair (the suite's vocabulary extends its, with the same IDs).

From scratch, the 2 x 128 draft stayed at the unigram plateau on the mix (answer loss ~6.3, accuracy 0 after 600
steps), and on ``single`` alone with 512 value words (0 after 400); the retrieval pair's copying circuits carry
over, so the suite starts where it left off.

``benchmarks/train_suite_pair.py`` runs ``train_suite_pair``; the pair ships in ``specprefill/data/suite-pair``.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from common.models import load_causal_lm
from specprefill.lab.retrieval import SHIPPED_PAIR
from specprefill.lab.suite import FAMILIES, SUITE_VERSION, make_task, make_tokenizer
from specprefill.lab.training import Batch, save, train

DRAFT_STEPS, TARGET_STEPS = 2400, 1200  # the wider target takes ~1.7x as long a step
DRAFT_LR, TARGET_LR = 1e-3, 5e-4
SCHEDULE = ((0.2, 128), (0.2, 512), (0.25, 1024), (0.35, 2048))  # (fraction of the steps, words of context)
FAMILY_WEIGHTS = (1, 2, 2, 2, 2)  # single recall is what the retrieval pair already does
QUESTIONS = 4  # asked in a row about one context (aggregation asks one)


def suite_batch(rng: random.Random, tokenizer, tokens_per_batch: int, n_words: int) -> Batch:
    """Rows of random families; each row is a context, then its questions, each answer followed by EOS."""
    rows, answers, ends = [], [], []
    for _ in range(max(2, tokens_per_batch // n_words)):
        sample = make_task(rng.choices(FAMILIES, FAMILY_WEIGHTS)[0], rng, n_words, QUESTIONS)
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
        return (torch.tensor([row for row, positions in enumerate(per_row) for _ in positions]),
                torch.tensor([p for positions in per_row for p in positions]))

    return Batch(ids, *flat(answers), *flat(ends))


def starting_point(model_dir: Path, tokenizer, seed: int):
    """A retrieval model with room for the suite's new words (their embeddings drawn around the others')."""
    torch.manual_seed(seed)
    model = load_causal_lm(model_dir, device="cpu", dtype="float32")
    model.resize_token_embeddings(len(tokenizer))
    return model


MODELS = {"draft": (DRAFT_STEPS, 1, DRAFT_LR), "target": (TARGET_STEPS, 2, TARGET_LR)}  # steps, seed offset, lr


def train_suite_model(name: str, out_dir: Path, *, steps: int | None = None, seed: int = 0,
                      start: Path = SHIPPED_PAIR) -> float:
    """Trains the suite's ``name`` ("draft" or "target") from the retrieval pair's, writes ``out_dir/name``;
    returns the seconds it took."""
    default_steps, offset, lr = MODELS[name]
    steps = default_steps if steps is None else steps
    tokenizer = make_tokenizer()
    print(f"training the suite {name} from {start / name} for {steps} steps "
          f"({torch.get_num_threads()} threads)", flush=True)
    began = time.perf_counter()
    model = train(None, tokenizer, steps=steps, seed=seed + offset, lr=lr, schedule=SCHEDULE, batch_fn=suite_batch,
                  init=starting_point(start / name, tokenizer, seed + offset))
    save(model, tokenizer, out_dir / name)
    return time.perf_counter() - began


def write_provenance(out_dir: Path, seconds: dict[str, float], *, seed: int = 0, start: Path = SHIPPED_PAIR) -> None:
    provenance = {"version": SUITE_VERSION, "seed": seed, "schedule": SCHEDULE, "families": FAMILIES,
                  "family_weights": FAMILY_WEIGHTS, "questions_per_context": QUESTIONS,
                  "start": "retrieval-pair " + json.loads((start / "retrieval.json").read_text())["version"],
                  "seconds": {name: round(s) for name, s in seconds.items()},
                  **{name: {"steps": steps, "lr": lr} for name, (steps, _, lr) in MODELS.items()}}
    (out_dir / "suite.json").write_text(json.dumps(provenance, indent=2))


def train_suite_pair(out_dir: Path, *, seed: int = 0, start: Path = SHIPPED_PAIR) -> Path:
    """Trains and writes ``out_dir/draft`` and ``out_dir/target`` (one tokenizer) and ``suite.json``, from the
    retrieval pair in ``start``."""
    seconds = {name: train_suite_model(name, out_dir, seed=seed, start=start) for name in MODELS}
    write_provenance(out_dir, seconds, seed=seed, start=start)
    return out_dir
