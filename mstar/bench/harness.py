"""The repeat harness every benchmark suite runs its measurements through.

* ``rotate(systems, run, repeats)``: one warm-up of each system (never recorded), then ``repeats``
  rounds, each running every system once; the order rotates by one system per round
  (``rotation``), so no system always runs first and a shared machine's drift reaches all alike.
  ``warm_each`` puts an untimed run right before every timed one instead of one warm-up per system,
  for suites whose runs leave state (allocator, caches) that the next system would pay for.
* ``rotate_timed(fns, repeats)``: the same for plain callables, timed here, in seconds.
* ``Spread``: median (min–max) of a figure over the repeats, as the tables show it.
* ``SuiteResult`` and ``Goal``: what a suite hands to ``make bench`` (``mstar.bench.report``): the
  command, what was measured, its markdown tables, its goals (met or not, from the measured
  figures) and a JSON-serialisable copy of the figures; ``markdown()`` and ``to_json()`` render it.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["Goal", "Spread", "SuiteResult", "markdown_table", "rotate", "rotate_timed", "rotation", "timed"]

S = TypeVar("S", bound=Hashable)
R = TypeVar("R")


@dataclass(frozen=True)
class Spread:
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("a spread needs at least one value")
        return cls(statistics.median(values), min(values), max(values))

    def cell(self, fmt: str = ".3f") -> str:
        """``median (min–max)``."""
        return f"{self.median:{fmt}} ({self.min:{fmt}}–{self.max:{fmt}})"

    def as_tuple(self) -> tuple[float, float, float]:
        return self.median, self.min, self.max


def rotation(systems: Sequence[S], repeat: int) -> list[S]:
    """The order of round ``repeat``: ``systems`` rotated left by ``repeat`` places."""
    k = repeat % len(systems) if systems else 0
    return [*systems[k:], *systems[:k]]


def rotate(systems: Sequence[S], run: Callable[[S, int], R], repeats: int, *,
           warmup: Callable[[S], object] | None = None, warm: bool = True, warm_each: bool = False,
           log: Callable[[str], None] | None = None, label: Callable[[R], str] | None = None,
           before_first: Callable[[], object] | None = None) -> dict[S, list[R]]:
    """``run(system, repeat)`` for every system, ``repeats`` rounds in rotating order; the results
    per system, in round order. The warm-up (``warm``) calls ``warmup(system)`` (default: ``run(system,
    0)``) once per system before the first round, or before each timed run with ``warm_each``; its
    results are dropped. ``before_first`` runs between the warm-up and the first timed run (to read
    a counter the timed runs are compared against)."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    if len(set(systems)) != len(systems) or not systems:
        raise ValueError(f"systems must be distinct and not empty, got {list(systems)}")
    warm_up = warmup or (lambda s: run(s, 0))
    if warm and not warm_each:
        for s in systems:
            warm_up(s)
    if before_first:
        before_first()
    out: dict[S, list[R]] = {s: [] for s in systems}
    for r in range(repeats):
        for s in rotation(systems, r):
            if warm and warm_each:
                warm_up(s)
            res = run(s, r)
            out[s].append(res)
            if log:
                log(f"repeat {r + 1}/{repeats} {s}" + (f": {label(res)}" if label else ""))
    return out


def timed(fn: Callable[[], R]) -> tuple[float, R]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


def rotate_timed(fns: Mapping[S, Callable[[], object]], repeats: int, *, warm: bool = True,
                 log: Callable[[str], None] | None = None) -> dict[S, list[float]]:
    """Seconds per call of every function, ``repeats`` rotating rounds after one warm-up call each."""
    return rotate(list(fns), lambda s, _r: timed(fns[s])[0], repeats, warmup=lambda s: fns[s](), warm=warm,
                  log=log, label=lambda t: f"{t:.4f} s")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A markdown table; ``align`` one character per column, ``l`` or ``r`` (default: the first
    column left, the others right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    if len(align) != len(headers) or any(len(r) != len(headers) for r in rows):
        raise ValueError("every row and the alignment need one entry per header")
    rule = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    return "\n".join(["| " + " | ".join(map(str, headers)) + " |", rule,
                      *("| " + " | ".join(map(str, r)) + " |" for r in rows)])


@dataclass
class Goal:
    """One goal of a suite; ``met`` is None when this run could not measure it (a peer missing)."""

    text: str  # what is asked and what was measured, e.g. "ours / vLLM >= 1.5x at 16: <the median ratio>"
    met: bool | None

    def line(self) -> str:
        verdict = {True: "met", False: "not met", None: "not measured"}[self.met]
        return f"- {self.text}: **{verdict}**"


def _jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return _jsonable(asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


@dataclass
class SuiteResult:
    """A suite's run as ``make bench`` writes it: markdown for BENCHMARKS.md, JSON beside it."""

    name: str
    command: str  # the CLI line that reproduces the run
    description: str = ""  # the run's parameters, one paragraph
    tables: list[str] = field(default_factory=list)  # markdown tables
    goals: list[Goal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # short remarks shown under the goals
    data: Any = None  # the figures, JSON-serialisable after _jsonable (dataclasses become dicts)
    skipped: str | None = None  # why the suite did not run (a prerequisite missing)

    def markdown(self) -> str:
        if self.skipped:
            return f"Not run: {self.skipped}"
        parts = [self.description] if self.description else []
        parts += self.tables
        if self.goals:
            parts.append("Goals:\n\n" + "\n".join(g.line() for g in self.goals))
        parts += self.notes
        return "\n\n".join(p.rstrip() for p in parts)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "command": self.command, "skipped": self.skipped,
                "goals": [{"text": g.text, "met": g.met} for g in self.goals], "data": _jsonable(self.data)}

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path
