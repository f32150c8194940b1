"""A real model's plain Hugging Face checkpoint, made once under the cache folder from its checked GGUF file.

transformers reads GGUF (``gguf_file=``, with the ``gguf`` package) and dequantizes it to float32, but will not
save a model it loaded that way, and the config it builds names the GGUF quantization (which vLLM refuses): the
weights are copied into a fresh model of the same class, written as bfloat16 safetensors with the tokenizer and
its chat template, checked against the GGUF model, and moved into place in one rename, so a half-written
checkpoint is never found. Later calls find it and return at once; concurrent first calls are safe.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from common.cache_folder import default_cache_dir
from common.process import sigterm_unwinds
from specprefill.real_models.catalog import RealModel
from specprefill.real_models.gguf_files import RealModelError, check_disk, gguf_file, part_files

DONE = "specprefill-real-model.json"  # written last: its presence says the checkpoint is whole


def checkpoint_dir(model: RealModel, cache_dir: str | Path | None = None) -> Path:
    return (Path(cache_dir) if cache_dir else default_cache_dir()) / model.folder


def ensure_checkpoint(model: RealModel, cache_dir: str | Path | None = None) -> Path:
    """The model's checkpoint folder, made on first use (20 s to a few minutes, by size)."""
    final = checkpoint_dir(model, cache_dir)
    if (final / DONE).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    check_disk(model, final.parent, part_files(model))
    with sigterm_unwinds():  # a SIGTERM meanwhile (a container stopped) leaves no gigabytes of half-made files
        staging = Path(tempfile.mkdtemp(prefix=f".{model.key}-", dir=final.parent))
        scratch = Path(tempfile.mkdtemp(prefix=f".{model.key}-gguf-", dir=final.parent))
        try:
            with gguf_file(model, scratch) as source:
                convert(model, source, staging)
            try:
                staging.rename(final)
            except OSError:  # another process finished first, or a folder without DONE is in the way
                if not (final / DONE).exists():
                    shutil.rmtree(final, ignore_errors=True)
                    staging.rename(final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)
    return final


@torch.inference_mode()
def convert(model: RealModel, source: Path, out: Path) -> None:
    """The GGUF file at ``source`` as a plain checkpoint in ``out`` (bfloat16 safetensors, tokenizer, template)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    except Exception as exc:
        raise RealModelError(
            f"{source} could not be read as a GGUF model ({type(exc).__name__}: {exc}); "
            f"reinstall it: {model.source.install(force=True)}"
        ) from exc
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF's: the checkpoint holds plain weights
    config._name_or_path = model.name
    with torch.device("meta"):
        plain: Any = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    if config.tie_word_embeddings:
        plain.tie_weights()
    # bfloat16, as the models are published: half the memory, and fast where the CPU has bfloat16 dot products
    # (common.models.compute_dtype computes in float32 where they are slower than float32, measured)
    plain = plain.to(torch.bfloat16)
    plain.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=_end_tokens(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
    )
    tokenizer.model_max_length = config.max_position_embeddings
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _check(loaded, plain, tokenizer, out)
    _readable(out)
    (out / DONE).write_text(
        json.dumps(
            {
                "model": model.name,
                "folder": model.folder,
                "packages": model.source.requirements(),
                "sha256": model.source.sha256,
                "dtype": "bfloat16",
            }
        )
    )


def _end_tokens(tokenizer: Any) -> int | list[int]:
    """The chat's end of turn and the tokenizer's end of text both end an answer (as the published generation
    configs say for ChatML models, whose GGUF names only the first)."""
    ends = [tokenizer.eos_token_id]
    for token in ("<|im_end|>", "<|endoftext|>"):
        if (found := tokenizer.convert_tokens_to_ids(token)) is not None and found != tokenizer.unk_token_id:
            ends.append(found)
    unique = list(dict.fromkeys(e for e in ends if e is not None))
    return unique[0] if len(unique) == 1 else unique


def _readable(folder: Path) -> None:
    """Permissions as the umask gives new files (a temporary folder and safetensors start private)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _check(loaded: Any, model: Any, tokenizer: Any, out: Path) -> None:
    """The written checkpoint holds the weights meant (bit for bit), and answers a chat prompt's first token as
    the GGUF model does."""
    saved = AutoModelForCausalLM.from_pretrained(out)
    written = saved.state_dict()
    for name, tensor in model.state_dict().items():
        if not torch.equal(written[name], tensor):
            raise RealModelError(f"the checkpoint written in {out} does not hold the model's {name}")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    expected, got = loaded(**ids).logits[0, -1].argmax(), saved(**ids).logits[0, -1].argmax()
    if expected != got:
        raise RealModelError(f"the checkpoint written in {out} answers otherwise than the GGUF model")
