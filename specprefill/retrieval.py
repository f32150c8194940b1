"""A synthetic long-context retrieval task, and a draft/target pair trained on it here, on the CPU, in minutes.

Each sample is filler text with key-value records scattered through it ("the code for KEY VALUE ."),
then a question that ends with one key ("question : the code for KEY"); the answer is the next token. Only the record holding that key answers it; every other record is a
distractor. A model has to find one 7-token record in thousands of tokens: exactly what SpecPrefill's
draft must point the target at. With a word-level tokenizer, accuracy is exact (one answer token).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specprefill.demo_models import default_cache_dir

TASK_VERSION = "v1"
N_FILLER, N_KEYS, N_VALUES = 256, 256, 128
TEMPLATE_WORDS = ["the", "code", "for", ".", "question", ":"]
RECORD_LEN, QUESTION_LEN = 6, 6
SPECIALS = ["<pad>", "<bos>", "<eos>"]


def vocabulary() -> list[str]:
    filler = [f"w{i}" for i in range(N_FILLER)]
    keys = [f"k{i}" for i in range(N_KEYS)]
    values = [f"v{i}" for i in range(N_VALUES)]
    return SPECIALS + TEMPLATE_WORDS + filler + keys + values


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {word: index for index, word in enumerate(vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", model_max_length=8192)


@dataclass(frozen=True, slots=True)
class Sample:
    text: str  # the prompt, ending with "answer :"
    answer: str  # one value word
    needle_word: int  # index (in words) where the answering record starts


def make_sample(rng: random.Random, n_words: int, n_records: int) -> Sample:
    """About ``n_words`` words of filler with ``n_records`` records; the question asks for one of them."""
    keys = rng.sample(range(N_KEYS), n_records)
    records = [["the", "code", "for", f"k{k}", f"v{rng.randrange(N_VALUES)}", "."] for k in keys]
    slots = sorted(rng.sample(range(max(n_records, n_words // 8)), n_records))
    asked = rng.randrange(n_records)
    words: list[str] = []
    needle = 0
    slot_iter = iter(zip(slots, records))
    next_slot = next(slot_iter, None)
    for sentence in range(max(n_records, n_words // 8)):
        while next_slot is not None and next_slot[0] == sentence:
            if next_slot[1] is records[asked]:
                needle = len(words)
            words += next_slot[1]
            next_slot = next(slot_iter, None)
        words += [f"w{rng.randrange(N_FILLER)}" for _ in range(rng.randint(4, 11))] + ["."]
    question = ["question", ":", "the", "code", "for", records[asked][3]]
    return Sample(" ".join(words + question), records[asked][4], needle)


@dataclass(frozen=True, slots=True)
class PairShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int


DRAFT = PairShape(hidden=128, layers=2, heads=4, kv_heads=2)
TARGET = PairShape(hidden=192, layers=3, heads=6, kv_heads=2)
DRAFT_STEPS, TARGET_STEPS = 4000, 3000


def _config(shape: PairShape, tokenizer) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden, intermediate_size=shape.hidden * 3,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )


def _training_batch(rng: random.Random, tokenizer, batch: int, n_words: int, n_questions: int = 4):
    """Token IDs [B, T] (right-padded), and the (row, position) of every answer token to predict.

    Training samples ask several questions in a row, each followed by its answer, for more signal per sequence.
    """
    rows, targets = [], []
    for _ in range(batch):
        sample = make_sample(rng, n_words, rng.randint(2, max(2, n_words // 40)))
        words = sample.text.split()[:-QUESTION_LEN]
        records = [(words[i + 3], words[i + 4]) for i in range(len(words) - 4)
                   if words[i] == "the" and words[i + 1] == "code" and words[i + 2] == "for"]
        answer_word_pos = []
        for key, value in rng.sample(records, min(len(records), n_questions)):
            words += ["question", ":", "the", "code", "for", key]
            answer_word_pos.append(len(words))
            words.append(value)
        rows.append(tokenizer(" ".join(words)).input_ids)
        targets.append([p + 1 for p in answer_word_pos])  # +1: the BOS token
    width = max(len(r) for r in rows)
    ids = torch.full((batch, width), tokenizer.pad_token_id)
    for row, r in enumerate(rows):
        ids[row, : len(r)] = torch.tensor(r)
    row_index = torch.tensor([row for row, t in enumerate(targets) for _ in t])
    answer_pos = torch.tensor([p for t in targets for p in t])
    return ids, row_index, answer_pos


def train(shape: PairShape, tokenizer, *, steps: int, seed: int, log_every: int = 250,
          schedule: tuple[tuple[float, int], ...] = ((0.4, 128), (0.3, 256), (0.3, 512)),
          tokens_per_batch: int = 4096, lr: float = 1e-3):
    """Several questions per sequence, loss on the answers only, a length curriculum (fraction, words).

    Experimental. Measured here (2 CPU cores): after 1,500 steps the 2-layer draft answers about 40% at
    128 words, where always naming one of the ~3 values present already scores a third; it copies a value
    from the context but has not learned to select it by key (an induction head has not formed). Repeat-
    sequence pre-training forms induction in ~150 steps only when the repeat sits at a fixed distance (a
    positional shortcut that does not transfer); with random distances it did not form in 600 steps, nor
    with a curriculum that widened the distance jitter from 0 to 100 over the first 400 steps.
    """
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = LlamaForCausalLM(_config(shape, tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    lr_at = lambda step: min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    bounds, total = [], 0.0
    for fraction, words in schedule:
        total += fraction
        bounds.append((total * steps, words))
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        n_words = next(words for bound, words in bounds if step < bound)
        ids, rows, answer_pos = _training_batch(rng, tokenizer, max(4, tokens_per_batch // n_words), n_words,
                                                n_questions=8)
        hidden = model.model(input_ids=ids).last_hidden_state  # causal: right padding never reaches an answer
        logits = model.lm_head(hidden[rows, answer_pos - 1])
        answers = ids[rows, answer_pos]
        loss = F.cross_entropy(logits, answers)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            acc = (logits.argmax(-1) == answers).float().mean().item()
            print(f"  step {step:>5} words {n_words:>4} loss {loss.item():.3f} acc {acc:.2f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    return model.eval()


def save(model: LlamaForCausalLM, tokenizer, out_dir: Path) -> None:
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def train_pair(out_dir: Path, *, draft_steps: int = DRAFT_STEPS, target_steps: int = TARGET_STEPS,
               seed: int = 0) -> Path:
    """Trains and writes ``out_dir/draft`` and ``out_dir/target`` (one tokenizer), deterministically."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = make_tokenizer()
    for name, shape, steps, model_seed in (("draft", DRAFT, draft_steps, seed + 1),
                                           ("target", TARGET, target_steps, seed + 2)):
        print(f"training the {name} ({shape}) for {steps} steps", flush=True)
        model = train(shape, tokenizer, steps=steps, seed=model_seed)
        save(model, tokenizer, out_dir / name)
    (out_dir / "retrieval.json").write_text(json.dumps({"version": TASK_VERSION, "seed": seed,
                                                         "draft_steps": draft_steps, "target_steps": target_steps}))
    return out_dir


def ensure_retrieval_pair(cache_dir: Path | None = None) -> Path:
    """Trains the pair once into the cache (experimental recipe, see ``train``) and returns its folder."""
    out = (cache_dir or default_cache_dir()) / f"retrieval-pair-{TASK_VERSION}"
    if not (out / "retrieval.json").exists():
        print(f"training the retrieval pair into {out} (once; 20-40 minutes on 2 CPU cores). Experimental: "
              "on this recipe and budget the models have not yet learned keyed retrieval", flush=True)
        train_pair(out)
    return out
