"""Service-level objectives: ``--slo 'ttft_p95<=500ms,tpot_p95<=0.05'``.

Each objective is ``METRIC_pPCT<=LIMIT``: ``METRIC`` one of ``METRICS`` (``ttft``: arrival to the first
output; ``tpot``: time per output after the first, per request; ``e2e``: arrival to the end), ``PCT``
a percentile in (0, 100] (``p50``, ``p95``, ``p99.9``), ``LIMIT`` seconds (``0.5``, ``0.5s``) or
milliseconds (``500ms``). ``parse_slo`` raises ``SLOError`` naming the objective it cannot read;
``SLO.evaluate`` judges measured (or predicted) per-request samples.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["METRICS", "SLO", "Objective", "SLOError", "Verdict", "parse_slo", "percentile"]

METRICS = ("ttft", "tpot", "e2e")
_OBJECTIVE = re.compile(r"^(?P<metric>[a-z0-9]+)_p(?P<pct>\d+(?:\.\d+)?)\s*<=\s*(?P<limit>\d+(?:\.\d+)?(?:e-?\d+)?)"
                        r"\s*(?P<unit>ms|s)?$")


class SLOError(ValueError):
    """An SLO string that cannot be read; the message names the objective."""


@dataclass(frozen=True)
class Objective:
    metric: str
    percentile: float  # in (0, 100]
    limit_s: float

    def __str__(self) -> str:
        return f"{self.metric}_p{self.percentile:g}<={self.limit_s * 1e3:g}ms"


@dataclass(frozen=True)
class Verdict:
    objective: Objective
    value_s: float | None  # None: no sample of this metric
    met: bool


@dataclass(frozen=True)
class SLO:
    objectives: tuple[Objective, ...]

    def evaluate(self, samples: Mapping[str, Sequence[float]]) -> list[Verdict]:
        """Each objective against ``samples`` (metric -> per-request seconds); an objective without samples
        is not met."""
        out = []
        for o in self.objectives:
            values = samples.get(o.metric) or []
            value = percentile(values, o.percentile) if values else None
            out.append(Verdict(o, value, value is not None and value <= o.limit_s))
        return out

    def met(self, samples: Mapping[str, Sequence[float]]) -> bool:
        return all(v.met for v in self.evaluate(samples))

    def request_meets(self, sample: Mapping[str, float]) -> bool:
        """Whether one request's own figures (metric -> seconds) are within every objective's limit
        (a metric it has no figure of, such as one output token's TPOT, does not count against it):
        what goodput counts."""
        return all(sample.get(o.metric) is None or sample[o.metric] <= o.limit_s for o in self.objectives)

    def __str__(self) -> str:
        return ",".join(str(o) for o in self.objectives)


def percentile(values: Sequence[float], pct: float) -> float:
    """The ``pct`` percentile of ``values``, linearly interpolated between order statistics."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def parse_slo(text: str) -> SLO:
    """``'ttft_p95<=500ms,tpot_p95<=0.05'`` -> an ``SLO`` (see the module doc)."""
    if not isinstance(text, str) or not text.strip():
        raise SLOError("an SLO is one or more objectives like 'ttft_p95<=500ms,tpot_p95<=50ms'")
    objectives: list[Objective] = []
    for part in (p.strip() for p in text.split(",")):
        m = _OBJECTIVE.match(part)
        if m is None:
            raise SLOError(f"cannot read objective {part!r}: expected METRIC_pPCT<=LIMIT, e.g. 'ttft_p95<=500ms' "
                           f"(metrics: {', '.join(METRICS)}; limits in s or ms)")
        if m["metric"] not in METRICS:
            raise SLOError(f"objective {part!r}: unknown metric {m['metric']!r} (known: {', '.join(METRICS)})")
        pct = float(m["pct"])
        if not 0 < pct <= 100:
            raise SLOError(f"objective {part!r}: the percentile must be in (0, 100], got {pct:g}")
        limit = float(m["limit"]) * (1e-3 if m["unit"] == "ms" else 1.0)
        if limit <= 0:
            raise SLOError(f"objective {part!r}: the limit must be > 0")
        if any(o.metric == m["metric"] and o.percentile == pct for o in objectives):
            raise SLOError(f"objective {part!r}: {m['metric']}_p{pct:g} is given twice")
        objectives.append(Objective(m["metric"], pct, limit))
    return SLO(tuple(objectives))
