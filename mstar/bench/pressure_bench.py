"""KV oversubscription benchmark: ``mstar bench pressure``.

N mixed requests (prompt lengths and ``max_tokens`` drawn from a seed, greedy, EOS ignored) are
submitted at once to llama-tiny (or a scaled-up Llama config, dummy weights) on an inline
``Runtime``, twice per repeat:

- **pressure**: a KV pool of ``ceil(demand / oversubscription)`` blocks, where the demand is the
  sum over the requests of ``ceil((prompt + max_tokens) / kv_block_size)``, the blocks each would
  hold at its end (at least the largest request's, so that every request fits alone);
- **large**: a pool of ``demand`` blocks: every request can hold its whole cache at once.

Both runtimes live through the whole run; the two loads alternate (the harness flips the order every
repeat, so drift of a shared machine hits both alike). Reported per system, median (min–max) over repeats:
completion rate, generated tokens / wall time, p50 / p99 of the request latencies (submission of
the whole load to the request's end), preemptions and batched forwards of the LLM node
(``Runtime.stats()``, the run's delta: fewer requests fit a step under pressure); then the
pressure / large ratios (median of the per-repeat ratios) and how many requests got the same
tokens under pressure as with the large cache, in every repeat.
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mstar.bench import harness
from mstar.bench.stats import spread, spread_cell
from mstar.placement import Placement
from mstar.runtime.api import Runtime

__all__ = ["MODELS", "PressureResult", "Workload", "format_table", "make_workload", "percentile",
           "run_pressure_bench"]

SYSTEMS = ("pressure", "large")
MODELS = ("tiny", "scaled")


# -- the load ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    block_size: int

    def blocks(self, i: int) -> int:
        """KV blocks request ``i`` holds at its end (prompt + every generated token)."""
        return -(-(len(self.prompts[i]) + self.max_tokens[i]) // self.block_size)

    @property
    def demand_blocks(self) -> int:
        return sum(self.blocks(i) for i in range(len(self.prompts)))

    @property
    def largest_blocks(self) -> int:
        return max(self.blocks(i) for i in range(len(self.prompts)))


def make_workload(n: int, seed: int = 0, prompt_len: tuple[int, int] = (16, 192),
                  max_tokens: tuple[int, int] = (16, 128), block_size: int = 16,
                  vocab: tuple[int, int] = (3, 259)) -> Workload:
    """``n`` requests, prompt lengths and ``max_tokens`` uniform in the inclusive ranges, token ids
    in ``[vocab[0], vocab[1])`` (llama-tiny's byte tokens by default)."""
    if n < 1 or block_size < 1 or min(prompt_len) < 1 or min(max_tokens) < 1:
        raise ValueError("requests, block size, prompt lengths and max_tokens must be >= 1")
    if prompt_len[0] > prompt_len[1] or max_tokens[0] > max_tokens[1]:
        raise ValueError(f"empty range: prompt_len {prompt_len}, max_tokens {max_tokens}")
    rng = random.Random(seed)
    prompts, maxes = [], []
    for _ in range(n):
        length = rng.randint(*prompt_len)
        prompts.append([rng.randrange(*vocab) for _ in range(length)])
        maxes.append(rng.randint(*max_tokens))
    return Workload(prompts, maxes, block_size)


def pressure_blocks(load: Workload, oversubscription: float) -> int:
    """The pool for ``demand / oversubscription``, never below the largest request's need."""
    return max(load.largest_blocks, math.ceil(load.demand_blocks / oversubscription))


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), ``q`` in [0, 100]."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# -- one run --------------------------------------------------------------------------------------
@dataclass
class Run:
    wall_s: float
    latencies_s: list[float]
    tokens: list[list[int] | None]  # None: the request did not finish
    preemptions: int
    forwards: int  # batched forwards of the LLM node

    @property
    def completed(self) -> int:
        return sum(t is not None for t in self.tokens)

    @property
    def tok_s(self) -> float:
        return sum(len(t) for t in self.tokens if t is not None) / self.wall_s

    def latency_ms(self, q: float) -> float:
        return percentile(self.latencies_s, q) * 1e3


def _params(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "sampling": {"temperature": 0.0, "ignore_eos": True}}


def _counters(rt: Runtime) -> tuple[int, int]:
    """(preemptions, batched forwards) so far, every rank and module."""
    ranks = rt.stats()["ranks"]
    return (sum(n for r in ranks for n in r["preemptions"].values()),
            sum(n for r in ranks for hist in r["batch_sizes"].values() for n in hist.values()))


def _tokens(out) -> list[int] | None:
    if not out.finished:
        return None
    return [int(t) for v in out.tensors("token") for t in v.reshape(-1).tolist()]


def run_load(rt: Runtime, load: Workload, timeout: float = 600.0) -> Run:
    """Submit every request in one step; each request's latency ends when its result is set."""
    before = _counters(rt)
    ends: list[float] = [0.0] * len(load.prompts)

    def wait(i: int, handle) -> None:
        handle.result(timeout)
        ends[i] = time.perf_counter()

    with rt.held():
        t0 = time.perf_counter()
        handles = [rt.submit({"input_ids": torch.tensor(p)}, _params(m))
                   for p, m in zip(load.prompts, load.max_tokens)]
    waiters = [threading.Thread(target=wait, args=(i, h), daemon=True) for i, h in enumerate(handles)]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join()
    wall = max(ends) - t0
    after = _counters(rt)
    return Run(wall, [e - t0 for e in ends], [_tokens(h.result(0)) for h in handles], after[0] - before[0],
               after[1] - before[1])


# -- the benchmark ---------------------------------------------------------------------------------
SCALED = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2}


def build_model(name: str):
    """``tiny``: llama-tiny; ``scaled``: its config at hidden 256 / 4 layers (head_dim 64), dummy weights."""
    from mstar.models.llama.config import TINY
    from mstar.models.llama.model import LlamaLM, LlamaTiny

    if name == "tiny":
        return LlamaTiny()
    if name == "scaled":
        return LlamaLM(config=dataclasses.replace(TINY, **SCALED), load_format="dummy")
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def _runtime(model_name: str, blocks: int, block_size: int) -> Runtime:
    model = build_model(model_name)
    placement = Placement.from_dict({"model": model.name, "node_groups": [{"node_names": ["LLM"], "ranks": [0]}],
                                     "runtime": {"kv_cache_blocks": blocks, "kv_block_size": block_size}})
    return Runtime(model, placement).start()


@dataclass
class PressureResult:
    model: str
    requests: int
    repeats: int
    seed: int
    demand_blocks: int
    block_size: int
    blocks: dict[str, int]  # system -> its KV pool
    runs: dict[str, list[Run]]  # system -> one run per repeat
    generated_tokens: int
    threads: int

    @property
    def oversubscription(self) -> float:
        """Demand over the pressure pool, as run (below the asked factor when the largest request caps it)."""
        return self.demand_blocks / self.blocks["pressure"]

    @property
    def same_tokens(self) -> int:
        """Requests whose tokens under pressure equal the large cache's, in every repeat."""
        pairs = list(zip(self.runs["pressure"], self.runs["large"]))
        return sum(all(p.tokens[i] is not None and p.tokens[i] == g.tokens[i] for p, g in pairs)
                   for i in range(self.requests))

    def ratio(self, metric: Callable[[Run], float]) -> tuple[float, float, float]:
        return spread([metric(p) / metric(g) for p, g in zip(self.runs["pressure"], self.runs["large"])])


def run_pressure_bench(requests: int = 32, oversubscription: float = 4.0, repeats: int = 3, seed: int = 0,
                       model: str = "tiny", block_size: int = 16, prompt_len: tuple[int, int] = (16, 192),
                       max_tokens: tuple[int, int] = (16, 128), warmup: bool = True,
                       log: Callable[[str], None] | None = None) -> PressureResult:
    """Both systems over the same seeded load, ``repeats`` alternating pairs (after one unmeasured
    run of each with ``warmup``)."""
    if repeats < 1 or not oversubscription >= 1:
        raise ValueError("repeats must be >= 1 and oversubscription >= 1")
    load = make_workload(requests, seed, prompt_len, max_tokens, block_size)
    blocks = {"pressure": pressure_blocks(load, oversubscription), "large": load.demand_blocks}
    rts = {s: _runtime(model, blocks[s], block_size) for s in SYSTEMS}
    try:
        runs = harness.rotate(SYSTEMS, lambda s, _r: run_load(rts[s], load), repeats,
                              warmup=lambda s: run_load(rts[s], load), warm=warmup, log=log,
                              label=lambda run: f"{run.wall_s:.2f} s, {run.completed}/{requests} done, "
                                                f"{run.preemptions} preemptions")
    finally:
        for rt in rts.values():
            rt.shutdown()
    return PressureResult(model, requests, repeats, seed, load.demand_blocks, block_size, blocks, runs,
                          sum(load.max_tokens), torch.get_num_threads())


# -- the table --------------------------------------------------------------------------------------
def describe(res: PressureResult) -> str:
    return (f"llama-{res.model}, {res.requests} requests (seed {res.seed}, {res.generated_tokens} tokens to "
            f"generate, greedy), KV demand {res.demand_blocks} blocks of {res.block_size} tokens; pressure "
            f"pool {res.blocks['pressure']} blocks ({res.oversubscription:.2f}x oversubscribed), large pool "
            f"{res.blocks['large']}; {res.repeats} alternating repeats, torch_threads={res.threads}; "
            f"median (min–max)")


def format_table(res: PressureResult) -> str:
    cols = [("completed %", lambda r: r.completed / res.requests * 100, ".0f"),
            ("tok/s", lambda r: r.tok_s, ".0f"),
            ("p50 latency ms", lambda r: r.latency_ms(50), ".0f"),
            ("p99 latency ms", lambda r: r.latency_ms(99), ".0f"),
            ("preemptions", lambda r: r.preemptions, ".0f"),
            ("forwards", lambda r: r.forwards, ".0f")]
    lines = [describe(res), "", "| cache | KV blocks | " + " | ".join(c[0] for c in cols) + " |",
             "|---|---:|" + "---:|" * len(cols)]
    for s in SYSTEMS:
        cells = [spread_cell(spread([f(r) for r in res.runs[s]]), fmt) for _, f, fmt in cols]
        lines.append(f"| {s} | {res.blocks[s]} | " + " | ".join(cells) + " |")
    ratios = [spread_cell(res.ratio(f), ".2f") for _, f, _ in cols[1:4]]
    lines.append(f"| pressure / large | {res.blocks['pressure'] / res.blocks['large']:.2f} | – | "
                 + " | ".join(ratios) + f" | – | {spread_cell(res.ratio(lambda r: r.forwards), '.2f')} |")
    lines += ["", f"same tokens: {res.same_tokens}/{res.requests}"]
    return "\n".join(lines)

