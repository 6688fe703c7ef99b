"""The *postprocess* part of a worker's step: the one place where what a forward (or a message)
caused leaves the worker. A batch's results go to their walks' trackers (here, or as a
``NodeResult`` to the walk's home rank); the trackers' ``Effects`` become client values (gathered,
sent as one ``Emits`` before the next message to the conductor), stream pushes to consumer
partitions, ready nodes queued here or sent to their rank, and walk ends.

A self-loop's usual iteration (an AR decode step) skips the tracker's general routing: the rows
that go on send their client values as one ``EmitRows`` per output and their stream items, and each
item is queued again as its next iteration (``_rows_values``), whether the forward was a general one
(``results``: each row's tracker has moved on) or the module's running rows' (``rows_ran``,
``runtime/running_rows.py``: the trackers catch up later).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

from mstar.runtime.failures import FailureKind, describe
from mstar.runtime.keys import PartitionKey, StreamKey, encode_counts
from mstar.runtime.routing import Routing
from mstar.runtime.running_rows import RunningRows, RunningSet, row_outputs
from mstar.runtime.scheduling import RankScheduler
from mstar.runtime.self_loops import NextIteration
from mstar.runtime.streams import StreamInbox
from mstar.runtime.walk_records import Effects, ReadyNode
from mstar.runtime.walk_table import LiveWalk, WalkTable
from mstar.runtime.wire.messages import (
    CONDUCTOR,
    Emit,
    EmitRows,
    Emits,
    ExecNode,
    NodeResult,
    PartitionReady,
    StreamPush,
    WalkDone,
)
from mstar.runtime.work_items import DEFERRED, ItemError, WorkItem, as_values

log = logging.getLogger(__name__)

__all__ = ["Postprocess"]


class _GoingOn(NamedTuple):
    """A row of a general forward that goes on to its self-loop's next iteration and sends values."""

    item: WorkItem
    walk: LiveWalk
    nxt: NextIteration
    out: dict[str, Any]


def _chunk_info(chunk) -> dict[str, Any]:
    return {"start": chunk.start, "new_start": chunk.new_start, "is_final": chunk.is_final}


class Postprocess:
    """Applies a rank's results (module docstring). ``fail(rid, error, kind)`` fails a request alone
    (the worker frees it everywhere on the rank)."""

    def __init__(self, rank: int, routing: Routing, transport: Any, walks: WalkTable, inbox: StreamInbox,
                 sched: RankScheduler, fail: Callable[[str, str, FailureKind], None]) -> None:
        self.rank, self.routing, self.transport = rank, routing, transport
        self.walks, self.inbox, self.sched, self.fail = walks, inbox, sched, fail
        self._emits: list[Emit | EmitRows] = []  # this step's values for clients, sent as one Emits

    # -- to the conductor ----------------------------------------------------------------------
    def emit(self, value: Emit | EmitRows) -> None:
        """Gather a value for clients: sent, with the others of this step, before the next message."""
        self._emits.append(value)

    def tell(self, msg: Any) -> None:
        """Send ``msg`` to the conductor after the values for clients gathered so far."""
        self.flush()
        self.transport.send(CONDUCTOR, msg)

    def flush(self) -> None:
        if self._emits:
            self.transport.send(CONDUCTOR, Emits(self._emits))
            self._emits = []

    def guarded(self, rid: str, fn: Callable[[], None]) -> None:
        """Run ``fn``; an error in it fails request ``rid`` alone."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one request's error must not stop the worker
            log.debug("request %s failed", rid, exc_info=True)
            self.fail(rid, describe(e), FailureKind.of(e))

    # -- a batch's results -----------------------------------------------------------------------
    def results(self, batch: list[WorkItem], results: list) -> tuple[list[WorkItem], list[LiveWalk]]:
        """Hand each item's outputs on (a general forward's: one result per item); returns the items
        requeued as their self-loop's next iteration, and their walks."""
        rank, walks = self.rank, self.walks
        continued: list[WorkItem] = []
        continued_walks: list[LiveWalk] = []
        sending: list[_GoingOn] = []  # the rows going on that send values
        for item, out in zip(batch, results):
            if out is DEFERRED:
                continue
            if isinstance(out, ItemError):
                log.debug("request %s failed: %s", item.request_id, "".join(traceback.format_exception(out)))
                self.fail(item.request_id, str(out), out.kind)
            elif item.home == rank:
                w = item.walk_ref or walks.get(item.walk_key)
                if w is None or not w.live:
                    continue
                try:
                    nxt = w.tracker.continue_self_loop(item.node, item.iteration, out)
                    if nxt is None:
                        self.apply(w, w.tracker.node_done(item.node, item.iteration, out))
                        continue
                except Exception as e:  # noqa: BLE001 - one request's error must not stop the worker
                    self.fail(item.request_id, describe(e), FailureKind.of(e))
                    continue
                if nxt.emits or nxt.streams:
                    sending.append(_GoingOn(item, w, nxt, out))
                item.seq, item.iteration, item.inputs = next(self.sched.seqs), nxt.iteration, nxt.inputs
                if item.chunks:
                    item.chunks = {}
                self.sched.enqueue(item)
                continued.append(item)
                continued_walks.append(w)
            else:
                self.transport.send(item.home, NodeResult(item.request_id, item.partition, item.walk_seq,
                                                          item.node, item.iteration, out))
        if sending:
            self._sent_on(sending)
        return continued, continued_walks

    def _sent_on(self, sending: list[_GoingOn]) -> None:
        """The values of ``results``' rows that go on, one node's rows at a time (a batch usually
        holds one node's)."""
        by_node: dict[str, list[_GoingOn]] = {}
        for g in sending:
            by_node.setdefault(g.item.node, []).append(g)
        for node, rows in by_node.items():
            nxt = rows[0].nxt
            self._rows_values([g.item for g in rows], [g.walk for g in rows], node, nxt.emits, nxt.streams,
                              lambda name, rows=rows: [g.out[name] for g in rows])

    def rows_ran(self, running: RunningSet, rows: RunningRows, out: dict[str, list]) -> None:
        """A forward of a module's running rows (``run_rows``: ``out`` is the module's outputs, a row
        each): the rows that leave (a stop, the loop's bound, their walk ended) are caught up and
        handed to their trackers; the others send their values and go on."""
        items, walks, n = rows.items, rows.walks, len(rows.items)
        leaving = rows.leaving(out) if out.keys() >= rows.needs else list(range(n))
        if not leaving and rows.all_live(self.walks.ended):  # the usual step: every row goes on
            keep = None
            rids, names = rows.request_id_list, rows.walk_names
            if rids is None:
                rids = rows.request_id_list = [it.request_id for it in items]
                names = rows.walk_names = [w.walk for w in walks]
            values = out.__getitem__
        else:
            leave, keep = set(leaving), []
            for i, w in enumerate(walks):
                if w.live and i in leave:
                    self._leave(running, rows, i, out)
                elif w.live:
                    keep.append(i)
            if not keep:
                running.ended(rows.base)
                return
            items, walks = [items[i] for i in keep], [walks[i] for i in keep]
            rids, names = [it.request_id for it in items], [w.walk for w in walks]
            values = lambda name: [out[name][i] for i in keep]  # noqa: E731
        bound = rows.bound
        self._rows_values(items, walks, items[0].node, bound.emits, bound.streams, values, rids, names)
        if rows.exits is not None:  # each row's values of the loop's exits
            exits = rows.exits if keep is None else [rows.exits[i] for i in keep]
            for ex, vals in zip(exits, zip(*[values(name) for name in bound.exits])):
                ex.add(vals)
        seq, now = self.sched.seqs, self.sched.policy.now()  # each item requeued (``ModuleScheduler.stamp``)
        if rows.flat:  # a top-level loop's iterations: (i,) -> (i + 1,)
            for item in items:
                item.seq, item.iteration, item.queued_at = next(seq), (item.iteration[0] + 1,), now
        else:
            for item in items:
                it = item.iteration
                item.seq, item.iteration, item.queued_at = next(seq), (*it[:-1], it[-1] + 1), now
        self.sched.queues[rows.base].extend(items)
        rows.kept(keep if keep is not None else list(range(n)), out)

    def _rows_values(self, items: list[WorkItem], walks: list[LiveWalk], node: str,
                     emits: tuple[tuple[str, str | None], ...], streams: tuple, values: Callable[[str], list],
                     rids: list[str] | None = None, names: list[str] | None = None) -> None:
        """The client values (one ``EmitRows`` per output) and stream items of rows going on:
        ``values(name)`` is an output's value per row."""
        if emits and len(items) == 1 and rids is None:  # one row: an Emit (no row list for the conductor to look up)
            rid, walk = items[0].request_id, walks[0].walk
            for name, modality in emits:
                value = as_values(values(name)[0])
                if value:
                    self._emits.append(Emit(rid, name, value, modality, node, walk))
        elif emits:
            if rids is None:
                rids, names = [it.request_id for it in items], [w.walk for w in walks]
            for name, modality in emits:
                self._emits.append(EmitRows(rids, names, name, modality, node, list(values(name))))
        for st in streams:  # each row's items of a stream to another partition
            for w, value in zip(walks, values(st.name)):
                if sent := list(value):  # (as the tracker routes it; none: nothing this step)
                    self.push(w, st.partition, st.node, st.name, sent)

    def _leave(self, running: RunningSet, rows: RunningRows, i: int, out: dict[str, list]) -> None:
        """Row ``i``'s iteration ended its running: catch its tracker up, then hand it the iteration."""
        item, w = rows.items[i], rows.walks[i]
        try:
            running.catch_up(rows, i)
            self.apply(w, w.tracker.node_done(item.node, item.iteration, row_outputs(out, i)))
        except Exception as e:  # noqa: BLE001 - one request's error must not stop the worker
            self.fail(item.request_id, describe(e), FailureKind.of(e))

    # -- a tracker's effects ---------------------------------------------------------------------
    def apply(self, w: LiveWalk, fx: Effects) -> None:
        """Carry out what a tracker call caused: the one place a walk's values leave the tracker."""
        rid = w.key.request_id
        for e in fx.emits:
            self._emits.append(Emit(rid, e.name, e.value, e.modality, e.node, w.walk))
        if fx.state:
            w.state.update(fx.state)
        for p in fx.pushes:
            if p.items:  # (none: nothing to stream this step, e.g. a token that carries no audio)
                self.push(w, p.partition, p.node, p.name, p.items)
        if fx.ready:
            self._dispatch(w, fx.ready)
        if fx.done:
            self._walk_done(w)

    def push(self, w: LiveWalk, partition: str, node: str, name: str, items: list) -> None:
        """Stream ``items`` (not empty) of walk ``w`` to input ``name`` of ``node`` in ``partition``, at
        the walk's next offset of that stream."""
        skey = StreamKey(partition, node, name)
        offset = w.offsets.get(skey, 0) + w.pushed[skey]
        w.pushed[skey] += len(items)
        self.transport.send(self.routing.partition_home[partition],
                            StreamPush(w.key.request_id, w.key.partition, partition, node, name, items, offset))

    def _dispatch(self, w: LiveWalk, ready: list[ReadyNode]) -> None:
        rid, partition, walk_seq = w.key
        rank, seqs = self.rank, self.sched.seqs
        for r in ready:
            chunks = {k: _chunk_info(c) for k, c in r.stream_chunks.items()} if r.stream_chunks else {}
            target = self.routing.rank_of(r.node, w.walk)
            if target == rank:
                self.sched.enqueue(WorkItem(next(seqs), rid, partition, w.walk, walk_seq, r.node, r.iteration,
                                            r.inputs, chunks, w.params, rank, walk_ref=w))
            else:
                self.transport.send(target, ExecNode(rid, partition, w.walk, walk_seq, r.node, r.iteration,
                                                     r.inputs, chunks, w.params, rank))

    def _walk_done(self, w: LiveWalk) -> None:
        if self.walks.drop(w.key) is None:
            return
        rid, partition, _ = w.key
        self.tell(WalkDone(rid, partition, w.walk, w.state, encode_counts(w.pushed), w.tracker.finish))
        pkey = PartitionKey(rid, partition)
        if self.inbox.walk_ended(pkey):
            self.streams_changed(pkey)

    def streams_changed(self, pkey: PartitionKey) -> None:
        """New stream items (or a stream's end) for a consumer partition: wake its waiting walks, or
        tell the conductor that the idle partition has work."""
        for w in self.walks.of_partition(pkey):
            if w.tracker.waiting_on_stream:
                self.guarded(pkey.request_id, lambda ww=w: self.apply(ww, ww.tracker.stream_ready()))
        done = self.inbox.notice(pkey)
        if done is not None:
            self.tell(PartitionReady(pkey.request_id, pkey.partition, done))
