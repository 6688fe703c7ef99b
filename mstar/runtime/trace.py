"""Per-request walk traces: what a request's walks did, node by node (ARCHITECTURE.md, "Traces").

Recording is local and cheap; nothing crosses ranks until someone asks:

* each worker keeps, per request that ran there, its node runs (``NodeRuns``): the node, its walk
  (partition and walk number) and iteration, the size of the batch it ran in, its wait in the
  queue, the wall-clock start and the compute time of that forward, the time its postprocess took
  after it (routing and sending its outputs), the new and attended KV tokens and attention pairs of
  the whole forward (and a stream consumer's chunk)
  -- one tuple per row of a forward, for the last ``keep`` requests, at most ``max_runs`` each
  (beyond that a count and a total per node); and counts its engines note (prefix-cache hits,
  preemptions, KV blocks held at the end) and the tensor bytes it sends other ranks (``SentBytes``);
* the conductor keeps each request's walks (``RequestTrace``: walk, partition, dispatch and end
  times) and its end, in a store of the last ``keep`` requests (``TraceStore``);
* ``Runtime.trace`` gathers a request's node runs from every rank (``TraceRequest`` /
  ``TraceReply``, ``TraceGather``) and joins them to its walks (``trace_json``).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.runtime.wire.messages import TraceReply, TraceRequest

__all__ = ["NodeRuns", "RequestTrace", "SentBytes", "TraceGather", "TraceStore", "tensor_bytes", "trace_json",
           "traces_in"]

# a node run as a worker keeps it (a tuple: one is made per row of every forward)
# (``batch_tokens`` / ``batch_context`` / ``batch_attention``: the forward's new KV tokens, attended KV
# tokens and attention pairs, each row's new tokens times its context, over all its rows; 0 on a
# stateless module)
# (``post_ms``: from the forward's end until its outputs were routed and sent, the rank busy with no
# forward; a message to another rank costs its sender here)
_RUN = ("node", "partition", "walk_seq", "iteration", "batch", "queued_ms", "start", "compute_ms", "chunks",
        "batch_tokens", "batch_context", "batch_attention", "post_ms")


class NodeRuns:
    """A rank's node runs per request (module docstring)."""

    def __init__(self, rank: int, keep: int, max_runs: int = 4096) -> None:
        self.rank, self.keep, self.max_runs = rank, keep, max_runs
        self._runs: OrderedDict[str, list[tuple]] = OrderedDict()
        self._over: dict[str, dict[str, list[float]]] = {}  # request -> node -> [runs, compute ms] past max_runs
        self._notes: OrderedDict[str, dict[str, dict[str, int]]] = OrderedDict()  # request -> module -> key -> sum
        self._unposted: list[tuple[list[tuple], int]] = []  # the last forward's runs (list, index): post_ms due
        self._ended = 0.0  # the last forward's end (``time.monotonic()``)

    def notes_of(self, module: str):
        """What ``module``'s engine calls to note a number about a request (summed per key; zeros
        are not noted)."""
        def note(request_id: str, key: str, value: int) -> None:
            if not value:
                return
            notes = self._notes.get(request_id)
            if notes is None:
                notes = self._notes[request_id] = {}
                if len(self._notes) > self.keep:
                    self._notes.popitem(last=False)
            per = notes.setdefault(module, {})
            per[key] = per.get(key, 0) + int(value)
        return note

    def record(self, items: list[Any], started: float, wall: float, seconds: float, engine: Any = None) -> None:
        """One forward of ``items`` (work items): ``started`` its ``time.monotonic()`` start (the
        items' ``queued_at`` clock), ``wall`` its ``time.time()`` start, ``seconds`` its length;
        ``engine`` the one that ran it (its ``step_tokens`` / ``step_context``)."""
        tokens, context = getattr(engine, "step_tokens", 0), getattr(engine, "step_context", 0)
        attention = getattr(engine, "step_attention", 0)
        batch, ms, runs_of = len(items), seconds * 1e3, self._runs
        self._unposted, self._ended = [], started + seconds
        for it in items:
            runs = runs_of.get(it.request_id)
            if runs is None:
                runs = runs_of[it.request_id] = []
                if len(runs_of) > self.keep:
                    old, _ = runs_of.popitem(last=False)
                    self._over.pop(old, None)
            if len(runs) < self.max_runs:
                queued = (started - it.queued_at) * 1e3 if it.queued_at else 0.0
                runs.append((it.node, it.partition, it.walk_seq, it.iteration, batch, queued, wall, ms,
                             it.chunks or None, tokens, context, attention, 0.0))
                self._unposted.append((runs, len(runs) - 1))
            else:
                agg = self._over.setdefault(it.request_id, {}).setdefault(it.node, [0, 0.0])
                agg[0] += 1
                agg[1] += ms

    def posted(self, now: float) -> None:
        """The last recorded forward's postprocess ended at ``now`` (``time.monotonic()``): its runs'
        ``post_ms``. Called after every step; a step that recorded nothing changes nothing."""
        ms = (now - self._ended) * 1e3
        for runs, i in self._unposted:  # a request's list only grows (or is dropped whole)
            runs[i] = runs[i][:-1] + (ms,)
        self._unposted = []

    def forget(self, request_id: str) -> None:
        """Drop what was kept of an untraced request (so it takes no other request's place)."""
        self._runs.pop(request_id, None)
        self._over.pop(request_id, None)
        self._notes.pop(request_id, None)

    def take(self, request_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The runs kept of these requests (each run a dict of ``_RUN``'s fields, with the rank)."""
        out = {}
        for rid in request_ids:
            runs, notes = self._runs.get(rid), self._notes.get(rid)
            if runs is None and notes is None:
                continue
            out[rid] = {"runs": [dict(zip(_RUN, r), rank=self.rank) for r in runs or ()],
                        "not_kept": {node: {"runs": int(n), "compute_ms": round(t, 3)}
                                     for node, (n, t) in self._over.get(rid, {}).items()},
                        "counts": notes or {}}
        return out


def tensor_bytes(value: Any) -> int:
    """The bytes of every tensor in ``value`` (a message: dataclasses, dicts, lists and tuples of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(tensor_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


class SentBytes:
    """A worker's transport that notes, per request, the tensor bytes of each message it sends to
    another rank (``bytes_to_rank_N``); messages to its own rank and to the conductor are not counted."""

    def __init__(self, transport: Any, rank: int, note: Any) -> None:
        self.inner, self.rank, self.note = transport, rank, note

    def send(self, dest: int, msg: Any) -> None:
        if dest >= 0 and dest != self.rank:
            rid = getattr(msg, "request_id", None)
            if rid is not None:
                self.note(rid, f"bytes_to_rank_{dest}", tensor_bytes(msg))
        self.inner.send(dest, msg)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class _Walk:
    walk: str
    partition: str
    seq: int  # the partition's walk number (a work item's ``walk_seq``)
    start: float  # time.time() when the conductor dispatched it
    end: float | None = None


@dataclass
class RequestTrace:
    """A request's walks as the conductor saw them, and its end."""

    request_id: str
    submitted: float = field(default_factory=time.time)
    walks: list[_Walk] = field(default_factory=list)
    ended: float | None = None
    status: str = "running"
    finish_reason: str | None = None
    error: str | None = None
    streamed: dict[str, int] = field(default_factory=dict)  # "partition.node.input" -> stream items pushed

    def walk_started(self, walk: str, partition: str, seq: int) -> None:
        self.walks.append(_Walk(walk, partition, seq, time.time()))

    def walk_ended(self, partition: str) -> None:
        for w in reversed(self.walks):
            if w.partition == partition and w.end is None:
                w.end = time.time()
                return

    def end(self, status: str, finish_reason: str | None, error: str | None) -> None:
        self.ended, self.status, self.finish_reason, self.error = time.time(), status, finish_reason, error


class TraceStore:
    """The traces of the last ``keep`` requests that ended, and of those running, by request id; a
    label (the id's part before its random suffix: the server's ``x-request-id``) finds every
    request submitted with it."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.running: dict[str, RequestTrace] = {}
        self.ended: OrderedDict[str, RequestTrace] = OrderedDict()

    def start(self, request_id: str) -> RequestTrace:
        trace = self.running[request_id] = RequestTrace(request_id)
        return trace

    def finish(self, request_id: str) -> None:
        trace = self.running.pop(request_id, None)
        if trace is None:
            return
        self.ended[request_id] = trace
        while len(self.ended) > self.keep:
            self.ended.popitem(last=False)

    def find(self, key: str) -> list[RequestTrace]:
        """The traces of request ``key``, or of every request labelled ``key`` (oldest first)."""
        exact = self.running.get(key) or self.ended.get(key)
        if exact is not None:
            return [exact]
        prefix = key + "-"
        found = [t for t in itertools.chain(self.ended.values(), self.running.values())
                 if t.request_id.startswith(prefix) and "-" not in t.request_id[len(prefix):]]
        return sorted(found, key=lambda t: t.submitted)


@dataclass
class _TraceCall:
    traces: list[RequestTrace]
    future: Future
    replies: dict[int, dict] = field(default_factory=dict)


class TraceGather:
    """The conductor's trace calls, each gathering every rank's node runs of some requests."""

    def __init__(self, num_ranks: int, transport: Any) -> None:
        self.num_ranks, self.transport = num_ranks, transport
        self._calls: dict[int, _TraceCall] = {}
        self._tokens = itertools.count()

    def collect(self, traces: list[RequestTrace], future: Future) -> None:
        if not traces:
            future.set_result([])
            return
        token = next(self._tokens)
        self._calls[token] = _TraceCall(traces, future)
        for r in range(self.num_ranks):
            self.transport.send(r, TraceRequest(token, [t.request_id for t in traces]))

    def reply(self, msg: TraceReply) -> None:
        call = self._calls.get(msg.token)
        if call is None:
            return
        call.replies[msg.rank] = msg.runs
        if len(call.replies) == self.num_ranks:
            del self._calls[msg.token]
            call.future.set_result([trace_json(t, [call.replies[r].get(t.request_id) for r in sorted(call.replies)])
                                    for t in call.traces])

    def fail(self, error: str) -> None:
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call.future.set_exception(RuntimeError(f"trace unavailable: {error}"))


def trace_json(trace: RequestTrace, per_rank: list[dict | None]) -> dict[str, Any]:
    """A request's trace as JSON-ready data: its walks in dispatch order, each with its node runs
    (every rank's, by start time; a stream consumer's with the chunk it took); the items each stream
    carried; ``counts`` per ``module@rank`` (a KV module's prefix-cache hit tokens, preemptions and
    blocks held at the end; ``sent@rank``: tensor bytes sent to each other rank); and per rank the
    runs counted but not kept."""
    runs: dict[tuple[str, int], list[dict]] = {}
    not_kept, counts = {}, {}
    for rank, part in enumerate(per_rank):
        if not part:
            continue
        for run in part["runs"]:
            if run["chunks"] is None:
                del run["chunks"]
            runs.setdefault((run.pop("partition"), run.pop("walk_seq")), []).append(run)
        if part["not_kept"]:
            not_kept[rank] = part["not_kept"]
        for module, notes in part["counts"].items():
            counts[f"{module}@{rank}"] = notes
    walks = []
    for w in trace.walks:
        nodes = sorted(runs.get((w.partition, w.seq), []), key=lambda r: r["start"])
        for r in nodes:
            r["iteration"] = list(r["iteration"])
            r["queued_ms"], r["compute_ms"] = round(r["queued_ms"], 3), round(r["compute_ms"], 3)
            r["post_ms"] = round(r["post_ms"], 3)
        walks.append({"walk": w.walk, "partition": w.partition, "start": w.start, "end": w.end, "nodes": nodes})
    return {"request_id": trace.request_id, "status": trace.status, "finish_reason": trace.finish_reason,
            "error": trace.error, "submitted": trace.submitted, "ended": trace.ended, "walks": walks,
            "streamed": dict(trace.streamed), "counts": counts, "not_kept": not_kept}


def traces_in(doc: Any) -> list[dict[str, Any]]:
    """The request traces in a parsed JSON document: ``GET /v1/requests/{id}/trace``'s (its
    ``requests``), a list of traces (``Runtime.trace``'s), or one trace. ValueError when it is none."""
    traces = doc.get("requests") if isinstance(doc, dict) and "requests" in doc else doc
    if isinstance(traces, dict):
        traces = [traces]
    if not isinstance(traces, list) or not all(isinstance(t, dict) and isinstance(t.get("walks"), list)
                                               for t in traces):
        raise ValueError("not a walk trace: expected GET /v1/requests/{id}/trace's JSON (requests with walks)")
    return traces
