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

import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from typing import Any

from mstar.placement import RuntimeLimits
from mstar.runtime.routing import Routing
from mstar.runtime.work_items import WorkItem

__all__ = ["ModuleScheduler", "module_stages"]


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
