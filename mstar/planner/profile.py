"""The planner's measurements of a model on this machine (``Profile``): what the simulator prices a
placement with. ``profiling.profile_model`` makes one with the real runtime; it is a JSON document
(``Profile.save`` / ``load``), reused by ``mstar plan --from-profile``.

* **programs**: what each request class runs, by its lengths (``ClassProgram``, programs.py);
* **forward costs**: one ``ForwardCost`` per module (costs.py), per tensor-parallel size and thread
  count (``cost_key``), and for a stream consumer's final chunks apart;
* **rank timing** per thread count (``RankTiming``): the step gap, a walk boundary's gap on one
  rank, a stream chunk's gap and, by how long the rank idled before (``AfterIdle``), a forward's
  wake-up cost and the client's overheads;
* **gaps between ranks**: a walk boundary's, the KV caches moving; a hop inside a walk;
* **contention**: how much slower ranks compute together, the cores shared or split (contention.py);
* **KV**: bytes per cached token of each KV module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mstar.planner.costs import ForwardCost, quantile
from mstar.planner.programs import Affine, ClassProgram

__all__ = ["FINAL", "IDLE_LEVELS_S", "IDLE_S", "PROFILE_VERSION", "AfterIdle", "Profile", "RankTiming", "cost_key"]

PROFILE_VERSION = 7
FINAL = "#final"  # a module's cost key suffix for forwards of stream-final chunks only
IDLE_S = 1e-3  # a rank idle this long before a forward pays a wake-up cost (RankTiming.wake_ms)
# The pauses the profile leaves between requests run alone, to see what idling costs: a rank's OpenMP
# threads stop spinning and sleep, a VM's idle vCPU is descheduled by its host, caches go cold; the
# longer the pause, the slower the first forward after it (and the client's submit).
IDLE_LEVELS_S = (0.003, 0.02, 0.08, 0.3, 1.0)


def cost_key(module: str, tp: int, threads: int, final: bool = False) -> str:
    """A forward cost's key in ``Profile.costs``: ``LLM@tp1/t2`` (``snac_decoder#final@tp1/t1``)."""
    return f"{module}{FINAL if final else ''}@tp{tp}/t{threads}"


@dataclass(frozen=True)
class AfterIdle:
    """What requests run alone after their rank idled about ``idle_s`` paid, as evenly spaced
    percentiles (ms, ``costs.percentiles``)."""

    idle_s: float  # the median idle time before the requests measured
    wake: tuple[float, ...]  # a forward's ms past its module's cost (threads asleep, caches cold)
    client: dict[str, tuple[float, ...]]  # readings.overheads_in's: submit, emit, end

    def to_dict(self) -> dict[str, Any]:
        return {"idle_s": self.idle_s, "wake": list(self.wake), "client": {k: list(v) for k, v in self.client.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AfterIdle:
        return cls(d["idle_s"], tuple(d["wake"]), {k: tuple(v) for k, v in d["client"].items()})


def _between(levels: tuple[AfterIdle, ...], idle_s: float, read: Any) -> float:
    """``read(level)`` at ``idle_s``: linear between the two levels around it, the nearest one outside."""
    if idle_s <= levels[0].idle_s:
        return read(levels[0])
    for lo, hi in zip(levels, levels[1:]):
        if idle_s <= hi.idle_s:
            w = (idle_s - lo.idle_s) / (hi.idle_s - lo.idle_s) if hi.idle_s > lo.idle_s else 1.0
            return read(lo) + (read(hi) - read(lo)) * w
    return read(levels[-1])


@dataclass(frozen=True)
class RankTiming:
    """What a rank of some thread count spends beside its forwards (and its clients wait)."""

    step_gap_ms: float  # between a request's consecutive forwards, past their compute
    after_idle: tuple[AfterIdle, ...]  # by idle_s, ascending (at least one)
    walk_gap_ms: float = 0.0  # a walk boundary on the same rank: the last run's end to the next walk's first
    # a stream's chunk: its last item's producer run end (or the consumer's rank's last forward's, were it
    # later) to the consumer's first run; measured where the profile placed the two (readings.stream_gaps_in)
    stream_gap_ms: float = 0.0

    def wake_ms(self, idle_s: float, u: float = 0.5) -> float:
        """Added to a forward after its rank idled ``idle_s`` (quantile ``u`` of the spread): nothing
        up to ``IDLE_S``, then growing to the first level's."""
        if idle_s <= IDLE_S:
            return 0.0
        ms = _between(self.after_idle, idle_s, lambda a: quantile(a.wake, u))
        first = self.after_idle[0].idle_s
        return ms * min(1.0, (idle_s - IDLE_S) / (first - IDLE_S)) if first > IDLE_S else ms

    def client(self, idle_s: float, u: float = 0.5) -> dict[str, float]:
        """The client overheads (ms, quantile ``u``) of a request reaching a rank idle for ``idle_s``."""
        keys = self.after_idle[0].client
        return {k: _between(self.after_idle, idle_s, lambda a, k=k: quantile(a.client.get(k, (0.0,)), u))
                for k in keys}

    def woken_ms(self, idle_s: float, u: float = 0.5) -> float:
        """What a peer's message (a KV move) reaching this rank after it idled ``idle_s`` pays beyond one
        reaching it after the shortest pause profiled (quantile ``u``): the client's submit's growth
        with the pause, the same wake-up of a worker blocked waiting for its next message (the KV move
        is profiled on ranks that never idle)."""
        warm = quantile(self.after_idle[0].client.get("submit", (0.0,)), u)
        return max(0.0, self.client(idle_s, u).get("submit", warm) - warm)

    def to_dict(self) -> dict[str, Any]:
        return {"step_gap_ms": self.step_gap_ms, "after_idle": [a.to_dict() for a in self.after_idle],
                "walk_gap_ms": self.walk_gap_ms, "stream_gap_ms": self.stream_gap_ms}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankTiming:
        return cls(d["step_gap_ms"], tuple(AfterIdle.from_dict(a) for a in d["after_idle"]), d["walk_gap_ms"],
                   d["stream_gap_ms"])


@dataclass
class Profile:
    model: str
    machine: str
    cores: int
    max_batch: int
    costs: dict[str, ForwardCost]  # cost_key -> its fit
    timing: dict[int, RankTiming]  # a rank's threads -> its timing beside the forwards
    # a walk's next run on another rank than the run it waits for: the message past a step gap, as
    # evenly spaced percentiles (ms, ``costs.percentiles``)
    hop_ms: tuple[float, ...]
    move_ms: Affine  # a walk boundary across ranks, the KV caches moving: ms at ``c + p * kv tokens``
    contention: dict[str, dict[int, float]]  # measure_contention's: "shared" / "split" -> k -> slowdown
    kv_bytes_per_token: dict[str, int]
    programs: dict[str, ClassProgram]
    tp_sizes: tuple[int, ...] = (1,)
    threads: tuple[int, ...] = ()  # the thread counts one rank (tp 1) was profiled at
    notes: list[str] = field(default_factory=list)

    def default_threads(self, tp: int = 1) -> int:
        """A rank's threads when its group sets none: every core, or its share under tensor parallelism."""
        return max(1, self.cores // tp)

    def cost(self, module: str, tp: int = 1, threads: int | None = None, final: bool = False) -> ForwardCost:
        """``module``'s forward cost at tensor-parallel size ``tp`` with ``threads`` per rank (None:
        the default); ``final``: of a batch of stream-final chunks only, where the profile saw such
        forwards."""
        threads = threads or self.default_threads(tp)
        if final and cost_key(module, tp, threads, True) in self.costs:
            return self.costs[cost_key(module, tp, threads, True)]
        key = cost_key(module, tp, threads)
        if key not in self.costs:
            raise KeyError(f"the profile has no forward cost of {module!r} at tensor-parallel size {tp} with "
                           f"{threads} thread(s) (profiled: {', '.join(sorted(self.costs))})")
        return self.costs[key]

    def rank_timing(self, threads: int) -> RankTiming:
        """The timing of a rank of ``threads`` threads (the nearest thread count profiled)."""
        return self.timing[min(self.timing, key=lambda t: (abs(t - threads), t))]

    def hop(self, u: float = 0.5) -> float:
        """A hop between ranks (ms) at quantile ``u``."""
        return quantile(self.hop_ms, u)

    def client(self, threads: int, idle_s: float = 0.0, u: float = 0.5) -> dict[str, float]:
        """The client overheads (ms) at quantile ``u`` of a request whose first rank runs ``threads``
        and idled ``idle_s`` before it."""
        return self.rank_timing(threads).client(idle_s, u)

    def slowdown(self, threads: list[int]) -> float:
        """How much slower each forward runs while groups using ``threads`` threads each compute at once:
        the ``split`` table while they fit the cores, else the ``shared`` one (past the ranks measured,
        growing in proportion)."""
        k = len(threads)
        if k <= 1 or not self.contention:
            return 1.0
        table = self.contention["split" if sum(threads) <= self.cores else "shared"]
        top = max(table)
        return table[min(k, top)] * (k / top if k > top else 1.0)

    def to_dict(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, "model": self.model, "machine": self.machine, "cores": self.cores,
                "max_batch": self.max_batch, "costs": {k: c.to_dict() for k, c in self.costs.items()},
                "timing": {str(k): t.to_dict() for k, t in self.timing.items()}, "hop_ms": list(self.hop_ms),
                "move_ms": vars(self.move_ms),
                "contention": {way: {str(k): v for k, v in t.items()} for way, t in self.contention.items()},
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "programs": {k: p.to_dict() for k, p in self.programs.items()}, "tp_sizes": list(self.tp_sizes),
                "threads": list(self.threads), "notes": self.notes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')!r} is not {PROFILE_VERSION}: profile again")
        return cls(d["model"], d["machine"], d["cores"], d["max_batch"],
                   {k: ForwardCost.from_dict(c) for k, c in d["costs"].items()},
                   {int(k): RankTiming.from_dict(t) for k, t in d["timing"].items()}, tuple(d["hop_ms"]),
                   Affine(**d["move_ms"]),
                   {way: {int(k): v for k, v in t.items()} for way, t in d["contention"].items()},
                   dict(d["kv_bytes_per_token"]), {k: ClassProgram.from_dict(p) for k, p in d["programs"].items()},
                   tuple(d.get("tp_sizes", (1,))), tuple(d.get("threads", ())), list(d.get("notes", [])))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a planner profile ({e})") from e
