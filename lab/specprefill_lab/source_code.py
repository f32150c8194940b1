"""Real source code that is on every machine this runs on and that no session wrote: the top-level functions and
classes of Python's own standard library, read from its sources with ``ast`` (nothing is imported)."""

from __future__ import annotations

import ast
import functools
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

from specprefill_lab.prose import SKIP


@dataclass(frozen=True, slots=True)
class Piece:
    module: str  # the file's path in the standard library, "json/encoder.py"
    name: str  # the function's or class's name
    source: str  # its source, decorators included, as the file has it
    defaults: tuple[tuple[str, int, int, int], ...] = ()  # a function's literal defaults: (param, line, start, end)


@functools.cache
def pieces(min_chars: int = 200, max_chars: int = 4000) -> tuple[Piece, ...]:
    """Every top-level function and class of ``min_chars`` to ``max_chars`` characters, in a stable order. A
    function's ``defaults`` are its parameters whose default is a literal number or string (not a bool), each
    with where its literal sits in ``source`` (line from 0, columns)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if any(part in SKIP for part in relative.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escapes in old sources
                tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            assert node.end_lineno is not None
            source = "\n".join(lines[first - 1 : node.end_lineno])
            if not min_chars <= len(source) <= max_chars or node.col_offset:
                continue
            defaults = _literal_defaults(node, first) if isinstance(node, ast.FunctionDef) else ()
            out.append(Piece(relative.as_posix(), node.name, source, defaults))
    return tuple(out)


def _literal_defaults(node: ast.FunctionDef, first: int) -> tuple[tuple[str, int, int, int], ...]:
    args = node.args
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    return tuple(
        (arg.arg, default.lineno - first, default.col_offset, default.end_col_offset or default.col_offset)
        for arg, default in pairs
        if isinstance(default, ast.Constant)
        and type(default.value) in (int, str)
        and default.lineno == default.end_lineno
        and (type(default.value) is int or default.value.isidentifier())
    )
