"""Retrains the retrieval draft/target pair that ships in lab/specprefill_lab/data/retrieval-pair (fixed seeds).

    .venv/bin/python lab/benchmarks/train_retrieval_pair.py [OUT_DIR]

About 20 minutes on 2 CPU cores. Without OUT_DIR it overwrites the shipped pair. See
specprefill_lab.training.train for the recipe, and `specprefill eval --pair OUT_DIR` to evaluate the result.
"""

from __future__ import annotations

import sys
from pathlib import Path

from specprefill_lab.retrieval import SHIPPED_PAIR
from specprefill_lab.training import train_pair

if __name__ == "__main__":
    if len(sys.argv) > 2:
        raise SystemExit(__doc__)
    out = train_pair(Path(sys.argv[1]) if len(sys.argv) == 2 else SHIPPED_PAIR)
    print(f"wrote {out}")
