"""The SpecPrefill draft worker: scores prompt tokens with a small draft model and selects what to keep."""

from draft_worker.config import ScoringConfig
from draft_worker.worker import DraftWorker, Selection

__all__ = ["DraftWorker", "ScoringConfig", "Selection"]
