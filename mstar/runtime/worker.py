"""A worker: one per rank. Holds the submodules placed on its rank, runs walks, batches nodes.

The worker routes messages to small owners and runs one step path:

* **schedule** (``RankScheduler``, ``scheduling.py``): the module to run next and its batch, KV
  admission and preemption (``kv/admission.py``; ARCHITECTURE.md, "KV pressure: admission and
  preemption"): an item that cannot get its KV blocks waits in its queue instead of failing; when
  nothing of a module can run, the oldest waiting request is made to progress by swapping out the
  youngest request holding blocks;
* **run**: one batched forward of the module's engine: ``run_rows`` when the batch is exactly the
  module's running rows (``RunningSet``, ``running_rows.py``: self-loop iterations that go on
  together), else ``run``;
* **postprocess** (``Postprocess``, ``postprocess.py``): the one place results leave the worker
  (client values, stream pushes, loop continuations, ready nodes, walk ends).

Its other owners: the live walks (``WalkTable``), the stream buffers of partitions homed here
(``StreamInbox``), KV moved between ranks (``KVMover``) and, on a tensor-parallel rank, its
follower and stats barrier (``TPRank``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from mstar.model.base import ModelDef
from mstar.runtime.failures import FailureKind
from mstar.runtime.keys import PartitionKey, decode_counts
from mstar.runtime.kv_mover import KVMover
from mstar.runtime.postprocess import Postprocess
from mstar.runtime.routing import Routing
from mstar.runtime.running_rows import RunningSet
from mstar.runtime.scheduling import ModuleScheduler, RankScheduler, module_stages
from mstar.runtime.streams import StreamInbox
from mstar.runtime.tp.follower import TPRank
from mstar.runtime.tp.groups import TPContext
from mstar.runtime.trace import NodeRuns, SentBytes
from mstar.runtime.walk_table import LiveWalk, WalkTable
from mstar.runtime.walk_tracker import WalkTracker
from mstar.runtime.wire.messages import (
    ExecNode,
    FreeRequest,
    NodeResult,
    RequestFailed,
    Shutdown,
    StartWalk,
    StatsReply,
    StatsRequest,
    StreamEnd,
    StreamPush,
    TraceReply,
    TraceRequest,
)
from mstar.runtime.work_items import DEFERRED, WorkItem
from mstar.runtime.worker_engines import build_engines

__all__ = ["Worker"]


class Worker:
    def __init__(self, rank: int, model: ModelDef, routing: Routing, transport, device: str = "cpu",
                 tp: TPContext | None = None) -> None:
        keep = routing.placement.limits.trace_requests
        self.trace = NodeRuns(rank, keep) if keep else None  # trace.py: each request's node runs here
        if self.trace is not None:  # and the tensor bytes sent to other ranks per request
            transport = SentBytes(transport, rank, self.trace.notes_of("sent"))
        self.rank, self.model, self.routing, self.transport = rank, model, routing, transport
        nodes = sorted(routing.placement.nodes_on(rank))
        built = build_engines(model, routing, nodes, device, tp, transport)  # worker_engines.py
        self.engines: dict[str, Any] = built.engines
        graph = routing.graph
        self.walks = WalkTable()
        self.inbox = StreamInbox(routing.producers, {p: routing.consumers_of(p) for p in graph.partitions},
                                 graph.root_partitions, routing.chunk_policy_factory)
        stages = module_stages(routing, model, set(nodes))
        policy = ModuleScheduler(routing.placement.limits, {b: stages.get(b, 0) for b in self.engines},
                                 lambda it: self.inbox.ahead(it.request_id, it.partition))
        self.sched = RankScheduler(rank, self.engines, {n: model.module_of(n) for n in nodes}, built.max_batch,
                                   policy, self.fail_request)
        self.queues, self.admission = self.sched.queues, self.sched.admission
        self.running_set = RunningSet(self.engines, self.sched, self.walks, self.fail_request)  # running_rows.py
        self.post = Postprocess(rank, routing, transport, self.walks, self.inbox, self.sched, self.fail_request)
        self.tp = TPRank(tp, built.shards, transport, self._reply_stats)
        if self.trace is not None:
            for base, eng in self.engines.items():
                eng.trace_note = self.trace.notes_of(base)
        self.running = True
        # requests already freed here: a message for one (sent before its sender learned of the end)
        # is dropped, so it cannot allocate KV blocks or buffers that nobody would free
        self._freed: OrderedDict[str, None] = OrderedDict()
        self._handlers = {StartWalk: self._start_walk, ExecNode: self._exec_node, NodeResult: self._node_result,
                          StreamPush: self._stream_push, StreamEnd: self._stream_end, FreeRequest: self._free_request,
                          StatsRequest: lambda m: self.tp.stats_requested(m.token), Shutdown: self._shutdown,
                          TraceRequest: self._trace_requested,
                          **KVMover(rank, self.engines, transport, self.post.guarded, self.fail_request,
                                    self.post.tell).handlers(),
                          **self.tp.handlers()}

    # -- messages ------------------------------------------------------------------------------
    def handle(self, msg: Any) -> None:
        try:
            if self.running_set.modules:
                self.running_set.before(msg)
            self._handle(msg)
        finally:
            self.post.flush()

    def _handle(self, msg: Any) -> None:
        rid = getattr(msg, "request_id", None)
        if rid is not None and rid in self._freed and not isinstance(msg, FreeRequest):
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise TypeError(f"worker {self.rank}: unexpected message {type(msg).__name__}")
        if rid is not None and not isinstance(msg, FreeRequest):
            self.admission.arrived(rid)
        self.admission.stalled.clear()  # anything may have freed blocks: try stalled modules again
        handler(msg)

    def _start_walk(self, msg: StartWalk) -> None:
        key = msg.walk_key
        buf = self.inbox.walk_started(PartitionKey(msg.request_id, msg.partition))

        def start():
            tracker = WalkTracker(self.routing.graph.plan(msg.walk), msg.inputs, buf)
            w = LiveWalk(key, tracker, msg.walk, msg.params, decode_counts(msg.stream_offsets))
            self.walks.add(w)
            self.post.apply(w, tracker.start())

        self.post.guarded(msg.request_id, start)

    def _exec_node(self, msg: ExecNode) -> None:
        self.sched.enqueue(WorkItem(next(self.sched.seqs), msg.request_id, msg.partition, msg.walk, msg.walk_seq,
                                    msg.node, tuple(msg.iteration), msg.inputs, msg.chunks, msg.params, msg.home))

    def _node_result(self, msg: NodeResult) -> None:
        w = self.walks.get(msg.walk_key)
        if w is not None:
            self.post.guarded(msg.request_id, lambda: self.post.apply(
                w, w.tracker.node_done(msg.node, tuple(msg.iteration), msg.outputs)))

    def _stream_push(self, msg: StreamPush) -> None:
        pkey = PartitionKey(msg.request_id, msg.partition)
        self.inbox.push(pkey, msg.from_partition, msg.node, msg.name, msg.items, msg.offset)
        self.post.streams_changed(pkey)

    def _stream_end(self, msg: StreamEnd) -> None:
        pkey = PartitionKey(msg.request_id, msg.partition)
        expected = {(k.node, k.name): n for k, n in decode_counts(msg.expected).items() if k.partition == msg.partition}
        self.inbox.end(pkey, msg.from_partition, expected)
        self.post.streams_changed(pkey)

    def _free_request(self, msg: FreeRequest) -> None:
        self._free(msg.request_id)
        if not msg.keep_trace and self.trace is not None:
            self.trace.forget(msg.request_id)
        for eng in self.engines.values():  # for good: a sharded engine's other shards drop what never arrived
            eng.forget(msg.request_id)
        self._freed[msg.request_id] = None
        if len(self._freed) > 100_000:
            self._freed.popitem(last=False)

    def _reply_stats(self, token: int) -> None:
        self.post.tell(StatsReply(token, self.rank, self.stats()))

    def _trace_requested(self, msg: TraceRequest) -> None:
        self.post.tell(TraceReply(msg.token, self.rank, self.trace.take(msg.request_ids) if self.trace else {}))

    def _shutdown(self, msg: Shutdown) -> None:
        self.running = False

    # -- the step --------------------------------------------------------------------------------
    def next_batch(self) -> tuple[str, list[WorkItem]] | None:
        return self.sched.next_batch()

    def step(self) -> bool:
        """Run one batched forward, if any work is queued. Returns whether anything changed."""
        try:
            return self._step()
        finally:
            self.post.flush()
            if self.trace is not None:  # the forward's outputs are sent: its postprocess's end
                self.trace.posted(time.monotonic())

    def _step(self) -> bool:
        picked = self.sched.next_batch()  # schedule
        if picked is None:
            return False
        base, batch = picked
        rows = self.running_set.of(base, batch) if base in self.running_set.modules else None
        trace = self.trace
        if trace is not None:
            started, wall = time.monotonic(), time.time()
        if rows is not None:  # the module's running rows
            out = self.running_set.run(rows)  # run
            if out is not None:
                if trace is not None:  # before postprocess moves the rows' iterations on
                    trace.record(rows.items, started, wall, time.monotonic() - started, self.engines[base])
                self.post.rows_ran(self.running_set, rows, out)  # postprocess
                return True
        results = self.admission.run(base, batch)  # run: any batch
        if results is None:
            if self.admission.relieve(base):
                return True
            self.admission.stalled.add(base)
            return self.sched.runnable()  # other modules may still run
        self.admission.stalled.clear()
        self.sched.batch_hist[base][sum(out is not DEFERRED for out in results)] += 1
        if trace is not None:
            trace.record([it for it, out in zip(batch, results) if out is not DEFERRED], started, wall,
                         time.monotonic() - started, self.engines[base])
        continued, walks = self.post.results(batch, results)  # postprocess
        if continued:
            self.running_set.form(base, continued, walks)
        return True

    # -- failures and cleanup --------------------------------------------------------------------
    def fail_request(self, rid: str, error: str, kind: FailureKind) -> None:
        self._free(rid)
        self.post.tell(RequestFailed(rid, error, kind))

    def _free(self, rid: str) -> None:
        self.walks.drop_request(rid)
        self.inbox.drop_request(rid)
        self.sched.drop_request(rid)
        for eng in self.engines.values():
            eng.free_request(rid)

    def stats(self) -> dict[str, Any]:
        kv = {b: e for b, e in self.engines.items() if e.holds_kv}
        return {
            "rank": self.rank,
            "queue_depth": {b: len(q) for b, q in self.queues.items()},
            "batch_sizes": {b: dict(sorted(h.items())) for b, h in self.sched.batch_hist.items()},
            "kv": {b: e.stats() for b, e in kv.items()},
            "waiting": {b: len(self.admission.waiting[b]) for b in kv},
            "preemptions": {b: e.preemptions for b, e in kv.items()},
            "walks": len(self.walks),
            "stream_buffers": len(self.inbox.buffers),
            "tensor_parallel": self.tp.stats(self.engines),
            "threads": _torch_threads(),  # the process's intra-op threads (placement ``threads``)
        }


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()
