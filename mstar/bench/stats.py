"""Spread of repeated measurements, as the benchmark tables show it: median (min–max)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["spread", "spread_cell"]


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def spread_cell(s: tuple[float, float, float], fmt: str = ".3f") -> str:
    """A ``spread`` triple as ``median (min–max)``."""
    med, lo, hi = s
    return f"{med:{fmt}} ({lo:{fmt}}–{hi:{fmt}})"
