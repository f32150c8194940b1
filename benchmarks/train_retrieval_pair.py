"""Trains the retrieval draft/target pair that `specprefill eval` uses (fixed seeds: reproducible on a CPU).

    .venv/bin/python benchmarks/train_retrieval_pair.py [OUT_DIR]    (default: specprefill/assets/retrieval-pair)
"""

from __future__ import annotations

import sys
from pathlib import Path

from specprefill.retrieval import train_pair

if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "specprefill" / "assets" / "retrieval-pair"
    train_pair(out)
    print(f"wrote {out}")
