"""The conductor: owns each request's state and acts only at walk boundaries.

It validates and admits requests, asks the model's ``next_walk`` which walk each partition runs
next, dispatches walks to their home workers, forwards emitted items to the request's handle, and
finishes, aborts or fails requests (telling every worker to free what the request held).
"""

from __future__ import annotations

import enum
import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from mstar.graph.finish import FinishReason
from mstar.model.base import ModelDef, WalkState
from mstar.runtime.failures import FailureKind, describe
from mstar.runtime.keys import decode_counts
from mstar.runtime.routing import Routing
from mstar.runtime.stats_gather import StatsGather
from mstar.runtime.trace import RequestTrace, TraceGather, TraceStore
from mstar.runtime.wire.messages import (
    Emit,
    EmitRows,
    Emits,
    FreeKV,
    FreeRequest,
    KVMoved,
    MigrateKV,
    PartitionReady,
    RequestFailed,
    StartWalk,
    StatsReply,
    StreamEnd,
    TraceReply,
    WalkDone,
)


class RequestStatus(enum.IntEnum):
    """Ordered: anything at or after FINISHED is final."""

    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    ABORTED = 3
    FAILED = 4

    @property
    def is_final(self) -> bool:
        return self >= RequestStatus.FINISHED


class RequestSink(Protocol):
    """Where a request's results go (its ``RequestHandle``); called on the conductor's thread."""

    def on_item(self, msg: Emit) -> None: ...

    def on_row(self, rows: EmitRows, i: int) -> None: ...

    def on_end(self, status: RequestStatus, error: str | None, failure: FailureKind | None,
               finish: FinishReason | None = None) -> None: ...


@dataclass
class _Partition:
    state: WalkState
    running: bool = False
    done: bool = False
    walks_run: int = 0


@dataclass
class _Request:
    request_id: str
    params: dict[str, Any]
    partitions: dict[str, _Partition]
    sink: RequestSink
    status: RequestStatus = RequestStatus.WAITING
    error: str | None = None
    walks: list[str] = field(default_factory=list)
    kv_owner: dict[str, int] = field(default_factory=dict)  # module -> rank holding its caches
    kv_copies: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # partition -> copies to drop
    migrations: set[int] = field(default_factory=set)  # KV moves to finish before ``deferred`` starts
    deferred: list[tuple[int, StartWalk]] = field(default_factory=list)
    streamed: dict[str, int] = field(default_factory=dict)  # stream (wire form) -> items pushed so far
    finish: FinishReason | None = None  # the latest a partition ended with (``ModelDef.finish_reason``)
    trace: RequestTrace | None = None  # its walks, when traces are kept (``trace.py``)


class Conductor:
    def __init__(self, model: ModelDef, routing: Routing, transport) -> None:
        self.model = model
        self.routing = routing
        self.transport = transport
        self.requests: dict[str, _Request] = {}
        self.stats = StatsGather(routing, transport, self.num_running)
        keep = routing.placement.limits.trace_requests
        self.traces = TraceStore(keep) if keep else None  # trace.py: each request's walks
        self.trace_calls = TraceGather(routing.num_ranks, transport)
        self._ids = itertools.count()
        self._row_sinks: tuple[list[str], list] | None = None  # (a request_ids list, its rows' on_row or None)

    def submit(self, request_id: str, inputs: dict[str, list], params: dict[str, Any], sink: RequestSink,
               traced: bool = True) -> None:
        """Admit a request (inputs already validated by the caller); ``traced`` False: keep no trace of it."""
        graph = self.model.graph
        # one dict of request tensors shared by every partition: the inputs, what create_state adds,
        # and later every value routed TO_STATE
        tensors: dict | None = None
        parts = {}
        for p in graph.partitions:
            st = self.model.create_state(request_id, p, dict(inputs), params)
            if tensors is None:
                tensors = st.tensors
            else:
                tensors.update({k: v for k, v in st.tensors.items() if k not in tensors})
            st.tensors = tensors
            parts[p] = _Partition(st)
        req = _Request(request_id, params, parts, sink, RequestStatus.RUNNING)
        if self.traces is not None and traced:
            req.trace = self.traces.start(request_id)
        self.requests[request_id] = req
        self._row_sinks = None  # looked up again: the rows find the requests as they are now
        for p in graph.root_partitions:
            self._advance(req, p)

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            self._end(req, RequestStatus.ABORTED, "aborted", FailureKind.ABORTED)

    def fail(self, request_id: str, error: str, kind: FailureKind) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            self._end(req, RequestStatus.FAILED, error, kind)

    # -- messages ------------------------------------------------------------------------------
    def handle(self, msg: Any) -> None:
        if type(msg) is Emits:
            requests = self.requests
            for e in msg.items:
                if type(e) is EmitRows:
                    self._deliver_rows(e)
                    continue
                req = requests.get(e.request_id)
                if req is not None:  # else a late value of a finished request
                    req.sink.on_item(e)
            return
        if isinstance(msg, StatsReply):
            self.stats.reply(msg)
            return
        if isinstance(msg, TraceReply):
            self.trace_calls.reply(msg)
            return
        req = self.requests.get(msg.request_id)
        if req is None:
            return  # a late message of a finished request
        if isinstance(msg, Emit):
            req.sink.on_item(msg)
        elif isinstance(msg, WalkDone):
            part = req.partitions[msg.partition]
            part.running = False
            if req.trace is not None:
                req.trace.walk_ended(msg.partition)
            part.state.tensors.update(msg.state)
            part.state.finish = msg.finish
            for k, n in msg.streamed.items():
                req.streamed[k] = req.streamed.get(k, 0) + n
            part.state.history.append(msg.walk)
            for module, rank in req.kv_copies.pop(msg.partition, []):
                self.transport.send(rank, FreeKV(req.request_id, module))
            if msg.partition in self.model.graph.root_partitions:
                self._advance(req, msg.partition)
        elif isinstance(msg, PartitionReady):
            part = req.partitions[msg.partition]
            part.state.stream_done = msg.streams_done
            if not part.running and not part.done:
                self._advance(req, msg.partition)
        elif isinstance(msg, KVMoved):
            req.migrations.discard(msg.token)
            if not req.migrations:
                for rank, start in req.deferred:
                    self.transport.send(rank, start)
                req.deferred.clear()
        elif isinstance(msg, RequestFailed):
            self._end(req, RequestStatus.FAILED, msg.error, msg.kind)
        else:
            raise TypeError(f"conductor: unexpected message {type(msg).__name__}")

    def _deliver_rows(self, e: EmitRows) -> None:
        """Each live row of ``e`` to its request's sink. The sinks of a row list are looked up once
        while no request starts or ends: a worker's running rows send the same ``request_ids`` list
        at every step (inline; over the wire each message brings its own, looked up afresh)."""
        rids = e.request_ids
        cached = self._row_sinks
        if cached is not None and cached[0] is rids:
            sinks = cached[1]
        else:
            requests = self.requests
            sinks = []
            for rid in rids:
                req = requests.get(rid)
                sinks.append(None if req is None else req.sink.on_row)
            self._row_sinks = (rids, sinks)
        i = 0
        for on_row, v in zip(sinks, e.values):
            if on_row is not None and not ((type(v) is list or type(v) is tuple) and not v):
                on_row(e, i)
            i += 1

    def _advance(self, req: _Request, partition: str) -> None:
        """Ask the model for the partition's next walk and dispatch it (a walk boundary)."""
        part = req.partitions[partition]
        try:
            walk = self.model.next_walk(part.state)
            if walk is None:
                req.finish = self.model.finish_reason(part.state) or req.finish
            else:
                plan = self.model.graph.plan(walk)
                if plan.partition != partition:
                    raise ValueError(f"next_walk returned {walk!r} of partition {plan.partition!r} "
                                     f"for partition {partition!r}")
                missing = [n for n in plan.inputs if n not in part.state.tensors]
                if missing:
                    raise ValueError(f"walk {walk!r} needs {missing}, which the request state does not hold "
                                     f"(has {sorted(part.state.tensors)})")
        except Exception as e:  # noqa: BLE001 - a model bug fails this request only
            self._end(req, RequestStatus.FAILED, describe(e), FailureKind.of(e))
            return
        if walk is None:
            part.done = True
            for consumer in self.routing.consumers_of(partition):
                self.transport.send(self.routing.partition_home[consumer],
                                    StreamEnd(req.request_id, partition, consumer, dict(req.streamed)))
            if all(p.done for p in req.partitions.values()):
                self._end(req, RequestStatus.FINISHED, None, None, req.finish or FinishReason.STOP)
            return
        part.running = True
        req.walks.append(walk)
        inputs = {n: part.state.tensors[n] for n in plan.inputs}
        start = StartWalk(req.request_id, partition, walk, part.walks_run, inputs, req.params, dict(req.streamed))
        if req.trace is not None:
            req.trace.walk_started(walk, partition, part.walks_run)
        part.walks_run += 1
        self._migrate_kv(req, partition, walk)
        if req.migrations:
            req.deferred.append((self.routing.home(walk), start))
        else:
            self.transport.send(self.routing.home(walk), start)

    def _migrate_kv(self, req: _Request, partition: str, walk: str) -> None:
        """Before a walk starts, put each module's caches where the walk runs the module's nodes.

        A module's caches live on one *owner* rank. When the walk places none of the module's nodes
        there (per-walk placement: prefill on rank 0, decode on rank 1) they move; when it also places
        some of them elsewhere (a weight-sharing view on another rank that forks the cache) those
        ranks get a copy for the duration of the walk, dropped when it ends.
        """
        ranks: dict[str, set[int]] = {}
        for node in self.model.graph.plan(walk).nodes:
            ranks.setdefault(self.model.module_of(node), set()).add(self.routing.rank_of(node, walk))
        for module, used in sorted(ranks.items()):
            preferred = self.routing.rank_of(module, walk) if module in self.model.graph.plan(walk).nodes \
                else min(used)
            owner = req.kv_owner.get(module)
            if owner is None:
                req.kv_owner[module] = preferred
                continue
            keep = owner in used
            new_owner = owner if keep else preferred
            dests = sorted(used - {owner})
            req.kv_owner[module] = new_owner
            if not dests:
                continue
            tokens = [next(self._ids) for _ in dests]
            req.migrations.update(tokens)
            self.transport.send(owner, MigrateKV(req.request_id, module, dests, tokens, keep))
            req.kv_copies.setdefault(partition, []).extend((module, r) for r in dests if r != new_owner)

    def _end(self, req: _Request, status: RequestStatus, error: str | None, failure: FailureKind | None,
             finish: FinishReason | None = None) -> None:
        """The request ends: ``finish`` for a FINISHED one (ABORTED and FAILED ones say ABORT and ERROR)."""
        if req.status.is_final:
            return
        req.status, req.error = status, error
        del self.requests[req.request_id]
        if req.trace is not None:
            reason = finish or {RequestStatus.ABORTED: FinishReason.ABORT, RequestStatus.FAILED: FinishReason.ERROR}.get(status)
            req.trace.streamed = {".".join(k): n for k, n in decode_counts(req.streamed).items()}
            req.trace.end(status.name.lower(), str(reason) if reason else None, error)
            self.traces.finish(req.request_id)
        self._row_sinks = None  # a list of sinks may hold the request's
        for rank in range(self.routing.num_ranks):
            self.transport.send(rank, FreeRequest(req.request_id, req.trace is not None))
        req.sink.on_end(status, error, failure, finish)

    def trace(self, key: str, future: Future) -> None:
        """``future`` gets the traces (``trace.trace_json``) of request ``key`` or of every request
        labelled ``key``: [] when none is kept."""
        if self.traces is None:
            future.set_result([])
            return
        self.trace_calls.collect(self.traces.find(key), future)

    def num_running(self) -> int:
        return len(self.requests)
