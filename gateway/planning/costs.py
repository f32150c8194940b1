"""What a plan costs: time models of the target engine and of the draft, calibrated from measured timings.

Prefilling ``n`` new tokens after ``ctx`` cached ones costs a fixed part, a part per new token (the weights),
a part per cached token (every forward reads the whole KV cache once), and a part per pair of tokens that
attend to each other (``n × (ctx + n/2)``); scoring adds a part per prompt token (the look-ahead queries and
the reduction read every key). The coefficients are fitted by least squares on relative error, non-negative,
over a short probe at start-up and a window of recent requests, so they follow the hardware and the load the
gateway actually sees. Recent timings the fit misses by more than ``OUTLIER``x either way, at the window's
median speed (a stalled engine, a request that met a fault, a burst the gateway could not see) are left out: a
passing fault teaches nothing, a lasting change of speed becomes the median and is learnt.

A fit can be sure of the wrong thing for good. Once, on an engine that another client's work slowed without
its saying so, a window of cached contexts priced a cold 10,320-token prefill at 1.14 s; it took 45 s, the rule
kept every such timing out as one the window's median speed did not explain, and every later prompt went whole
at that price. So once ``RESET_AFTER`` prefills of at least ``RESET_MIN_NEW`` new tokens in a row, over at
least ``RESET_SPAN_S`` seconds (longer than a stall the rule should wait out), take more than ``OUTLIER`` times
what the fit predicted, the fit is reset: the probe and the window are forgotten, the coefficients scaled by
those timings' median shortfall (those prefills are then priced at what they took), and the model learns again
from them and what follows. Logged and counted (``resets``; ``specprefill_cost_model_resets_total``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from gateway.cost_terms import DRAFT_TERMS, TARGET_TERMS, check_coefficients

# a recent timing this many times off the fit, either way, is not the engine's usual cost (a shape of request the
# fit misprices this badly is learnt once it is most of the window: a smaller bound would keep more out for longer)
OUTLIER = 4.0
RESET_AFTER = 3  # prefills in a row that much slower than predicted: the fit is wrong, not the engine unlucky
RESET_MIN_NEW = 512  # new tokens of a prefill that counts towards a reset (a few tokens' timing is mostly noise)
RESET_SPAN_S = 60.0  # ... over at least this long: an engine stopped for a few seconds is a fault, not a change
# the fit follows the window a 32nd of it at a time: a full window of 256 is fitted again every 8 answers (a fit is
# about 130 µs of numpy on small arrays; after every answer it was a seventh of the gateway's CPU a request under
# load, and one answer moves a 256-row least-squares fit by about a 256th)
REFIT_SHARE = 32
logger = logging.getLogger("specprefill.gateway")


def target_features(new: int, cached: int) -> list[float]:
    return [1.0, float(new), float(cached), new * (cached + new / 2)]


def draft_features(new: int, cached: int) -> list[float]:
    return [1.0, float(new), new * (cached + new / 2), float(new + cached)]


class CostModel:
    """seconds ≈ coefficients · features, fitted on the probe (always kept) and the last ``window`` requests."""

    def __init__(
        self,
        terms: Sequence[str],
        features: Callable[[int, int], Sequence[float]],
        defaults: Sequence[float],
        window: int = 256,
        fixed: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert len(terms) == len(defaults)
        self.terms = tuple(terms)
        self.features = features
        self.coefficients = np.asarray(defaults, dtype=float)
        self.fixed = fixed  # the coefficients were given: observations change nothing
        self._probe: list[tuple[list[float], float]] = []
        # the recent requests' features and seconds, a ring of ``window`` rows: a refit after every answer reads
        # arrays, not lists (under 100 concurrent streams, building the arrays was a tenth of the gateway's CPU)
        self._x = np.zeros((window, len(self.terms)))
        self._y = np.zeros(window)
        self._seen = 0
        self._unfitted = 0  # timings remembered since the last fit
        self.clock = clock
        # the slow prefills in a row: features, seconds, measured over predicted, when
        self._shortfalls: list[tuple[list[float], float, float, float]] = []
        self.resets = 0  # times the fit was found wrong and started again

    @property
    def coefficients(self) -> np.ndarray:
        return self._coefficients

    @coefficients.setter
    def coefficients(self, value: np.ndarray) -> None:
        self._coefficients = np.asarray(value, dtype=float)
        self._values: tuple[float, ...] = tuple(self._coefficients.tolist())  # a price is 4 products: no array

    def _priced(self, features: Sequence[float]) -> float:
        return float(sum(c * f for c, f in zip(self._values, features)))

    def predict(self, new: int, cached: int) -> float:
        """Seconds to process ``new`` tokens after ``cached`` ones (0 for nothing new)."""
        if new <= 0:
            return 0.0
        return self._priced(self.features(new, cached))

    def observe(self, new: int, cached: int, seconds: float, *, probe: bool = False) -> None:
        if self.fixed or new <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        features = list(self.features(new, cached))
        if probe:
            self._probe.append((features, seconds))
        elif self._mispriced(new, features, seconds):
            self._reset()
            return
        else:
            self._remember(features, seconds)
            self._unfitted += 1
            if self._unfitted < min(self._seen, len(self._y)) // REFIT_SHARE:
                return
        self.refit()

    @property
    def probe_timings(self) -> list[tuple[list[float], float]]:
        """The start-up probe's timings (features, seconds), as the fit keeps them."""
        return [(list(features), seconds) for features, seconds in self._probe]

    def restore_probe(self, timings: Sequence[tuple[Sequence[float], float]]) -> None:
        """An earlier probe's timings in place of probing again: fitted as the probe's own would have been."""
        if self.fixed:
            return
        self._probe = [([float(f) for f in features], float(seconds)) for features, seconds in timings]
        self.refit()

    def _remember(self, features: list[float], seconds: float) -> None:
        row = self._seen % len(self._y)
        self._x[row], self._y[row] = features, seconds
        self._seen += 1

    def _mispriced(self, new: int, features: list[float], seconds: float) -> bool:
        """Whether this timing makes ``RESET_AFTER`` prefills in a row that took over ``OUTLIER`` times the
        prediction (they are remembered meanwhile, as any timing)."""
        if new < RESET_MIN_NEW:
            return False
        predicted = self._priced(features)  # neither evidence for nor against: the streak goes on
        if seconds <= OUTLIER * max(predicted, 1e-9):
            self._shortfalls.clear()
            return False
        now = self.clock()
        self._shortfalls.append((features, seconds, seconds / max(predicted, 1e-9), now))
        return len(self._shortfalls) >= RESET_AFTER and now - self._shortfalls[0][3] >= RESET_SPAN_S

    def _reset(self) -> None:
        shortfall = float(np.median([ratio for _, _, ratio, _ in self._shortfalls]))
        logger.warning(
            "the %s cost model priced %d prefills in a row at under 1/%g of what they took (%.0fx on the median): "
            "it starts again from those timings",
            "target" if self.terms == TARGET_TERMS else "draft",
            len(self._shortfalls),
            OUTLIER,
            shortfall,
        )
        self.coefficients = self.coefficients * shortfall
        self._probe.clear()
        self._seen = 0
        for features, seconds, _, _ in self._shortfalls:
            self._remember(features, seconds)
        self._shortfalls.clear()
        self.resets += 1
        self.refit()

    def refit(self) -> None:
        self._unfitted = 0
        recent = min(self._seen, len(self._y))
        x, y = self._x[:recent], self._y[:recent]
        if self._probe:
            x = np.vstack([np.asarray([f for f, _ in self._probe], dtype=float), x])
            y = np.concatenate([np.asarray([t for _, t in self._probe], dtype=float), y])
        if len(y) < len(self.terms):
            return
        probes = len(y) - recent
        rows = x / y[:, None]  # relative error: a row predicts 1 when the fit is exact
        # the fit so far judges the recent timings, at the window's own median speed (an engine that changed speed
        # for good is most of the window, and learnt); the trimmed fit judges them again, until it settles. (Fitted
        # first, a few timings 10x too fast would pull the fit to themselves and pass for the rule.)
        coefficients, keep = self.coefficients, None
        for _ in range(3):
            ratio = rows[probes:] @ coefficients  # predicted over measured
            if recent:
                ratio = ratio / max(float(np.median(ratio)), 1e-12)
            inlier = (ratio <= OUTLIER) & (ratio >= 1 / OUTLIER)
            if probes + inlier.sum() < len(self.terms):
                inlier[:] = True
            trimmed = np.concatenate([np.ones(probes, dtype=bool), inlier])
            if keep is not None and np.array_equal(trimmed, keep):
                break
            keep = trimmed
            coefficients = _nonnegative_fit(rows[keep], np.ones(int(keep.sum())))
        self.coefficients = coefficients

    def describe(self) -> dict[str, float]:
        return dict(zip(self.terms, self.coefficients.tolist()))


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with the coefficients held at zero that would otherwise come out negative."""
    active = np.ones(x.shape[1], dtype=bool)
    while True:
        solution = np.zeros(x.shape[1])
        if active.any():
            solution[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        negative = active & (solution < 0)
        if not negative.any():
            return solution
        active &= ~negative


def cost_models(fixed: Mapping[str, Sequence[float]] | None = None) -> tuple[CostModel, CostModel]:
    """The target's and the draft's models: ``fixed`` coefficients, or defaults for calibration to replace (a
    target about 30x the draft per token, as a 1B draft for a 30B-class target)."""
    if fixed is not None:
        check_coefficients(fixed)
        return (
            CostModel(TARGET_TERMS, target_features, fixed["target"], fixed=True),
            CostModel(DRAFT_TERMS, draft_features, fixed["draft"], fixed=True),
        )
    return (
        CostModel(TARGET_TERMS, target_features, (0.02, 3e-4, 1e-6, 3e-9)),
        CostModel(DRAFT_TERMS, draft_features, (0.005, 1e-5, 1e-10, 1e-6)),
    )
