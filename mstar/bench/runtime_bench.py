"""Runtime overhead benchmark: ``mstar bench runtime``.

(a) ``step``: per-step cost of the runtime on a trivial loop (one stateless node computing ``x + 1``,
    fed back to itself ``iters`` times, nothing emitted). B concurrent requests run through an
    inline ``Runtime``; every step is one batched forward of size B. Reported: wall time / iters.
(b) ``matmul``: the same loop with a node doing real work (an MLP stack shaped like a small LLM's), run
    through the ``Runtime`` vs. a bare Python loop that concatenates the same B inputs and calls the
    module's ``forward`` ``iters`` times. Reported: both times and (runtime - bare) / bare.

Each measurement is repeated ``repeats`` times after a warm-up, through ``mstar.bench.harness``
(runtime and bare in rotating order); we report the median
and the min/max. The runtime timing covers submitting the B requests until every result is back;
the driver thread is held while the requests are submitted so that all B start in the same step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mstar.bench import harness
from mstar.bench.harness import Spread
from mstar.graph import GraphEdge, GraphNode, Loop, Walk, WalkGraph
from mstar.model.base import ModelDef
from mstar.model.submodule import EngineInputs, ForwardInfo, NodeSubmodule
from mstar.runtime.api import Runtime

NODE = "body"


class AddOne(NodeSubmodule):
    """Almost nothing: ``x + 1`` on the whole batch."""

    def forward(self, graph_walk, engine_inputs, x):
        return {"x": engine_inputs.split("x", x + 1)}


class MatMul(NodeSubmodule):
    """Real work, shaped like a small LLM's MLPs: ``layers`` x (x + down(silu(up(x)))), layer-normed so
    values stay bounded over many iterations (hidden 512 / intermediate 1408 / 8 layers by default)."""

    def __init__(self, hidden: int, intermediate: int = 1408, layers: int = 8, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.up = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(hidden, intermediate, generator=g) / hidden ** 0.5) for _ in range(layers)])
        self.down = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(intermediate, hidden, generator=g) / intermediate ** 0.5)
             for _ in range(layers)])

    def forward(self, graph_walk, engine_inputs, x):
        for up, down in zip(self.up, self.down):
            x = torch.nn.functional.layer_norm(x + torch.nn.functional.silu(x @ up) @ down, x.shape[-1:])
        return {"x": engine_inputs.split("x", x)}


class LoopBench(ModelDef):
    """One walk: ``Loop(max_iters=iters)`` over one stateless node feeding ``x`` back to itself."""

    name = "bench-loop"

    def __init__(self, kind: str = "step", iters: int = 200, hidden: int = 512, layers: int = 8):
        if kind not in ("step", "matmul"):
            raise ValueError(f"kind must be 'step' or 'matmul', got {kind!r}")
        self.kind, self.iters, self.hidden, self.layers = kind, iters, hidden, layers

    def build_graph(self) -> WalkGraph:
        body = GraphNode(NODE, ["x"], [GraphEdge(NODE, "x")])
        return WalkGraph([Walk("loop", Loop(body, max_iters=self.iters), inputs=["x"])])

    def next_walk(self, state):
        return "loop" if state.last_walk is None else None

    def build_submodules(self, node_names):
        return {NODE: AddOne() if self.kind == "step" else MatMul(self.hidden, layers=self.layers)}


def _inputs(batch: int, width: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, width, generator=g) for _ in range(batch)]


def _time_runtime(rt: Runtime, xs: list[torch.Tensor]) -> float:
    """Seconds from submitting every request to the last result; all requests start in one step."""
    with rt.held():  # the B submissions land together
        t0 = time.perf_counter()
        handles = [rt.submit({"x": x}) for x in xs]
    outs = [h.result(timeout=600) for h in handles]
    dt = time.perf_counter() - t0
    bad = [o for o in outs if not o.finished]
    if bad:
        raise RuntimeError(f"benchmark request failed: {bad[0].error}")
    return dt


def _batch_hist(rt: Runtime) -> dict[int, int]:
    return dict(rt.stats()["ranks"][0]["batch_sizes"][NODE])


def _time_bare(module: NodeSubmodule, xs: list[torch.Tensor], iters: int) -> float:
    """The same batches without the runtime: concatenate the B inputs, call forward, split, repeat."""
    b = len(xs)
    infos = [ForwardInfo(f"r{i}", "loop", NODE, (0,), {}) for i in range(b)]
    ei = EngineInputs(walks=["loop"] * b, nodes=[NODE] * b, request_ids=[f"r{i}" for i in range(b)],
                      infos=infos, splits={"x": [x.shape[0] for x in xs]}, args=[None] * len(xs))
    cur = list(xs)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for _ in range(iters):
            cur = module.forward("loop", ei, x=torch.cat(cur, 0))["x"]
    return time.perf_counter() - t0


@dataclass
class BatchResult:
    batch: int
    step_us: Spread  # (a) runtime wall time per step, trivial node
    step_hist: dict[int, int]  # (a) batch-size histogram of the node over one run
    runtime_ms: Spread  # (b) runtime end-to-end, matmul node
    bare_ms: Spread  # (b) bare loop, same module and batches
    overhead_pct: Spread  # (b) (runtime - bare) / bare, per repeat pair
    matmul_hist: dict[int, int]
    raw: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class BenchResult:
    iters: int
    repeats: int
    hidden: int
    threads: int
    results: list[BatchResult]


def _rotated_timings(model: LoopBench, fns: dict[str, Callable[[Runtime], float]], b: int, iters: int,
                     repeats: int, warmup: bool) -> tuple[dict[str, list[float]], dict[int, int]]:
    """Every function's seconds over the harness's rotating repeats, in one ``Runtime`` of ``model``,
    and the node's batch-size histogram per timed run (checked: ``iters`` forwards of size ``b``)."""
    with Runtime(model) as rt:
        hist: list[dict[int, int]] = []
        per = harness.rotate(list(fns), lambda name, _r: fns[name](rt), repeats, warm=warmup,
                             before_first=lambda: hist.append(_batch_hist(rt)))
        before, after = hist[0], _batch_hist(rt)
    delta = {k: (v - before.get(k, 0)) // repeats for k, v in after.items() if v - before.get(k, 0)}
    if delta != {b: iters}:
        raise RuntimeError(f"batch {b}: expected {iters} forwards of size {b}, got histogram {delta}")
    return per, delta


def _batch_result(b: int, iters: int, repeats: int, hidden: int, layers: int, warmup: bool) -> BatchResult:
    # (a) trivial node: per-step runtime cost
    xs1 = _inputs(b, 1)
    step, step_hist = _rotated_timings(LoopBench("step", iters, hidden), {"runtime": lambda rt: _time_runtime(rt, xs1)},
                                       b, iters, repeats, warmup)
    # (b) matmul node: runtime vs bare loop, in rotating order
    mm_model = LoopBench("matmul", iters, hidden, layers)
    xs = _inputs(b, hidden)
    bare_module = mm_model.build_submodules([NODE])[NODE].eval()
    per, mm_hist = _rotated_timings(mm_model, {"runtime": lambda rt: _time_runtime(rt, xs),
                                               "bare": lambda _rt: _time_bare(bare_module, xs, iters)},
                                    b, iters, repeats, warmup)
    step_s, rt_s, bare_s = step["runtime"], per["runtime"], per["bare"]
    return BatchResult(
        batch=b,
        step_us=Spread.of([s / iters * 1e6 for s in step_s]),
        step_hist=step_hist,
        runtime_ms=Spread.of([s * 1e3 for s in rt_s]),
        bare_ms=Spread.of([s * 1e3 for s in bare_s]),
        overhead_pct=Spread.of([(r - a) / a * 100 for r, a in zip(rt_s, bare_s)]),
        matmul_hist=mm_hist,
        raw={"step_s": step_s, "runtime_s": rt_s, "bare_s": bare_s},
    )


def run_runtime_bench(batches: list[int], iters: int = 200, repeats: int = 3, hidden: int = 512,
                      warmup: bool = True, layers: int = 8) -> BenchResult:
    if iters < 1 or repeats < 1 or hidden < 1 or not batches or min(batches) < 1:
        raise ValueError("iters, repeats, hidden and every batch size must be >= 1")
    results = [_batch_result(b, iters, repeats, hidden, layers, warmup) for b in batches]
    return BenchResult(iters, repeats, hidden, torch.get_num_threads(), results)


def _fmt(s: Spread, digits: int = 1) -> str:
    return f"{s.median:.{digits}f} ({s.min:.{digits}f}–{s.max:.{digits}f})"


def format_table(res: BenchResult) -> str:
    lines = [
        f"iters={res.iters} repeats={res.repeats} hidden={res.hidden} torch_threads={res.threads}; "
        f"median (min–max)",
        "",
        "| batch | (a) us/step, x+1 node | (b) runtime ms, MLP node | (b) bare loop ms | (b) runtime overhead % |"
        " (b) us/step over bare |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res.results:
        extra_us = (r.runtime_ms.median - r.bare_ms.median) * 1e3 / res.iters
        lines.append(f"| {r.batch} | {_fmt(r.step_us)} | {_fmt(r.runtime_ms, 2)} | {_fmt(r.bare_ms, 2)} | "
                     f"{_fmt(r.overhead_pct)} | {extra_us:.1f} |")
    return "\n".join(lines)

