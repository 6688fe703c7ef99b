"""A worker: one per rank. Holds the submodules placed on its rank, runs walks, batches nodes.

Main loop (``step``): pick the node queue whose oldest item waited longest -> run one batched
forward -> hand each result to its walk's tracker (here, or on the walk's home rank). Trackers
return ``Effects``; ``apply_effects`` is the one place where their consequences leave the worker
(emits and walk ends to the conductor, stream pushes to consumer partitions, ready nodes to
queues or to other ranks).

KV pressure (``kv/admission.py``; ARCHITECTURE.md, "KV pressure: admission and preemption"): an item
that cannot get its KV blocks waits in its queue instead of failing; when nothing of a module can
run, the oldest waiting request is made to progress by swapping out the youngest request holding
blocks.
"""

from __future__ import annotations

import itertools
import logging
import traceback
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from mstar.model.base import ModelDef
from mstar.runtime.decode_cohort import Lockstep
from mstar.runtime.engine import DEFERRED, ItemError, StatelessEngine, WorkItem
from mstar.runtime.failures import FailureKind, describe
from mstar.runtime.keys import PartitionKey, StreamKey, WalkKey, decode_counts, encode_counts
from mstar.runtime.kv.admission import KVAdmission
from mstar.runtime.kv.engine import KVCacheEngine
from mstar.runtime.routing import Routing
from mstar.runtime.scheduling import ModuleScheduler, module_stages
from mstar.runtime.streams import StreamBuffer, holds_chunks
from mstar.runtime.tp.follower import TPFollower, TPShard
from mstar.runtime.tp.groups import (
    StatsBarrier,
    TPCall,
    TPContext,
    TPLeaderEngine,
    TPLeaderKVEngine,
    TPStatsBarrier,
)
from mstar.runtime.walk_records import Effects, ReadyNode
from mstar.runtime.walk_tracker import WalkTracker
from mstar.runtime.wire.messages import (
    CONDUCTOR,
    Emit,
    EmitRows,
    Emits,
    ExecNode,
    FreeKV,
    FreeRequest,
    KVImport,
    KVMoved,
    MigrateKV,
    NodeResult,
    PartitionReady,
    RequestFailed,
    Shutdown,
    StartWalk,
    StatsReply,
    StatsRequest,
    StreamEnd,
    StreamPush,
    WalkDone,
)
from mstar.runtime.worker_engines import build_engines

log = logging.getLogger(__name__)


def _chunk_info(chunk) -> dict[str, Any]:
    return {"start": chunk.start, "new_start": chunk.new_start, "is_final": chunk.is_final}


@dataclass
class _Walk:
    key: WalkKey
    tracker: WalkTracker
    walk: str
    params: dict[str, Any]
    offsets: dict[StreamKey, int]  # items pushed by this partition's earlier walks
    state: dict[str, Any] = field(default_factory=dict)  # values routed TO_STATE
    pushed: Counter[StreamKey] = field(default_factory=Counter)  # items this walk pushed
    live: bool = True  # False once removed from Worker.walks (an item may still refer to it)


class Worker:
    def __init__(self, rank: int, model: ModelDef, routing: Routing, transport, device: str = "cpu",
                 tp: TPContext | None = None) -> None:
        self.rank = rank
        self.model = model
        self.routing = routing
        self.transport = transport
        self.tp = tp
        nodes = sorted(routing.placement.nodes_on(rank))
        built = build_engines(model, routing, nodes, device, tp, transport)  # worker_engines.py
        self.engines: dict[str, StatelessEngine] = built.engines
        self.following = built.following  # tensor-parallel modules this rank follows (runtime/tp/groups.py)
        self.max_batch = built.max_batch
        self.queues: dict[str, deque[WorkItem]] = {b: deque() for b in self.engines}
        self._queue_of = {node: self.queues[model.module_of(node)] for node in nodes}
        self.walks: dict[WalkKey, _Walk] = {}
        self._partition_walks: dict[PartitionKey, dict[WalkKey, _Walk]] = {}  # self.walks by request and partition
        self.walks_ended = 0  # walks made not live so far (a lockstep cohort rechecks its rows when it moves)
        self.streams: dict[PartitionKey, StreamBuffer] = {}
        self.seqs = itertools.count()
        self.running = True
        self.batch_hist: dict[str, Counter] = {b: Counter() for b in self.engines}
        # requests already freed here: a message for one (sent before its sender learned of the end)
        # is dropped, so it cannot allocate KV blocks or buffers that nobody would free
        self._freed: OrderedDict[str, None] = OrderedDict()
        self.admission = KVAdmission(self.engines, self.queues, self.fail_request)  # KV pressure (kv/admission.py)
        self._handlers = {StartWalk: self._start_walk, ExecNode: self._exec_node, NodeResult: self._node_result,
                          StreamPush: self._stream_push, StreamEnd: self._stream_end, FreeRequest: self._free_request,
                          MigrateKV: self._migrate_kv, FreeKV: self._free_kv, KVImport: self._import_kv,
                          StatsRequest: self._stats_request, Shutdown: self._shutdown, TPCall: self._tp_call,
                          TPStatsBarrier: self._tp_stats_barrier, TPShard: self._tp_shard}
        self._stats_barrier = StatsBarrier()
        self._emits: list[Emit] = []  # this step's values for clients, sent as one Emits (_tell)
        self.lockstep = Lockstep(self)  # per module, its rows decoding in lockstep (decode_cohort.py)
        stages = module_stages(routing, model, set(nodes))
        consumers = {p: sorted(routing.consumers_of(p)) for p in routing.graph.partitions}
        # an item is ahead (never overdue) while a consumer homed here holds its unconsumed chunks
        self.scheduler = ModuleScheduler(routing.placement.limits, {b: stages.get(b, 0) for b in self.engines},
                                         lambda it: holds_chunks(self.streams, it.request_id, it.partition,
                                                                 consumers.get(it.partition, ())))
        self._tp_follower = TPFollower(self.engines, transport, tp) if self.following else None

    # -- messages ------------------------------------------------------------------------------
    def _tell(self, msg: Any) -> None:
        """Send ``msg`` to the conductor after the values for clients gathered so far."""
        self._flush_emits()
        self.transport.send(CONDUCTOR, msg)

    def emit(self, value: Emit | EmitRows) -> None:
        """Gather a value for clients: sent, with the others of this step, before the next message."""
        self._emits.append(value)

    def _flush_emits(self) -> None:
        if self._emits:
            self.transport.send(CONDUCTOR, Emits(self._emits))
            self._emits = []

    def handle(self, msg: Any) -> None:
        try:
            if self.lockstep.cohorts:
                self.lockstep.before(msg)
            self._handle(msg)
        finally:
            self._flush_emits()

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
        pkey = PartitionKey(msg.request_id, msg.partition)
        buf = self.streams.get(pkey)
        if buf is None and msg.partition not in self.routing.graph.root_partitions:
            buf = self.streams.setdefault(pkey, StreamBuffer())
        if buf is not None:
            buf.walk_running = True
            buf.notified = False

        def start():
            tracker = WalkTracker(self.routing.graph.plan(msg.walk), msg.inputs, buf)
            w = self.walks[key] = _Walk(key, tracker, msg.walk, msg.params, decode_counts(msg.stream_offsets))
            self._partition_walks.setdefault(pkey, {})[key] = w
            self.apply_effects(w, tracker.start())

        self.guarded(msg.request_id, start)

    def _exec_node(self, msg: ExecNode) -> None:
        self.enqueue(WorkItem(next(self.seqs), msg.request_id, msg.partition, msg.walk, msg.walk_seq, msg.node,
                               tuple(msg.iteration), msg.inputs, msg.chunks, msg.params, msg.home))

    def _node_result(self, msg: NodeResult) -> None:
        if msg.walk_key in self.walks:
            self.guarded(msg.request_id, lambda: self._node_done(msg.walk_key, msg.node, tuple(msg.iteration),
                                                                  msg.outputs))

    def _stream_push(self, msg: StreamPush) -> None:
        buf = self.streams.setdefault(PartitionKey(msg.request_id, msg.partition), StreamBuffer())
        factory = self.routing.chunk_policy_factory(msg.from_partition, msg.partition, msg.name)
        buf.push(msg.node, msg.name, msg.from_partition, factory, msg.items, msg.offset)
        self._streams_changed(PartitionKey(msg.request_id, msg.partition))

    def _stream_end(self, msg: StreamEnd) -> None:
        pkey = PartitionKey(msg.request_id, msg.partition)
        expected = {(k.node, k.name): n for k, n in decode_counts(msg.expected).items() if k.partition == msg.partition}
        self.streams.setdefault(pkey, StreamBuffer()).end(msg.from_partition, expected)
        self._streams_changed(pkey)

    def _free_request(self, msg: FreeRequest) -> None:
        self._free(msg.request_id)
        for eng in self._tp_led():  # for good: followers drop shards of it that were never imported
            eng.tell("forget", msg.request_id)
        self._freed[msg.request_id] = None
        if len(self._freed) > 100_000:
            self._freed.popitem(last=False)

    def _migrate_kv(self, msg: MigrateKV) -> None:
        eng = self.engines.get(msg.module)
        if isinstance(eng, TPLeaderKVEngine):  # each follower sends its own shard
            eng.tell("migrate", msg.request_id, list(msg.dests), list(msg.tokens), msg.keep)
        caches = eng.export_request(msg.request_id, free=not msg.keep) if eng is not None else {}
        for dest, token in zip(msg.dests, msg.tokens):
            self.transport.send(dest, KVImport(msg.request_id, msg.module, caches, token))

    def _free_kv(self, msg: FreeKV) -> None:
        eng = self.engines.get(msg.module)
        if eng is not None:
            eng.free_request(msg.request_id)

    def _import_kv(self, msg: KVImport) -> None:
        eng = self.engines.get(msg.module)
        if isinstance(eng, TPLeaderKVEngine):
            self.guarded(msg.request_id, lambda: eng.import_shard(msg.request_id, msg.caches, msg.token))
        elif eng is not None:
            self.guarded(msg.request_id, lambda: eng.import_request(msg.request_id, msg.caches))
        elif msg.caches:
            self.fail_request(msg.request_id, f"rank {self.rank} received KV of {msg.module!r}, which it does not hold",
                       FailureKind.INTERNAL)
        self._tell(KVMoved(msg.request_id, msg.token))

    def _stats_request(self, msg: StatsRequest) -> None:
        if self.tp is not None:
            for rank in self.tp.followers:
                self.transport.send(rank, TPStatsBarrier(msg.token))
            if self.tp.follows and not self._stats_barrier.arrived(msg.token, from_leader=False):
                return  # answered when the leader's barrier arrives
        self._tell(StatsReply(msg.token, self.rank, self.stats()))

    def _tp_stats_barrier(self, msg: TPStatsBarrier) -> None:
        if self._stats_barrier.arrived(msg.token, from_leader=True):
            self._tell(StatsReply(msg.token, self.rank, self.stats()))

    def _tp_call(self, msg: TPCall) -> None:
        self._tp_follower.call(msg)

    def _tp_shard(self, msg: TPShard) -> None:
        self._tp_follower.shard(msg)

    def _tp_led(self) -> list:
        """The engines this rank leads a tensor-parallel group for."""
        return [e for e in self.engines.values() if isinstance(e, TPLeaderKVEngine | TPLeaderEngine)]

    def _shutdown(self, msg: Shutdown) -> None:
        self.running = False

    # -- walks ---------------------------------------------------------------------------------
    def apply_effects(self, w: _Walk, fx: Effects) -> None:
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

    def push(self, w: _Walk, partition: str, node: str, name: str, items: list) -> None:
        """Stream ``items`` (not empty) of walk ``w`` to input ``name`` of ``node`` in ``partition``, at
        the walk's next offset of that stream."""
        skey = StreamKey(partition, node, name)
        offset = w.offsets.get(skey, 0) + w.pushed[skey]
        w.pushed[skey] += len(items)
        self.transport.send(self.routing.partition_home[partition],
                            StreamPush(w.key.request_id, w.key.partition, partition, node, name, items, offset))

    def _dispatch(self, w: _Walk, ready: list[ReadyNode]) -> None:
        rid, partition, walk_seq = w.key
        rank = self.rank
        for r in ready:
            chunks = {k: _chunk_info(c) for k, c in r.stream_chunks.items()} if r.stream_chunks else {}
            target = self.routing.rank_of(r.node, w.walk)
            if target == rank:
                self.enqueue(WorkItem(next(self.seqs), rid, partition, w.walk, walk_seq, r.node, r.iteration,
                                       r.inputs, chunks, w.params, rank, walk_ref=w))
            else:
                self.transport.send(target, ExecNode(rid, partition, w.walk, walk_seq, r.node, r.iteration,
                                                     r.inputs, chunks, w.params, self.rank))

    def enqueue(self, item: WorkItem) -> None:
        q = self._queue_of.get(item.node)
        if q is None:
            raise RuntimeError(f"worker {self.rank} got node {item.node!r}, which is not placed on it")
        self.scheduler.stamp(item)
        q.append(item)

    def _node_done(self, key: WalkKey, node: str, vec: tuple, outputs: dict) -> None:
        w = self.walks.get(key)
        if w is not None:
            self.apply_effects(w, w.tracker.node_done(node, vec, outputs))

    def _drop_walk(self, key: WalkKey) -> _Walk | None:
        """Forget a walk (None: not known); ``self.walks`` and its index by partition together."""
        w = self.walks.pop(key, None)
        if w is not None:
            pkey = PartitionKey(key.request_id, key.partition)
            of_partition = self._partition_walks[pkey]
            del of_partition[key]
            if not of_partition:
                del self._partition_walks[pkey]
        return w

    def _walk_done(self, w: _Walk) -> None:
        if self._drop_walk(w.key) is None:
            return
        w.live = False
        self.walks_ended += 1
        rid, partition, _ = w.key
        self._tell(WalkDone(rid, partition, w.walk, w.state, encode_counts(w.pushed)))
        buf = self.streams.get(PartitionKey(rid, partition))
        if buf is not None:
            buf.walk_running = False
            self._streams_changed(PartitionKey(rid, partition))

    def _streams_changed(self, pkey: PartitionKey) -> None:
        """New stream items (or a stream's end) for a consumer partition: wake its waiting walks, or
        tell the conductor that the idle partition has work."""
        buf = self.streams[pkey]
        for w in list(self._partition_walks.get(pkey, {}).values()):  # not a scan of every walk: one a push
            if w.tracker.waiting_on_stream:
                self.guarded(pkey.request_id, lambda ww=w: self.apply_effects(ww, ww.tracker.stream_ready()))
        if buf.walk_running or buf.notified:
            return
        ended = buf.all_ended(self.routing.producers[pkey.partition])
        if buf.has_pending() or ended:
            buf.notified = True
            self._tell(PartitionReady(pkey.request_id, pkey.partition, ended and not buf.has_pending()))

    # -- execution -----------------------------------------------------------------------------
    def next_batch(self) -> tuple[str, list[WorkItem]] | None:
        """The next module to run (``ModuleScheduler``; modules stalled for KV blocks skipped) and its
        items, up to its batch limit."""
        base = self.scheduler.pick(self.queues, self.admission.stalled)
        if base is None:
            return None
        q = self.queues[base]
        return base, [q.popleft() for _ in range(min(len(q), self.max_batch[base]))]

    def _runnable(self) -> bool:
        return any(q and base not in self.admission.stalled for base, q in self.queues.items())

    def step(self) -> bool:
        """Run one batched forward, if any work is queued. Returns whether anything changed."""
        try:
            return self._step()
        finally:
            self._flush_emits()

    def _step(self) -> bool:
        picked = self.next_batch()
        if picked is None:
            return False
        base, batch = picked
        if base in self.lockstep.cohorts and self.lockstep.run(base, batch):
            return True
        results = self.admission.run(base, batch)
        if results is None:
            if self.admission.relieve(base):
                return True
            self.admission.stalled.add(base)
            return self._runnable()  # other modules may still run
        self.admission.stalled.clear()
        self.batch_hist[base][sum(out is not DEFERRED for out in results)] += 1
        rank, walks = self.rank, self.walks
        continued: list[WorkItem] = []  # items that are now their self-loop's next iteration, requeued
        continued_walks: list[_Walk] = []
        for item, out in zip(batch, results):
            if out is DEFERRED:
                continue
            if isinstance(out, ItemError):
                log.debug("request %s failed: %s", item.request_id, "".join(traceback.format_exception(out)))
                self.fail_request(item.request_id, str(out), out.kind)
            elif item.home == rank:
                w = item.walk_ref or walks.get(WalkKey(item.request_id, item.partition, item.walk_seq))
                if w is None or not w.live:
                    continue
                try:
                    c = w.tracker.continue_self_loop(item.node, item.iteration, out)
                    if c is None:
                        self.apply_effects(w, w.tracker.node_done(item.node, item.iteration, out))
                        continue
                    # the usual decode step: its client values, and the same item as the next iteration
                    rid = item.request_id
                    for name, modality in c.emits:
                        value = out[name]
                        if not (type(value) is list and not value):
                            self._emits.append(Emit(rid, name, value, modality, item.node, w.walk))
                    for st in c.streams:
                        items = list(out[st.name])  # as the tracker routes a stream's values
                        if items:
                            self.push(w, st.partition, st.node, st.name, items)
                    item.seq, item.iteration, item.inputs = next(self.seqs), c.iteration, c.inputs
                    if item.chunks:
                        item.chunks = {}
                    self.enqueue(item)
                    continued.append(item)
                    continued_walks.append(w)
                except Exception as e:  # noqa: BLE001 - one request's error must not stop the worker
                    self.fail_request(item.request_id, describe(e), FailureKind.of(e))
            else:
                self.transport.send(item.home, NodeResult(item.request_id, item.partition, item.walk_seq,
                                                          item.node, item.iteration, out))
        if continued:
            self.lockstep.form(base, continued, continued_walks)
        return True

    # -- failures and cleanup --------------------------------------------------------------------
    def guarded(self, rid: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one request's error must not stop the worker
            log.debug("request %s failed", rid, exc_info=True)
            self.fail_request(rid, describe(e), FailureKind.of(e))

    def fail_request(self, rid: str, error: str, kind: FailureKind) -> None:
        self._free(rid)
        self._tell(RequestFailed(rid, error, kind))

    def _free(self, rid: str) -> None:
        for key in [k for k in self.walks if k.request_id == rid]:
            self._drop_walk(key).live = False
            self.walks_ended += 1
        for key in [k for k in self.streams if k.request_id == rid]:
            del self.streams[key]
        for q in self.queues.values():
            if any(it.request_id == rid for it in q):
                kept = [it for it in q if it.request_id != rid]
                q.clear()
                q.extend(kept)
        for base, eng in self.engines.items():
            if base not in self.following:  # a follower's engine is freed by its leader only
                eng.free_request(rid)
        self.admission.forget(rid)

    def stats(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "queue_depth": {b: len(q) for b, q in self.queues.items()},
            "batch_sizes": {b: dict(sorted(h.items())) for b, h in self.batch_hist.items()},
            "kv": {b: e.stats() for b, e in self.engines.items() if isinstance(e, KVCacheEngine)},
            "waiting": {b: len(w) for b, w in self.admission.waiting.items()
                        if isinstance(self.engines[b], KVCacheEngine)},
            "preemptions": {b: e.preemptions for b, e in self.engines.items() if isinstance(e, KVCacheEngine)},
            "walks": len(self.walks),
            "stream_buffers": len(self.streams),
            "tensor_parallel": {} if self.tp is None else {
                b: {"ranks": list(lay.ranks), "role": "leader" if lay.is_leader else "follower"}
                for b, lay in self.tp.layouts.items() if b in self.engines},
        }
