"""The SpecPrefill draft worker: scores prompt tokens with a small draft model; ``select_tokens`` keeps the best."""

from draft_worker.config import ScoringConfig
from draft_worker.selector import select_tokens
from draft_worker.worker import DraftWorker

__all__ = ["DraftWorker", "ScoringConfig", "select_tokens"]
