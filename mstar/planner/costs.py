"""What one forward of a module costs on this machine, fitted to the forwards the real runtime ran.

A forward's compute time is modelled as ``a + b * rows + c * tokens + d * attention`` milliseconds:
``rows`` the work items in the batch, ``tokens`` the new KV tokens it computes (a prompt's length,
one per decode row), ``attention`` its attention pairs (each row's new tokens times the KV tokens
it attends to: a decode row's context, a prompt's square; 0 for a stateless module). The
coefficients are non-negative (a longer batch never gets cheaper) and fitted, least absolute
relative error, to the forwards the rank's trace recorded (``batch``, ``batch_tokens``, ``batch_attention``,
``compute_ms``), so a mixed batch (prompts with decode rows) is priced by the same four numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Forward", "ForwardCost", "nonnegative_least_squares", "percentiles", "quantile"]

FEATURES = ("fixed", "rows", "tokens", "attention")
ROBUST_ROUNDS = 8
MIN_STEPS, MAX_STEPS = 20, 100  # a spread's percentile steps: 5 to 1 percent


@dataclass(frozen=True)
class Forward:
    """One forward as a rank's trace recorded it."""

    module: str
    rows: int
    tokens: int
    attention: int
    ms: float


def percentiles(values: Sequence[float], floor: float | None = None) -> tuple[float, ...]:
    """Evenly spaced percentiles of ``values``, the 0th to the 100th, each at least ``floor`` when
    given: how the profile keeps a measured spread, read back by ``quantile``. One step per sample,
    between 5 and 1 percent: at 5 percent steps, a single odd reading among hundreds (a worker's
    hiccup) would be drawn, interpolated from the 95th percentile up, by one draw in twenty."""
    steps = min(MAX_STEPS, max(MIN_STEPS, len(values)))
    qs = np.percentile(np.asarray(values, dtype=float), np.linspace(0.0, 100.0, steps + 1))
    return tuple(round(float(q if floor is None else max(floor, q)), 4) for q in qs)


def quantile(qs: Sequence[float], u: float) -> float:
    """``u`` in [0, 1] read off evenly spaced percentiles ``qs`` (linearly interpolated)."""
    if len(qs) == 1:
        return qs[0]
    x = u * (len(qs) - 1)
    i = min(int(x), len(qs) - 2)
    return qs[i] + (qs[i + 1] - qs[i]) * (x - i)


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: solve, drop the most negative coefficient's column,
    solve again (an active-set method; enough for a handful of features)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        del active[int(np.argmin(sol))]
    return coef


@dataclass(frozen=True)
class ForwardCost:
    """A module's forward time in ms: ``fixed + rows * per_row + tokens * per_token + attention *
    per_pair``; ``samples`` forwards were fitted, ``error`` their median relative error."""

    fixed: float
    per_row: float
    per_token: float
    per_pair: float
    samples: int = 0
    error: float = 0.0
    spread: tuple[float, ...] = ()  # measured / fitted time at evenly spaced percentiles (``percentiles``)

    def draw(self, u: float) -> float:
        """The factor a forward's time is off the fit at quantile ``u`` in [0, 1] (1.0 without a spread):
        what a simulator multiplies by, so its forwards vary as the measured ones did."""
        return quantile(self.spread, u) if self.spread else 1.0

    def ms(self, rows: int, tokens: int, attention: int) -> float:
        return self.fixed + self.per_row * rows + self.per_token * tokens + self.per_pair * attention

    @classmethod
    def fit(cls, forwards: Sequence[Forward]) -> ForwardCost:
        """Fitted to ``forwards`` (at least one), minimizing the sum of absolute relative errors (each
        forward counts by 1 / its time, so a decode step of 1 ms is fitted as closely as a prompt of
        100 ms; absolute, so outliers weigh little), by iteratively reweighted least squares."""
        if not forwards:
            raise ValueError("no forwards to fit")
        x = np.array([[1.0, f.rows, f.tokens, f.attention] for f in forwards])
        y = np.array([f.ms for f in forwards])
        w = 1.0 / np.maximum(y, 1e-3)
        coef = nonnegative_least_squares(x * w[:, None], y * w)
        for _ in range(ROBUST_ROUNDS):  # least absolute relative error (IRLS): a few odd forwards
            rel = np.abs(x @ coef - y) * w  # (a worker's hiccup, a chunk with nothing to do) do not pull it
            scale = w / np.sqrt(np.maximum(rel, 0.01))
            coef = nonnegative_least_squares(x * scale[:, None], y * scale)
        pred = x @ coef
        err = float(np.median(np.abs(pred - y) / np.maximum(y, 1e-3)))
        ratio = y / np.maximum(pred, 1e-6)
        spread = percentiles(ratio)
        return cls(*(float(c) for c in coef), samples=len(forwards), error=err, spread=spread)

    def to_dict(self) -> dict[str, Any]:
        return {"fixed_ms": self.fixed, "per_row_ms": self.per_row, "per_token_ms": self.per_token,
                "per_pair_ms": self.per_pair, "samples": self.samples, "median_error": self.error,
                "spread": list(self.spread)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ForwardCost:
        return cls(d["fixed_ms"], d["per_row_ms"], d["per_token_ms"], d["per_pair_ms"], d.get("samples", 0),
                   d.get("median_error", 0.0), tuple(d.get("spread", ())))
