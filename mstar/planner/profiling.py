"""Profiling a model on this machine with the real runtime (``profile_model`` -> ``Profile``).

It starts the runtime (worker processes, as ``mstar serve`` runs) on placements it makes itself and
submits sized requests of the workload's classes (``ModelDef.sized_request``):

* each class alone at three size points -> its ``ClassProgram``;
* batches of 1, 2, 4, ... requests of each class at once and staggered, on one rank of all the
  cores, at every fewer thread count a rank may get (partitions and a walk's parallel branches
  spread over the ranks the cores then hold, as a placement splitting the cores would run them) and over all ranks tensor-parallel
  -> every forward the traces recorded, fitted;
* requests run alone after pauses of each of ``IDLE_LEVELS_S`` -> each thread count's ``RankTiming``
  (what a forward and the client pay after the rank idled that long);
* the KV modules' walks split over two ranks -> the KV move and the hops between ranks;
* spawned processes computing at once -> contention (contention.py), first, while no worker lives.
"""

from __future__ import annotations

import asyncio
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mstar.planner.costs import Forward, ForwardCost, percentiles, quantile
from mstar.planner.profile import FINAL, IDLE_LEVELS_S, Profile, RankTiming
from mstar.planner.programs import Affine, ClassProgram, emitting_runs, parallel_branches
from mstar.planner.readings import (
    after_idle_in,
    forwards_in,
    gaps_in,
    hops_in,
    median,
    overheads_in,
    stream_gaps_in,
    wake_penalties_in,
)
from mstar.planner.workload import RequestClass, Workload

__all__ = ["profile_model"]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


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
        return self.spaced([(name, prompt, output)], label, [0.0])[0]

    def spaced(self, sizes: Sequence[tuple[str, int, int]], label: str, gaps_s: Sequence[float]) -> list[dict[str, Any]]:
        """Requests of ``sizes`` one after another, the i-th ``gaps_s[i]`` after the previous one's end,
        read on one event loop as the server and ``measure.replay`` read them: their traces, with the
        client's clock as ``alone``'s."""
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
            for (inputs, params), gap in zip(made, gaps_s):
                await asyncio.sleep(gap)
                out.append(await read(inputs, params))
            return out

        traces = []
        for handle, client in asyncio.run(main()):
            handle.result()
            trace = self.rt.trace(handle.request_id)[-1]
            trace["client"] = client
            traces.append(trace)
        return traces

    def together(self, name: str, count: int, prompt: int, output: int, label: str, spacing_s: float = 0.0) -> list:
        """``count`` requests at once (or ``spacing_s`` apart), their items read on one event loop as
        the server reads them (the loop's wake-ups take the client's process some CPU, beside the
        ranks'): their traces."""
        async def drain(handle: Any) -> None:
            async for _ in handle:
                pass
            handle.result()

        async def main() -> None:
            readers = []
            for i in range(count):
                if i and spacing_s:
                    await asyncio.sleep(spacing_s)
                readers.append(asyncio.ensure_future(drain(self.submit(name, prompt, output, label))))
            await asyncio.gather(*readers)

        asyncio.run(main())
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
    move at the walk boundary), the cores split between the two (two ranks each spinning every core's
    thread would price their contention into the move): None when no KV module is used by two walks."""
    graph = model.graph
    split = [n for n in sorted(kv) if sum(n in graph.nodes_in(w) for w in graph.walks) > 1]
    if not split:
        return None
    first = [w for w in graph.walks if any(n in graph.nodes_in(w) for n in split)]
    rest = sorted(graph.node_names - set(split))
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    groups = [{"node_names": split, "ranks": [0], "graph_walks": first[:1], "threads": threads},
              {"node_names": split, "ranks": [1], "graph_walks": first[1:], "threads": threads}]
    return groups + ([{"node_names": rest, "ranks": [0], "threads": threads}] if rest else [])


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
    fit = Affine.fit([(h, 0) for h in held], [median(per_size[h]) for h in held])
    if fit.p < 0 or len(held) < 2:
        fit = Affine(median([ms for _, ms in bounds]))
    say(f"  walk boundary across ranks: {fit.c:.2f} ms + {fit.p * 1e3:.3f} µs per KV token; "
        f"{len(hops)} hops between ranks inside a walk, median {median(hops):.2f} ms")
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


# requests run alone per thread count and idle level, for what idling costs (with 8 a level's median
# could come out above the next, longer level's)
CLIENT_RUNS = 16


def _client_runs(run: _Runner) -> list[dict[str, Any]]:
    """``CLIENT_RUNS`` requests per level of ``IDLE_LEVELS_S``, of the classes at their sizes in turn,
    one at a time, each after a pause of its level (the levels interleaved, so that a drift of the
    machine spreads over them all), on one event loop."""
    sizes = [(name, p, o) for name, c in run.classes.items() for p, o in _sizes(c)]
    n = CLIENT_RUNS * len(IDLE_LEVELS_S)
    gaps = [IDLE_LEVELS_S[i % len(IDLE_LEVELS_S)] for i in range(n)]
    return run.spaced([sizes[i % len(sizes)] for i in range(n)], "client", gaps)


def _timing(traces: Sequence[dict[str, Any]], costs: dict[str, ForwardCost], threads: int, model: Any) -> RankTiming:
    """A rank's timing beside its forwards, from requests it ran alone at ``threads`` threads."""
    steps, bounds = gaps_in(traces)
    return RankTiming(max(0.0, median(steps)),
                      after_idle_in(wake_penalties_in(traces, costs, threads, model.module_of),
                                    overheads_in(traces, emitting_runs(model.graph))),
                      max(0.0, median([ms for _, ms in bounds])), max(0.0, median(stream_gaps_in(traces, model.graph))))


def _said(timing: RankTiming, threads: int) -> str:
    """What idling costs a rank of ``threads`` threads (medians), in a line."""
    return f"  {threads} thread(s), after idling " + "; ".join(
        f"{a.idle_s * 1e3:.0f} ms: +{quantile(a.wake, 0.5):.1f} ms to a forward, "
        f"{quantile(a.client.get('submit', (0.0,)), 0.5):.1f} ms from submit to start" for a in timing.after_idle)


def _spread_groups(model: Any, threads: int, weights: dict[str, float]) -> list[dict[str, Any]]:
    """The model over as many ranks of ``threads`` threads as the cores hold, what computes at once
    apart, as a placement that splits the cores runs it (so the profile sees what that costs: a rank
    hosting more spends longer between its steps and its caches serve them all; a step whose work
    crosses ranks sends between them and starts its walks on both):

    * each partition's nodes (partitions sharing a module as one) on one rank, the heaviest (by
      ``weights``, their modules' compute in the sweep on one rank) first, each on the rank least
      loaded so far: a stream's producer and its consumer apart;
    * a walk's parallel branches (``parallel_branches``) that no other walk runs dealt, in name
      order, over the other ranks: a guided step's passes apart from its main one (which holds the
      KV other walks fill), the step that joins them back on the main one's rank.

    The rest of a walk stays together: a step gap is read between its runs on one rank."""
    graph, units = model.graph, []
    for part in graph.partitions:
        nodes = {n for w in graph.walks_of(part) for n in graph.nodes_in(w)}
        modules = {model.module_of(n) for n in nodes}
        for u in [u for u in units if u[1] & modules]:
            units.remove(u)
            nodes, modules = nodes | u[0], modules | u[1]
        units.append((nodes, modules))
    ranks = max(1, len(os.sched_getaffinity(0)) // threads)
    load, placed = [0.0] * ranks, [set() for _ in range(ranks)]
    weighed = [(sum(weights.get(m, 0.0) for m in modules), nodes) for nodes, modules in units]
    for weight, nodes in sorted(weighed, key=lambda u: (-u[0], sorted(u[1]))):
        rank = load.index(min(load))
        load[rank] += weight
        placed[rank] |= nodes
    if ranks > 1:
        for _, nodes in parallel_branches(graph):
            home = next(r for r in range(ranks) if nodes[0] in placed[r])
            others = [r for r in range(ranks) if r != home]
            alone = [n for n in nodes if sum(n in graph.nodes_in(w) for w in graph.walks) == 1]
            for i, node in enumerate(alone[:len(nodes) - 1]):  # one branch stays home at least
                placed[home].discard(node)
                placed[others[i % len(others)]].add(node)
    return [{"node_names": sorted(n), "ranks": [r], "threads": threads} for r, n in enumerate(placed) if n]


def _thread_sweeps(model: Any, workload: Workload, options: list[int], weights: dict[str, float], max_batch: int,
                   workers: str, say: Callable[[str], None]) -> tuple[dict[str, ForwardCost], dict[int, RankTiming]]:
    """Forward costs and timing of a rank given ``threads``, for each of ``options``, the model spread
    over the ranks the cores hold (``_spread_groups``)."""
    from mstar.runtime.api import Runtime

    costs, timing = {}, {}
    for threads in options:
        groups = _spread_groups(model, threads, weights)
        say(f"profiling {model.name} with {threads} thread(s) per rank: " +
            "; ".join(f"rank {g['ranks'][0]}: {', '.join(g['node_names'])}" for g in groups))
        with Runtime(model, _placement(model, groups, max_batch), workers=workers) as rt:
            run = _Runner(rt, model, workload.classes())
            _warm(run, max_batch)
            fitted = _fit_costs(forwards_in(_sweep(run, max_batch, f"t{threads}", say), model.module_of), 1, threads)
            alone = _client_runs(run)
        costs.update(fitted)
        timing[threads] = _timing(alone, fitted, threads, model)
        say(_said(timing[threads], threads))
    return costs, timing


def profile_model(model: Any, workload: Workload, ranks: int, *, max_batch: int = 16, workers: str = "process",
                  tensor_parallel: bool = True, say: Callable[[str], None] = print) -> Profile:
    """Profile ``model`` (a ``ModelDef``) for ``workload`` on this machine (module docstring);
    ``ranks`` bounds the placements the planner may choose (2 or more: a KV move, the cores split
    between ranks, tensor parallelism over all of them, the contention of that many ranks)."""
    from mstar.planner.contention import measure_contention
    from mstar.runtime.api import Runtime

    for c in workload.requests:  # fails early, naming the model, when it cannot make requests
        try:
            model.sized_request(1, 2, c.params, 0)
        except NotImplementedError as e:  # a user's error to read (the CLI's), not a crash
            raise ValueError(str(e)) from e
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
    forwards = forwards_in(traces + alone, model.module_of)
    costs = _fit_costs(forwards, 1, cores)
    weights: dict[str, float] = {}
    for f in forwards:
        module = f.module.removesuffix(FINAL)
        weights[module] = weights.get(module, 0.0) + f.ms
    timing = {cores: _timing(client_alone, costs, cores, model)}
    say(_said(timing[cores], cores))
    move, tp_sizes, hop = Affine(0.0), (1,), (0.0,)
    splits = sorted({max(1, cores // k) for k in range(2, ranks + 1)} - {cores})
    if ranks >= 2:
        more_costs, more_timing = _thread_sweeps(model, workload, splits, weights, max_batch, workers, say)
        costs.update(more_costs)
        timing.update(more_timing)
        say(f"profiling a KV move and tensor parallelism over {ranks} ranks")
        moved = _move_cost(model, workload, kv, max_batch, workers, say)
        if moved is None:
            notes.append("no KV module is used by two walks: no KV move or hop between ranks profiled")
        else:
            move, hops = moved
            if hops:  # the move's ranks split the cores
                gap = timing[max(1, cores // 2)].step_gap_ms
                hop = percentiles([ms - gap for ms in hops], floor=0.0)
        if tensor_parallel:
            tp, more = _tp_costs(model, workload, ranks, max_batch, workers, say)
            costs.update(tp)
            notes += more
            tp_sizes = (1, ranks) if tp else (1,)
    return Profile(model.name, _cpu_name(), cores, max_batch, costs, timing, hop, move, contention, kv, programs,
                   tp_sizes, tuple(sorted({cores, *splits})), notes)
