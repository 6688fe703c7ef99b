"""A rank's KV admission (see ARCHITECTURE.md, "KV pressure: admission and preemption"): an item that
cannot get its KV blocks waits in its queue instead of failing; when nothing of a module can run,
the oldest waiting request is made to progress by swapping out the youngest request holding blocks.

``KVAdmission`` keeps, per KV module, the requests whose item waits for blocks and the oldest of
those that holds none yet (the *gate*: younger requests without blocks wait behind it, so a large
prompt is not starved), the order requests first reached the rank (older = higher priority), and
the modules stalled until something may have freed blocks. The worker owns one and calls ``run``
for every batch and ``relieve`` when no item of a module could run.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Mapping

from mstar.runtime.engine import DEFERRED, StatelessEngine, WorkItem
from mstar.runtime.failures import FailureKind, KVCacheExhausted, describe
from mstar.runtime.kv.engine import KVCacheEngine

__all__ = ["KVAdmission"]


class KVAdmission:
    def __init__(self, engines: Mapping[str, StatelessEngine], queues: Mapping[str, deque[WorkItem]],
                 fail: Callable[[str, str, FailureKind], None]) -> None:
        self.engines, self.queues, self._fail = engines, queues, fail
        self._arrival: dict[str, int] = {}
        self._arrivals = itertools.count()
        self.waiting: dict[str, set[str]] = {b: set() for b in engines}
        self._gate: dict[str, str] = {}
        self.stalled: set[str] = set()  # KV modules waiting for older requests to free blocks

    def arrived(self, rid: str) -> None:
        """A message of ``rid`` reached the rank (its first one sets its age)."""
        if rid not in self._arrival:
            self._arrival[rid] = next(self._arrivals)

    def forget(self, rid: str) -> None:
        """The request is gone from the rank."""
        self._arrival.pop(rid, None)
        for base, waiting in self.waiting.items():
            waiting.discard(rid)
            if self._gate.get(base) == rid:
                del self._gate[base]

    def _age(self, rid: str) -> int:
        return self._arrival.get(rid, 1 << 62)

    def unhindered(self, base: str) -> bool:
        """No request waits for blocks of ``base`` (no item is gated): a batch may run without
        ``run``'s bookkeeping."""
        return base not in self._gate and not self.waiting[base]

    def run(self, base: str, batch: list[WorkItem]) -> list | None:
        """Run a batch. On a KV module the items that cannot get their blocks now (``DEFERRED``) go
        back to the front of the queue, in order; None when no item ran."""
        eng = self.engines[base]
        if not isinstance(eng, KVCacheEngine):
            return eng.run(batch)
        waiting = self.waiting[base]
        if base not in self._gate and not waiting:  # nobody waits for blocks here (no item is gated)
            results = eng.run(batch)
            if DEFERRED not in results:  # and every item got its blocks: the common case
                return results
        else:
            gated = [self._gated(eng, base, it.request_id) for it in batch]
            outs = iter(eng.run([it for it, g in zip(batch, gated) if not g]) if not all(gated) else [])
            results = [DEFERRED if g else next(outs) for g in gated]
        deferred = [it for it, out in zip(batch, results) if out is DEFERRED]
        for it, out in zip(batch, results):
            if out is DEFERRED:
                waiting.add(it.request_id)
                self._hold_gate(eng, base, it.request_id)
            else:
                waiting.discard(it.request_id)
                if self._gate.get(base) == it.request_id:
                    del self._gate[base]
        self.queues[base].extendleft(reversed(deferred))
        return None if len(deferred) == len(batch) else results

    def _gated(self, eng: KVCacheEngine, base: str, rid: str) -> bool:
        """A request that holds no blocks yet waits while an older one without blocks is waiting."""
        gate = self._gate.get(base)
        return gate is not None and gate != rid and self._age(rid) > self._age(gate) and not eng.blocks_of(rid)

    def _hold_gate(self, eng: KVCacheEngine, base: str, rid: str) -> None:
        gate = self._gate.get(base)
        if not eng.blocks_of(rid) and (gate is None or self._age(rid) < self._age(gate)):
            self._gate[base] = rid

    def relieve(self, base: str) -> bool:
        """No item of the module could get its KV blocks: make the oldest waiting request progress.

        Its items go first (the queue is re-sorted by request age); then the youngest request
        younger than it that holds blocks here is swapped out, one per call. With no such request
        and nobody else holding blocks, the oldest cannot fit even alone: it fails (out of memory).
        Otherwise older requests hold the blocks and will release them: wait. Returns whether
        anything changed.
        """
        eng, q = self.engines[base], self.queues[base]
        order = sorted(q, key=lambda it: (self._age(it.request_id), it.seq))
        if self._gate.get(base) not in {it.request_id for it in q}:
            self._gate.pop(base, None)  # stale: its request no longer waits here
        if any(a is not b for a, b in zip(order, q)):
            q.clear()
            q.extend(order)
            return True
        target = q[0].request_id
        younger = [r for r in eng.holders() if self._age(r) > self._age(target)]
        if younger:
            eng.swap_out(max(younger, key=self._age))
            return True
        if all(r == target for r in eng.holders()):
            error = KVCacheExhausted(f"request {target} needs more KV blocks of {base!r} than the whole cache "
                                     f"({eng.manager.pool.num_blocks} blocks of {eng.manager.block_size} tokens); "
                                     f"raise kv_cache_blocks in the placement")
            self._fail(target, describe(error), FailureKind.OUT_OF_MEMORY)
            return True
        return False
