"""Trains the retrieval draft/target pair for `specprefill eval --pair DIR` (fixed seeds; experimental recipe).

    .venv/bin/python benchmarks/train_retrieval_pair.py OUT_DIR

See specprefill.retrieval.train for what this recipe does and does not reach yet.
"""

from __future__ import annotations

import sys
from pathlib import Path

from specprefill.retrieval import train_pair

if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    out = train_pair(Path(sys.argv[1]))
    print(f"wrote {out}")
