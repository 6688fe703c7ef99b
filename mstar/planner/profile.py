"""The planner's measurements of a model on this machine (``Profile``): what the simulator prices a
placement with. ``profiling.profile_model`` makes one with the real runtime; it is a JSON document
(``Profile.save`` / ``load``), reused by ``mstar plan --from-profile``.

* **programs**: what each request class runs, by its lengths (``ClassProgram``, programs.py);
* **forward costs**: one ``ForwardCost`` per module (costs.py), per tensor-parallel size and thread
  count (``cost_key``), and for a stream consumer's final chunks apart;
* **rank timing** per thread count (``RankTiming``): the step gap, the wake-up cost of a rank that
  idled, the client's overheads;
* **gaps**: a walk boundary's on one rank and, the KV caches moving, across two; a stream chunk's;
  a hop between ranks inside a walk;
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

__all__ = ["FINAL", "IDLE_S", "PROFILE_VERSION", "Profile", "RankTiming", "cost_key"]

PROFILE_VERSION = 4
FINAL = "#final"  # a module's cost key suffix for forwards of stream-final chunks only
IDLE_S = 1e-3  # a rank idle this long before a forward pays its RankTiming.wake_ms


def cost_key(module: str, tp: int, threads: int, final: bool = False) -> str:
    """A forward cost's key in ``Profile.costs``: ``LLM@tp1/t2`` (``snac_decoder#final@tp1/t1``)."""
    return f"{module}{FINAL if final else ''}@tp{tp}/t{threads}"


@dataclass(frozen=True)
class RankTiming:
    """What a rank of some thread count spends beside its forwards (and its clients wait)."""

    step_gap_ms: float  # between a request's consecutive forwards, past their compute
    wake_ms: float  # added to a forward after more than IDLE_S idle (threads asleep, caches cold)
    client: dict[str, tuple[float, ...]]  # overheads_in's percentiles (ms): submit, emit, end

    def to_dict(self) -> dict[str, Any]:
        return {"step_gap_ms": self.step_gap_ms, "wake_ms": self.wake_ms,
                "client": {k: list(v) for k, v in self.client.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankTiming:
        return cls(d["step_gap_ms"], d["wake_ms"], {k: tuple(v) for k, v in d["client"].items()})


@dataclass
class Profile:
    model: str
    machine: str
    cores: int
    max_batch: int
    costs: dict[str, ForwardCost]  # cost_key -> its fit
    timing: dict[int, RankTiming]  # a rank's threads -> its timing beside the forwards
    walk_gap_ms: float  # a walk boundary on the same rank
    stream_gap_ms: float  # a stream's chunk: its last item's producer run end to the consumer's first run
    # a walk's next run on another rank than the run it waits for: the message past a step gap, as the
    # 0, 5, ..., 100th percentiles (ms)
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

    def client(self, threads: int, u: float = 0.5) -> dict[str, float]:
        """The client overheads (ms) at quantile ``u`` of a request whose first rank runs ``threads``."""
        return {k: quantile(qs, u) for k, qs in self.rank_timing(threads).client.items()}

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
                "timing": {str(k): t.to_dict() for k, t in self.timing.items()}, "walk_gap_ms": self.walk_gap_ms,
                "stream_gap_ms": self.stream_gap_ms, "hop_ms": list(self.hop_ms), "move_ms": vars(self.move_ms),
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
                   {int(k): RankTiming.from_dict(t) for k, t in d["timing"].items()}, d["walk_gap_ms"],
                   d["stream_gap_ms"], tuple(d["hop_ms"]), Affine(**d["move_ms"]),
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
