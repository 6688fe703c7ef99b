"""Validate one walk and compile it into a ``WalkPlan``.

Every failure is a ``ValueError`` whose message starts with ``walk 'W':`` and names the node and
edge (or loop) at fault, so a model author sees the culprit before any weights load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mstar.graph.plan import (
    InputBinding,
    InputKind,
    LoopExit,
    LoopPlan,
    NodePlan,
    Producer,
    Route,
    RouteKind,
    WalkPlan,
)
from mstar.graph.sections import (
    EMIT_TO_CLIENT,
    TO_STATE,
    GraphEdge,
    GraphNode,
    Loop,
    Parallel,
    Section,
    Sequential,
)

Branch = tuple[tuple[int, int], ...]  # ((parallel id, branch index), ...) from the outside in


@dataclass
class _Item:
    """Layout of a node or loop inside the walk."""

    frame: str | None
    rank_start: int
    rank_end: int
    branch: Branch


@dataclass
class _Ref:
    producer: Producer
    relation: RouteKind  # LOCAL, ENTER or FEEDBACK, seen from the consumer's frame
    edge: str


@dataclass
class _Layout:
    walk: str
    nodes: dict[str, GraphNode] = field(default_factory=dict)
    loops: dict[str, Loop] = field(default_factory=dict)
    node_items: dict[str, _Item] = field(default_factory=dict)
    loop_items: dict[str, _Item] = field(default_factory=dict)
    parallel_ids: int = 0

    def err(self, msg: str) -> ValueError:
        return ValueError(f"walk {self.walk!r}: {msg}")

    def lay_out(self, section: Section, start: int, frame: str | None, branch: Branch) -> int:
        if isinstance(section, GraphNode):
            if section.name in self.nodes:
                raise self.err(f"node {section.name!r} appears twice (a node runs once per walk iteration; "
                               f"give a second use its own name, e.g. a weight-sharing view)")
            self.nodes[section.name] = section
            self.node_items[section.name] = _Item(frame, start, start + 1, branch)
            return start + 1
        if isinstance(section, Sequential):
            cur = start
            for s in section.sections:
                cur = self.lay_out(s, cur, frame, branch)
            return cur
        if isinstance(section, Parallel):
            pid = self.parallel_ids
            self.parallel_ids += 1
            ends = [self.lay_out(s, start, frame, branch + ((pid, i),)) for i, s in enumerate(section.sections)]
            return max(ends)
        if isinstance(section, Loop):
            if section.name in self.loops:
                raise self.err(f"two loops are named {section.name!r}; pass name= to tell them apart")
            self.loops[section.name] = section
            end = self.lay_out(section.section, start, section.name, branch)
            self.loop_items[section.name] = _Item(frame, start, end, branch)
            return end
        raise self.err(f"unknown section type {type(section).__name__}")

    # -- frame helpers -------------------------------------------------------------------------
    def frame_chain(self, frame: str | None) -> list[str | None]:
        """[frame, parent, ..., None]."""
        chain: list[str | None] = [frame]
        while frame is not None:
            frame = self.loop_items[frame].frame
            chain.append(frame)
        return chain

    def child_loop_toward(self, outer: str | None, frame: str | None) -> str | None:
        """The loop directly inside ``outer`` that contains ``frame`` (None if frame == outer)."""
        prev = None
        for f in self.frame_chain(frame):
            if f == outer:
                return prev
            prev = f
        return None

    def item(self, p: Producer) -> _Item:
        return self.loop_items[p.name] if p.is_loop else self.node_items[p.name]


def _crosses_branches(a: Branch, b: Branch) -> bool:
    pa = dict(a)
    return any(pid in pa and pa[pid] != idx for pid, idx in b)


def _relation(lay: _Layout, src: Producer, dest: str, where: str) -> RouteKind:
    """Classify a value going from ``src`` to node ``dest`` (both in the walk)."""
    s_item, d_item = lay.item(src), lay.node_items[dest]
    s_frame = s_item.frame
    if _crosses_branches(s_item.branch, d_item.branch):
        raise lay.err(f"{where} goes from one Parallel branch to another ({dest!r}); "
                      f"branches are independent: join them in a node after the Parallel")
    chain = lay.frame_chain(d_item.frame)
    if s_frame not in chain:
        # the source sits in a loop that does not contain the destination
        leaving = next(f for f in lay.frame_chain(s_frame) if f not in chain)
        raise lay.err(f"{where} leaves loop {leaving!r} directly to {dest!r}; route the value out through "
                      f"the loop's outputs= instead (feedback edges must stay inside their loop)")
    if d_item.frame == s_frame:
        if d_item.rank_start >= s_item.rank_end:
            return RouteKind.LOCAL
        if s_frame is None:
            raise lay.err(f"{where} goes backwards to {dest!r} outside any loop (a cycle); wrap the "
                          f"repeated part in a Loop or DynamicLoop")
        return RouteKind.FEEDBACK
    inner = lay.child_loop_toward(s_frame, d_item.frame)
    if lay.loop_items[inner].rank_start < s_item.rank_end:
        raise lay.err(f"{where} enters loop {inner!r} from a node that runs after it starts")
    return RouteKind.ENTER


def _route_edge(lay: _Layout, src: Producer, edge: GraphEdge, where: str, refs: dict, known_nodes: set[str],
                partition: str) -> Route:
    if edge.next_node == EMIT_TO_CLIENT:
        return Route(edge.name, RouteKind.EMIT, modality=edge.output_modality)
    if edge.next_node == TO_STATE:
        return Route(edge.name, RouteKind.STATE)
    if edge.is_streaming:
        # checked against the topology and the consumer walks by the graph
        return Route(edge.name, RouteKind.STREAM, dest=edge.next_node, partition=edge.target_partition)
    dest = edge.next_node
    if dest not in lay.nodes:
        if dest in known_nodes:
            raise lay.err(f"{where} targets node {dest!r}, which is not part of this walk")
        raise lay.err(f"{where} targets unknown node {dest!r}")
    if edge.name not in lay.nodes[dest].input_names:
        raise lay.err(f"{where} targets {dest!r}, which has no input named {edge.name!r} "
                      f"(its inputs: {list(lay.nodes[dest].input_names)})")
    kind = _relation(lay, src, dest, where)
    refs.setdefault((dest, edge.name), []).append(_Ref(src, kind, edge.name))
    dest_frame = lay.node_items[dest].frame
    if kind is RouteKind.FEEDBACK:
        loop = dest_frame
    elif kind is RouteKind.ENTER:
        loop = lay.child_loop_toward(lay.item(src).frame, dest_frame)
    else:
        loop = None
    return Route(edge.name, kind, dest=dest, loop=loop)


def compile_walk(walk_name: str, section: Section, inputs: tuple[str, ...], partition: str,
                 stream_inputs: dict[tuple[str, str], str], known_nodes: set[str]) -> WalkPlan:
    """Validate ``section`` as walk ``walk_name`` and return its plan.

    ``stream_inputs`` maps (node, input) of this partition to the partition streaming it in;
    ``known_nodes`` is every node name of the model (to tell "unknown" from "not in this walk").
    """
    lay = _Layout(walk_name)
    lay.lay_out(section, 0, None, ())

    refs: dict[tuple[str, str], list[_Ref]] = {}
    routes: dict[str, list[Route]] = {n: [] for n in lay.nodes}
    for name, node in lay.nodes.items():
        for edge in node.outputs:
            where = f"node {name!r}, edge {edge.name!r}"
            routes[name].append(_route_edge(lay, Producer(name), edge, where, refs, known_nodes, partition))

    exits, exit_names, stop_nodes = _compile_exits(lay, refs, known_nodes, partition)
    bindings, used_walk_inputs = _compile_bindings(lay, refs, inputs, stream_inputs, stop_nodes)
    unused = [i for i in inputs if i not in used_walk_inputs]
    if unused:
        raise lay.err(f"declared inputs {unused} are consumed by no node (check for a typo)")

    return _build_plan(lay, walk_name, partition, inputs, bindings, routes, exits, exit_names, stop_nodes)


def _compile_exits(lay: _Layout, refs: dict, known_nodes: set[str], partition: str):
    """Each loop's exits (the value of a name produced last in the iteration), per node the names that
    leave its frame, and per dynamic loop's stop node its stop signal."""
    exits: dict[str, list[LoopExit]] = {name: [] for name in lay.loops}
    exit_names: dict[str, list[str]] = {n: [] for n in lay.nodes}
    stop_nodes: dict[str, str] = {}
    for lname, loop in lay.loops.items():
        if loop.dynamic:
            if lay.node_items[loop.stop_node].frame != lname:
                raise lay.err(f"dynamic loop {lname!r}: stop_node {loop.stop_node!r} must sit directly in "
                              f"its body, not in a nested loop")
            stop_nodes[loop.stop_node] = loop.stop_signal
            body = [n for n, it in lay.node_items.items() if lname in lay.frame_chain(it.frame)]
            if loop.defer_stop_check and len(body) != 1:
                raise lay.err(f"dynamic loop {lname!r}: defer_stop_check needs a single-node body (an extra "
                              f"iteration is discarded whole); this body has {sorted(body)}")
        for edge in loop.outputs:
            where = f"loop {lname!r}, output {edge.name!r}"
            producers = [Producer(n) for n, it in lay.node_items.items()
                         if it.frame == lname and edge.name in lay.nodes[n].output_names]
            producers += [Producer(inner, True) for inner, it in lay.loop_items.items()
                          if it.frame == lname and any(e.name == edge.name for e in lay.loops[inner].outputs)]
            if not producers:
                raise lay.err(f"{where} is produced by no node of the loop's body")
            # the loop's value of a name is the one produced last in the iteration
            last = max(lay.item(p).rank_end for p in producers)
            producers = [p for p in producers if lay.item(p).rank_end == last]
            if len(producers) > 1:
                raise lay.err(f"{where} is produced last by several parallel nodes: {[str(p) for p in producers]}")
            if edge.next_node in lay.nodes and lname in lay.frame_chain(lay.node_items[edge.next_node].frame):
                raise lay.err(f"{where} targets {edge.next_node!r}, which is inside the loop itself; "
                              f"feed it back with an edge of the producing node instead")
            route = _route_edge(lay, Producer(lname, True), edge, where, refs, known_nodes, partition)
            exits[lname].append(LoopExit(edge.name, producers[0], route, edge.name in loop.accumulate))
            if not producers[0].is_loop:
                exit_names[producers[0].name].append(edge.name)

    return exits, exit_names, stop_nodes


def _compile_bindings(lay: _Layout, refs: dict, inputs: tuple[str, ...], stream_inputs: dict[tuple[str, str], str],
                      stop_nodes: dict[str, str]):
    """Where each input of each node comes from; also which declared walk inputs are consumed."""
    used_walk_inputs: set[str] = set()
    bindings: dict[str, dict[str, InputBinding]] = {}
    for name, node in lay.nodes.items():
        frame = lay.node_items[name].frame
        bindings[name] = {}
        for inp in node.input_names:
            where = f"node {name!r}, input {inp!r}"
            rs = refs.get((name, inp), [])
            feedback = [r for r in rs if r.relation is RouteKind.FEEDBACK]
            local = [r for r in rs if r.relation is RouteKind.LOCAL]
            outer = [r for r in rs if r.relation is RouteKind.ENTER]
            stream = stream_inputs.get((name, inp))
            outside: list[InputBinding] = [InputBinding(InputKind.OUTER, r.producer) for r in outer]
            if stream is not None:
                outside.append(InputBinding(InputKind.STREAM, partition=stream))
            if not local and not outside and inp in inputs:
                outside.append(InputBinding(InputKind.WALK_INPUT))
                used_walk_inputs.add(inp)
            writers = [str(r.producer) for r in local + outer] + (["a stream"] if stream else [])
            if len(feedback) > 1:
                raise lay.err(f"{where} receives feedback from several nodes: {[str(r.producer) for r in feedback]}")
            if feedback:
                if local:
                    raise lay.err(f"{where} is produced both within the iteration by {local[0].producer} and by "
                                  f"feedback from {feedback[0].producer}")
                if not outside:
                    raise lay.err(f"{where} is fed back by {feedback[0].producer} but nothing provides its "
                                  f"first iteration: declare it as a walk input or produce it before loop "
                                  f"{frame!r}")
                if len(outside) > 1:
                    raise lay.err(f"{where} has several first-iteration sources: {writers}")
                bindings[name][inp] = InputBinding(InputKind.CARRIED, feedback[0].producer, initial=outside[0])
                continue
            sources = [InputBinding(InputKind.LOCAL, r.producer) for r in local] + outside
            if not sources:
                raise lay.err(f"{where} is produced by nothing in the walk (nor by the walk's declared "
                              f"inputs {list(inputs)})")
            if len(sources) > 1:
                prods = [r.producer for r in local + outer]
                parallel = len(prods) >= 2 and _crosses_branches(lay.item(prods[0]).branch, lay.item(prods[1]).branch)
                what = "two Parallel branches write the same input of join node" if parallel else "written twice:"
                raise lay.err(f"{where}: {what} {name!r} — writers {writers}")
            bindings[name][inp] = sources[0]
        if name in stop_nodes and stop_nodes[name] in node.output_names:
            raise lay.err(f"node {name!r}: stop signal {stop_nodes[name]!r} is consumed by its loop and cannot "
                          f"also be an edge")

    return bindings, used_walk_inputs


def _build_plan(lay, walk_name, partition, inputs, bindings, routes, exits, exit_names, stop_nodes) -> WalkPlan:
    order = sorted(lay.nodes, key=lambda n: (lay.node_items[n].rank_start, n))
    nodes = {
        n: NodePlan(
            name=n,
            frame=lay.node_items[n].frame,
            rank=lay.node_items[n].rank_start,
            input_names=lay.nodes[n].input_names,
            inputs=bindings[n],
            routes=tuple(routes[n]),
            loop_exit_names=tuple(exit_names[n]),
            stop_signal=stop_nodes.get(n),
        )
        for n in order
    }

    def no_local(n: str) -> bool:
        return all(b.kind is not InputKind.LOCAL for b in bindings[n].values())

    loops = {}
    for lname, loop in sorted(lay.loops.items(), key=lambda kv: lay.loop_items[kv[0]].rank_start):
        it = lay.loop_items[lname]
        body = tuple(n for n in order if nodes[n].frame == lname)
        loops[lname] = LoopPlan(
            name=lname,
            parent=it.frame,
            max_iters=loop.max_iters,
            dynamic=loop.dynamic,
            stop_node=loop.stop_node if loop.dynamic else None,
            stop_signal=loop.stop_signal if loop.dynamic else None,
            defer_stop_check=bool(loop.dynamic and loop.defer_stop_check),
            body_nodes=body,
            inner_loops=tuple(x for x, xi in lay.loop_items.items() if xi.frame == lname),
            entry_nodes=tuple(n for n in body if no_local(n)),
            exits=tuple(exits[lname]),
            rank_start=it.rank_start,
            rank_end=it.rank_end,
        )
    top_nodes = tuple(n for n in order if nodes[n].frame is None)
    producers_per_node = {
        n: {b.producer for b in bindings[n].values() if b.kind is InputKind.LOCAL and b.producer is not None}
        for n in order
    }
    return WalkPlan(
        walk=walk_name,
        partition=partition,
        inputs=tuple(inputs),
        nodes=nodes,
        loops=loops,
        entry_nodes=tuple(n for n in top_nodes if no_local(n)),
        top_nodes=top_nodes,
        top_loops=tuple(x for x in loops if loops[x].parent is None),
        join_nodes=tuple(n for n in order if len(producers_per_node[n]) > 1),
    )
