"""The *postprocess* part of a worker's step: the one place where what a forward (or a message)
caused leaves the worker. A batch's results go to their walks' trackers (here, or as a
``NodeResult`` to the walk's home rank); the trackers' ``Effects`` become client values (gathered,
sent as one ``Emits`` before the next message to the conductor), stream pushes to consumer
partitions, ready nodes queued here or sent to their rank, and walk ends. A self-loop's usual
iteration (an AR decode step) skips the tracker's general routing: ``go_on`` sends its client values
and streams and queues the same item as the next iteration; the decode rows
(``runtime/decode_rows.py``) do the same for rows that go on in lockstep, through ``emit`` and
``push``.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

from mstar.runtime.failures import FailureKind, describe
from mstar.runtime.keys import PartitionKey, StreamKey, encode_counts
from mstar.runtime.routing import Routing
from mstar.runtime.scheduling import RankScheduler
from mstar.runtime.self_loops import Continued
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
from mstar.runtime.work_items import DEFERRED, ItemError, WorkItem

log = logging.getLogger(__name__)

__all__ = ["Postprocess"]


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
        """Hand each item's outputs on; returns the items requeued as their self-loop's next
        iteration, and their walks."""
        rank, walks = self.rank, self.walks
        continued: list[WorkItem] = []
        continued_walks: list[LiveWalk] = []
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
                    c = w.tracker.continue_self_loop(item.node, item.iteration, out)
                    if c is None:
                        self.apply(w, w.tracker.node_done(item.node, item.iteration, out))
                    else:
                        self.go_on(item, w, out, c)
                        continued.append(item)
                        continued_walks.append(w)
                except Exception as e:  # noqa: BLE001 - one request's error must not stop the worker
                    self.fail(item.request_id, describe(e), FailureKind.of(e))
            else:
                self.transport.send(item.home, NodeResult(item.request_id, item.partition, item.walk_seq,
                                                          item.node, item.iteration, out))
        return continued, continued_walks

    def go_on(self, item: WorkItem, w: LiveWalk, out: dict[str, Any], c: Continued) -> None:
        """The usual self-loop iteration: its client values and stream items, and the same item
        queued as the next iteration."""
        rid = item.request_id
        for name, modality in c.emits:
            value = out[name]
            if not (type(value) is list and not value):
                self._emits.append(Emit(rid, name, value, modality, item.node, w.walk))
        for st in c.streams:
            items = list(out[st.name])  # as the tracker routes a stream's values
            if items:
                self.push(w, st.partition, st.node, st.name, items)
        item.seq, item.iteration, item.inputs = next(self.sched.seqs), c.iteration, c.inputs
        if item.chunks:
            item.chunks = {}
        self.sched.enqueue(item)

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
        self.tell(WalkDone(rid, partition, w.walk, w.state, encode_counts(w.pushed)))
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
