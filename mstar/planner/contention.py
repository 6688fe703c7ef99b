"""How much slower a rank computes while other ranks compute: measured, not assumed.

Worker processes run torch's intra-op pool over every core by default (a placement group's
``threads`` gives its ranks fewer), so ranks that compute at once share the cores, and their
OpenMP threads may outnumber them. ``measure_contention`` runs the same small matrix products
(decode-sized: many short parallel regions, where oversubscription hurts most) in ``k`` spawned
processes at once and reports each one's time per product over one process alone with the same
threads, two ways:

* ``shared``: every process with all the cores' threads (the default placement: oversubscribed);
* ``split``: every process with ``cores // k`` threads (the cores split between the ranks).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

__all__ = ["measure_contention"]


def _products(threads: int, ready: object, start: object, seconds: float, out: object) -> None:
    import torch

    torch.set_num_threads(threads)
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


def _per_product(k: int, threads: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_products, args=(threads, ready, start, seconds, out), daemon=True)
             for _ in range(k)]
    for p in procs:
        p.start()
    for _ in procs:  # every process imported torch and warmed up before the clock starts
        ready.get(timeout=120)
    start.set()
    times = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return sum(times) / len(times)


def measure_contention(max_ranks: int, seconds: float = 1.0, rounds: int = 3) -> dict[str, dict[int, float]]:
    """``{"shared": {k: slowdown}, "split": {k: slowdown}}`` for ``k`` = 1 .. ``max_ranks`` processes
    computing at once (module docstring): the median of ``rounds`` alternating rounds (oversubscribed
    threads make single rounds noisy)."""
    cores = len(os.sched_getaffinity(0))
    ratios: dict[str, dict[int, list[float]]] = {"shared": {}, "split": {}}
    for _ in range(rounds):
        alone = {t: _per_product(1, t, seconds) for t in {cores, *(max(1, cores // k) for k in range(2, max_ranks + 1))}}
        for k in range(2, max_ranks + 1):
            split = max(1, cores // k)
            ratios["shared"].setdefault(k, []).append(_per_product(k, cores, seconds) / alone[cores])
            ratios["split"].setdefault(k, []).append(_per_product(k, split, seconds) / alone[split])
    return {way: {1: 1.0, **{k: round(max(1.0, sorted(r)[len(r) // 2]), 3) for k, r in per.items()}}
            for way, per in ratios.items()}
