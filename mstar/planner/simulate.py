"""A discrete-event simulator of the runtime's scheduling, priced by a ``Profile``.

It replays a workload's arrivals against a placement the way the workers run them:

* each request runs its class's program (``ClassProgram.expand``): node runs one after another,
  walk after walk;
* a node run waits in its module's queue on the rank its (node, walk) group places it (a
  tensor-parallel group's leader; the forward occupies every rank of the group);
* a free rank runs the module whose oldest queued item came first (FCFS), batching up to the
  group's ``max_batch_size`` of its queue, prompts and decode rows together (continuous batching);
* a forward takes the module's ``ForwardCost`` for its rows, new tokens and context, times the
  contention of the groups computing at once (``Profile.slowdown``); then the rank's step gap;
* a request reaches its first queue after the client-to-worker time, its first item and its end
  reach the client after theirs (``Profile.client_ms``);
* a request's next run is ready after the step gap, or at a walk boundary after the walk gap, or,
  when its KV module moves to another group, after the KV move (``Profile.move_ms``).

What it does not model (yet): KV admission and preemption (it reports each rank's peak KV instead),
streams between partitions, parallel branches inside a walk (runs of one request are sequential).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mstar.planner.profile import Profile
from mstar.planner.programs import ProgramRun, emitting_runs
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

    @property
    def leader(self) -> int:
        return self.ranks[0]


@dataclass
class _Request:
    arrival: Arrival
    runs: list[ProgramRun]
    emits: list[bool]
    at: int = 0
    first_emit: float | None = None


@dataclass(order=True)
class _Item:
    ready: float
    seq: int
    req: _Request = field(compare=False)


class _Sim:
    def __init__(self, profile: Profile, placement: Any, module_of: Any, emitting: set[tuple[str, str]]) -> None:
        self.p, self.placement, self.module_of, self.emitting = profile, placement, module_of, emitting
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.queues: dict[tuple[int, str], list[_Item]] = {}  # (leader rank, module) -> items
        self.free_at: dict[int, float] = {}
        self.computing: dict[tuple[int, ...], float] = {}  # group ranks -> end of its forward
        self.busy: dict[int, float] = {}
        self.kv: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.done: list[RequestTimes] = []
        self.groups: dict[tuple[str, str], _Group] = {}

    def group(self, node: str, walk: str) -> _Group:
        key = (node, walk)
        if key not in self.groups:
            g = self.placement.group_for(node, walk)
            self.groups[key] = _Group(tuple(g.ranks), g.tp_size, self.placement.max_batch_size(node, walk))
        return self.groups[key]

    def push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def ready(self, t: float, req: _Request) -> None:
        run = req.runs[req.at]
        g = self.group(run.node, run.walk)
        self.queues.setdefault((g.leader, self.module_of(run.node)), []).append(_Item(t, next(self.seq), req))
        self.push(t, "try", g.leader)

    def try_start(self, t: float, rank: int) -> None:
        if self.free_at.get(rank, 0.0) > t + 1e-12:
            return
        waiting = [(min(it.ready for it in q if it.ready <= t), key) for key, q in self.queues.items()
                   if key[0] == rank and any(it.ready <= t for it in q)]
        if not waiting:
            return
        _, key = min(waiting)
        q = self.queues[key]
        first = q[0].req.runs[q[0].req.at]
        g = self.group(first.node, first.walk)
        if any(self.free_at.get(r, 0.0) > t + 1e-12 for r in g.ranks):
            return
        q.sort()
        take = [it for it in q if it.ready <= t][:g.max_batch]
        for it in take:
            q.remove(it)
        runs = [it.req.runs[it.req.at] for it in take]
        cost = self.p.cost(key[1], g.tp).ms(len(runs), sum(r.tokens for r in runs), sum(r.context for r in runs))
        others = sum(1 for ranks, end in self.computing.items() if end > t and ranks != g.ranks)
        compute = cost * self.p.slowdown(others + 1) / 1e3
        end = t + compute
        self.computing[g.ranks] = end
        for r in g.ranks:
            self.free_at[r] = end + self.p.step_gap_ms / 1e3
            self.busy[r] = self.busy.get(r, 0.0) + compute
        self.push(end, "done", (g, take))

    def finish(self, t: float, g: _Group, items: list[_Item]) -> None:
        for it in items:
            req = it.req
            run = req.runs[req.at]
            if req.emits[req.at] and req.first_emit is None:
                req.first_emit = t
            self._hold_kv(g.leader, run)
            req.at += 1
            if req.at == len(req.runs):
                self._end(t, req)
                continue
            nxt = req.runs[req.at]
            delay = self.p.step_gap_ms
            if nxt.walk_index != run.walk_index:
                moved = self.group(nxt.node, nxt.walk).leader != g.leader and nxt.context > nxt.tokens
                delay = self.p.move_ms.at(run.context, 0) if moved else self.p.walk_gap_ms
            self.ready(t + delay / 1e3, req)
        for r in g.ranks:
            self.push(self.free_at[r], "try", r)

    def _hold_kv(self, rank: int, run: ProgramRun) -> None:
        self.kv[rank] = self.kv.get(rank, 0) + run.tokens
        self.peak[rank] = max(self.peak.get(rank, 0), self.kv[rank])

    def _end(self, t: float, req: _Request) -> None:
        a = req.arrival
        held: dict[int, int] = {}
        for run in req.runs:
            leader = self.group(run.node, run.walk).leader
            held[leader] = held.get(leader, 0) + run.tokens
        for rank, n in held.items():
            self.kv[rank] -= n
        client = self.p.client_ms
        ttft = (req.first_emit + client.get("emit", 0.0) / 1e3 if req.first_emit is not None else t) - a.at_s
        e2e = t + client.get("end", 0.0) / 1e3 - a.at_s
        tpot = (e2e - ttft) / (a.output_tokens - 1) if a.output_tokens > 1 else None
        self.done.append(RequestTimes(a.request_class, a.at_s, ttft, e2e, tpot))

    def run(self, requests: Iterable[_Request]) -> None:
        for req in requests:
            self.push(req.arrival.at_s + self.p.client_ms.get("submit", 0.0) / 1e3, "arrive", req)
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self.ready(t, payload)
            elif kind == "try":
                self.try_start(t, payload)
            else:
                self.finish(t, *payload)


def simulate(profile: Profile, placement: Any, graph: Any, module_of: Any, arrivals: Sequence[Arrival]) -> Prediction:
    """Predicted latencies of ``arrivals`` served on ``placement`` (module docstring)."""
    emitting = emitting_runs(graph)
    sim = _Sim(profile, placement, module_of, emitting)
    reqs = []
    for a in arrivals:
        if a.request_class not in profile.programs:
            raise ValueError(f"the profile has no program of request class {a.request_class!r}: profile again")
        runs = profile.programs[a.request_class].expand(a.prompt_tokens, a.output_tokens)
        reqs.append(_Request(a, runs, [(r.walk, r.node) in emitting for r in runs]))
    sim.run(reqs)
    start = min((a.at_s for a in arrivals), default=0.0)
    end = max((r.arrival_s + r.e2e for r in sim.done), default=start)
    return Prediction(sorted(sim.done, key=lambda r: r.arrival_s), end - start, sim.busy, sim.peak)
