"""Prefix caching benchmark: ``mstar bench prefix``.

Chats that share one long system prompt (``system`` tokens) and differ in a short user turn
(``user`` tokens, drawn from a seed), greedy, ``max_tokens`` each, on llama-tiny or its scaled
config (``mstar.bench.pressure_bench.build_model``), twice per repeat, alternating in one process:

- **cached**: prefix caching on (the default): from the second request on, the system prompt's full
  blocks come from the cache and only the rest of the prompt is computed;
- **uncached**: the same runtime settings with ``prefix_caching: false``.

Two loads per system: ``sequential`` (one request at a time: time to first token, the prefill the
cache saves) and ``burst`` (every request submitted in one step: wall time and tokens/s). The
first request of each system warms its cache (and the process) and is not measured. Reported:
median (min–max) over repeats, the cached / uncached ratios, the hit rate (reused / looked-up
prompt tokens) and whether both systems produced the same tokens.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mstar.bench import harness
from mstar.bench.pressure_bench import build_model, percentile
from mstar.bench.stats import spread, spread_cell
from mstar.placement import Placement
from mstar.runtime.api import Runtime

__all__ = ["PrefixResult", "format_table", "run_prefix_bench"]

SYSTEMS = ("cached", "uncached")


@dataclass
class PrefixRun:
    ttft_s: list[float]  # sequential load: per request, submission -> first token
    burst_wall_s: float  # burst load: submission of all -> the last result
    tokens: list[list[int]]  # sequential load's outputs, then the burst's
    hit_tokens: int
    query_tokens: int

    @property
    def ttft_ms(self) -> float:
        return percentile(self.ttft_s, 50) * 1e3

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(self.query_tokens, 1)


@dataclass
class PrefixResult:
    model: str
    requests: int
    system_tokens: int
    max_tokens: int
    repeats: int
    threads: int
    runs: dict[str, list[PrefixRun]] = field(default_factory=dict)

    def ratio(self, metric: Callable[[PrefixRun], float]) -> tuple[float, float, float]:
        return spread([metric(c) / metric(u) for c, u in zip(self.runs["cached"], self.runs["uncached"])])

    @property
    def same_tokens(self) -> bool:
        return all(c.tokens == u.tokens for c, u in zip(self.runs["cached"], self.runs["uncached"]))


def _prompts(n: int, system: int, user: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(1, vocab) for _ in range(system)]
    return [head + [rng.randrange(1, vocab) for _ in range(rng.randint(*user))] for _ in range(n)]


def _params(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "sampling": {"temperature": 0.0, "ignore_eos": True}}


def _counters(rt: Runtime) -> tuple[int, int]:
    kvs = [kv for r in rt.stats()["ranks"] for kv in r["kv"].values()]
    return sum(kv["prefix_hit_tokens"] for kv in kvs), sum(kv["prefix_query_tokens"] for kv in kvs)


def _tokens(handle) -> list[int]:
    out = handle.result(600)
    if not out.finished:
        raise RuntimeError(f"a benchmark request failed: {out.error}")
    return [int(t) for v in out.tensors("token") for t in v.reshape(-1).tolist()]


def _run(rt: Runtime, prompts: list[list[int]], max_tokens: int) -> PrefixRun:
    hits0, queries0 = _counters(rt)
    ttft, outs = [], []
    for p in prompts:
        t0 = time.perf_counter()
        handle = rt.submit({"input_ids": torch.tensor(p)}, _params(max_tokens))
        next(iter(handle))  # the first streamed item: the first token
        ttft.append(time.perf_counter() - t0)
        outs.append(_tokens(handle))
    with rt.held():
        t0 = time.perf_counter()
        handles = [rt.submit({"input_ids": torch.tensor(p)}, _params(max_tokens)) for p in prompts]
    outs += [_tokens(h) for h in handles]
    wall = time.perf_counter() - t0
    hits, queries = _counters(rt)
    return PrefixRun(ttft, wall, outs, hits - hits0, queries - queries0)


def _runtime(model: str, prefix_caching: bool, blocks: int, block_size: int) -> Runtime:
    m = build_model(model)
    placement = Placement.from_dict({"model": m.name, "node_groups": [{"node_names": ["LLM"], "ranks": [0]}],
                                     "runtime": {"kv_cache_blocks": blocks, "kv_block_size": block_size,
                                                 "prefix_caching": prefix_caching}})
    return Runtime(m, placement).start()


def run_prefix_bench(requests: int = 16, system_tokens: int = 512, user_tokens: tuple[int, int] = (8, 32),
                     max_tokens: int = 8, repeats: int = 3, model: str = "tiny", block_size: int = 16,
                     seed: int = 0, log: Callable[[str], None] | None = None) -> PrefixResult:
    if repeats < 1 or requests < 1 or system_tokens < 0:
        raise ValueError("repeats and requests must be >= 1, system_tokens >= 0")
    vocab = build_model(model).config.vocab_size
    prompts = _prompts(requests, system_tokens, user_tokens, vocab, seed)
    longest = max(len(p) for p in prompts) + max_tokens
    blocks = 2 * requests * -(-longest // block_size)  # room for the burst, whatever is cached
    res = PrefixResult(model, requests, system_tokens, max_tokens, repeats, torch.get_num_threads(),
                       {s: [] for s in SYSTEMS})
    rts = {s: _runtime(model, s == "cached", blocks, block_size) for s in SYSTEMS}
    try:
        # warm-up: the process, and the cached system's first copy of the prefix
        res.runs = harness.rotate(
            SYSTEMS, lambda s, _r: _run(rts[s], prompts, max_tokens), repeats,
            warmup=lambda s: _tokens(rts[s].submit({"input_ids": torch.tensor(prompts[0])}, _params(max_tokens))),
            log=log, label=lambda run: f"TTFT p50 {run.ttft_ms:.1f} ms, burst {run.burst_wall_s:.2f} s, "
                                       f"hit rate {run.hit_rate:.2f}")
    finally:
        for rt in rts.values():
            rt.shutdown()
    return res


def format_table(res: PrefixResult) -> str:
    cols = [("sequential TTFT p50 ms", lambda r: r.ttft_ms, ".1f"),
            ("burst wall s", lambda r: r.burst_wall_s, ".2f"),
            ("burst tok/s", lambda r: res.requests * res.max_tokens / r.burst_wall_s, ".0f"),
            ("hit rate", lambda r: r.hit_rate, ".2f")]
    lines = [f"llama-{res.model}, {res.requests} chats sharing a {res.system_tokens}-token system prompt, "
             f"{res.max_tokens} greedy tokens each; {res.repeats} alternating repeats, "
             f"torch_threads={res.threads}; median (min–max)", "",
             "| prefix cache | " + " | ".join(c[0] for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for s in SYSTEMS:
        lines.append(f"| {s} | " + " | ".join(spread_cell(spread([f(r) for r in res.runs[s]]), fmt)
                                              for _, f, fmt in cols) + " |")
    lines.append("| cached / uncached | " + " | ".join(spread_cell(res.ratio(f), ".2f") for _, f, _ in cols[:3])
                 + " | – |")
    lines += ["", f"same tokens with and without the cache: {'yes' if res.same_tokens else 'NO'}"]
    return "\n".join(lines)
