"""Real prose that is on every machine this runs on and that no session wrote: the docstrings of Python's own
standard library, read from its sources with ``ast`` (nothing is imported), cut into paragraphs of plain English.
"""

from __future__ import annotations

import ast
import functools
import sysconfig
import warnings
from pathlib import Path

SKIP = ("test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "site-packages", "pydoc_data")


@functools.cache
def paragraphs(min_chars: int = 200) -> tuple[str, ...]:
    """Every docstring paragraph of at least ``min_chars`` characters that reads as prose (letters and spaces
    nine tenths of it, no interpreter sessions), whitespace collapsed, each once, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: dict[str, None] = {}
    for path in sorted(root.rglob("*.py")):
        if any(part in SKIP for part in path.relative_to(root).parts):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escapes in old sources
                tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for paragraph in (ast.get_docstring(node) or "").split("\n\n"):
                text = " ".join(paragraph.split())
                if len(text) >= min_chars and _prose(text):
                    seen.setdefault(text)
    return tuple(seen)


def _prose(text: str) -> bool:
    return (
        ">>>" not in text
        and "::" not in text
        and "$" not in text
        and sum(c.isalpha() or c == " " for c in text) >= 0.9 * len(text)
        and text[0].isupper()
        and text.rstrip()[-1] in ".!?"
    )
