"""Where things run: the placement applied to a model's walks, computed once per runtime."""

from __future__ import annotations

from mstar.graph import InputKind, WalkGraph
from mstar.placement import Placement


class Routing:
    def __init__(self, graph: WalkGraph, placement: Placement) -> None:
        self.graph = graph
        self.placement = placement
        self.num_ranks = placement.num_ranks
        self._ranks = {(n, w): placement.ranks_of(n, w)[0] for w, plan in graph.plans.items() for n in plan.nodes}
        self._home: dict[str, int] = {}
        for name, plan in graph.plans.items():
            streamed = [n for n in plan.nodes.values()
                        if any((b.initial if b.kind is InputKind.CARRIED else b).kind is InputKind.STREAM
                               for b in n.inputs.values())]
            first = (streamed or list(plan.nodes.values()))[0].name
            self._home[name] = self.rank_of(first, name)
        self.partition_home: dict[str, int] = {}
        for part in graph.partitions:
            homes = {self._home[w] for w in graph.walks_of(part)}
            if part not in graph.root_partitions and len(homes) > 1:
                raise ValueError(f"the walks of streaming partition {part!r} start on different ranks "
                                 f"{sorted(homes)}; place their first nodes on one rank (its stream buffers live there)")
            self.partition_home[part] = min(homes)
        self.producers: dict[str, set[str]] = {p: set() for p in graph.partitions}
        for c in graph.topology.connections:
            self.producers[c.to_partition].add(c.from_partition)
        self.stage: dict[str, int] = {}  # partition -> streams above it (0: a root partition)
        for part in graph.partitions:
            self._stage_of(part, ())

    def _stage_of(self, part: str, path: tuple[str, ...]) -> int:
        if part not in self.stage:
            above = [self._stage_of(p, path + (part,)) for p in self.producers[part] if p not in path]
            self.stage[part] = 1 + max(above, default=-1)
        return self.stage[part]

    def rank_of(self, node: str, walk: str) -> int:
        return self._ranks[(node, walk)]

    def home(self, walk: str) -> int:
        return self._home[walk]

    def chunk_policy_factory(self, from_partition: str, to_partition: str, edge: str):
        return self.graph.topology.connection(from_partition, to_partition, edge).chunk_policy_factory

    def consumers_of(self, partition: str) -> set[str]:
        return {c.to_partition for c in self.graph.topology.connections if c.from_partition == partition}
