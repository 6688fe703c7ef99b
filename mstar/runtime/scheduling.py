"""Which of a rank's modules runs next (``runtime.scheduling`` in the placement).

``fcfs``: the module whose oldest queued item came first. ``downstream_first``: the module of the
deepest stream stage (``Routing.stage``; a module takes the deepest stage of the partitions it runs
in), ties FCFS, unless some queued item has waited longer than ``scheduling_max_wait_ms``: then FCFS
among those overdue items, so a producer's new prompts and other requests are never starved by a
consumer that always has work. An item whose request is *ahead* (``ahead(item)``: a consumer on this
rank still holds stream chunks from the item's partition that it has not taken) is never overdue:
running it could only add to that backlog, and the consumer, which has priority, takes the chunks
first; once they are taken the item is overdue again. Nor is an item overdue while its request has an
item of a deeper stage queued here (that item goes first; the request's producer step can only help
its consumer after it). So a Thinker that already streamed the Talker its next text waits behind the
Talker and code predictor, whose steps lead to the first audio, and a Thinker step is not taken
between a frame's last code-predictor step and its assembly, or between the frame and its Code2Wav
chunk. With one stage on the rank (no streams) both policies are FCFS.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Mapping
from typing import Any

from mstar.placement import RuntimeLimits
from mstar.runtime.failures import FailureKind
from mstar.runtime.kv.admission import KVAdmission
from mstar.runtime.routing import Routing
from mstar.runtime.work_items import WorkItem

__all__ = ["ModuleScheduler", "RankScheduler", "module_stages"]


def module_stages(routing: Routing, model: Any, nodes: Collection[str]) -> dict[str, int]:
    """Per module of ``nodes``: the deepest stage of a partition whose walks run one of them."""
    graph, out = routing.graph, {}
    for part in graph.partitions:
        for walk in graph.walks_of(part):
            for node in graph.plans[walk].nodes:
                if node in nodes:
                    base = model.module_of(node)
                    out[base] = max(out.get(base, 0), routing.stage[part])
    return out


class ModuleScheduler:
    """The rank's choice of module; ``stamp`` each item as it joins a queue."""

    def __init__(self, limits: RuntimeLimits, stages: Mapping[str, int],
                 ahead: Callable[[WorkItem], bool] | None = None) -> None:
        self.stage = dict(stages) if limits.scheduling == "downstream_first" else {b: 0 for b in stages}
        self.staged = len(set(self.stage.values())) > 1
        self.max_wait = limits.scheduling_max_wait_ms / 1e3
        self.ahead = ahead or (lambda _item: False)

    @staticmethod
    def stamp(item: WorkItem) -> None:
        item.queued_at = time.monotonic()

    now = staticmethod(time.monotonic)  # what ``stamp`` puts in ``queued_at``

    def pick(self, queues: Mapping[str, deque[WorkItem]], skip: Collection[str]) -> str | None:
        """The module to run next among the non-empty queues not in ``skip``; None when there is none."""
        heads = [(q[0].seq, base) for base, q in queues.items() if q and base not in skip]
        if not heads:
            return None
        if not self.staged or len(heads) == 1:
            return min(heads)[1]
        due = time.monotonic() - self.max_wait
        overdue = [h for h in heads if self._overdue(queues, h[1], due, skip)]
        if overdue:
            return min(overdue)[1]
        return min(heads, key=lambda h: (-self.stage[h[1]], h[0]))[1]

    def _overdue(self, queues: Mapping[str, deque[WorkItem]], base: str, due: float, skip: Collection[str]) -> bool:
        """Some item of ``base`` queued before ``due`` whose request is not ahead and has no runnable item
        of a deeper stage queued (items queue in time order)."""
        deeper = None
        for item in queues[base]:
            if item.queued_at >= due:
                return False
            if self.ahead(item):
                continue
            if deeper is None:  # the requests with work queued downstream of this module, looked up once
                deeper = {it.request_id for b, q in queues.items()
                          if q and b not in skip and self.stage[b] > self.stage[base] for it in q}
            if item.request_id not in deeper:
                return True
        return False


class RankScheduler:
    """A rank's queues and the choice of its next batch: one queue per module, the policy
    (``ModuleScheduler``), KV admission (``KVAdmission``: which items may run, who is preempted) and
    each module's batch limit. The *schedule* part of a worker's step."""

    def __init__(self, rank: int, engines: Mapping[str, Any], module_of: Mapping[str, str],
                 max_batch: Mapping[str, int], policy: ModuleScheduler,
                 fail: Callable[[str, str, FailureKind], None]) -> None:
        self.rank = rank
        self.queues: dict[str, deque[WorkItem]] = {b: deque() for b in engines}
        self._queue_of = {node: self.queues[base] for node, base in module_of.items()}
        self.max_batch = dict(max_batch)
        self.policy = policy
        self.admission = KVAdmission(engines, self.queues, fail)  # KV pressure (kv/admission.py)
        self.seqs = itertools.count()  # queue order of items
        self.batch_hist: dict[str, Counter] = {b: Counter() for b in engines}  # module -> batch size -> forwards

    def enqueue(self, item: WorkItem) -> None:
        q = self._queue_of.get(item.node)
        if q is None:
            raise RuntimeError(f"worker {self.rank} got node {item.node!r}, which is not placed on it")
        self.policy.stamp(item)
        q.append(item)

    def next_batch(self) -> tuple[str, list[WorkItem]] | None:
        """The next module to run (the policy's pick; modules stalled for KV blocks skipped) and its
        items, up to its batch limit."""
        base = self.policy.pick(self.queues, self.admission.stalled)
        if base is None:
            return None
        q = self.queues[base]
        return base, [q.popleft() for _ in range(min(len(q), self.max_batch[base]))]

    def runnable(self) -> bool:
        stalled = self.admission.stalled
        return any(q and base not in stalled for base, q in self.queues.items())

    def drop_request(self, rid: str) -> None:
        """The request's queued items, gone."""
        for q in self.queues.values():
            if any(it.request_id == rid for it in q):
                kept = [it for it in q if it.request_id != rid]
                q.clear()
                q.extend(kept)
        self.admission.forget(rid)
