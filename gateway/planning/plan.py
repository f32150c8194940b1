"""A plan: what goes to the backend for one request, decided once (``planner`` makes it) and frozen. What happens
to the request afterwards (its timings at the backend, the wait predicted when it was sent, its headers) is its
``Trace``.

A plan holds only immutable values: its token IDs and kept positions as tuples (made from any sequence, in
``__post_init__``: a 57,000-token list's copy is 0.05 ms), its token array read-only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gateway.engines.replicas import Replica


@dataclass(frozen=True, slots=True)
class Plan:
    """What goes to the backend for one request, priced at the replica it goes to."""

    token_ids: Sequence[int]  # a tuple, whatever sequence it was made from
    status: str = "bypassed"
    reason: str | None = None
    position_ids: Sequence[int] | None = None  # a tuple; None: the whole prompt
    keep_rate: float = 1.0
    cache: str = "off"
    draft_ms: float = 0.0
    passthrough: bool = False  # forward the client's body unchanged
    kind: str = "whole"  # whole, fresh or extend
    protected: bool = False  # the system prompt kept whole
    recurring: bool = False  # a context likely to come back (a system prompt, or the start of an earlier prompt)
    engine_cached: int = 0  # prompt tokens the engine is expected to serve from its prefix cache
    target_s: float = 0.0  # the target's predicted time for what is sent, on an idle engine
    tokenize_ms: float = 0.0
    select_ms: float = 0.0
    replica: Replica | None = None  # the replica it is priced for (None: not yet routed)
    tokens: np.ndarray | None = field(default=None, compare=False, repr=False)  # token_ids as int64, where made

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, tuple):
            object.__setattr__(self, "token_ids", tuple(self.token_ids))
        if self.position_ids is not None and not isinstance(self.position_ids, tuple):
            object.__setattr__(self, "position_ids", tuple(self.position_ids))
        if self.tokens is not None and self.tokens.flags.writeable:
            tokens = self.tokens.view()  # the prompt's own array stays as it was
            tokens.flags.writeable = False
            object.__setattr__(self, "tokens", tokens)

    @property
    def placed(self) -> Replica:
        """The replica it is priced for, once routed (every plan the dispatcher holds)."""
        if self.replica is None:
            raise RuntimeError("the plan was not routed to a replica")
        return self.replica

    @property
    def original_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def kept_tokens(self) -> int:
        return len(self.position_ids) if self.position_ids is not None else len(self.token_ids)

    def kept_token_ids(self) -> Sequence[int]:
        if self.position_ids is None:
            return self.token_ids
        return [self.token_ids[i] for i in self.position_ids]

    def token_array(self) -> np.ndarray:
        """``token_ids`` as an int64 array: the one the planner made, where it did (a 35,000-token list takes
        the event loop 1-2 ms to convert, and every lookup of the engine's cache compares arrays)."""
        return self.tokens if self.tokens is not None else np.asarray(self.token_ids, dtype=np.int64)

    def kept_array(self) -> np.ndarray:
        """``kept_token_ids`` as an int64 array."""
        tokens = self.token_array()
        return tokens if self.position_ids is None else tokens[np.asarray(self.position_ids, dtype=np.intp)]

    def sent_position_ids(self) -> Sequence[int]:
        return self.position_ids if self.position_ids is not None else list(range(len(self.token_ids)))

    def but(self, **changes: Any) -> Plan:
        """This plan with ``changes`` (a plan is never changed in place)."""
        return replace(self, **changes)
