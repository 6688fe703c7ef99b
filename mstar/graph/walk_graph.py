"""A model's Walk Graph: its named walks, their partitions, and the streams between partitions.

Constructing a ``WalkGraph`` validates every walk and the topology and compiles each walk into a
``WalkPlan``. A graph that constructs is one the runtime can execute.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from mstar.graph.compiler import compile_walk
from mstar.graph.plan import WalkPlan
from mstar.graph.render import describe_plan
from mstar.graph.sections import Section
from mstar.graph.topology import DEFAULT_PARTITION, PartitionTopology


@dataclass(frozen=True)
class Walk:
    """A named walk: the section it runs, the request-state values it reads, its partition."""

    name: str
    section: Section
    inputs: Sequence[str] = ()
    partition: str = DEFAULT_PARTITION

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"walk name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.section, Section):
            raise ValueError(f"walk {self.name!r}: section must be a GraphNode/Sequential/Parallel/Loop, "
                             f"got {type(self.section).__name__}")
        ins = tuple(self.inputs)
        if len(set(ins)) != len(ins):
            raise ValueError(f"walk {self.name!r}: duplicate inputs in {list(ins)}")
        object.__setattr__(self, "inputs", ins)


class WalkGraph:
    """Validated, compiled set of walks.

    ``walks``: a sequence of ``Walk`` or a mapping name -> ``Walk`` | section (a bare section is a
    walk with no inputs in the default partition). ``nodes``: optionally, every component the model
    provides; one that no walk uses is reported as unreachable.
    """

    def __init__(self, walks: Sequence[Walk] | Mapping[str, Walk | Section],
                 topology: PartitionTopology | None = None, nodes: Iterable[str] | None = None) -> None:
        self.walks: dict[str, Walk] = _normalise_walks(walks)
        self.topology = topology or PartitionTopology()
        self.partitions: tuple[str, ...] = self._check_partitions()
        used = {n.name for w in self.walks.values() for n in w.section.iter_nodes()}
        stream_inputs = self._check_streams(used)
        self.plans: dict[str, WalkPlan] = {}
        for name, walk in self.walks.items():
            self.plans[name] = compile_walk(
                name, walk.section, walk.inputs, walk.partition, stream_inputs.get(walk.partition, {}), used)
        self.node_names: frozenset[str] = frozenset(used)
        if nodes is not None:
            unused = sorted(set(nodes) - used)
            if unused:
                raise ValueError(f"nodes {unused} are unreachable: no walk uses them")
        consumers = self.topology.consumers()
        self.root_partitions: tuple[str, ...] = tuple(p for p in self.partitions if p not in consumers)

    # -- queries ---------------------------------------------------------------------------------
    def walks_of(self, partition: str) -> tuple[str, ...]:
        return tuple(n for n, w in self.walks.items() if w.partition == partition)

    def nodes_in(self, walk: str) -> frozenset[str]:
        return self.plan(walk).node_names

    def plan(self, walk: str) -> WalkPlan:
        try:
            return self.plans[walk]
        except KeyError:
            raise KeyError(f"unknown walk {walk!r}; walks: {sorted(self.plans)}") from None

    def describe(self, walk: str | None = None) -> str:
        names = [walk] if walk else list(self.plans)
        return "\n\n".join(describe_plan(self.plan(n)) for n in names)

    def to_dot(self, walk: str) -> str:
        from mstar.graph.render import plan_to_dot

        return plan_to_dot(self.plan(walk), self.walks[walk].section)

    # -- validation helpers --------------------------------------------------------------------------
    def _check_partitions(self) -> tuple[str, ...]:
        named = tuple(dict.fromkeys(w.partition for w in self.walks.values()))
        declared = self.topology.partitions
        if declared is not None:
            undeclared = [p for p in named if p not in declared]
            if undeclared:
                raise ValueError(f"walks use partitions {undeclared} missing from PartitionTopology.partitions "
                                 f"{list(declared)}")
            empty = [p for p in declared if p not in named]
            if empty:
                raise ValueError(f"partitions {empty} have no walks")
            parts = tuple(declared)
        else:
            parts = named
        for c in self.topology.connections:
            for p in (c.from_partition, c.to_partition):
                if p not in parts:
                    raise ValueError(f"Connection {c.edge_name!r} ({c.from_partition} -> {c.to_partition}) names "
                                     f"unknown partition {p!r}; partitions: {list(parts)}")
        _check_acyclic(parts, [(c.from_partition, c.to_partition) for c in self.topology.connections])
        return parts

    def _check_streams(self, used: set[str]) -> dict[str, dict[tuple[str, str], str]]:
        """Check every streaming edge against the topology; return stream inputs per partition."""
        consumers: dict[str, dict[str, set[str]]] = {}  # partition -> node -> input names
        for w in self.walks.values():
            for node in w.section.iter_nodes():
                consumers.setdefault(w.partition, {}).setdefault(node.name, set()).update(node.input_names)
        stream_inputs: dict[str, dict[tuple[str, str], str]] = {}
        used_conns = set()
        for wname, w in self.walks.items():
            for node in w.section.iter_nodes():
                for e in node.outputs:
                    if not e.is_streaming:
                        continue
                    where = f"walk {wname!r}: node {node.name!r}, streaming edge {e.name!r}"
                    target = e.target_partition
                    if target not in self.partitions:
                        raise ValueError(f"{where} targets unknown partition {target!r}; "
                                         f"partitions: {list(self.partitions)}")
                    if target == w.partition:
                        raise ValueError(f"{where} streams into its own partition {target!r}; use a GraphEdge")
                    conn = self.topology.connection(w.partition, target, e.name)
                    if conn is None:
                        raise ValueError(f"{where}: partitions {w.partition!r} and {target!r} are not connected "
                                         f"for {e.name!r}; add Connection(from_partition={w.partition!r}, "
                                         f"to_partition={target!r}, edge_name={e.name!r}, ...) to the topology")
                    if e.name not in consumers[target].get(e.next_node, set()):
                        raise ValueError(f"{where}: no walk of partition {target!r} has node {e.next_node!r} "
                                         f"with input {e.name!r}")
                    used_conns.add(conn)
                    stream_inputs.setdefault(target, {})[(e.next_node, e.name)] = w.partition
        for c in self.topology.connections:
            if c not in used_conns:
                raise ValueError(f"Connection {c.edge_name!r} ({c.from_partition} -> {c.to_partition}) is used "
                                 f"by no StreamingGraphEdge")
        return stream_inputs


def _normalise_walks(walks: Sequence[Walk] | Mapping[str, Walk | Section]) -> dict[str, Walk]:
    out: dict[str, Walk] = {}
    if isinstance(walks, Mapping):
        items = []
        for name, w in walks.items():
            if isinstance(w, Walk):
                if w.name != name:
                    raise ValueError(f"walk registered as {name!r} is named {w.name!r}")
                items.append(w)
            else:
                items.append(Walk(name, w))
    else:
        items = list(walks)
    if not items:
        raise ValueError("a WalkGraph needs at least one walk")
    for w in items:
        if not isinstance(w, Walk):
            raise ValueError(f"walks must be Walk instances, got {type(w).__name__}")
        if w.name in out:
            raise ValueError(f"duplicate walk name {w.name!r}")
        out[w.name] = w
    return out


def _check_acyclic(parts: Sequence[str], edges: list[tuple[str, str]]) -> None:
    succ: dict[str, set[str]] = {p: set() for p in parts}
    for a, b in edges:
        succ[a].add(b)
    state: dict[str, int] = {}

    def visit(p: str, path: list[str]) -> None:
        state[p] = 1
        for q in sorted(succ[p]):
            if state.get(q) == 1:
                cycle = path[path.index(q):] + [q] if q in path else [p, q]
                raise ValueError(f"partition streams form a cycle: {' -> '.join(cycle)}")
            if q not in state:
                visit(q, path + [q])
        state[p] = 2

    for p in parts:
        if p not in state:
            visit(p, [p])
