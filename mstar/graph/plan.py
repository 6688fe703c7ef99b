"""The compiled form of a walk: an explicit, inspectable plan the runtime executes.

A ``WalkPlan`` answers, without looking at the declaration again, every question the runtime asks
while a request walks: which nodes fire first, which inputs each node waits for and where each
comes from, where each output goes, which loop frame a node runs in and when that frame ends.

Execution model (what the runtime implements):

* A *frame* is the top level of the walk or one run of a loop body. Loops nest; a node belongs to
  its innermost loop (``NodePlan.frame``; ``None`` = top level).
* A node fires for a request once every input of its current iteration is present.
* Input bindings (``InputKind``):
    WALK_INPUT  read from the request's state when the walk starts; valid for every iteration.
    LOCAL       produced earlier in the same iteration of the same frame (by a node or by an
                inner loop's exit).
    OUTER       produced in an enclosing frame before this loop started; reused every iteration.
    CARRIED     iteration 0 takes ``initial`` (a WALK_INPUT/OUTER/STREAM binding); iteration i+1
                takes what the feedback producer sent in iteration i.
    STREAM      pushed by another partition of the same request through a chunk policy.
* Routes (``RouteKind``): LOCAL (same frame, same iteration), ENTER (into an inner loop, as an
  OUTER or CARRIED-initial value), FEEDBACK (next iteration of ``loop``), EMIT (client), STATE
  (request state, for later walks) and STREAM (another partition).
* A loop ends after ``max_iters`` iterations or, for a dynamic loop, after the iteration in which
  ``stop_node`` reported ``stop_signal`` true. Then, instead of delivering the feedback of the last
  iteration, the value of each exit name is routed along the loop's exit routes (the list of all
  iterations' values for ``accumulate`` names).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class InputKind(StrEnum):
    WALK_INPUT = "walk_input"
    LOCAL = "local"
    OUTER = "outer"
    CARRIED = "carried"
    STREAM = "stream"


class RouteKind(StrEnum):
    LOCAL = "local"
    ENTER = "enter"
    FEEDBACK = "feedback"
    EMIT = "emit"
    STATE = "state"
    STREAM = "stream"


@dataclass(frozen=True)
class Producer:
    """Who produces a value: a node, or a loop (its exit value)."""

    name: str
    is_loop: bool = False

    def __str__(self) -> str:
        return f"loop {self.name}" if self.is_loop else self.name


@dataclass(frozen=True)
class InputBinding:
    kind: InputKind
    producer: Producer | None = None  # LOCAL / OUTER / CARRIED (the feedback producer)
    initial: InputBinding | None = None  # CARRIED only
    partition: str | None = None  # STREAM only: producing partition

    def describe(self) -> str:
        if self.kind is InputKind.CARRIED:
            return f"carried (first: {self.initial.describe()}; then feedback from {self.producer})"
        if self.kind is InputKind.STREAM:
            return f"stream from partition {self.partition}"
        if self.producer is not None:
            return f"{self.kind.value} from {self.producer}"
        return self.kind.value


@dataclass(frozen=True)
class Route:
    edge_name: str
    kind: RouteKind
    dest: str | None = None  # destination node (LOCAL / ENTER / FEEDBACK / STREAM)
    # FEEDBACK: the loop whose next iteration receives it; ENTER: the loop it enters (the one
    # directly inside the producer's frame that contains ``dest``)
    loop: str | None = None
    partition: str | None = None  # STREAM: target partition
    modality: str | None = None  # EMIT

    def describe(self) -> str:
        if self.kind is RouteKind.EMIT:
            return f"{self.edge_name} -> client" + (f" ({self.modality})" if self.modality else "")
        if self.kind is RouteKind.STATE:
            return f"{self.edge_name} -> request state"
        if self.kind is RouteKind.FEEDBACK:
            return f"{self.edge_name} -> {self.dest} (next iteration of {self.loop})"
        if self.kind is RouteKind.STREAM:
            return f"{self.edge_name} ~> {self.dest} (partition {self.partition})"
        return f"{self.edge_name} -> {self.dest}" + (f" (enters loop {self.loop})" if self.kind is RouteKind.ENTER else "")


@dataclass(frozen=True)
class NodePlan:
    name: str
    frame: str | None  # innermost enclosing loop, None at top level
    rank: int  # position in the walk; every LOCAL route goes to a higher rank
    input_names: tuple[str, ...]
    inputs: dict[str, InputBinding]
    routes: tuple[Route, ...]
    loop_exit_names: tuple[str, ...] = ()  # outputs that leave ``frame`` when it ends
    stop_signal: str | None = None  # set when this node decides a dynamic loop's end


@dataclass(frozen=True)
class LoopExit:
    name: str
    producer: Producer  # node or inner loop of this loop's body that produces the value
    route: Route  # seen from the loop's parent frame
    accumulate: bool = False


@dataclass(frozen=True)
class LoopPlan:
    name: str
    parent: str | None
    max_iters: int
    dynamic: bool
    stop_node: str | None
    stop_signal: str | None
    defer_stop_check: bool
    body_nodes: tuple[str, ...]  # nodes whose innermost loop is this one, in rank order
    inner_loops: tuple[str, ...]  # loops directly nested in this one
    entry_nodes: tuple[str, ...]  # body nodes with no LOCAL inputs: they start every iteration
    exits: tuple[LoopExit, ...]
    rank_start: int
    rank_end: int


@dataclass(frozen=True)
class WalkPlan:
    walk: str
    partition: str
    inputs: tuple[str, ...]
    nodes: dict[str, NodePlan]  # in rank order
    loops: dict[str, LoopPlan]
    entry_nodes: tuple[str, ...]  # top-level nodes ready from walk inputs / streams alone
    top_nodes: tuple[str, ...]  # all top-level nodes
    top_loops: tuple[str, ...]  # loops at the top level
    join_nodes: tuple[str, ...]  # nodes fed by several producers (Parallel joins)

    @property
    def node_names(self) -> frozenset[str]:
        return frozenset(self.nodes)

    def frame_members(self, frame: str | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(nodes, loops) that run directly in ``frame`` (None = top level)."""
        if frame is None:
            return self.top_nodes, self.top_loops
        lp = self.loops[frame]
        return lp.body_nodes, lp.inner_loops
