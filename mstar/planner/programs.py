"""What a request of a class runs, node by node, as a function of its prompt and output lengths.

A request's trace run alone (batch 1) lists its walks and, per walk, its node runs with the new and
attended KV tokens of each (``batch_tokens`` / ``batch_context`` of a forward of one row). A walk is
read as a *head* (runs outside any loop, before it), a loop of *iterations* of one *body* (the nodes
of one iteration, in order) and a *tail* (runs outside the loop, after it). Every number of that
shape (how many iterations; each run's tokens and context) is affine in the prompt and output
lengths, fitted exactly to traces at three size points (``ClassProgram.fit``), so the simulator
can expand a request of any size (``ClassProgram.expand``) without tracing it. A body's first
iteration keeps its own sizes; later iterations take the second one's, their context growing by
the step seen between the two.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Affine", "ClassProgram", "ConsumerShape", "ProgramRun", "RunShape", "WalkShape", "emitting_runs",
           "expand_walk", "node_levels", "parallel_branches", "stream_producers"]


@dataclass(frozen=True)
class Affine:
    """``c + p * prompt_tokens + o * output_tokens``."""

    c: float
    p: float = 0.0
    o: float = 0.0

    def at(self, prompt: int, output: int) -> float:
        return self.c + self.p * prompt + self.o * output

    @classmethod
    def fit(cls, sizes: Sequence[tuple[int, int]], values: Sequence[float]) -> Affine:
        """Through ``values`` at ``sizes`` (least squares, minimum norm: a length that never varied
        gets no coefficient)."""
        x = np.array([[1.0, p, o] for p, o in sizes])
        sol, *_ = np.linalg.lstsq(x, np.array(values, dtype=float), rcond=None)
        c, p, o = (round(float(v), 9) for v in sol)
        return cls(c, p, o)


@dataclass(frozen=True)
class RunShape:
    node: str
    tokens: Affine
    context: Affine


@dataclass(frozen=True)
class WalkShape:
    walk: str
    partition: str
    head: tuple[RunShape, ...]
    iterations: Affine
    body: tuple[RunShape, ...]  # the first iteration's sizes
    later: tuple[RunShape, ...]  # the second iteration's (a loop of one iteration: the first's)
    context_step: tuple[float, ...]  # per body run: context added each iteration past the second
    tail: tuple[RunShape, ...]


@dataclass(frozen=True)
class ProgramRun:
    """One node run of an expanded request."""

    walk_index: int
    walk: str
    partition: str
    node: str
    tokens: int
    context: int
    final: bool = False  # a stream consumer's run on the stream's final chunk
    stage: int = 0  # runs of one walk with the same stage start together (parallel branches)


def _split(runs: list[dict]) -> tuple[list[dict], list[list[dict]], list[dict]]:
    """A walk's runs (by start) as head, iterations (each a list of runs) and tail."""
    head, tail, iters, order = [], [], {}, []
    for r in runs:
        it = tuple(r["iteration"])
        if not it:
            (tail if iters else head).append(r)
            continue
        if it not in iters:
            iters[it] = []
            order.append(it)
        iters[it].append(r)
    return head, [iters[k] for k in order], tail


def _shape(walk: str, runs_at: Sequence[list[dict]], sizes: Sequence[tuple[int, int]], what: str) -> list[RunShape]:
    nodes = [r["node"] for r in runs_at[0]]
    for runs in runs_at[1:]:
        if [r["node"] for r in runs] != nodes:
            raise ValueError(f"walk {walk!r}: the {what} runs {nodes} at one size but "
                             f"{[r['node'] for r in runs]} at another: its shape depends on the lengths")
    # a run's forward may hold the request's own parallel branches (views of one module batch together):
    # the trace's figures are the forward's, each branch's its share
    return [RunShape(n, Affine.fit(sizes, [runs[i]["batch_tokens"] / runs[i]["batch"] for runs in runs_at]),
                     Affine.fit(sizes, [runs[i]["batch_context"] / runs[i]["batch"] for runs in runs_at]))
            for i, n in enumerate(nodes)]


def _walk_shape(walk: str, partition: str, walk_runs: Sequence[list[dict]], sizes: Sequence[tuple[int, int]]) -> WalkShape:
    """One walk's shape from its runs at each size."""
    parts = [_split(runs) for runs in walk_runs]
    heads, iters, tails = ([p[k] for p in parts] for k in range(3))
    first = [it[0] if it else [] for it in iters]
    second = [it[1] if len(it) > 1 else (it[0] if it else []) for it in iters]
    body = _shape(walk, first, sizes, "first iteration's")
    later = _shape(walk, second, sizes, "second iteration's")
    steps = []
    for j in range(len(body)):
        grow = [s[j]["batch_context"] - f[j]["batch_context"] for f, s, it in zip(first, second, iters) if len(it) > 2]
        steps.append(float(np.median(grow)) if grow else 0.0)
    return WalkShape(walk, partition, tuple(_shape(walk, heads, sizes, "head")),
                     Affine.fit(sizes, [len(it) for it in iters]), tuple(body), tuple(later), tuple(steps),
                     tuple(_shape(walk, tails, sizes, "tail")))


@dataclass(frozen=True)
class ConsumerShape:
    """A partition fed by a stream: one walk per chunk its policy fires (``firing``; the end of the
    stream's chunk ``final``, when the stream's end fires one), the stream carrying ``items``."""

    partition: str
    producer: str  # the producing partition
    edge: str  # the stream's edge
    items: Affine
    firing: WalkShape
    final: WalkShape | None


def _consumer(partition: str, producer: str, edge: str, traces: Sequence[dict[str, Any]],
              sizes: Sequence[tuple[int, int]]) -> ConsumerShape:
    walks = [[w for w in t["walks"] if w["partition"] == partition] for t in traces]
    if not all(walks):
        raise ValueError(f"partition {partition!r} ran no walk at some size: profile longer outputs")
    finals = [ws[-1] if any(r.get("chunks", {}).get(edge, {}).get("is_final") for r in ws[-1]["nodes"]) else None
              for ws in walks]
    firing = _walk_shape(walks[0][0]["walk"], partition, [ws[0]["nodes"] for ws in walks], sizes)
    final = None
    if all(finals) and all(len(ws) > 1 for ws in walks):
        final = _walk_shape(finals[0]["walk"], partition, [f["nodes"] for f in finals], sizes)
    items = [next((n for k, n in t.get("streamed", {}).items() if k.startswith(f"{partition}.") and
                   k.endswith(f".{edge}")), 0) for t in traces]
    return ConsumerShape(partition, producer, edge, Affine.fit(sizes, items), firing, final)


@dataclass(frozen=True)
class ClassProgram:
    """The walks of one request class (module docstring): its root partition's, in order, and the
    partitions its streams feed."""

    name: str
    walks: tuple[WalkShape, ...]
    consumers: tuple[ConsumerShape, ...] = ()

    @classmethod
    def fit(cls, name: str, traces: Sequence[dict[str, Any]], sizes: Sequence[tuple[int, int]],
            graph: Any = None) -> ClassProgram:
        """From the traces (``Runtime.trace``'s, one request each, run alone) at ``sizes`` (prompt,
        output), one trace per size; ``graph`` (the model's ``WalkGraph``) names the streams.
        ValueError when the root walks or their bodies differ by size."""
        connections = tuple(graph.topology.connections) if graph is not None else ()
        fed = {c.to_partition for c in connections}
        walk_lists = [[(w["walk"], w["partition"]) for w in t["walks"] if w["partition"] not in fed] for t in traces]
        if any(wl != walk_lists[0] for wl in walk_lists):
            raise ValueError(f"class {name!r}: its walks {walk_lists[0]} change with its lengths ({walk_lists[1:]})")
        roots = [[w for w in t["walks"] if w["partition"] not in fed] for t in traces]
        walks = tuple(_walk_shape(walk, partition, [ws[i]["nodes"] for ws in roots], sizes)
                      for i, (walk, partition) in enumerate(walk_lists[0]))
        consumers = tuple(_consumer(c.to_partition, c.from_partition, c.edge_name, traces, sizes) for c in connections)
        return cls(name, walks, consumers)

    def expand(self, prompt: int, output: int, levels: Mapping[tuple[str, str], int] | None = None) -> list[ProgramRun]:
        """Every node run of the root partition for a request of these lengths, walk by walk, in order
        (``levels``: see ``expand_walk``)."""
        out: list[ProgramRun] = []
        for i, w in enumerate(self.walks):
            out += expand_walk(w, i, prompt, output, levels=levels)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "walks": [_walk_dict(w) for w in self.walks],
                "consumers": [{"partition": c.partition, "producer": c.producer, "edge": c.edge,
                               "items": vars(c.items), "firing": _walk_dict(c.firing),
                               "final": _walk_dict(c.final) if c.final else None} for c in self.consumers]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClassProgram:
        return cls(d["name"], tuple(_walk_of(w) for w in d["walks"]), tuple(
            ConsumerShape(c["partition"], c["producer"], c["edge"], Affine(**c["items"]), _walk_of(c["firing"]),
                          _walk_of(c["final"]) if c["final"] else None) for c in d.get("consumers", ())))


def expand_walk(w: WalkShape, index: int, prompt: int, output: int, final: bool = False,
                levels: Mapping[tuple[str, str], int] | None = None) -> list[ProgramRun]:
    """The node runs of one walk of this shape for a request of these lengths (``final``: a stream
    consumer's walk on the final chunk). With ``levels`` (``node_levels``), the runs of a loop
    iteration are ordered by level and those of one level share a stage (they run in parallel);
    otherwise every run is its own stage."""
    out: list[ProgramRun] = []
    stage = 0

    def add(s: RunShape, extra: float = 0.0) -> None:
        out.append(ProgramRun(index, w.walk, w.partition, s.node, max(0, round(s.tokens.at(prompt, output))),
                              max(0, round(s.context.at(prompt, output) + extra)), final, stage))

    def level(s: RunShape) -> int:
        return levels.get((w.walk, s.node), 0) if levels is not None else 0

    def segment(runs: Sequence[RunShape], steps: Sequence[float] = (), k: int = 0) -> None:
        nonlocal stage
        order = sorted(range(len(runs)), key=lambda j: level(runs[j]))
        for pos, j in enumerate(order):
            if pos and (levels is None or level(runs[j]) != level(runs[order[pos - 1]])):
                stage += 1
            add(runs[j], steps[j] * max(0, k - 1) if steps else 0.0)
        stage += 1

    for s in w.head:
        segment([s])
    for k in range(max(0, round(w.iterations.at(prompt, output)))):
        segment(w.body if k == 0 else w.later, w.context_step, k)
    for s in w.tail:
        segment([s])
    return out


def node_levels(graph: Any) -> dict[tuple[str, str], int]:
    """(walk, node) -> its depth among the nodes of its loop iteration (or the walk's top level):
    0 with no input from a node of the same frame, else one more than its deepest such producer.
    Nodes of one level in one frame are parallel branches."""
    from mstar.graph.plan import InputKind

    out: dict[tuple[str, str], int] = {}
    for walk in graph.walks:
        plan = graph.plan(walk)
        for name, node in plan.nodes.items():  # in rank order: a LOCAL producer comes first
            producers = [b.producer.name for b in node.inputs.values() if b.kind is InputKind.LOCAL
                         and b.producer is not None and not b.producer.is_loop
                         and (walk, b.producer.name) in out and plan.nodes[b.producer.name].frame == node.frame]
            out[(walk, name)] = 1 + max((out[(walk, p)] for p in producers), default=-1)
    return out


def parallel_branches(graph: Any) -> list[tuple[str, tuple[str, ...]]]:
    """(walk, its nodes) per set of a walk's parallel branches: two or more nodes of one level
    (``node_levels``) in one loop frame (a guided diffusion step's conditional and unconditional
    passes), in name order."""
    levels, out = node_levels(graph), []
    for walk in graph.walks:
        by: dict[tuple[Any, int], list[str]] = {}
        for name, node in graph.plan(walk).nodes.items():
            by.setdefault((node.frame, levels[(walk, name)]), []).append(name)
        out += [(walk, tuple(sorted(nodes))) for nodes in by.values() if len(nodes) > 1]
    return out


def _run_dict(s: RunShape) -> dict[str, Any]:
    return {"node": s.node, "tokens": vars(s.tokens), "context": vars(s.context)}


def _walk_dict(w: WalkShape) -> dict[str, Any]:
    return {"walk": w.walk, "partition": w.partition, "head": [_run_dict(s) for s in w.head],
            "iterations": vars(w.iterations), "body": [_run_dict(s) for s in w.body],
            "later": [_run_dict(s) for s in w.later], "context_step": list(w.context_step),
            "tail": [_run_dict(s) for s in w.tail]}


def _walk_of(w: dict[str, Any]) -> WalkShape:
    def runs(items: list[dict]) -> tuple[RunShape, ...]:
        return tuple(RunShape(r["node"], Affine(**r["tokens"]), Affine(**r["context"])) for r in items)

    return WalkShape(w["walk"], w["partition"], runs(w["head"]), Affine(**w["iterations"]), runs(w["body"]),
                     runs(w["later"]), tuple(w["context_step"]), runs(w["tail"]))


def emitting_runs(graph: Any) -> set[tuple[str, str]]:
    """(walk, node) pairs whose node sends something to the client in that walk."""
    from mstar.graph.plan import RouteKind

    return {(walk, name) for walk in graph.walks for name, node in graph.plan(walk).nodes.items()
            if any(r.kind is RouteKind.EMIT for r in node.routes)}


def stream_producers(graph: Any) -> dict[tuple[str, str], set[str]]:
    """(walk, node) -> the partitions it streams to."""
    from mstar.graph.plan import RouteKind

    out: dict[tuple[str, str], set[str]] = {}
    for walk in graph.walks:
        for name, node in graph.plan(walk).nodes.items():
            for r in node.routes:
                if r.kind is RouteKind.STREAM:
                    out.setdefault((walk, name), set()).add(r.partition)
    return out
