"""Training a draft/target pair on the retrieval task, on the CPU, reproducibly (fixed seeds).

``train_pair`` writes ``DIR/draft`` and ``DIR/target``; ``lab/benchmarks/train_retrieval_pair.py`` runs it.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from common.cache_folder import default_cache_dir
from specprefill_lab.retrieval import QUESTION_LEN, TASK_VERSION, make_bpe_tokenizer, make_sample, make_tokenizer

TRAIN_ATTENTION = "specprefill_train_sdpa"


@dataclass(frozen=True, slots=True)
class PairShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int


DRAFT = PairShape(hidden=128, layers=2, heads=4, kv_heads=2)
TARGET = PairShape(hidden=192, layers=2, heads=6, kv_heads=2)
DRAFT_STEPS, TARGET_STEPS = 1600, 1600
DRAFT_LR, TARGET_LR = 1e-3, 5e-4  # the wider target leaves the plateau only at the lower rate
SCHEDULE = ((0.3, 96), (0.15, 256), (0.2, 640), (0.35, 1536))  # (fraction of the steps, words of context)


def _config(shape: PairShape, tokenizer) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.hidden * 3,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )


def _training_batch(rng: random.Random, tokenizer, batch: int, n_words: int, n_questions: int = 4):
    """Token IDs [B, T] (right-padded), and the (row, position) of every answer token to predict.

    Training samples ask several questions in a row, each followed by its answer and EOS, for more signal per
    sequence. Without the EOS the draft learns that another question follows an answer, and its greedy
    look-ahead asks about some other record, whose attention then pulls distractor chunks into the selection
    (measured, draft as its own target, keep 0.1: the answering record was kept in 22 of 30 samples with
    look-ahead 8 and 27 of 30 with look-ahead 1; with the EOS, 30 of 30 with look-ahead 8).
    """
    rows, targets = [], []
    for _ in range(batch):
        sample = make_sample(rng, n_words, rng.randint(2, max(2, n_words // 40)))
        words = sample.text.split()[:-QUESTION_LEN]
        records = [
            (words[i + 3], words[i + 4])
            for i in range(len(words) - 4)
            if words[i] == "the" and words[i + 1] == "code" and words[i + 2] == "for"
        ]
        answer_word_pos = []
        for key, value in rng.sample(records, min(len(records), n_questions)):
            words += ["question", ":", "the", "code", "for", key]
            answer_word_pos.append(len(words))
            words.append(value + tokenizer.eos_token)  # an answer ends the turn: the draft's look-ahead stops there
        text = " ".join(words)
        encoded = tokenizer(text, return_offsets_mapping=True)
        starts = [sum(len(w) + 1 for w in words[:p]) for p in answer_word_pos]  # the answers' first characters
        rows.append(encoded.input_ids)
        targets.append([_token_at(encoded.offset_mapping, c) for c in starts])
    width = max(len(r) for r in rows)
    ids = torch.full((batch, width), tokenizer.pad_token_id)
    for row, r in enumerate(rows):
        ids[row, : len(r)] = torch.tensor(r)
    row_index = torch.tensor([row for row, t in enumerate(targets) for _ in t])
    answer_pos = torch.tensor([p for t in targets for p in t])
    return ids, row_index, answer_pos


def _token_at(offsets: list[tuple[int, int]], char: int) -> int:
    """The index of the first token whose span ends past ``char`` (the answer's first token, whatever the
    tokenizer: a word-level token, or a SentencePiece-style one that starts with the space before it)."""
    return next(i for i, (a, b) in enumerate(offsets) if b > char and b > a)


def _head_zero_attention(inner):
    """An attention kernel that also records head 0's attention probabilities in layers 0 and 1."""

    def attention(module, query, key, value, attention_mask, head_zero=None, **kwargs):
        if head_zero is not None and module.layer_idx in (0, 1):
            scaling = kwargs.get("scaling") or module.head_dim**-0.5
            logits = query[:, 0] @ key[:, 0].transpose(-1, -2) * scaling  # head 0 reads KV head 0
            causal = torch.ones(logits.shape[-2:], dtype=torch.bool, device=logits.device).tril()
            head_zero[module.layer_idx] = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        return inner(module, query, key, value, attention_mask, **kwargs)

    return attention


def _prepare_for_training(config: LlamaConfig) -> None:
    """SDPA, plus head 0's probabilities for the circuit losses: registered here, when a model is prepared."""
    AttentionInterface.register(TRAIN_ATTENTION, _head_zero_attention(ALL_ATTENTION_FUNCTIONS["sdpa"]))
    AttentionMaskInterface.register(TRAIN_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = TRAIN_ATTENTION


def circuit_losses(
    previous_attn: torch.Tensor, induction_attn: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Auxiliary losses that seed the two generic circuits language-model pre-training forms at scale.

    ``previous_attn`` and ``induction_attn`` are head 0's attention probabilities [B, T, T] in layers 0 and 1.
    The first is taught to be a previous-token head (position t attends to t-1), the second an induction head
    (position t attends to every position that follows an earlier occurrence of token t). Both targets come
    from the token sequence alone, not from the task: nothing says where a record or an answer is. Without
    them, answer-only training sits on the plateau where the model copies one of the values present at random
    (measured: chance for 1,000-1,900 steps, see ``train``); with them it leaves it in ~300-500 steps.
    """
    length = ids.shape[1]
    steps = torch.arange(1, length)
    previous = -torch.log(previous_attn[:, steps, steps - 1] + 1e-9).mean()
    earlier = (ids[:, :, None] == ids[:, None, :]) & torch.ones(length, length, dtype=torch.bool).tril(-1)
    follows = torch.zeros_like(earlier)
    follows[:, :, 1:] = earlier[:, :, :-1]  # column s follows an earlier occurrence of row t's token
    has = follows.any(-1)
    induction = -torch.log((induction_attn * follows).sum(-1)[has] + 1e-9).mean()
    return previous, induction


def retrieval_batch(rng: random.Random, tokenizer, tokens_per_batch: int, n_words: int) -> Batch:
    """The retrieval task's training batch: several questions per sequence, each answer followed by EOS."""
    ids, rows, answer_pos = _training_batch(rng, tokenizer, max(2, tokens_per_batch // n_words), n_words, n_questions=8)
    return Batch(ids, rows, answer_pos, rows, answer_pos + 1)


@dataclass(frozen=True, slots=True)
class Batch:
    ids: torch.Tensor  # [B, T] right-padded token IDs
    answer_rows: torch.Tensor  # every answer token to predict: (row, position)
    answer_pos: torch.Tensor
    eos_rows: torch.Tensor  # every EOS that ends an answer: (row, position)
    eos_pos: torch.Tensor


def train(
    shape: PairShape,
    tokenizer,
    *,
    steps: int,
    seed: int,
    log_every: int = 100,
    schedule: tuple[tuple[float, int], ...] = SCHEDULE,
    tokens_per_batch: int = 4096,
    lr: float = 1e-3,
    circuit_weight: float = 1.0,
    batch_fn=retrieval_batch,
    init: LlamaForCausalLM | None = None,
):
    """Several questions per sequence, loss on the answers (and the EOS after each) plus ``circuit_losses``,
    and a length curriculum (fraction of the steps, words of context).

    Measured on this CPU without the circuit losses: answer-only training stayed at chance among the values
    present (it copies a value, not the one the key names) for as long as each run was given, 1,000-1,900
    steps, at every setting tried: lr 1e-3 and 3e-3, 2 and 4 records, keys before or after values, a skip-gram
    filler with a language-model loss that rewards a previous-token head, a previous-token loss alone. With
    both circuit losses (lr 1e-3, 96 words) the 2-layer x 128 draft reached 0.93 accuracy by step 500. Wider
    targets at lr 1e-3 did not (both circuits formed, answers stayed near chance): 3 layers x 192 at 0.06
    after 1,100 steps, 2 x 256 at 0.21 after 800. At lr 5e-4 the 2 x 192 ``TARGET`` reached 0.97 by step 400;
    3 x 128 at 1e-3 was slower (0.66 at step 600).

    ``init``: a model to go on training (its shape, not ``shape``), for instance a pair trained on an easier task.
    """
    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = init.config if init is not None else _config(shape, tokenizer)
    _prepare_for_training(config)
    model = init if init is not None else LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    scheduler = _scheduler(optimizer, steps)
    bounds, total = [], 0.0
    for fraction, words in schedule:
        total += fraction
        bounds.append((total * steps, words))
    model.train()
    start, window = time.perf_counter(), []
    for step in range(steps):
        n_words = next((words for bound, words in bounds if step < bound), schedule[-1][1])
        batch = batch_fn(rng, tokenizer, tokens_per_batch, n_words)
        loss, answer_loss, logits, answers, previous, induction = _losses(model, batch, circuit_weight)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        window = (window + [(logits.argmax(-1) == answers).float().mean().item()])[-log_every or 1 :]
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(
                f"  step {step:>5} words {n_words:>4} answer loss {answer_loss.item():.3f} "
                f"accuracy {sum(window) / len(window):.2f} previous-token {previous.item():.3f} "
                f"induction {induction.item():.3f} ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    model.config._attn_implementation = "sdpa"
    return model.eval()


def _scheduler(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up over a twentieth of the steps, constant through the curriculum, then cosine to a tenth."""
    warmup, decay = max(1, steps // 20), int(steps * 0.75)

    def lr_at(step: int) -> float:
        tail = max(0.0, (step - decay) / max(1, steps - decay))
        return min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * tail)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)


def _losses(model: LlamaForCausalLM, batch, circuit_weight: float):
    """One batch's loss (answers, the EOS after each, the circuit losses), its answer loss, the answers' logits
    and tokens, and the two circuit losses."""
    ids = batch.ids
    head_zero: dict[int, torch.Tensor] = {}
    hidden = model.model(input_ids=ids, head_zero=head_zero).last_hidden_state  # causal: right padding
    logits = model.lm_head(hidden[batch.answer_rows, batch.answer_pos - 1])  # never reaches an answer
    answers = ids[batch.answer_rows, batch.answer_pos]
    eos_logits = model.lm_head(hidden[batch.eos_rows, batch.eos_pos - 1])  # and after the answer, EOS
    previous, induction = circuit_losses(head_zero[0], head_zero[1], ids)
    answer_loss = F.cross_entropy(logits, answers)
    loss = (
        answer_loss
        + F.cross_entropy(eos_logits, ids[batch.eos_rows, batch.eos_pos])
        + circuit_weight * (previous + induction)
    )
    return loss, answer_loss, logits, answers, previous, induction


def save(model: LlamaForCausalLM, tokenizer, out_dir: Path) -> None:
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def provenance(seed: int, draft_steps: int, target_steps: int) -> dict:
    """What ``retrieval.json`` records about how a pair was trained."""
    return {
        "version": TASK_VERSION,
        "seed": seed,
        "schedule": SCHEDULE,
        "draft": {"shape": asdict(DRAFT), "steps": draft_steps, "lr": DRAFT_LR},
        "target": {"shape": asdict(TARGET), "steps": target_steps, "lr": TARGET_LR},
    }


def train_pair(
    out_dir: Path, *, draft_steps: int = DRAFT_STEPS, target_steps: int = TARGET_STEPS, seed: int = 0
) -> Path:
    """Trains and writes ``out_dir/draft`` and ``out_dir/target`` (one tokenizer), deterministically."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = make_tokenizer()
    for name, shape, steps, model_seed, lr in (
        ("draft", DRAFT, draft_steps, seed + 1, DRAFT_LR),
        ("target", TARGET, target_steps, seed + 2, TARGET_LR),
    ):
        print(f"training the {name} ({shape}) for {steps} steps", flush=True)
        model = train(shape, tokenizer, steps=steps, seed=model_seed, lr=lr)
        save(model, tokenizer, out_dir / name)
    (out_dir / "retrieval.json").write_text(json.dumps(provenance(seed, draft_steps, target_steps), indent=2))
    return out_dir


def train_cross_tokenizer_draft(out_dir: Path, *, steps: int = DRAFT_STEPS, seed: int = 0) -> Path:
    """The retrieval draft again, with ``make_bpe_tokenizer`` (another tokenizer than the target's): same shape,
    steps, learning rate and seed as the pair's draft. Writes ``out_dir`` (model and tokenizer)."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = make_bpe_tokenizer(seed)
    print(f"training the cross-tokenizer draft ({DRAFT}) for {steps} steps", flush=True)
    model = train(DRAFT, tokenizer, steps=steps, seed=seed + 1, lr=DRAFT_LR)
    save(model, tokenizer, out_dir)
    return out_dir


def ensure_retrieval_pair(cache_dir: Path | None = None) -> Path:
    """Trains a pair once into the cache with this recipe (instead of the shipped one) and returns its folder."""
    out = (cache_dir or default_cache_dir()) / f"retrieval-pair-{TASK_VERSION}"
    if not (out / "retrieval.json").exists():
        print(f"training the retrieval pair into {out} (once; about 20 minutes on 2 CPU cores)", flush=True)
        train_pair(out)
    return out
