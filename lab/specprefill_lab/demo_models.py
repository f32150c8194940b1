"""The demo model pair, made locally and deterministically: no hub, no download.

Both are Llama-architecture models that share one byte-level BPE tokenizer trained with ``tokenizers``
on generated text, with BOS, EOS, pad and a Llama-3-style chat template. Weights are random from a fixed
seed. The target costs far more than 10x the draft's FLOPs per token, so speed measurements mean something.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from common.cache_folder import default_cache_dir
from common.models import RANDOM_WEIGHTS

DEMO_VERSION = "v3"  # v2: the chat template renders tools; v3: 131,072 positions (a coding agent's prompts)
DEMO_POSITIONS = 131_072  # random weights need no training at any length
DEMO_NAME = "specprefill-demo"  # the model name clients send to a gateway serving the demo pair
BOS, EOS, EOT, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|pad|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's tool-call marker (vLLM's llama3_json tool parser looks for it)
SPECIAL_TOKENS = [BOS, EOS, EOT, PAD, HEADER_START, HEADER_END, PYTHON_TAG]
CHAT_TEMPLATE = (
    # Llama-3.1-style: tools are a block in the system turn; an assistant's tool calls are JSON objects
    "{{ bos_token }}"
    "{% set rest = messages %}{% set system = none %}"
    "{% if tools and messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] | trim %}{% set rest = messages[1:] %}{% endif %}"
    "{% if tools %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\n' }}{% if system %}{{ system + '\n\n' }}{% endif %}"
    '{{ \'To call a function, answer with {"name": function name, "parameters": arguments}. Functions:\n\' }}'
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}{{ '<|eot_id|>' }}"
    "{% endif %}"
    "{% for message in rest %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ {'name': call['function']['name'], 'parameters': call['function']['arguments']} | tojson }}"
    "{% endfor %}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool = False


DRAFT_SHAPE = ModelShape(128, 512, 2, 4, 2)
TARGET_SHAPE = ModelShape(512, 2048, 8, 8, 2)
# real models' shapes (their configs on the hub), for measurements with random weights: the vocabulary stays the
# demo tokenizer's, so only the embedding table and the one-row output projection are smaller than the real ones
SHAPES = {
    "demo-draft": DRAFT_SHAPE,
    "demo-target": TARGET_SHAPE,
    "llama-3.2-1b": ModelShape(2048, 8192, 16, 32, 8, tie_word_embeddings=True),
    "llama-3.2-3b": ModelShape(3072, 8192, 28, 24, 8, tie_word_embeddings=True),
    "llama-3.1-8b": ModelShape(4096, 14336, 32, 32, 8),
    "qwen2.5-32b": ModelShape(5120, 27648, 64, 40, 8),  # in the Llama architecture: no biases on q, k and v
}


def synthetic_corpus(seed: int = 0, n_sentences: int = 20_000) -> list[str]:
    """Sentences over a Zipf-distributed invented vocabulary, with numbers and punctuation."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "qu", "st", "er", "an"]
    words = sorted({"".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(3000)})
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    sentences = []
    for _ in range(n_sentences):
        n = rng.randint(4, 16)
        tokens = rng.choices(words, weights, k=n)
        if rng.random() < 0.3:
            tokens.insert(rng.randrange(n), str(rng.randint(0, 99999)))
        sentence = " ".join(tokens).capitalize() + rng.choice([".", ".", ".", "?", "!", ";", ":"])
        sentences.append(sentence)
    return sentences


def train_tokenizer(vocab_size: int = 4096, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE with the special tokens and chat template the demo pair uses."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        additional_special_tokens=[EOS, HEADER_START, HEADER_END, PYTHON_TAG],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )


def llama_config(
    shape: ModelShape, tokenizer: PreTrainedTokenizerFast, max_positions: int = 32768, init_std: float = 0.02
) -> LlamaConfig:
    return LlamaConfig(
        initializer_range=init_std,
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=shape.tie_word_embeddings,
    )


def eos_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(EOT), tokenizer.convert_tokens_to_ids(EOS)]


def write_model(
    out_dir: Path,
    shape: ModelShape,
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    max_positions: int = 32768,
    init_std: float = 0.02,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    weights: bool = True,
) -> None:
    """Random weights from ``seed``, initialised on ``device`` in ``dtype`` (an 8B model is made on a GPU in
    seconds) and saved in ``dtype``; without ``weights``, the config, the tokenizer and ``RANDOM_WEIGHTS`` only:
    every load makes the same weights where it runs."""
    config = llama_config(shape, tokenizer, max_positions, init_std)
    if not weights:
        out_dir.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        dtype_name = str(dtype).removeprefix("torch.")
        (out_dir / RANDOM_WEIGHTS).write_text(json.dumps({"seed": seed, "dtype": dtype_name}))
        return
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids(tokenizer), pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def write_demo_models(out_dir: str | Path, seed: int = 0) -> Path:
    """Writes ``out_dir/draft`` and ``out_dir/target``. Deterministic for a given seed."""
    return write_shaped_pair(
        out_dir, "demo-draft", "demo-target", seed=seed, dtype=torch.float32, max_positions=DEMO_POSITIONS
    )


def write_shaped_pair(
    out_dir: str | Path,
    draft: str,
    target: str,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    max_positions: int = 65536,
    weights: bool = True,
) -> Path:
    """``out_dir/draft`` and ``out_dir/target`` at the named ``SHAPES`` with random weights and the demo
    tokenizer (the demo pair itself, or real models' compute and memory without their weights: for timing,
    never for answers). Without ``weights`` the weights are made at each load instead (``RANDOM_WEIGHTS``)."""
    out_dir = Path(out_dir)
    tokenizer = train_tokenizer(seed=seed)
    tokenizer.model_max_length = max_positions
    for name, shape, offset in (("draft", draft, 1), ("target", target, 2)):
        write_model(
            out_dir / name,
            SHAPES[shape],
            tokenizer,
            seed=seed + offset,
            max_positions=max_positions,
            device=device,
            dtype=dtype,
            weights=weights,
        )
    (out_dir / "demo.json").write_text(
        json.dumps(
            {
                "version": DEMO_VERSION,
                "seed": seed,
                "draft": draft,
                "target": target,
                "dtype": str(dtype).removeprefix("torch."),
                "max_positions": max_positions,
                "weights": "saved" if weights else "made at load",
            }
        )
    )
    return out_dir


def ensure_demo_models(cache_dir: str | Path | None = None) -> Path:
    """The demo pair's folder, written on first use (atomically, so concurrent first uses are safe)."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / f"demo-{DEMO_VERSION}"
    if (final / "demo.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=root))
    try:
        write_demo_models(staging)
        try:
            staging.rename(final)
        except OSError:  # another process finished first
            if not (final / "demo.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def flops_per_token(config: LlamaConfig) -> int:
    """Matmul FLOPs per token (2 × weights touched), attention over the context left out."""
    head_dim = config.hidden_size // config.num_attention_heads
    attn = config.hidden_size * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    mlp = 3 * config.hidden_size * config.intermediate_size
    return 2 * (config.num_hidden_layers * (attn + mlp) + config.hidden_size * config.vocab_size)
