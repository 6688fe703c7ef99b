"""Profiling a model on this machine with the real runtime: what the planner's simulator needs.

``profile_model`` starts the runtime (worker processes, as ``mstar serve`` runs) on placements it
makes itself and submits sized requests of the workload's classes (``ModelDef.sized_request``):

* **programs**: each class alone at three size points -> ``ClassProgram`` (programs.py);
* **forward costs**: batches of 1, 2, 4, ... requests of each class at once and staggered, every
  forward the traces recorded -> one ``ForwardCost`` per module (costs.py), per tensor-parallel size;
* **gaps**: a rank's own time between two forwards of a request (scheduling, postprocess), a walk
  boundary's (the conductor's round trip), on one rank and, split over two, with the request's KV
  caches moving (fitted per KV token moved), a stream chunk's (producer run to consumer walk), and a
  hop between ranks inside a walk (a node's result sent to the next node's rank);
* **wake-up**: what a forward costs more on a rank that was idle (its OpenMP threads asleep);
* **contention**: how much slower a rank computes while others compute too (worker processes share
  the machine's cores; ``contention.py``);
* **KV**: bytes per cached token of each KV module.

The result is a JSON document (``Profile.save`` / ``load``), reused by ``mstar plan --profile``.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mstar.planner.costs import Forward, ForwardCost
from mstar.planner.programs import Affine, ClassProgram, emitting_runs
from mstar.planner.workload import RequestClass, Workload

__all__ = ["FINAL", "IDLE_S", "Profile", "RankTiming", "cost_key", "forwards_in", "gaps_in", "profile_model", "stream_gaps_in",
           "hops_in", "wake_penalties_in"]

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
        return _quantile(self.hop_ms, u)

    def client(self, threads: int, u: float = 0.5) -> dict[str, float]:
        """The client overheads (ms) at quantile ``u`` of a request whose first rank runs ``threads``."""
        return {k: _quantile(qs, u) for k, qs in self.rank_timing(threads).client.items()}

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


# -- reading traces ------------------------------------------------------------------------------------
def forwards_in(traces: Sequence[dict[str, Any]], module_of: Callable[[str], str]) -> list[Forward]:
    """Every forward the traces recorded, once (a batch appears in each of its requests' traces). A
    forward whose every row took its stream's final chunk counts as ``module#final`` (a consumer
    often does other work on the end of a stream: flushing, or nothing)."""
    seen: dict[tuple[int, float, str], tuple[dict, bool]] = {}
    for t in traces:
        for w in t["walks"]:
            for r in w["nodes"]:
                module = module_of(r["node"])
                key = (r["rank"], r["start"], module)
                final = bool(r.get("chunks")) and all(c.get("is_final") for c in r["chunks"].values())
                first, all_final = seen.get(key, (r, True))
                seen[key] = (first, all_final and final)
    return [Forward(module + (FINAL if final else ""), r["batch"], r["batch_tokens"], r["batch_attention"],
                    r["compute_ms"]) for (_, _, module), (r, final) in seen.items()]


def gaps_in(traces: Sequence[dict[str, Any]]) -> tuple[list[float], list[tuple[int, float]]]:
    """From traces of requests run alone: the gaps (ms) between a walk's consecutive runs past the
    first one's compute, and per walk boundary of the root partition (the first walk's: the KV
    tokens the request held, the ms from the last run's end to the next walk's first run)."""
    steps, bounds = [], []
    for t in traces:
        prev_end, held = None, 0
        root = t["walks"][0]["partition"] if t["walks"] else None
        for w in t["walks"]:
            runs = w["nodes"]
            if not runs:
                continue
            for a, b in zip(runs, runs[1:]):
                if b["start"] != a["start"]:  # not two rows of one forward (a request's parallel branches)
                    steps.append((b["start"] - a["start"]) * 1e3 - a["compute_ms"])
            if w["partition"] != root:
                continue
            if prev_end is not None:
                bounds.append((held, (runs[0]["start"] - prev_end) * 1e3))
            last = runs[-1]
            prev_end = last["start"] + last["compute_ms"] / 1e3
            held = max(held, max(r["batch_context"] for r in runs))
    return steps, bounds


def wake_penalties_in(traces: Sequence[dict[str, Any]], costs: dict[str, ForwardCost], threads: int,
                      module_of: Callable[[str], str]) -> list[float]:
    """From traces of requests run one after another: per forward that followed more than ``IDLE_S``
    of its rank's idleness, its ms past what its module's cost predicts."""
    forwards = {}
    for t in traces:
        for w in t["walks"]:
            for r in w["nodes"]:
                forwards[(r["rank"], r["start"])] = r
    out, last_end = [], {}
    for (rank, start), r in sorted(forwards.items()):
        end = last_end.get(rank)
        last_end[rank] = start + r["compute_ms"] / 1e3
        key = cost_key(module_of(r["node"]), 1, threads)
        if end is None or start - end <= IDLE_S or key not in costs:
            continue
        out.append(r["compute_ms"] - costs[key].ms(r["batch"], r["batch_tokens"], r["batch_attention"]))
    return out


def hops_in(traces: Sequence[dict[str, Any]]) -> list[float]:
    """The ms between a run and the next run of its walk that depends on it on another rank: per run
    whose latest-ending earlier run of the walk is on another rank, from that one's end to its start."""
    out = []
    for t in traces:
        for w in t["walks"]:
            done: list[tuple[float, int]] = []  # (end, rank) of the walk's runs so far
            for r in sorted(w["nodes"], key=lambda r: r["start"]):
                before = [d for d in done if d[0] <= r["start"]]
                if before:
                    end, rank = max(before)
                    if rank != r["rank"]:
                        out.append((r["start"] - end) * 1e3)
                done.append((r["start"] + r["compute_ms"] / 1e3, r["rank"]))
    return out


def stream_gaps_in(traces: Sequence[dict[str, Any]], graph: Any) -> list[float]:
    """From traces of requests run alone: per chunk a stream's policy fired, the ms from the end of
    the producer run that pushed the chunk's last item to the consumer walk's first run."""
    from mstar.planner.programs import stream_producers

    producers, gaps = stream_producers(graph), []
    for c in graph.topology.connections:
        for t in traces:
            pushes = [r for w in t["walks"] if w["partition"] == c.from_partition for r in w["nodes"]
                      if c.to_partition in producers.get((w["walk"], r["node"]), ())]
            pushes.sort(key=lambda r: r["start"])
            consumer = [w["nodes"][0] for w in t["walks"] if w["partition"] == c.to_partition and w["nodes"]]
            policy, fired = c.chunk_policy_factory(), []
            for i in range(len(pushes)):
                fired += [i] * len(policy.push([None]))
            for i, run in zip(fired, consumer):
                end = pushes[i]["start"] + pushes[i]["compute_ms"] / 1e3
                gaps.append((run["start"] - end) * 1e3)
    return gaps


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def overheads_in(traces: Sequence[dict[str, Any]], emitting: set[tuple[str, str]]) -> dict[str, list[float]]:
    """Over requests run alone (``_Runner.alone``'s traces), the 0, 5, ..., 100th percentiles (ms) of
    ``submit``, from the client's submit to the first run's start, ``emit``, from the first emitting
    run's end to the client's first item, and ``end``, from the last run's end to the client seeing
    the request end."""
    out: dict[str, list[float]] = {"submit": [], "emit": [], "end": []}
    for t in traces:
        c, runs = t["client"], [(w["walk"], r) for w in t["walks"] for r in w["nodes"]]
        if not runs:
            continue
        out["submit"].append((runs[0][1]["start"] - c["sent"]) * 1e3)
        emits = [r for walk, r in runs if (walk, r["node"]) in emitting]
        if emits:
            out["emit"].append((c["first"] - emits[0]["start"]) * 1e3 - emits[0]["compute_ms"])
        last = max((r for _, r in runs), key=lambda r: r["start"] + r["compute_ms"] / 1e3)
        out["end"].append((c["end"] - last["start"]) * 1e3 - last["compute_ms"])
    return {k: [round(max(0.0, float(q)), 4) for q in np.percentile(v, np.arange(0, 101, 5))] if v else [0.0]
            for k, v in out.items()}


def _quantile(qs: Sequence[float], u: float) -> float:
    """Linear interpolation in evenly spaced percentiles ``qs`` at ``u`` in [0, 1]."""
    if len(qs) == 1:
        return qs[0]
    x = u * (len(qs) - 1)
    i = min(int(x), len(qs) - 2)
    return qs[i] + (qs[i + 1] - qs[i]) * (x - i)


def _median(values: Sequence[float], default: float = 0.0) -> float:
    return float(np.median(values)) if len(values) else default


# -- running the model ----------------------------------------------------------------------------------
class _Runner:
    """Sized requests of a workload's classes through one started runtime."""

    def __init__(self, rt: Any, model: Any, classes: dict[str, RequestClass]) -> None:
        self.rt, self.model, self.classes, self.seed = rt, model, classes, 0

    def request(self, name: str, prompt: int, output: int) -> tuple[dict[str, Any], dict[str, Any]]:
        self.seed += 1
        return self.model.sized_request(prompt, output, self.classes[name].params, self.seed)

    def submit(self, name: str, prompt: int, output: int, label: str) -> Any:
        return self.rt.submit(*self.request(name, prompt, output), request_id=label)

    def alone(self, name: str, prompt: int, output: int, label: str) -> dict[str, Any]:
        """The request's trace, with the client's clock (``time.time()``, as the trace's) at submit
        (the request already made), first item and end under ``"client"``."""
        return self.spaced([(name, prompt, output)], label, 0.0)[0]

    def spaced(self, sizes: Sequence[tuple[str, int, int]], label: str, gap_s: float) -> list[dict[str, Any]]:
        """Requests of ``sizes`` one after another, ``gap_s`` apart, read on one event loop as the server
        and ``measure.replay`` read them: their traces, with the client's clock as ``alone``'s."""
        made = [self.request(*size) for size in sizes]

        async def read(inputs: dict[str, Any], params: dict[str, Any]) -> tuple[Any, dict[str, float]]:
            sent = time.time()
            handle, first = self.rt.submit(inputs, params, request_id=label), None
            async for _ in handle:
                if first is None:
                    first = time.time()
            end = time.time()
            return handle, {"sent": sent, "first": first if first is not None else end, "end": end}

        async def main() -> list[tuple[Any, dict[str, float]]]:
            out = []
            for inputs, params in made:
                out.append(await read(inputs, params))
                await asyncio.sleep(gap_s)
            return out

        traces = []
        for handle, client in asyncio.run(main()):
            handle.result()
            trace = self.rt.trace(handle.request_id)[-1]
            trace["client"] = client
            traces.append(trace)
        return traces

    def together(self, name: str, count: int, prompt: int, output: int, label: str, spacing_s: float = 0.0) -> list:
        handles = []
        for _ in range(count):
            handles.append(self.submit(name, prompt, output, label))
            if spacing_s:
                time.sleep(spacing_s)
        for h in handles:
            h.result()
        return self.rt.trace(label)


def _sizes(c: RequestClass) -> list[tuple[int, int]]:
    """Three size points spanning the class's lengths (fewer when a length is fixed)."""
    plo, phi = min(c.prompt_tokens.values), c.prompt_tokens.largest
    olo, ohi = max(2, min(c.output_tokens.values)), max(2, c.output_tokens.largest)
    return list(dict.fromkeys([(plo, olo), (phi, olo), (plo, ohi)]))


def _mid(c: RequestClass) -> tuple[int, int]:
    return max(1, round(c.prompt_tokens.mean)), max(2, round(c.output_tokens.mean))


def _placement(model: Any, groups: list[dict[str, Any]], max_batch: int) -> Any:
    from mstar.placement import Placement

    return Placement.from_dict({"model": model.name, "node_groups": groups,
                                "runtime": {"trace_requests": 4096, "prefix_caching": False,
                                            "max_batch_size": max_batch}})


def _batches(max_batch: int) -> list[int]:
    out, b = [], 1
    while b <= max_batch:
        out.append(b)
        b *= 2
    return out


def _sweep(run: _Runner, max_batch: int, label: str, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Each class at its middle sizes in batches of 1, 2, 4, ... submitted at once, then the largest
    staggered (prompts joining running decode rows): the traces of them all."""
    traces = []
    for name, c in run.classes.items():
        prompt, output = _mid(c)
        for b in _batches(max_batch):
            traces += run.together(name, b, prompt, output, f"{label}-{name}-b{b}")
        traces += run.together(name, max_batch, prompt, output, f"{label}-{name}-staggered", spacing_s=0.01)
        say(f"  {name}: batches {_batches(max_batch)} at {prompt} prompt / {output} output tokens")
    return traces


def _warm(run: _Runner, max_batch: int) -> None:
    for name, c in run.classes.items():  # first forwards build kernels and buffers: not measured
        run.together(name, min(4, max_batch), *_mid(c), f"warm-{name}")


def _kv_bytes(model: Any) -> dict[str, int]:
    out = {}
    for node, module in model.build_submodules(sorted(model.graph.node_names)).items():
        spec = getattr(module, "kv_spec", None)
        if spec is not None and model.module_of(node) == node:
            itemsize = spec.dtype.itemsize if hasattr(spec.dtype, "itemsize") else 4
            out[node] = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * itemsize
    return out


def _split_groups(model: Any, kv: dict[str, int]) -> list[dict[str, Any]] | None:
    """Every node on rank 0, but each KV module's walks after its first on rank 1 (so the caches
    move at the walk boundary): None when no KV module is used by two walks."""
    graph = model.graph
    split = [n for n in sorted(kv) if sum(n in graph.nodes_in(w) for w in graph.walks) > 1]
    if not split:
        return None
    first = [w for w in graph.walks if any(n in graph.nodes_in(w) for n in split)]
    rest = sorted(graph.node_names - set(split))
    groups = [{"node_names": split, "ranks": [0], "graph_walks": first[:1]},
              {"node_names": split, "ranks": [1], "graph_walks": first[1:]}]
    return groups + ([{"node_names": rest, "ranks": [0]}] if rest else [])



def _programs(run: _Runner, say: Callable[[str], None]) -> tuple[dict[str, ClassProgram], list[dict[str, Any]]]:
    programs, traces = {}, []
    for name, c in run.classes.items():
        sizes = _sizes(c)
        alone = [run.alone(name, p, o, f"program-{name}-{p}-{o}") for p, o in sizes]
        programs[name] = ClassProgram.fit(name, alone, sizes, run.model.graph)
        traces += alone
        say(f"  {name}: walks {[w.walk for w in programs[name].walks]} at sizes {sizes}")
    return programs, traces


def _move_cost(model: Any, workload: Workload, kv: dict[str, int], max_batch: int, workers: str,
               say: Callable[[str], None]) -> tuple[Affine, list[float]]:
    """A walk boundary across two ranks (KV moving), fitted per KV token held, and the hops between
    ranks inside walks (``hops_in``): run each class alone at its sizes on a placement that splits
    the KV modules' walks (the other nodes stay on rank 0). None when nothing splits."""
    from mstar.runtime.api import Runtime

    groups = _split_groups(model, kv)
    if groups is None:
        return None
    bounds, hops = [], []
    with Runtime(model, _placement(model, groups, max_batch), workers=workers) as rt:
        run = _Runner(rt, model, workload.classes())
        _warm(run, 1)
        for name, c in run.classes.items():
            for p, o in _sizes(c):
                for i in range(3):
                    trace = run.alone(name, p, o, f"move-{name}-{p}-{o}-{i}")
                    bounds += gaps_in([trace])[1]
                    hops += hops_in([trace])
    per_size: dict[int, list[float]] = {}
    for held, ms in bounds:  # a median per size: a worker's wake-up makes single gaps noisy
        per_size.setdefault(held, []).append(ms)
    held = sorted(per_size)
    fit = Affine.fit([(h, 0) for h in held], [_median(per_size[h]) for h in held])
    if fit.p < 0 or len(held) < 2:
        fit = Affine(_median([ms for _, ms in bounds]))
    say(f"  walk boundary across ranks: {fit.c:.2f} ms + {fit.p * 1e3:.3f} µs per KV token; "
        f"{len(hops)} hops between ranks inside a walk, median {_median(hops):.2f} ms")
    return Affine(max(0.0, fit.c), fit.p), hops


def _tp_costs(model: Any, workload: Workload, ranks: int, max_batch: int, workers: str,
              say: Callable[[str], None]) -> tuple[dict[str, ForwardCost], list[str]]:
    from mstar.runtime.api import Runtime

    groups = [{"node_names": sorted(model.graph.node_names), "ranks": list(range(ranks)), "tp_size": ranks}]
    try:
        rt = Runtime(model, _placement(model, groups, max_batch), workers=workers).start()
    except Exception as e:  # noqa: BLE001 - a model without tensor parallelism is planned without it
        return {}, [f"tensor parallelism over {ranks} ranks not profiled: {str(e).splitlines()[0]}"]
    with rt:
        run = _Runner(rt, model, workload.classes())
        _warm(run, max_batch)
        traces = _sweep(run, max_batch, f"tp{ranks}", say)
    threads = max(1, len(os.sched_getaffinity(0)) // ranks)
    return _fit_costs(forwards_in(traces, model.module_of), ranks, threads), []


def _fit_costs(forwards: list[Forward], tp: int, threads: int) -> dict[str, ForwardCost]:
    """One cost per module (and per module's final-chunk forwards, ``FINAL``) at this TP size and threads."""
    by: dict[str, list[Forward]] = {}
    for f in forwards:
        by.setdefault(f.module, []).append(f)
    return {f"{m}@tp{tp}/t{threads}": ForwardCost.fit(fs) for m, fs in by.items()}


CLIENT_RUNS = 12  # requests run alone per thread count, for the client overheads' spread
CLIENT_GAP_S = 0.02


def _client_runs(run: _Runner) -> list[dict[str, Any]]:
    """``CLIENT_RUNS`` requests of the classes at their sizes in turn, one at a time with a pause
    between (the rank goes idle, as between a light workload's requests), on one event loop."""
    sizes = [(name, p, o) for name, c in run.classes.items() for p, o in _sizes(c)]
    return run.spaced([sizes[i % len(sizes)] for i in range(CLIENT_RUNS)], "client", CLIENT_GAP_S)


def _timing(traces: Sequence[dict[str, Any]], costs: dict[str, ForwardCost], threads: int, model: Any) -> RankTiming:
    """A rank's timing beside its forwards, from requests it ran alone at ``threads`` threads."""
    steps, _ = gaps_in(traces)
    wake = wake_penalties_in(traces, costs, threads, model.module_of)
    client = overheads_in(traces, emitting_runs(model.graph))
    return RankTiming(max(0.0, _median(steps)), max(0.0, _median(wake)), {k: tuple(v) for k, v in client.items()})


def _thread_sweeps(model: Any, workload: Workload, options: list[int], max_batch: int, workers: str,
                   say: Callable[[str], None]) -> tuple[dict[str, ForwardCost], dict[int, RankTiming]]:
    """Forward costs and timing of one rank given ``threads``, for each of ``options``."""
    from mstar.runtime.api import Runtime

    costs, timing = {}, {}
    for threads in options:
        single = [{"node_names": sorted(model.graph.node_names), "ranks": [0], "threads": threads}]
        say(f"profiling {model.name} on one rank with {threads} thread(s)")
        with Runtime(model, _placement(model, single, max_batch), workers=workers) as rt:
            run = _Runner(rt, model, workload.classes())
            _warm(run, max_batch)
            fitted = _fit_costs(forwards_in(_sweep(run, max_batch, f"t{threads}", say), model.module_of), 1, threads)
            alone = _client_runs(run)
        costs.update(fitted)
        timing[threads] = _timing(alone, fitted, threads, model)
    return costs, timing


def profile_model(model: Any, workload: Workload, ranks: int, *, max_batch: int = 16, workers: str = "process",
                  tensor_parallel: bool = True, say: Callable[[str], None] = print) -> Profile:
    """Profile ``model`` (a ``ModelDef``) for ``workload`` on this machine (module docstring);
    ``ranks`` bounds the placements the planner may choose (2 or more: a KV move, the cores split
    between ranks, tensor parallelism over all of them, the contention of that many ranks)."""
    from mstar.planner.contention import measure_contention
    from mstar.runtime.api import Runtime

    for c in workload.requests:  # fails early, naming the model, when it cannot make requests
        model.sized_request(1, 2, c.params, 0)
    kv, notes, cores = _kv_bytes(model), [], len(os.sched_getaffinity(0))
    contention: dict[str, dict[int, float]] = {}
    if ranks >= 2:  # first, while no worker process of ours is alive
        contention = measure_contention(ranks, seconds=0.5)
        say(f"contention of {ranks} ranks computing at once: {contention}")
    say(f"profiling {model.name} on one rank ({workers} workers, {cores} threads)")
    single = [{"node_names": sorted(model.graph.node_names), "ranks": [0]}]
    with Runtime(model, _placement(model, single, max_batch), workers=workers) as rt:
        run = _Runner(rt, model, workload.classes())
        _warm(run, max_batch)
        programs, alone = _programs(run, say)
        traces = _sweep(run, max_batch, "tp1", say)
        client_alone = _client_runs(run)
    costs = _fit_costs(forwards_in(traces + alone, model.module_of), 1, cores)
    steps, bounds = gaps_in(alone)
    timing = {cores: _timing(alone + client_alone, costs, cores, model)}
    move, tp_sizes, hop = Affine(0.0), (1,), (0.0,)
    splits = sorted({max(1, cores // k) for k in range(2, ranks + 1)} - {cores})
    if ranks >= 2:
        more_costs, more_timing = _thread_sweeps(model, workload, splits, max_batch, workers, say)
        costs.update(more_costs)
        timing.update(more_timing)
        say(f"profiling a KV move and tensor parallelism over {ranks} ranks")
        moved = _move_cost(model, workload, kv, max_batch, workers, say)
        if moved is None:
            notes.append("no KV module is used by two walks: no KV move or hop between ranks profiled")
        else:
            move, hops = moved
            if hops:
                hop = tuple(round(max(0.0, float(q) - _median(steps)), 4)
                            for q in np.percentile(hops, np.arange(0, 101, 5)))
        if tensor_parallel:
            tp, more = _tp_costs(model, workload, ranks, max_batch, workers, say)
            costs.update(tp)
            notes += more
            tp_sizes = (1, ranks) if tp else (1,)
    return Profile(model.name, _cpu_name(), cores, max_batch, costs, timing,
                   max(0.0, _median([ms for _, ms in bounds])), max(0.0, _median(stream_gaps_in(alone, model.graph))),
                   hop, move, contention, kv, programs, tp_sizes, tuple(sorted({cores, *splits})), notes)
