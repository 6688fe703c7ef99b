"""The search: which placement of a model's nodes over ``ranks`` ranks is the cheapest that meets
the SLO under the workload, as the simulator predicts.

Candidates (``candidates``):

* every way to split the model's heaviest nodes (by their share of the work on one rank, at most
  ``HEAVY`` of them) over up to ``ranks`` ranks, the other nodes on rank 0;
* each of those with one KV module's walks split (its first walk where it is, the later ones on
  another rank: a prefill / decode split; the caches move at the walk boundary);
* each of those over several ranks also with the cores split evenly between its ranks (the groups'
  ``threads``), where the profile measured that thread count;
* every node as one tensor-parallel group over all ranks, when the profile measured it.

Each is simulated on the workload's arrivals. The cost of a placement is the ranks it uses; the plan
is the cheapest whose predicted percentiles meet every objective, the higher goodput (requests
within every limit per second) first among equals. When none meets the SLO the plan says so and
gives the placement with the best goodput (then the smallest shortfall), with its figures.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mstar.planner.profile import Profile
from mstar.planner.simulate import Prediction, simulate
from mstar.planner.slo import SLO, Verdict
from mstar.planner.workload import Arrival, Workload

__all__ = ["Candidate", "Evaluated", "Plan", "candidates", "describe", "evaluate", "goodput", "naive_groups", "plan"]

HEAVY = 4  # nodes whose placement is searched; lighter ones stay on rank 0


@dataclass(frozen=True)
class Candidate:
    name: str
    groups: tuple[dict[str, Any], ...]

    @property
    def ranks_used(self) -> int:
        return len({r for g in self.groups for r in g["ranks"]})

    def placement_dict(self, model: str, max_batch: int) -> dict[str, Any]:
        return {"model": model, "node_groups": [dict(g) for g in self.groups],
                "runtime": {"max_batch_size": max_batch}}


@dataclass(frozen=True)
class Evaluated:
    candidate: Candidate
    prediction: Prediction
    verdicts: tuple[Verdict, ...]
    goodput: float

    @property
    def met(self) -> bool:
        return all(v.met for v in self.verdicts)

    @property
    def shortfall(self) -> float:
        """The worst objective's predicted value over its limit (<= 1 when every one is met)."""
        return max((v.value_s / v.objective.limit_s if v.value_s is not None else float("inf"))
                   for v in self.verdicts)

    def rank_key(self) -> tuple:
        """Meeting the SLO first; then fewer ranks and more goodput; short of it, more goodput and the
        smaller shortfall."""
        if self.met:
            return (0, self.candidate.ranks_used, -self.goodput, self.candidate.name)
        return (1, -self.goodput, self.shortfall, self.candidate.name)


@dataclass(frozen=True)
class Plan:
    chosen: Evaluated
    feasible: bool  # the chosen placement meets the SLO (else it is the best achievable)
    evaluated: tuple[Evaluated, ...]  # every candidate, best first


def goodput(prediction: Prediction, slo: SLO, duration_s: float) -> float:
    """Requests within every objective's limit per second, over the workload's duration or, when the
    last request ends later, until then."""
    good = sum(slo.request_meets(r.samples()) for r in prediction.requests)
    return good / max(duration_s, prediction.makespan_s, 1e-9)


def _splits(items: Sequence[str], ranks: int) -> Iterator[list[int]]:
    """Every assignment of ``items`` to ranks 0..ranks-1 up to renaming the ranks (each new rank is
    the next unused one; the first item is on rank 0)."""
    def grow(prefix: list[int]) -> Iterator[list[int]]:
        if len(prefix) == len(items):
            yield list(prefix)
            return
        for r in range(min(ranks, max(prefix, default=-1) + 2)):
            yield from grow([*prefix, r])
    yield from grow([])


def _heaviest(profile: Profile, model: Any, workload: Workload, arrivals: Sequence[Arrival]) -> list[str]:
    """Nodes by their predicted compute on one rank (most first), at most ``HEAVY``."""
    work: dict[str, float] = {}
    for a in arrivals[:200]:
        for run in profile.programs[a.request_class].expand(a.prompt_tokens, a.output_tokens):
            cost = profile.cost(model.module_of(run.node)).ms(1, run.tokens, run.tokens * run.context)
            work[run.node] = work.get(run.node, 0.0) + cost
    names = sorted(model.graph.node_names)
    return sorted(names, key=lambda n: (-work.get(n, 0.0), n))[:HEAVY]


def _walk_split(model: Any, node: str, walks: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    used = [w for w in walks if node in model.graph.nodes_in(w)]
    return (tuple(used[:1]), tuple(used[1:])) if len(used) > 1 else None


def candidates(model: Any, profile: Profile, ranks: int, heavy: Sequence[str]) -> list[Candidate]:
    """The placements the search simulates (module docstring)."""
    walks, kv = list(model.graph.walks), set(profile.kv_bytes_per_token)
    rest = sorted(model.graph.node_names - set(heavy))
    out: list[Candidate] = []
    for assign in _splits(heavy, ranks):
        on: dict[int, list[str]] = {}
        for node, r in zip(heavy, assign):
            on.setdefault(r, []).append(node)
        on.setdefault(0, [])
        on[0] += rest
        base = tuple({"node_names": sorted(ns), "ranks": [r]} for r, ns in sorted(on.items()) if ns)
        out += _with_threads(base, profile)
        for node, r in zip(heavy, assign):
            split = _walk_split(model, node, walks) if node in kv else None
            if split is None:
                continue
            for other in range(min(ranks, len(on) + 1)):
                if other == r:
                    continue
                groups = [dict(g, node_names=[n for n in g["node_names"] if n != node]) for g in base]
                groups = [g for g in groups if g["node_names"]]
                groups += [{"node_names": [node], "ranks": [r], "graph_walks": list(split[0])},
                           {"node_names": [node], "ranks": [other], "graph_walks": list(split[1])}]
                out += _with_threads(groups, profile)
    if ranks in profile.tp_sizes and ranks > 1:
        groups = naive_groups(model, ranks)
        out.append(Candidate(describe(groups), tuple(groups)))
    return out


def _with_threads(groups: Sequence[dict[str, Any]], profile: Profile) -> list[Candidate]:
    """The groups as they are (each rank on every core) and, over several ranks, with the cores split
    evenly between the ranks, when the profile measured that thread count."""
    out = [Candidate(describe(groups), tuple(groups))]
    used = {r for g in groups for r in g["ranks"]}
    share = profile.cores // len(used)
    if len(used) > 1 and share >= 1 and share in profile.threads:
        split = tuple(dict(g, threads=share) for g in groups)
        out.append(Candidate(describe(split), split))
    return out


def describe(groups: Sequence[dict[str, Any]]) -> str:
    """``rank 0: LLM (prefill); rank 1: LLM (decode)``; a TP group as ``ranks 0-1 (TP2): ...``."""
    parts = []
    for g in groups:
        ranks = g["ranks"]
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]} (TP{g.get('tp_size', 1)})"
        walks = f" ({', '.join(g['graph_walks'])})" if g.get("graph_walks") else ""
        threads = f" [{g['threads']} thread{'s' if g['threads'] > 1 else ''}]" if g.get("threads") else ""
        parts.append(f"{where}{threads}: {', '.join(g['node_names'])}{walks}")
    return "; ".join(parts)


def naive_groups(model: Any, ranks: int) -> list[dict[str, Any]]:
    """Everything on every rank: every node in one group over all ``ranks`` (tensor parallel)."""
    return [{"node_names": sorted(model.graph.node_names), "ranks": list(range(ranks)), "tp_size": ranks}]


def evaluate(c: Candidate, model: Any, profile: Profile, workload: Workload, slo: SLO,
             arrivals: Sequence[Arrival]) -> Evaluated | None:
    """The candidate simulated on the arrivals; None when it is not a valid placement of the model."""
    from mstar.placement import Placement, PlacementError

    try:
        placement = Placement.from_dict(c.placement_dict(model.name, profile.max_batch)).validate(model.graph)
    except PlacementError:
        return None
    pred = simulate(profile, placement, model.graph, model.module_of, arrivals)
    return Evaluated(c, pred, tuple(slo.evaluate(pred.samples())), goodput(pred, slo, workload.duration_s))


def plan(model: Any, profile: Profile, workload: Workload, slo: SLO, ranks: int) -> Plan:
    """The cheapest placement meeting ``slo`` (module docstring)."""
    arrivals = workload.arrivals()
    if not arrivals:
        raise ValueError("the workload draws no request in its duration: raise arrival_rate or duration_s")
    missing = sorted({c.name for c in workload.requests} - set(profile.programs))
    if missing:
        raise ValueError(f"the profile has no program of request class {missing[0]!r} (it has "
                         f"{', '.join(sorted(profile.programs))}): profile this workload again")
    heavy = _heaviest(profile, model, workload, arrivals)
    done = [e for c in candidates(model, profile, ranks, heavy)
            if (e := evaluate(c, model, profile, workload, slo, arrivals)) is not None]
    if not done:
        raise ValueError(f"no candidate placement of {model.name} over {ranks} ranks is valid")
    done.sort(key=Evaluated.rank_key)
    return Plan(done[0], done[0].met, tuple(done))
