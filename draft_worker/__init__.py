"""The SpecPrefill draft worker: scores prompt tokens with a small draft model (``common.selection`` keeps the
best)."""

from draft_worker.config import ScoringConfig
from draft_worker.worker import DraftWorker

__all__ = ["DraftWorker", "ScoringConfig"]
