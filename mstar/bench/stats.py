"""Spread of repeated measurements, as the benchmark tables show it: median (min–max); percentiles;
the timing of one streamed audio request and of one system's run (the TTS suites)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["AudioTiming", "AudioRun", "percentile", "spread", "spread_cell"]


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def spread_cell(s: tuple[float, float, float], fmt: str = ".3f") -> str:
    """A ``spread`` triple as ``median (min–max)``."""
    med, lo, hi = s
    return f"{med:{fmt}} ({lo:{fmt}}–{hi:{fmt}})"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (``q`` in [0, 100]) of a non-empty sequence."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class AudioTiming:
    """One streamed audio request, times from its submission (suites add their own fields)."""

    sample_rate: ClassVar[int] = 24000  # both TTS families' output (SNAC, Code2Wav)
    ttfa_s: float  # first audio
    end_s: float  # end of the request
    audio_samples: int

    @property
    def audio_s(self) -> float:
        return self.audio_samples / self.sample_rate

    @property
    def rtf(self) -> float:
        return self.end_s / self.audio_s if self.audio_samples else math.inf


@dataclass
class AudioClock:
    """A streamed request's audio as its items arrive: samples so far and when the first came."""

    submitted: float  # time.perf_counter() at submission
    first: float | None = None
    samples: int = 0

    def add(self, chunks) -> None:
        """One streamed ``audio`` item (its tensors)."""
        n = sum(int(c.numel()) for c in chunks)
        if n and self.first is None:
            self.first = time.perf_counter()
        self.samples += n

    def times(self) -> tuple[float, float]:
        """(TTFA, end) from submission, now at the end (TTFA = end when no audio came)."""
        end = time.perf_counter()
        return (self.first if self.first is not None else end) - self.submitted, end - self.submitted


@dataclass
class AudioRun:
    """One system running one workload once."""

    wall_s: float
    requests: list  # of AudioTiming (or a subclass)

    @property
    def audio_s(self) -> float:
        return sum(r.audio_s for r in self.requests)
