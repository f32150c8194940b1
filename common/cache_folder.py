"""Where the project keeps what it makes once and finds again: real models' checkpoints, the demo pair, the start-up
probe's timings. ``$SPECPREFILL_CACHE_DIR``, else ``$XDG_CACHE_HOME/specprefill``, else ``~/.cache/specprefill``."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    root = os.environ.get("SPECPREFILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specprefill"
    )
    return Path(root)
