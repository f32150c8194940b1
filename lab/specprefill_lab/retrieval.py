"""A synthetic long-context retrieval task (``training`` trains a draft/target pair on it here, on the CPU).

Each sample is filler text with key-value records scattered through it ("the code for KEY VALUE ."),
then a question that ends with one key ("question : the code for KEY"); the answer is the next token.
Only the record holding that key answers it; every other record is a distractor. A model has to find one
6-token record in thousands of tokens: exactly what SpecPrefill's draft must point the target at. With a
word-level tokenizer, accuracy is exact (one answer token).

The trained pair ships in the package (``SHIPPED_PAIR``, float32 safetensors, 5.7 MB);
``lab/benchmarks/train_retrieval_pair.py`` retrains it from scratch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

TASK_VERSION = "v2"
SHIPPED_PAIR = Path(__file__).parent / "data" / "retrieval-pair"
N_FILLER, N_KEYS, N_VALUES = 256, 256, 128
TEMPLATE_WORDS = ["the", "code", "for", ".", "question", ":"]
RECORD_LEN, QUESTION_LEN = 6, 6
SPECIALS = ["<pad>", "<bos>", "<eos>"]
BPE_SPECIALS = ["<unk>", "<s>", "</s>"]


def vocabulary() -> list[str]:
    filler = [f"w{i}" for i in range(N_FILLER)]
    keys = [f"k{i}" for i in range(N_KEYS)]
    values = [f"v{i}" for i in range(N_VALUES)]
    return SPECIALS + TEMPLATE_WORDS + filler + keys + values


def make_tokenizer(words: list[str] | None = None, model_max_length: int = 8192) -> PreTrainedTokenizerFast:
    """One token per word of ``words`` (default: this task's ``vocabulary``), BOS first."""
    vocab = {word: index for index, word in enumerate(words or vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        model_max_length=model_max_length,
    )


def make_bpe_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """A second tokenizer for the same task, for a draft from another "family": a BPE with SentencePiece-style
    word starts (``▁k12``, the space inside the token, as Llama-2 or Mistral tokenizers have), other special
    tokens (``<s>``, ``</s>``, ``<unk>``) and other IDs, trained here on the task's text (fixed seed). It
    learns every task word whole, so its tokens line up with the word-level ones but their character spans
    start one space earlier; unlike the word-level tokenizer it can spell any text."""
    rng = random.Random(seed)
    texts = [make_sample(rng, 1536, 37).text for _ in range(400)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=1024, special_tokens=BPE_SPECIALS, show_progress=False)
    )
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
        model_max_length=16384,
    )


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
class Session:
    context: str  # the filler and records, without a question
    questions: list[tuple[str, str]]  # (key, value) of records asked in turn


def question(key: str) -> str:
    return f"question : the code for {key}"


def make_session(rng: random.Random, n_words: int, n_records: int, n_questions: int) -> Session:
    """One document asked several of its records, in a random order (as successive turns or requests)."""
    words = make_sample(rng, n_words, n_records).text.split()[:-QUESTION_LEN]
    records = [
        (words[i + 3], words[i + 4]) for i in range(len(words) - 4) if words[i : i + 3] == ["the", "code", "for"]
    ]
    return Session(" ".join(words), rng.sample(records, min(n_questions, len(records))))
