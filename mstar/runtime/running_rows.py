"""A rank's running set: per module, the rows whose self-loop goes on (an AR decode step, a code
predictor's step), run as one batch step after step.

After a forward, ``Postprocess`` requeues the items whose walk simply goes on
(``WalkTracker.continue_self_loop``: the next iteration, nothing routed but client values and
streamed items). When every one of them can go on without the tracker (``WalkTracker.rows_bound``)
and the engine can make their next batch from the last one (``rows_of``), they become the module's
``RunningRows``. While the module's next batch is exactly those rows, the step's *run* is the
engine's ``run_rows`` (no ``prepare_inputs``, no per-item planning) and its *postprocess*
(``Postprocess.rows_ran``) sends each row's client values and stream items and requeues the item:
the rows' trackers, and their items' inputs, are not touched.

They are caught up (``WalkTracker.catch_up_rows``) when a row leaves (a stop, the loop's bound) and,
for every row, before anything else may look at them: a message reaching the worker for one of
their requests (other than one for another partition of it: the rows' own stream pushes), a batch
that is not the rows. A loop with exits (a code predictor's, nested in its talker's loop) gets each
iteration's exit values as it runs (``WalkTracker.rows_exits``): those are what its end routes on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mstar.runtime.failures import FailureKind, describe
from mstar.runtime.self_loops import LoopExits, RowsBound
from mstar.runtime.walk_records import read_stop
from mstar.runtime.wire.messages import (
    ExecNode,
    NodeResult,
    StartWalk,
    StatsRequest,
    StreamEnd,
    StreamPush,
    TraceRequest,
)
from mstar.runtime.work_items import WorkItem, as_values

if TYPE_CHECKING:
    from mstar.runtime.scheduling import RankScheduler
    from mstar.runtime.walk_table import WalkTable

__all__ = ["RunningRows", "RunningSet", "row_outputs"]

# messages that touch one partition of a request (their ``partition``) and nothing else
_WALK_MESSAGES = frozenset({StartWalk, ExecNode, NodeResult, StreamPush, StreamEnd})


def row_outputs(out: dict[str, list], row: int) -> dict[str, list]:
    """One row's outputs from a forward's (``StatelessEngine._rows`` for a single row)."""
    return {name: as_values(vals[row]) for name, vals in out.items()}


@dataclass(slots=True)
class RunningRows:
    """The queued items of one module that go on together, in queue order."""

    base: str  # the module
    items: list[WorkItem]
    walks: list[Any]  # each item's walk record (``LiveWalk``)
    seen: list[tuple[int, ...]]  # per item: the iteration its tracker saw start
    rows: list[int]  # per item: its row in ``outputs``
    outputs: dict[str, list]  # the last forward's outputs: the rows' trackers have not seen them
    bound: RowsBound  # of the first row; every row's node is the same
    steps_left: int  # forwards every row may still take before a loop's bound
    request_ids: set[str]  # of every row it started with (a message for one ends the rows)
    needs: frozenset[str]  # the outputs every row's node must return
    flat: bool  # every row's loop is a top-level one (its iterations are ``(i,)``)
    request_id_list: list[str] | None = None  # per item (made at the first usual step; replaced, never changed)
    walk_names: list[str] | None = None  # per item: its walk's name (ditto)
    ended_seen: int = -1  # the walk table's ``ended`` when every row's walk was last seen live
    exits: list[LoopExits] | None = None  # per item, when the loop has exits: where its iterations' values go
    partitions: frozenset[str] = frozenset()  # of every row's walk (``RunningSet.before``)

    def is_batch(self, batch: list[WorkItem]) -> bool:
        items = self.items
        return len(batch) == len(items) and all(a is b for a, b in zip(batch, items))

    def leaving(self, out: dict[str, list]) -> list[int]:
        """The rows (positions in ``items``) whose iteration just run ends their running: with a
        deferred stop check, those whose previous iteration raised the stop flag (this one ran
        speculatively); otherwise those raising it now."""
        b = self.bound
        if b.stop_signal is None:
            return []
        if b.defer_stop_check:
            flags, rows = self.outputs[b.stop_signal], self.rows
            if flags.count(None) == len(flags):  # no row's flag raised (a ``FinishReason`` or None each)
                return []
            if all(type(f) is bool for f in flags):
                return [i for i, r in enumerate(rows) if flags[r]] if True in flags else []
            return [i for i, r in enumerate(rows) if read_stop(as_values(flags[r]))]
        flags = out[b.stop_signal]
        if flags.count(None) == len(flags):
            return []
        if all(type(f) is bool for f in flags):
            return [i for i, f in enumerate(flags) if f] if True in flags else []
        return [i for i, f in enumerate(flags) if read_stop(as_values(f))]

    def all_live(self, ended: int) -> bool:
        """Every row's walk is live (looked at again only after some walk of the rank ended: ``ended``
        is the walk table's count)."""
        if ended == self.ended_seen:
            return True
        if not all(w.live for w in self.walks):
            return False
        self.ended_seen = ended
        return True

    def kept(self, keep: list[int], out: dict[str, list]) -> None:
        """After a step: only the rows at positions ``keep`` go on (in order), from outputs ``out``."""
        n = len(self.items)
        if len(keep) != n:
            self.items = [self.items[i] for i in keep]
            self.walks = [self.walks[i] for i in keep]
            self.seen = [self.seen[i] for i in keep]
            if self.exits is not None:
                self.exits = [self.exits[i] for i in keep]
            self.request_id_list = self.walk_names = None
            self.rows = keep
        elif len(self.rows) != n or self.rows[-1] != n - 1:  # rows ascend: this is range(n)
            self.rows = list(range(n))
        self.outputs = out
        self.steps_left -= 1


class RunningSet:
    """A rank's running rows (one ``RunningRows`` per module at most): formed after a forward,
    scheduled while the module's batch is exactly them, caught up and ended otherwise. ``fail``
    fails a request alone (a row whose catching up raised)."""

    def __init__(self, engines: Mapping[str, Any], sched: RankScheduler, walks: WalkTable,
                 fail: Callable[[str, str, FailureKind], None]) -> None:
        self.engines, self.sched, self.walks, self._fail = engines, sched, walks, fail
        self.modules: dict[str, RunningRows] = {}

    def form(self, base: str, items: list[WorkItem], walks: list[Any]) -> None:
        """Make the requeued continuations of a forward (``items``, with their walks) the module's
        running rows when all of them may go on together."""
        eng = self.engines[base]
        if not getattr(eng, "continues_batches", False):
            return
        found = eng.rows_of(items)
        if found is None:
            return
        rows, outputs = found
        first = items[0]
        bound = walks[0].tracker.rows_bound(first.node, first.iteration)
        if bound is None:
            return
        steps = bound.steps_left
        for it, w in zip(items, walks):
            b = w.tracker.rows_bound(it.node, it.iteration)
            if it.node != first.node or b is None or b.stop_signal != bound.stop_signal \
                    or b.defer_stop_check != bound.defer_stop_check or b.emits != bound.emits \
                    or b.streams != bound.streams:
                return
            steps = min(steps, b.steps_left)
        exits = None
        if bound.exits:
            exits = [w.tracker.rows_exits(it.node, it.iteration) for it, w in zip(items, walks)]
            if None in exits:
                return
        self.modules[base] = RunningRows(base, items, walks, [it.iteration for it in items], rows, outputs,
                                         bound, steps, {it.request_id for it in items}, frozenset(bound.outputs),
                                         all(len(it.iteration) == 1 for it in items), exits=exits,
                                         partitions=frozenset(w.key.partition for w in walks))

    def of(self, base: str, batch: list[WorkItem]) -> RunningRows | None:
        """The module's running rows when ``batch`` is exactly them and they may take another step
        together; otherwise (the module has none: None) they end, caught up, and the batch runs
        the general way."""
        rows = self.modules.get(base)
        if rows is None:
            return None
        if rows.is_batch(batch) and rows.steps_left > 0 and self.sched.admission.unhindered(base):
            return rows
        self.dissolve(base)
        return None

    def run(self, rows: RunningRows) -> dict[str, list] | None:
        """One forward of the rows (``run_rows``): the module's outputs, or None when the engine
        declined (the rows ended, caught up: the batch runs the general way)."""
        out = self.engines[rows.base].run_rows(rows.items, rows.rows)
        if out is None:
            self.dissolve(rows.base)
            return None
        self.sched.admission.stalled.clear()
        self.sched.batch_hist[rows.base][len(rows.items)] += 1
        return out

    def catch_up(self, rows: RunningRows, i: int) -> None:
        """Bring row ``i``'s tracker and item up to date (``WalkTracker.catch_up_rows``)."""
        item, seen = rows.items[i], rows.seen[i]
        if item.iteration != seen:
            item.inputs = rows.walks[i].tracker.catch_up_rows(
                item.node, seen, item.iteration, row_outputs(rows.outputs, rows.rows[i]))
            if item.chunks:
                item.chunks = {}
            rows.seen[i] = item.iteration

    def ended(self, base: str) -> None:
        """No row of the module goes on."""
        del self.modules[base]

    def before(self, msg: Any) -> None:
        """A message reached the worker: end every module's rows if handling it may look at one of
        their walks or items. A request's messages touch only that request's state (a new request's
        items end the rows at the next step instead, the batch being another), and a walk's messages
        (its start, nodes and results, its stream's items and end) only its partition's: the items
        the rows stream to another partition of their requests leave them as they are. Others
        (stats and trace requests aside) are taken to touch anything."""
        rid = getattr(msg, "request_id", None)
        if rid is None:
            if not isinstance(msg, (StatsRequest, TraceRequest)):
                self.dissolve()
            return
        walk_msg = type(msg) in _WALK_MESSAGES
        for rows in self.modules.values():
            if rid in rows.request_ids and not (walk_msg and msg.partition not in rows.partitions):
                self.dissolve()
                return

    def dissolve(self, base: str | None = None) -> None:
        """End a module's running rows (every module's when ``base`` is None): every row's tracker
        and item up to date."""
        for b in [base] if base is not None else list(self.modules):
            rows = self.modules.pop(b, None)
            if rows is None:
                continue
            for i, w in enumerate(rows.walks):
                if w.live:
                    try:
                        self.catch_up(rows, i)
                    except Exception as e:  # noqa: BLE001 - one request's error must not stop the worker
                        self._fail(rows.items[i].request_id, describe(e), FailureKind.of(e))
