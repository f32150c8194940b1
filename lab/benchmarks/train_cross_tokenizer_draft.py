"""Trains the retrieval draft with another tokenizer (``make_bpe_tokenizer``), for cross-tokenizer SpecPrefill.

    .venv/bin/python lab/benchmarks/train_cross_tokenizer_draft.py [OUT_DIR]

The same recipe and shape as the shipped draft (``specprefill_lab.training``), fixed seeds; about 10 minutes on
2 CPU cores. Without OUT_DIR it writes the shipped one, lab/specprefill_lab/data/retrieval-pair/draft-bpe.
"""

from __future__ import annotations

import sys
from pathlib import Path

from specprefill_lab.retrieval import SHIPPED_PAIR
from specprefill_lab.training import train_cross_tokenizer_draft

if __name__ == "__main__":
    if len(sys.argv) > 2:
        raise SystemExit(__doc__)
    out = train_cross_tokenizer_draft(Path(sys.argv[1]) if len(sys.argv) == 2 else SHIPPED_PAIR / "draft-bpe")
    print(f"wrote {out}")
