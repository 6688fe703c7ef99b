"""How much slower a rank computes while other ranks compute: measured, not assumed.

Worker processes each run torch's intra-op pool over every core (tensor-parallel ranks split the
cores), so ranks that compute at once share the cores, and their OpenMP threads may outnumber them.
``measure_contention`` runs the same small matrix products (decode-sized: many short parallel
regions, where oversubscription hurts most) in ``k`` spawned processes at once and reports each
one's time per product over the time of one process alone.
"""

from __future__ import annotations

import multiprocessing as mp
import time

__all__ = ["measure_contention"]


def _products(ready: object, start: object, seconds: float, out: object) -> None:
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    a, w = torch.randn(16, 1024), torch.randn(1024, 1024)
    for _ in range(20):  # warm
        a @ w
    ready.put(True)
    start.wait()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ w
        n += 10
    out.put((time.perf_counter() - t0) / n)


def _per_product(k: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_products, args=(ready, start, seconds, out), daemon=True) for _ in range(k)]
    for p in procs:
        p.start()
    for _ in procs:  # every process imported torch and warmed up before the clock starts
        ready.get(timeout=120)
    start.set()
    times = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return sum(times) / len(times)


def measure_contention(max_ranks: int, seconds: float = 1.0, rounds: int = 3) -> dict[int, float]:
    """``{k: slowdown}`` for ``k`` = 1 .. ``max_ranks`` processes computing at once (1.0 for one):
    the median of ``rounds`` alternating rounds (oversubscribed threads make single rounds noisy)."""
    ratios: dict[int, list[float]] = {k: [] for k in range(2, max_ranks + 1)}
    for _ in range(rounds):
        alone = _per_product(1, seconds)
        for k in ratios:
            ratios[k].append(_per_product(k, seconds) / alone)
    out = {1: 1.0}
    for k, r in ratios.items():
        out[k] = round(max(1.0, sorted(r)[len(r) // 2]), 3)
    return out
