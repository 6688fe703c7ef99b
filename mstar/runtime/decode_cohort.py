"""The rows of a module that decode in lockstep: a worker's steady decode path.

After a forward, the items whose walk simply goes on (``WalkTracker.continue_self_loop``: the next
iteration of an AR decode step, nothing routed but client values) are requeued as they are. When
every one of them can go on without the tracker (``WalkTracker.lockstep_bound``) and the engine can
make their next batch from the last one (``KVCacheEngine.decode_rows``), they form a
``DecodeCohort``. While the module's next batch is exactly the cohort, the worker runs it through
``KVCacheEngine.run_rows`` and, per row, only sends the client values and requeues the item: the
rows' trackers, and their items' inputs, are not touched. They are caught up
(``WalkTracker.advance_self_loop``) when a row leaves (a stop, the loop's bound) and, for every row,
before anything else may look at them: a message reaching the worker, a batch that is not the
cohort.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mstar.runtime.walk_tracker import LockstepBound, read_stop
from mstar.runtime.work_items import WorkItem

__all__ = ["DecodeCohort", "as_values", "row_outputs"]


def as_values(v: Any) -> list:
    """One request's output value as the list an edge carries (a list the module made is kept)."""
    return v if type(v) is list else list(v) if isinstance(v, (list, tuple)) else [v]


def row_outputs(out: dict[str, list], row: int) -> dict[str, list]:
    """One row's outputs from a forward's (``StatelessEngine._rows`` for a single row)."""
    return {name: as_values(vals[row]) for name, vals in out.items()}


@dataclass(slots=True)
class DecodeCohort:
    """The queued items of one module that go on in lockstep, in queue order."""

    base: str  # the module
    items: list[WorkItem]
    walks: list[Any]  # each item's walk record (the worker's ``_Walk``)
    seen: list[tuple[int, ...]]  # per item: the iteration its tracker saw start
    rows: list[int]  # per item: its row in ``outputs``
    outputs: dict[str, list]  # the last forward's outputs: the rows' trackers have not seen them
    bound: LockstepBound  # of the first row; every row's node is the same
    steps_left: int  # lockstep forwards every row may still take before a loop's bound
    request_ids: set[str]  # of every row it started with (a message for one ends the cohort)
    needs: frozenset[str]  # the outputs every row's node must return
    flat: bool  # every row's loop is a top-level one (its iterations are ``(i,)``)

    def is_batch(self, batch: list[WorkItem]) -> bool:
        items = self.items
        return len(batch) == len(items) and all(a is b for a, b in zip(batch, items))

    def leaving(self, out: dict[str, list]) -> list[int]:
        """The rows (positions in ``items``) whose iteration just run ends the lockstep: with a
        deferred stop check, those whose previous iteration raised the stop flag (this one ran
        speculatively); otherwise those raising it now."""
        b = self.bound
        if b.stop_signal is None:
            return []
        if b.defer_stop_check:
            flags, rows = self.outputs[b.stop_signal], self.rows
            if all(type(f) is bool for f in flags):
                return [i for i, r in enumerate(rows) if flags[r]] if True in flags else []
            return [i for i, r in enumerate(rows) if read_stop(as_values(flags[r]))]
        flags = out[b.stop_signal]
        if all(type(f) is bool for f in flags):
            return [i for i, f in enumerate(flags) if f] if True in flags else []
        return [i for i, f in enumerate(flags) if read_stop(as_values(f))]
