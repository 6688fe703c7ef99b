"""Replaying a workload's arrivals against the real runtime: the measured side of the planner's
validation and of its side-by-side goodput comparison.

Each arrival is submitted at its time (``ModelDef.sized_request`` of its class and lengths) to a
started ``Runtime``; the first item it streams back gives its TTFT, its end its end-to-end latency
(the same ``RequestTimes`` the simulator predicts).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from mstar.planner.simulate import Prediction, RequestTimes
from mstar.planner.workload import Arrival, Workload

__all__ = ["replay"]


async def _one(rt: Any, model: Any, workload: Workload, a: Arrival, t0: float, seed: int) -> RequestTimes:
    inputs, params = model.sized_request(a.prompt_tokens, a.output_tokens,
                                         workload.classes()[a.request_class].params, seed)
    await asyncio.sleep(max(0.0, t0 + a.at_s - time.perf_counter()))
    sent = time.perf_counter()
    handle = rt.submit(inputs, params, request_id=f"replay-{a.request_class}", trace=False)
    first = None
    async for _ in handle:
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    out = handle.result()
    if out.error:
        raise RuntimeError(f"a replayed request failed: {out.error}")
    ttft = (first if first is not None else end) - sent
    tpot = (end - sent - ttft) / (a.output_tokens - 1) if a.output_tokens > 1 else None
    return RequestTimes(a.request_class, a.at_s, ttft, end - sent, tpot)


def replay(rt: Any, model: Any, workload: Workload, arrivals: Sequence[Arrival]) -> Prediction:
    """Measured latencies of ``arrivals`` on the started runtime ``rt`` (a ``Prediction`` of what
    happened: the same shape as the simulator's)."""
    async def main() -> list[RequestTimes]:
        t0 = time.perf_counter()
        return await asyncio.gather(*(_one(rt, model, workload, a, t0, i + 1000) for i, a in enumerate(arrivals)))

    started = time.perf_counter()
    times = asyncio.run(main())
    return Prediction(sorted(times, key=lambda r: r.arrival_s), time.perf_counter() - started)
