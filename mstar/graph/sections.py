"""The Walk Graph vocabulary: nodes, edges and the four composition primitives.

These classes only describe structure. They hold no runtime state and never import torch, so a
model's graph can be declared, validated, compiled and drawn on any machine.

Vocabulary (as in the M* paper):

* ``GraphNode(name, input_names, outputs)``: one component invocation. ``name`` is the logical
  component (the deployer places it on ranks; the model maps it to a NodeSubmodule).
* ``GraphEdge(next_node, name)``: the node's output tensor ``name`` becomes input ``name`` of
  ``next_node``. Special destinations: ``EMIT_TO_CLIENT`` (stream to the caller) and ``TO_STATE``
  (keep on the request for later walks).
* ``StreamingGraphEdge(next_node, name, target_partition)``: items are pushed into a per-request
  buffer of another partition of the same request; a chunk policy decides when it fires.
* ``Sequential``, ``Parallel``, ``Loop`` and ``DynamicLoop`` compose sections.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

EMIT_TO_CLIENT = "<emit_to_client>"
"""Destination: the value is streamed to the request's client as it is produced."""

TO_STATE = "<to_state>"
"""Destination: the value is stored on the request (by edge name) for the walks that follow."""

SPECIAL_DESTINATIONS = frozenset({EMIT_TO_CLIENT, TO_STATE})


def _check_name(kind: str, name: object) -> None:
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"{kind} name must be a non-empty string without surrounding spaces, got {name!r}")


@dataclass(frozen=True)
class GraphEdge:
    """Output ``name`` of a node, delivered as input ``name`` of ``next_node``."""

    next_node: str
    name: str
    output_modality: str | None = None

    def __post_init__(self) -> None:
        _check_name("edge", self.name)
        if not isinstance(self.next_node, str) or not self.next_node:
            raise ValueError(f"edge {self.name!r}: next_node must be a node name or a special destination")
        if self.output_modality is not None and self.next_node != EMIT_TO_CLIENT:
            raise ValueError(
                f"edge {self.name!r}: output_modality only applies to edges to EMIT_TO_CLIENT "
                f"(this one goes to {self.next_node!r})"
            )

    @property
    def is_streaming(self) -> bool:
        return False


@dataclass(frozen=True)
class StreamingGraphEdge(GraphEdge):
    """Output ``name`` pushed, item by item, into ``next_node`` of partition ``target_partition``."""

    target_partition: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_name("target partition of streaming edge", self.target_partition)
        if self.next_node in SPECIAL_DESTINATIONS:
            raise ValueError(f"streaming edge {self.name!r} must target a node, not {self.next_node}")

    @property
    def is_streaming(self) -> bool:
        return True


class Section:
    """A piece of a walk: a node or a composition of sections."""

    def iter_nodes(self) -> Iterator[GraphNode]:
        raise NotImplementedError

    def iter_loops(self) -> Iterator[Loop]:
        raise NotImplementedError

    @property
    def label(self) -> str:
        raise NotImplementedError


def _as_sections(kind: str, sections: Sequence[Section]) -> tuple[Section, ...]:
    items = tuple(sections)
    if not items:
        raise ValueError(f"{kind} needs at least one section")
    for s in items:
        if not isinstance(s, Section):
            raise ValueError(f"{kind} sections must be GraphNode/Sequential/Parallel/Loop, got {type(s).__name__}")
    return items


@dataclass(frozen=True, eq=False)
class GraphNode(Section):
    name: str
    input_names: Sequence[str] = ()
    outputs: Sequence[GraphEdge] = ()

    def __post_init__(self) -> None:
        _check_name("node", self.name)
        if self.name in SPECIAL_DESTINATIONS:
            raise ValueError(f"{self.name!r} is reserved and cannot name a node")
        names = tuple(self.input_names)
        seen: set[str] = set()
        for n in names:
            _check_name(f"input of node {self.name!r}", n)
            if n in seen:
                raise ValueError(f"node {self.name!r} lists input {n!r} twice")
            seen.add(n)
        object.__setattr__(self, "input_names", names)
        outs = tuple(self.outputs)
        keys: set[tuple[str, str, str]] = set()
        for e in outs:
            if not isinstance(e, GraphEdge):
                raise ValueError(f"node {self.name!r}: outputs must be GraphEdge, got {type(e).__name__}")
            key = (e.next_node, e.name, getattr(e, "target_partition", ""))
            if key in keys:
                raise ValueError(f"node {self.name!r} declares edge {e.name!r} to {e.next_node!r} twice")
            keys.add(key)
        object.__setattr__(self, "outputs", outs)

    def iter_nodes(self) -> Iterator[GraphNode]:
        yield self

    def iter_loops(self) -> Iterator[Loop]:
        return iter(())

    @property
    def label(self) -> str:
        return self.name

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.name for e in self.outputs))


@dataclass(frozen=True, eq=False)
class _Composite(Section):
    sections: Sequence[Section]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sections", _as_sections(type(self).__name__, self.sections))

    def iter_nodes(self) -> Iterator[GraphNode]:
        for s in self.sections:
            yield from s.iter_nodes()

    def iter_loops(self) -> Iterator[Loop]:
        for s in self.sections:
            yield from s.iter_loops()

    @property
    def label(self) -> str:
        return type(self).__name__


@dataclass(frozen=True, eq=False)
class Sequential(_Composite):
    """Sections run one after another; a later section consumes earlier outputs."""


@dataclass(frozen=True, eq=False)
class Parallel(_Composite):
    """Independent branches that may run at the same time; a later node joins their outputs."""


@dataclass(frozen=True, eq=False)
class Loop(Section):
    """Run ``section`` ``max_iters`` times.

    Edges from a body node back to a node at the same or an earlier position in the body are
    feedback edges: they feed the next iteration. When the loop ends, the last iteration's value
    of each name in ``outputs`` leaves the loop along that edge. Names listed in ``accumulate``
    leave as the list of every iteration's value instead of the last one.
    """

    section: Section
    max_iters: int | None = None
    outputs: Sequence[GraphEdge] = ()
    name: str | None = None
    accumulate: Sequence[str] = ()

    dynamic = False

    def __post_init__(self) -> None:
        if not isinstance(self.section, Section):
            raise ValueError(f"loop body must be a section, got {type(self.section).__name__}")
        first = next(self.section.iter_nodes()).name
        if self.name is None:
            object.__setattr__(self, "name", f"{first}_loop")
        _check_name("loop", self.name)
        bound = self.max_iters
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
            raise ValueError(
                f"loop {self.name!r} has no bound: max_iters must be a positive int, got {bound!r} "
                f"(a DynamicLoop may stop early, but still needs a max_iters bound)"
            )
        outs = tuple(self.outputs)
        for e in outs:
            if not isinstance(e, GraphEdge) or e.is_streaming:
                raise ValueError(f"loop {self.name!r}: outputs must be plain GraphEdge instances")
        object.__setattr__(self, "outputs", outs)
        acc = tuple(self.accumulate)
        unknown = set(acc) - {e.name for e in outs}
        if unknown:
            raise ValueError(f"loop {self.name!r}: accumulate names {sorted(unknown)} are not loop outputs")
        object.__setattr__(self, "accumulate", acc)

    def iter_nodes(self) -> Iterator[GraphNode]:
        yield from self.section.iter_nodes()

    def iter_loops(self) -> Iterator[Loop]:
        yield self
        yield from self.section.iter_loops()

    @property
    def label(self) -> str:
        return f"Loop {self.name} (max_iters={self.max_iters})"


@dataclass(frozen=True, eq=False)
class DynamicLoop(Loop):
    """A loop each request may leave early (EOS, rollout horizon).

    ``stop_node`` (default: the body's only node) returns, besides its edges, an output named
    ``stop_signal``: one boolean per request, true when that request's loop should end after this
    iteration. ``defer_stop_check`` declares that running one extra iteration past the stop is
    harmless (its results are discarded), so the runtime may schedule iteration i+1 before it has
    read iteration i's stop flag.
    """

    stop_signal: str = "stop"
    stop_node: str | None = None
    defer_stop_check: bool = False

    dynamic = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_name("stop signal", self.stop_signal)
        names = [n.name for n in self.section.iter_nodes()]
        if self.stop_node is None:
            if len(names) != 1:
                raise ValueError(
                    f"dynamic loop {self.name!r} has several body nodes {names}: name the one that "
                    f"produces {self.stop_signal!r} with stop_node="
                )
            object.__setattr__(self, "stop_node", names[0])
        elif self.stop_node not in names:
            raise ValueError(
                f"dynamic loop {self.name!r}: stop_node {self.stop_node!r} is not in its body {names}"
            )

    @property
    def label(self) -> str:
        return f"DynamicLoop {self.name} (max_iters={self.max_iters}, stop={self.stop_node}.{self.stop_signal})"
