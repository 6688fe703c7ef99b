"""The rows of a module that decode in lockstep: a worker's steady decode path.

After a forward, the items whose walk simply goes on (``WalkTracker.continue_self_loop``: the next
iteration of an AR decode step, nothing routed but client values) are requeued as they are. When
every one of them can go on without the tracker (``WalkTracker.lockstep_bound``) and the engine can
make their next batch from the last one (``KVCacheEngine.decode_rows``), they form a
``DecodeCohort``. While the module's next batch is exactly the cohort, ``Lockstep`` (the worker's
part that keeps the cohorts) runs it through ``KVCacheEngine.run_rows`` and, per row, only sends the
client values (and the items it streams to another partition, an AR step's states for a talker or
its audio tokens for a codec) and requeues the item: the rows' trackers, and their items' inputs,
are not touched.
They are caught up (``WalkTracker.advance_self_loop``) when a row leaves (a stop, the loop's bound)
and, for every row, before anything else may look at them: a message reaching the worker for one of
their requests (other than one for another partition of it: the rows' own stream pushes), a batch
that is not the cohort. A loop with exits (a code predictor's, nested in its talker's loop) gets
each lockstep iteration's exit values as it runs (``WalkTracker.lockstep_exits``): those are what
its end routes on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mstar.runtime.failures import FailureKind, describe
from mstar.runtime.self_loops import LockstepBound, LoopExits
from mstar.runtime.walk_records import read_stop
from mstar.runtime.wire.messages import (
    Emit,
    EmitRows,
    ExecNode,
    NodeResult,
    StartWalk,
    StatsRequest,
    StreamEnd,
    StreamPush,
)
from mstar.runtime.work_items import WorkItem, as_values

if TYPE_CHECKING:
    from mstar.runtime.postprocess import Postprocess
    from mstar.runtime.scheduling import RankScheduler
    from mstar.runtime.walk_table import WalkTable

__all__ = ["DecodeCohort", "Lockstep", "row_outputs"]

# messages that touch one partition of a request (their ``partition``) and nothing else
_WALK_MESSAGES = frozenset({StartWalk, ExecNode, NodeResult, StreamPush, StreamEnd})


def row_outputs(out: dict[str, list], row: int) -> dict[str, list]:
    """One row's outputs from a forward's (``StatelessEngine._rows`` for a single row)."""
    return {name: as_values(vals[row]) for name, vals in out.items()}


@dataclass(slots=True)
class DecodeCohort:
    """The queued items of one module that go on in lockstep, in queue order."""

    base: str  # the module
    items: list[WorkItem]
    walks: list[Any]  # each item's walk record (``LiveWalk``)
    seen: list[tuple[int, ...]]  # per item: the iteration its tracker saw start
    rows: list[int]  # per item: its row in ``outputs``
    outputs: dict[str, list]  # the last forward's outputs: the rows' trackers have not seen them
    bound: LockstepBound  # of the first row; every row's node is the same
    steps_left: int  # lockstep forwards every row may still take before a loop's bound
    request_ids: set[str]  # of every row it started with (a message for one ends the cohort)
    needs: frozenset[str]  # the outputs every row's node must return
    flat: bool  # every row's loop is a top-level one (its iterations are ``(i,)``)
    request_id_list: list[str] | None = None  # per item (made at the first usual step; replaced, never changed)
    walk_names: list[str] | None = None  # per item: its walk's name (ditto)
    ended_seen: int = -1  # the walk table's ``ended`` when every row's walk was last seen live
    exits: list[LoopExits] | None = None  # per item, when the loop has exits: where its iterations' values go
    partitions: frozenset[str] = frozenset()  # of every row's walk (``Lockstep.before``)

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


class Lockstep:
    """A worker's cohorts (one per module at most) and the steps it runs through them: a part of the
    ``Worker`` (``worker.lockstep``), using the rank's engines, its queues (``RankScheduler``), its
    walk table (``ended``) and the one place results leave it (``Postprocess``)."""

    def __init__(self, engines: Mapping[str, Any], sched: RankScheduler, post: Postprocess,
                 walks: WalkTable) -> None:
        self.engines, self.sched, self.post, self.walks = engines, sched, post, walks
        self.cohorts: dict[str, DecodeCohort] = {}

    def form(self, base: str, items: list[WorkItem], walks: list[Any]) -> None:
        """Make the requeued continuations of a forward (``items``, with their walks) a cohort when
        all of them may go on in lockstep."""
        eng = self.engines[base]
        if not getattr(eng, "continues_batches", False):
            return
        found = eng.decode_rows(items)
        if found is None:
            return
        rows, outputs = found
        first = items[0]
        bound = walks[0].tracker.lockstep_bound(first.node, first.iteration)
        if bound is None:
            return
        steps = bound.steps_left
        for it, w in zip(items, walks):
            b = w.tracker.lockstep_bound(it.node, it.iteration)
            if it.node != first.node or b is None or b.stop_signal != bound.stop_signal \
                    or b.defer_stop_check != bound.defer_stop_check or b.emits != bound.emits \
                    or b.streams != bound.streams:
                return
            steps = min(steps, b.steps_left)
        exits = None
        if bound.exits:
            exits = [w.tracker.lockstep_exits(it.node, it.iteration) for it, w in zip(items, walks)]
            if None in exits:
                return
        self.cohorts[base] = DecodeCohort(base, items, walks, [it.iteration for it in items], rows, outputs,
                                          bound, steps, {it.request_id for it in items}, frozenset(bound.outputs),
                                          all(len(it.iteration) == 1 for it in items), exits=exits,
                                          partitions=frozenset(w.key.partition for w in walks))

    def run(self, base: str, batch: list[WorkItem]) -> bool:
        """Run ``batch`` (the module's next batch) in lockstep if it is the module's cohort: True when
        done. Otherwise the cohort ends (its rows caught up) and the worker runs the batch."""
        cohort = self.cohorts[base]
        if cohort.is_batch(batch) and self._step(cohort):
            return True
        self.dissolve(base)
        return False

    def _step(self, cohort: DecodeCohort) -> bool:
        """One forward of the cohort (the module's whole batch); False, with nothing changed, when it
        cannot run that way."""
        sched, base = self.sched, cohort.base
        if cohort.steps_left <= 0 or not sched.admission.unhindered(base):
            return False
        out = self.engines[base].run_rows(cohort.items, cohort.rows)
        if out is None:
            return False
        sched.admission.stalled.clear()
        n = len(cohort.items)
        sched.batch_hist[base][n] += 1
        leaving = cohort.leaving(out) if out.keys() >= cohort.needs else list(range(n))
        columns = [(name, modality, out[name]) for name, modality in cohort.bound.emits]
        if not leaving and (self.walks.ended == cohort.ended_seen or self._all_live(cohort)):
            self._all_go_on(cohort, out, columns)
        else:
            self._some_go_on(cohort, out, columns, leaving)
        return True

    def _all_go_on(self, cohort: DecodeCohort, out: dict[str, list], columns: list[tuple[str, Any, list]]) -> None:
        """The usual step: every row sends its values and goes on."""
        post, sched, items, walks, n = self.post, self.sched, cohort.items, cohort.walks, len(cohort.items)
        rids, names = cohort.request_id_list, cohort.walk_names
        if rids is None:
            rids = cohort.request_id_list = [it.request_id for it in items]
            names = cohort.walk_names = [w.walk for w in walks]
        node = items[0].node
        for name, modality, col in columns:  # one message per output, for every row
            post.emit(EmitRows(rids, names, name, modality, node, list(col)))
        for st in cohort.bound.streams:  # each row's items of a stream to another partition
            push = post.push
            for w, value in zip(walks, out[st.name]):
                if sent := list(value):  # (as the tracker routes it; none: nothing this step)
                    push(w, st.partition, st.node, st.name, sent)
        if cohort.exits is not None:  # each row's values of the loop's exits
            for ex, values in zip(cohort.exits, zip(*[out[name] for name in cohort.bound.exits])):
                ex.add(values)
        seq, now = sched.seqs, sched.policy.now()  # each item requeued (``ModuleScheduler.stamp``)
        if cohort.flat:  # a top-level loop's iterations: (i,) -> (i + 1,)
            for item in items:
                item.seq, item.iteration, item.queued_at = next(seq), (item.iteration[0] + 1,), now
        else:
            for item in items:
                it = item.iteration
                item.seq, item.iteration, item.queued_at = next(seq), (*it[:-1], it[-1] + 1), now
        sched.queues[cohort.base].extend(items)
        if len(cohort.rows) != n or cohort.rows[-1] != n - 1:  # rows ascend: this is range(n)
            cohort.rows = list(range(n))
        cohort.outputs = out
        cohort.steps_left -= 1

    def _some_go_on(self, cohort: DecodeCohort, out: dict[str, list], columns: list[tuple[str, Any, list]],
                    leaving: list[int]) -> None:
        """Rows ``leaving`` (and those whose walk ended) leave the cohort; the others send their values
        one by one and go on. The cohort ends when no row is left."""
        post, sched, items, walks = self.post, self.sched, cohort.items, cohort.walks
        kept_items, kept_walks, kept_seen, kept_rows = [], [], [], []
        exits, kept_exits = cohort.exits, []
        leave = iter(leaving)
        next_leave = next(leave, -1)
        for i, item in enumerate(items):
            w = walks[i]
            if i == next_leave:
                next_leave = next(leave, -1)
                if w.live:
                    self._leave(cohort, i, out)
                continue
            if not w.live:
                continue
            rid, node = item.request_id, item.node
            for name, modality, col in columns:
                if value := as_values(col[i]):
                    post.emit(Emit(rid, name, value, modality, node, w.walk))
            for st in cohort.bound.streams:
                if sent := list(out[st.name][i]):
                    post.push(w, st.partition, st.node, st.name, sent)
            if exits is not None:
                exits[i].add([out[name][i] for name in cohort.bound.exits])
                kept_exits.append(exits[i])
            it = item.iteration
            item.seq, item.iteration = next(sched.seqs), (*it[:-1], it[-1] + 1)
            sched.enqueue(item)
            kept_items.append(item)
            kept_walks.append(w)
            kept_seen.append(cohort.seen[i])
            kept_rows.append(i)
        if not kept_items:
            del self.cohorts[cohort.base]
            return
        cohort.items, cohort.walks, cohort.seen, cohort.rows = kept_items, kept_walks, kept_seen, kept_rows
        if exits is not None:
            cohort.exits = kept_exits
        cohort.request_id_list = cohort.walk_names = None
        cohort.outputs = out
        cohort.steps_left -= 1

    def _all_live(self, cohort: DecodeCohort) -> bool:
        """Every row's walk is live (looked at again only after some walk of the worker ended)."""
        if not all(w.live for w in cohort.walks):
            return False
        cohort.ended_seen = self.walks.ended
        return True

    def _catch_up(self, cohort: DecodeCohort, i: int) -> None:
        """Bring row ``i``'s tracker and item up to date (``WalkTracker.advance_self_loop``)."""
        item, seen = cohort.items[i], cohort.seen[i]
        if item.iteration != seen:
            item.inputs = cohort.walks[i].tracker.advance_self_loop(
                item.node, seen, item.iteration, row_outputs(cohort.outputs, cohort.rows[i]))
            if item.chunks:
                item.chunks = {}
            cohort.seen[i] = item.iteration

    def _leave(self, cohort: DecodeCohort, i: int, out: dict[str, list]) -> None:
        """Row ``i``'s iteration ended its lockstep: catch its tracker up, then hand it the iteration."""
        post, item, w = self.post, cohort.items[i], cohort.walks[i]
        try:
            self._catch_up(cohort, i)
            post.apply(w, w.tracker.node_done(item.node, item.iteration, row_outputs(out, i)))
        except Exception as e:  # noqa: BLE001 - one request's error must not stop the worker
            post.fail(item.request_id, describe(e), FailureKind.of(e))

    def before(self, msg: Any) -> None:
        """A message reached the worker: end every cohort if handling it may look at one of their walks
        or items. A request's messages touch only that request's state (a new request's items end the
        cohort at the next step instead, the batch being another), and a walk's messages (its start,
        nodes and results, its stream's items and end) only its partition's: the items a cohort's rows
        stream to another partition of their requests leave the cohort as it is. Others (stats aside)
        are taken to touch anything."""
        rid = getattr(msg, "request_id", None)
        if rid is None:
            if not isinstance(msg, StatsRequest):
                self.dissolve()
            return
        walk_msg = type(msg) in _WALK_MESSAGES
        for c in self.cohorts.values():
            if rid in c.request_ids and not (walk_msg and msg.partition not in c.partitions):
                self.dissolve()
                return

    def dissolve(self, base: str | None = None) -> None:
        """End a module's cohort (every cohort when ``base`` is None): every row's tracker and item up
        to date."""
        for b in [base] if base is not None else list(self.cohorts):
            cohort = self.cohorts.pop(b, None)
            if cohort is None:
                continue
            for i, w in enumerate(cohort.walks):
                if w.live:
                    self.post.guarded(cohort.items[i].request_id, lambda c=cohort, i=i: self._catch_up(c, i))
