"""A worker: one per rank. Holds the submodules placed on its rank, runs walks, batches nodes.

Main loop (``step``): drain messages -> pick the node queue whose oldest item waited longest ->
run one batched forward -> route the outputs (local tracker, another worker, the conductor).
"""

from __future__ import annotations

import itertools
import logging
import traceback
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from mstar.model.base import ModelDef
from mstar.runtime.engine import ItemError, KVCacheEngine, StatelessEngine, WorkItem
from mstar.runtime.messages import (
    CONDUCTOR,
    Emit,
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
from mstar.runtime.routing import Routing
from mstar.runtime.streams import StreamBuffer
from mstar.runtime.walk_tracker import ReadyNode, WalkTracker

log = logging.getLogger(__name__)


def _chunk_info(chunk) -> dict[str, Any]:
    return {"start": chunk.start, "new_start": chunk.new_start, "is_final": chunk.is_final}


@dataclass
class _Walk:
    tracker: WalkTracker
    partition: str
    walk: str
    params: dict[str, Any]
    offsets: dict[str, int]  # stream key -> items pushed by this partition's earlier walks
    state: dict[str, Any] = field(default_factory=dict)
    pushed: Counter = field(default_factory=Counter)  # stream key -> items this walk pushed


class Worker:
    def __init__(self, rank: int, model: ModelDef, routing: Routing, transport, device: str = "cpu") -> None:
        self.rank = rank
        self.model = model
        self.routing = routing
        self.transport = transport
        placement = routing.placement
        nodes = sorted(placement.nodes_on(rank))
        modules = model.build_submodules(nodes) if nodes else {}
        limits = placement.limits
        self.engines: dict[str, StatelessEngine] = {}
        self.max_batch: dict[str, int] = {}
        for node in nodes:
            base = model.module_of(node)
            module = modules[node]
            module.to(device).eval()
            if base not in self.engines:
                self.engines[base] = (KVCacheEngine(module, limits.kv_cache_blocks, limits.kv_block_size, device)
                                      if module.kv_spec is not None else StatelessEngine(module))
            self.max_batch[base] = min(self.max_batch.get(base, 1 << 30), placement.max_batch_size(node))
        self.queues: dict[str, deque[WorkItem]] = {b: deque() for b in self.engines}
        self._queue_of = {node: self.queues[model.module_of(node)] for node in nodes}
        self.walks: dict[tuple[str, str, int], _Walk] = {}
        self.streams: dict[tuple[str, str], StreamBuffer] = {}
        self._seq = itertools.count()
        self.running = True
        self.batch_hist: dict[str, Counter] = {b: Counter() for b in self.engines}
        # requests already freed here: a message for one (sent before its sender learned of the end)
        # is dropped, so it cannot allocate KV blocks or buffers that nobody would free
        self._freed: OrderedDict[str, None] = OrderedDict()

    # -- messages ------------------------------------------------------------------------------
    def handle(self, msg: Any) -> None:
        rid = getattr(msg, "request_id", None)
        if rid is not None and rid in self._freed and not isinstance(msg, FreeRequest):
            return
        if isinstance(msg, StartWalk):
            self._start_walk(msg)
        elif isinstance(msg, ExecNode):
            self._enqueue(WorkItem(next(self._seq), msg.request_id, msg.partition, msg.walk, msg.walk_seq, msg.node,
                                   tuple(msg.iteration), msg.inputs, msg.chunks, msg.params, msg.home))
        elif isinstance(msg, NodeResult):
            key = (msg.request_id, msg.partition, msg.walk_seq)
            if key in self.walks:
                self._guarded(msg.request_id, lambda: self._node_done(key, msg.node, tuple(msg.iteration),
                                                                       msg.outputs))
        elif isinstance(msg, StreamPush):
            buf = self.streams.setdefault((msg.request_id, msg.partition), StreamBuffer())
            factory = self.routing.chunk_policy_factory(msg.from_partition, msg.partition, msg.name)
            buf.push(msg.node, msg.name, msg.from_partition, factory, msg.items, msg.offset)
            self._streams_changed(msg.request_id, msg.partition)
        elif isinstance(msg, StreamEnd):
            self.streams.setdefault((msg.request_id, msg.partition), StreamBuffer()).end(msg.from_partition,
                                                                                         msg.expected)
            self._streams_changed(msg.request_id, msg.partition)
        elif isinstance(msg, FreeRequest):
            self._free(msg.request_id)
            self._freed[msg.request_id] = None
            if len(self._freed) > 100_000:
                self._freed.popitem(last=False)
        elif isinstance(msg, MigrateKV):
            eng = self.engines.get(msg.module)
            caches = eng.export_request(msg.request_id, free=not msg.keep) if eng is not None else {}
            for dest, token in zip(msg.dests, msg.tokens):
                self.transport.send(dest, KVImport(msg.request_id, msg.module, caches, token))
        elif isinstance(msg, FreeKV):
            eng = self.engines.get(msg.module)
            if eng is not None:
                eng.free_request(msg.request_id)
        elif isinstance(msg, KVImport):
            eng = self.engines.get(msg.module)
            if eng is not None:
                self._guarded(msg.request_id, lambda: eng.import_request(msg.request_id, msg.caches))
            elif msg.caches:
                self._fail(msg.request_id, f"rank {self.rank} received KV of {msg.module!r}, which it does not hold")
            self.transport.send(CONDUCTOR, KVMoved(msg.request_id, msg.token))
        elif isinstance(msg, StatsRequest):
            self.transport.send(CONDUCTOR, StatsReply(msg.token, self.rank, self.stats()))
        elif isinstance(msg, Shutdown):
            self.running = False
        else:
            raise TypeError(f"worker {self.rank}: unexpected message {type(msg).__name__}")

    def _start_walk(self, msg: StartWalk) -> None:
        key = (msg.request_id, msg.partition, msg.walk_seq)
        buf = self.streams.get((msg.request_id, msg.partition))
        if buf is None and msg.partition not in self.routing.graph.root_partitions:
            buf = self.streams.setdefault((msg.request_id, msg.partition), StreamBuffer())
        if buf is not None:
            buf.walk_running = True
            buf.notified = False

        def emit(name, value, modality, node):
            if isinstance(value, list) and not value:
                return  # an empty list: nothing to send this iteration
            self.transport.send(CONDUCTOR, Emit(msg.request_id, name, value, modality, node, msg.walk))

        def to_state(name, value):
            self.walks[key].state[name] = value

        def stream(partition, node, name, value):
            w = self.walks[key]
            skey = f"{partition}/{node}/{name}"
            offset = w.offsets.get(skey, 0) + w.pushed[skey]
            w.pushed[skey] += len(value)
            home = self.routing.partition_home[partition]
            self.transport.send(home, StreamPush(msg.request_id, msg.partition, partition, node, name, list(value),
                                                 offset))

        def pull(node, name):
            b = self.streams.get((msg.request_id, msg.partition))
            return b.pull(node, name) if b is not None else None

        def start():
            tracker = WalkTracker(self.routing.graph.plan(msg.walk), msg.inputs, emit=emit, to_state=to_state,
                                  stream=stream, pull_stream=pull, read_stop=_read_stop)
            self.walks[key] = _Walk(tracker, msg.partition, msg.walk, msg.params, dict(msg.stream_offsets))
            self._dispatch(key, tracker.start())
            self._maybe_walk_done(key)

        self._guarded(msg.request_id, start)

    # -- execution -----------------------------------------------------------------------------
    def _dispatch(self, key, ready: list[ReadyNode], w: _Walk | None = None) -> None:
        w = w or self.walks[key]
        rid, partition, walk_seq = key
        rank_of = self.routing.rank_of
        for r in ready:
            chunks = {k: _chunk_info(c) for k, c in r.stream_chunks.items()} if r.stream_chunks else {}
            target = rank_of(r.node, w.walk)
            if target == self.rank:
                self._enqueue(WorkItem(next(self._seq), rid, partition, w.walk, walk_seq, r.node, r.iteration,
                                       r.inputs, chunks, w.params, self.rank))
            else:
                self.transport.send(target, ExecNode(rid, partition, w.walk, walk_seq, r.node, r.iteration,
                                                     r.inputs, chunks, w.params, self.rank))

    def _enqueue(self, item: WorkItem) -> None:
        q = self._queue_of.get(item.node)
        if q is None:
            raise RuntimeError(f"worker {self.rank} got node {item.node!r}, which is not placed on it")
        q.append(item)

    def _node_done(self, key, node: str, vec: tuple, outputs: dict) -> None:
        w = self.walks.get(key)
        if w is None:
            return
        ready = w.tracker.node_done(node, vec, outputs)
        if ready:
            self._dispatch(key, ready, w)
        if w.tracker.done:
            self._maybe_walk_done(key)

    def _maybe_walk_done(self, key) -> None:
        w = self.walks.get(key)
        if w is None or not w.tracker.done:
            return
        del self.walks[key]
        rid, partition, _ = key
        self.transport.send(CONDUCTOR, WalkDone(rid, partition, w.walk, w.state, dict(w.pushed)))
        buf = self.streams.get((rid, partition))
        if buf is not None:
            buf.walk_running = False
            self._streams_changed(rid, partition)

    def _streams_changed(self, rid: str, partition: str) -> None:
        buf = self.streams[(rid, partition)]
        for key, w in list(self.walks.items()):
            if key[0] == rid and key[1] == partition and w.tracker.waiting_on_stream:
                self._guarded(rid, lambda k=key, ww=w: (self._dispatch(k, ww.tracker.stream_ready()),
                                                       self._maybe_walk_done(k)))
        if buf.walk_running or buf.notified:
            return
        ended = buf.all_ended(self.routing.producers[partition])
        if buf.has_pending() or ended:
            buf.notified = True
            self.transport.send(CONDUCTOR, PartitionReady(rid, partition, ended and not buf.has_pending()))

    def step(self) -> bool:
        """Run one batched forward, if any work is queued. Returns whether it ran one."""
        heads = [(q[0].seq, base) for base, q in self.queues.items() if q]
        if not heads:
            return False
        _, base = min(heads)
        q = self.queues[base]
        batch = [q.popleft() for _ in range(min(len(q), self.max_batch[base]))]
        results = self.engines[base].run(batch)
        self.batch_hist[base][len(batch)] += 1
        for item, out in zip(batch, results):
            if isinstance(out, ItemError):
                log.debug("request %s failed: %s", item.request_id, "".join(traceback.format_exception(out)))
                self._fail(item.request_id, str(out))
                continue
            if item.home == self.rank:
                try:
                    self._node_done((item.request_id, item.partition, item.walk_seq), item.node, item.iteration, out)
                except Exception as e:  # noqa: BLE001 - one request's error must not stop the worker
                    self._fail(item.request_id, f"{type(e).__name__}: {e}")
            else:
                self.transport.send(item.home, NodeResult(item.request_id, item.partition, item.walk_seq,
                                                          item.node, item.iteration, out))
        return True

    # -- failures and cleanup --------------------------------------------------------------------
    def _guarded(self, rid: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one request's error must not stop the worker
            log.debug("request %s failed", rid, exc_info=True)
            self._fail(rid, f"{type(e).__name__}: {e}")

    def _fail(self, rid: str, error: str) -> None:
        self._free(rid)
        self.transport.send(CONDUCTOR, RequestFailed(rid, error))

    def _free(self, rid: str) -> None:
        for key in [k for k in self.walks if k[0] == rid]:
            del self.walks[key]
        for key in [k for k in self.streams if k[0] == rid]:
            del self.streams[key]
        for q in self.queues.values():
            if any(it.request_id == rid for it in q):
                kept = [it for it in q if it.request_id != rid]
                q.clear()
                q.extend(kept)
        for eng in self.engines.values():
            eng.free_request(rid)

    def stats(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "queue_depth": {b: len(q) for b, q in self.queues.items()},
            "batch_sizes": {b: dict(sorted(h.items())) for b, h in self.batch_hist.items()},
            "kv": {b: e.stats() for b, e in self.engines.items() if isinstance(e, KVCacheEngine)},
            "walks": len(self.walks),
            "stream_buffers": len(self.streams),
        }


def _read_stop(value: Any) -> bool:
    """A stop signal is a per-request value: a bool, or a tensor / list whose entries are all truthy."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_read_stop(v) for v in value)
    if hasattr(value, "numel"):
        return bool(value.numel() > 0 and bool(value.all()))
    return bool(value)
