"""A discrete-event simulator of the runtime's scheduling, priced by a ``Profile``.

It replays a workload's arrivals against a placement the way the workers run them:

* each request runs its class's program (``ClassProgram.expand``): node runs one after another,
  walk after walk, except a loop iteration's parallel branches (nodes of one level, ``node_levels``),
  which start together, the next level waiting for them all;
* a node run waits in its module's queue on the rank its (node, walk) group places it (a
  tensor-parallel group's leader; the forward occupies every rank of the group);
* a free rank runs, as ``RankScheduler`` does, the module of an item that waited past
  ``scheduling_max_wait_ms`` (oldest first), else (``downstream_first``) the module of the deepest
  partition with a ready item, else the oldest; it batches up to the group's ``max_batch_size`` of
  that module's queue, prompts and decode rows together (continuous batching);
* a stream's producer runs push one item each to the consumer partition's chunk policy (the graph's
  own ``ChunkPolicy``); each chunk it fires is one walk of the consumer, walks of one request's
  consumer one after another; the request ends when every partition has;
* a forward's work is the module's ``ForwardCost`` for its rows, new tokens and attention pairs
  (each row's tokens times its context) at its rank's threads (the group's ``threads``, else the
  default), times a draw from the profiled forwards' spread around the fit (seeded), plus a draw of
  ``RankTiming.wake_ms`` for as long as its rank idled before (nothing up to ``IDLE_S``); groups computing at
  once share the machine (processor sharing: each progresses at 1 / ``Profile.slowdown`` of the
  threads computing, re-paced whenever a forward starts or ends; ranks whose threads outnumber the
  cores slow each other all the time, at the ``shared`` slowdown of them all: idle OpenMP threads
  spin); then the rank's step gap;
* a request reaches its first queue after the client-to-worker time, its first item and its end
  reach the client after theirs (``Profile.client``, measured for its first rank's threads and how
  long that rank had idled when the request came, drawn per request from their spread);
* a request's next run is ready after the step gap (plus a hop, ``Profile.hop_ms``, when it runs on another
  rank than the run it waits for), or at a walk boundary after the rank's walk gap, or, when its KV
  module moves to another group, after the KV move (``Profile.move_ms``, plus ``RankTiming.woken_ms``
  for as long as the new rank idled); a stream's chunk reaches its consumer after the consumer
  rank's stream gap (``RankTiming.stream_gap_ms``, no hop added: the profile measured it across
  ranks wherever it placed the two apart).

What it does not model (yet): KV admission and preemption (it reports each rank's peak KV instead),
chains of streams (a consumer that streams on).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mstar.planner.profile import Profile
from mstar.planner.programs import (
    ConsumerShape,
    ProgramRun,
    emitting_runs,
    expand_walk,
    node_levels,
    stream_producers,
)
from mstar.planner.slo import percentile
from mstar.planner.workload import Arrival

__all__ = ["Prediction", "RequestTimes", "simulate"]


@dataclass(frozen=True)
class RequestTimes:
    """One request's latencies in seconds (``tpot`` None for fewer than two output tokens)."""

    request_class: str
    arrival_s: float
    ttft: float
    e2e: float
    tpot: float | None

    def samples(self) -> dict[str, float]:
        out = {"ttft": self.ttft, "e2e": self.e2e}
        if self.tpot is not None:
            out["tpot"] = self.tpot
        return out


@dataclass
class Prediction:
    requests: list[RequestTimes]
    makespan_s: float  # first arrival to last completion
    busy_s: dict[int, float] = field(default_factory=dict)  # rank -> seconds computing
    peak_kv_tokens: dict[int, int] = field(default_factory=dict)  # rank -> most KV tokens held at once
    node_runs: dict[str, int] = field(default_factory=dict)  # node -> rows it ran (over all requests)

    def samples(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for r in self.requests:
            for k, v in r.samples().items():
                out.setdefault(k, []).append(v)
        return out

    def figure(self, metric: str, pct: float) -> float:
        return percentile(self.samples().get(metric, []), pct)


@dataclass
class _Group:
    ranks: tuple[int, ...]
    tp: int
    max_batch: int
    threads: int  # each rank's

    @property
    def demand(self) -> int:
        """The threads its forwards run on, over all its ranks."""
        return self.threads * self.tp

    @property
    def leader(self) -> int:
        return self.ranks[0]


@dataclass
class _Cursor:
    """Where one partition of a request is: the runs of its current walk(s) and the next one."""

    req: _Request
    runs: list[ProgramRun]
    depth: int  # 0 for the root partition, 1 for a partition its stream feeds
    at: int = 0  # the first run of the current stage
    consumer: _Consumer | None = None
    end: int = 0  # past the current stage's last run
    left: int = 0  # its runs not finished yet

    def stage(self) -> range:
        """The runs that start together at ``at``: one, or a walk's parallel branches."""
        first, end = self.runs[self.at], self.at + 1
        while end < len(self.runs) and self.runs[end].walk_index == first.walk_index \
                and self.runs[end].stage == first.stage:
            end += 1
        return range(self.at, end)


@dataclass
class _Consumer:
    """A partition fed by a stream: its chunk policy, the items still to come, the walks waiting."""

    shape: ConsumerShape
    policy: Any
    items: int
    pushed: int = 0
    pending: deque = field(default_factory=deque)  # run lists of fired walks, in order
    cursor: _Cursor | None = None  # the walk running now
    closed: bool = False  # the stream ended (its final chunk, if any, is pending)

    @property
    def idle(self) -> bool:
        return self.closed and self.cursor is None and not self.pending


@dataclass
class _Request:
    arrival: Arrival
    consumers: list[_Consumer]
    root: _Cursor | None = None
    first_emit: float | None = None
    root_done: bool = False
    client: dict[str, float] | None = None  # its client overheads (ms), drawn when it arrives


@dataclass
class _Forward:
    """A forward in flight: ``left`` seconds of its work alone remain as of ``since``."""

    group: _Group
    items: list[_Item]
    left: float
    since: float
    started: float
    version: int = 0


@dataclass(order=True)
class _Item:
    ready: float
    seq: int
    cursor: _Cursor = field(compare=False)
    index: int = field(compare=False, default=0)  # the run's, in the cursor's runs

    @property
    def run(self) -> ProgramRun:
        return self.cursor.runs[self.index]


class _Sim:
    def __init__(self, profile: Profile, placement: Any, module_of: Any, graph: Any, seed: int) -> None:
        self.p, self.placement, self.module_of = profile, placement, module_of
        self.rng = random.Random(seed)
        self.emitting, self.producers = emitting_runs(graph), stream_producers(graph)
        self.levels = node_levels(graph)
        limits = placement.limits
        self.downstream_first = limits.scheduling == "downstream_first"
        self.max_wait = limits.scheduling_max_wait_ms / 1e3
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.queues: dict[tuple[int, str], list[_Item]] = {}  # (leader rank, module) -> items
        self.free_at: dict[int, float] = {}
        self.last_end: dict[int, float] = {}  # rank -> when its last forward ended
        self.computing: dict[tuple[int, ...], _Forward] = {}  # group ranks -> its forward in flight
        self.busy: dict[int, float] = {}
        self.kv: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.done: list[RequestTimes] = []
        self.node_runs: dict[str, int] = {}
        self.spinning = self._oversubscribed(placement)
        self.groups: dict[tuple[str, str], _Group] = {}

    def _oversubscribed(self, placement: Any) -> list[int] | None:
        """Each rank's threads when they add up to more than the cores (else None): idle OpenMP
        threads spin between forwards, so such ranks slow each other even when only one computes."""
        threads = []
        for rank in range(placement.num_ranks):
            tp = max((g.tp_size for g in placement.node_groups if rank in g.ranks), default=1)
            threads.append(placement.threads_of(rank) or self.p.default_threads(tp))
        return threads if len(threads) > 1 and sum(threads) > self.p.cores else None

    def _slowdown(self) -> float:
        if self.spinning is not None:
            return self.p.slowdown(self.spinning)
        return self.p.slowdown([f.group.demand for f in self.computing.values()])

    def group(self, node: str, walk: str) -> _Group:
        key = (node, walk)
        if key not in self.groups:
            g = self.placement.group_for(node, walk)
            threads = self.placement.threads_of(g.ranks[0]) or self.p.default_threads(g.tp_size)
            self.groups[key] = _Group(tuple(g.ranks), g.tp_size, self.placement.max_batch_size(node, walk), threads)
        return self.groups[key]

    def push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def ready(self, t: float, cur: _Cursor) -> None:
        """The cursor's next stage is ready at ``t``: each of its runs joins its module's queue."""
        stage = cur.stage()
        cur.end, cur.left = stage.stop, len(stage)
        for i in stage:
            run = cur.runs[i]
            g = self.group(run.node, run.walk)
            self.queues.setdefault((g.leader, self.module_of(run.node)), []).append(_Item(t, next(self.seq), cur, i))
            self.push(t, "try", g.leader)

    def _pick(self, t: float, rank: int) -> tuple[str, str] | None:
        """The module this rank runs next: an item that waited past the limit first (oldest), else
        the deepest partition's (``downstream_first``), else the oldest (FCFS)."""
        best = None
        for key, q in self.queues.items():
            ready = [it for it in q if it.ready <= t]
            if key[0] != rank or not ready:
                continue
            oldest = min(ready)
            depth = max(it.cursor.depth for it in ready) if self.downstream_first else 0
            late = t - oldest.ready > self.max_wait
            order = (0, oldest.ready) if late else (1, -depth, oldest.ready)
            if best is None or order < best[0]:
                best = (order, key)
        return None if best is None else best[1]

    def try_start(self, t: float, rank: int) -> None:
        if self.free_at.get(rank, 0.0) > t + 1e-12:
            return
        key = self._pick(t, rank)
        if key is None:
            return
        q = self.queues[key]
        first = min(it for it in q if it.ready <= t).run
        g = self.group(first.node, first.walk)
        if any(self.free_at.get(r, 0.0) > t + 1e-12 for r in g.ranks):
            return
        q.sort()
        take = [it for it in q if it.ready <= t][:g.max_batch]
        for it in take:
            q.remove(it)
        runs = [it.run for it in take]
        fit = self.p.cost(key[1], g.tp, g.threads, all(r.final for r in runs))
        cost = fit.ms(len(runs), sum(r.tokens for r in runs), sum(r.tokens * r.context for r in runs))
        cost *= fit.draw(self.rng.random())  # as far off the fit as a measured forward may be
        # its threads went to sleep, its caches cold: the longer it idled, the more it pays
        cost += self.p.rank_timing(g.threads).wake_ms(max(self._idle(r, t) for r in g.ranks), self.rng.random())
        self._progress(t)
        self.computing[g.ranks] = _Forward(g, take, cost / 1e3, t, t)
        for r in g.ranks:
            self.free_at[r] = float("inf")
        self._reschedule(t)

    def _idle(self, rank: int, t: float) -> float:
        """How long ``rank`` has been idle at ``t`` (0 while it computes; forever before its first forward)."""
        if self.free_at.get(rank, 0.0) > t:
            return 0.0
        return t - self.last_end[rank] if rank in self.last_end else float("inf")

    def _progress(self, t: float) -> None:
        """Bring every forward in flight up to ``t`` at the speed the ranks computing together allow."""
        speed = 1.0 / self._slowdown()
        for f in self.computing.values():
            f.left = max(0.0, f.left - (t - f.since) * speed)
            f.since = t

    def _reschedule(self, t: float) -> None:
        """(Re)schedule the end of every forward in flight (processor sharing: each ends at the pace of
        the ranks computing now; an older scheduled end is stale once its version moved on)."""
        slow = self._slowdown()
        for f in self.computing.values():
            f.version += 1
            self.push(t + f.left * slow, "done", (f, f.version))

    def finish(self, t: float, f: _Forward, version: int) -> None:
        if version != f.version or self.computing.get(f.group.ranks) is not f:
            return  # rescheduled since
        self._progress(t)
        del self.computing[f.group.ranks]
        self._reschedule(t)
        g, items = f.group, f.items
        for r in g.ranks:
            self.free_at[r] = t + self.p.rank_timing(g.threads).step_gap_ms / 1e3
            self.busy[r] = self.busy.get(r, 0.0) + t - f.started
            self.last_end[r] = t
        for it in items:
            cur, run = it.cursor, it.run
            req = cur.req
            if (run.walk, run.node) in self.emitting and req.first_emit is None:
                req.first_emit = t
            self._hold_kv(g.leader, run)
            self.node_runs[run.node] = self.node_runs.get(run.node, 0) + 1
            if cur.consumer is None:
                self._pushed(t, req, run)
            cur.left -= 1
            if cur.left:
                continue  # a parallel branch still runs
            cur.at = cur.end
            if cur.consumer is None:
                self._root_ran(t, req, run, g)
            elif cur.at < len(cur.runs):
                self.ready(t + (self.p.rank_timing(g.threads).step_gap_ms + self._hop(g.leader, cur)) / 1e3, cur)
            else:
                cur.consumer.cursor = None
                self._next_firing(t, req, cur.consumer)
        for r in g.ranks:
            self.push(self.free_at[r], "try", r)

    def _hop(self, src: int, cur: _Cursor) -> float:
        """A hop (drawn from ``Profile.hop_ms``) when a run of the cursor's next stage is on another rank
        than ``src``."""
        leaders = {self.group(cur.runs[i].node, cur.runs[i].walk).leader for i in cur.stage()}
        return self.p.hop(self.rng.random()) if leaders - {src} else 0.0

    def _pushed(self, t: float, req: _Request, run: ProgramRun) -> None:
        """A root run's stream items: one per run, until the stream's count."""
        for c in req.consumers:
            if c.shape.partition in self.producers.get((run.walk, run.node), ()) and c.pushed < c.items:
                c.pushed += 1
                self._fired(t, req, c, c.policy.push([None]))

    def _root_ran(self, t: float, req: _Request, run: ProgramRun, g: _Group) -> None:
        """The root partition's stage ended with ``run`` (on ``g``): its next stage, or its end."""
        cur = req.root
        if cur.at < len(cur.runs):
            nxt = cur.runs[cur.at]
            delay = self.p.rank_timing(g.threads).step_gap_ms + self._hop(g.leader, cur)
            if nxt.walk_index != run.walk_index:
                dest = self.group(nxt.node, nxt.walk)
                delay = self.p.rank_timing(g.threads).walk_gap_ms
                if dest.leader != g.leader and nxt.context > nxt.tokens:  # the KV moves, waking its new rank
                    delay = self.p.move_ms.at(run.context, 0) + self.p.rank_timing(dest.threads).woken_ms(
                        max(self._idle(r, t) for r in dest.ranks), self.rng.random())
            self.ready(t + delay / 1e3, cur)
            return
        req.root_done = True
        for c in req.consumers:
            c.closed = True
            self._fired(t, req, c, c.policy.finish())
        self._maybe_end(t, req)

    def _fired(self, t: float, req: _Request, c: _Consumer, chunks: list) -> None:
        for chunk in chunks:
            shape = c.shape.final if chunk.is_final and c.shape.final is not None else c.shape.firing
            c.pending.append(expand_walk(shape, 0, req.arrival.prompt_tokens, req.arrival.output_tokens,
                                         chunk.is_final, self.levels))
        self._next_firing(t, req, c)

    def _next_firing(self, t: float, req: _Request, c: _Consumer) -> None:
        """The consumer's next fired walk, if it is free."""
        while c.cursor is None and c.pending:
            runs = c.pending.popleft()
            if runs:
                c.cursor = _Cursor(req, runs, 1, consumer=c)
                g = self.group(runs[0].node, runs[0].walk)
                self.ready(t + self.p.rank_timing(g.threads).stream_gap_ms / 1e3, c.cursor)
        self._maybe_end(t, req)

    def _client(self, req: _Request, t: float) -> dict[str, float]:
        """The request's client overheads, drawn once (seeded) from the profiled spread when it is
        submitted at ``t``, after its first rank idled as long as it has then."""
        if req.client is None:
            g = self.group(req.root.runs[0].node, req.root.runs[0].walk)
            req.client = self.p.client(g.threads, max(self._idle(r, t) for r in g.ranks), self.rng.random())
        return req.client

    def _hold_kv(self, rank: int, run: ProgramRun) -> None:
        self.kv[rank] = self.kv.get(rank, 0) + run.tokens
        self.peak[rank] = max(self.peak.get(rank, 0), self.kv[rank])

    def _maybe_end(self, t: float, req: _Request) -> None:
        if not req.root_done or not all(c.idle for c in req.consumers) or req.root is None:
            return
        a, cur, client = req.arrival, req.root, self._client(req, t)
        req.root = None  # ended: counted once
        held: dict[int, int] = {}
        for run in cur.runs:
            leader = self.group(run.node, run.walk).leader
            held[leader] = held.get(leader, 0) + run.tokens
        for rank, n in held.items():
            self.kv[rank] -= n
        e2e = t + client.get("end", 0.0) / 1e3 - a.at_s
        ttft = (req.first_emit + client.get("emit", 0.0) / 1e3 if req.first_emit is not None else t) - a.at_s
        ttft = min(ttft, e2e)  # drawn overheads aside, a client never sees its first item after the end
        tpot = (e2e - ttft) / (a.output_tokens - 1) if a.output_tokens > 1 else None
        self.done.append(RequestTimes(a.request_class, a.at_s, ttft, e2e, tpot))

    def run(self, requests: Iterable[_Request]) -> None:
        for req in requests:
            self.push(req.arrival.at_s, "submit", req)
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if kind == "submit":
                self.push(t + self._client(payload, t).get("submit", 0.0) / 1e3, "arrive", payload)
            elif kind == "arrive":
                self.ready(t, payload.root)
            elif kind == "try":
                self.try_start(t, payload)
            else:
                self.finish(t, *payload)


def simulate(profile: Profile, placement: Any, graph: Any, module_of: Any, arrivals: Sequence[Arrival],
             seed: int = 0) -> Prediction:
    """Predicted latencies of ``arrivals`` served on ``placement`` (module docstring); ``seed`` draws
    the forwards' spread."""
    sim = _Sim(profile, placement, module_of, graph, seed)
    policies = {c.to_partition: c.chunk_policy_factory for c in graph.topology.connections}
    reqs = []
    for a in arrivals:
        if a.request_class not in profile.programs:
            raise ValueError(f"the profile has no program of request class {a.request_class!r}: profile again")
        program = profile.programs[a.request_class]
        consumers = [_Consumer(c, policies[c.partition](), max(0, round(c.items.at(a.prompt_tokens, a.output_tokens))))
                     for c in program.consumers]
        req = _Request(a, consumers)
        req.root = _Cursor(req, program.expand(a.prompt_tokens, a.output_tokens, sim.levels), 0)
        reqs.append(req)
    sim.run(reqs)
    start = min((a.at_s for a in arrivals), default=0.0)
    end = max((r.arrival_s + r.e2e for r in sim.done), default=start)
    return Prediction(sorted(sim.done, key=lambda r: r.arrival_s), end - start, sim.busy, sim.peak, sim.node_runs)
