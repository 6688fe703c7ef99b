"""Dataflow execution of one walk of one request, driven by its compiled ``WalkPlan``.

Pure Python: values are opaque (lists of tensors in practice). The tracker lives on the walk's
home worker. It turns arriving values into *ready node instances* and node results into routed
values; loops iterate here, never through the conductor.

Frames and iteration vectors::

    top frame (key: (None, ()))             nodes at top level run with iteration vector ()
      loop L (key: ("L", ()))               nodes in L, iteration i, run with vector (i,)
        loop M (key: ("M", (i,)))           nodes in M, iteration j, run with vector (i, j)

A frame instance runs its iterations one after another. An iteration ends when every member
(direct body node and inner loop) has finished; the frame then starts the next iteration with the
fed-back values, or ends and routes its exit values into its parent frame.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mstar.graph.plan import InputBinding, InputKind, NodePlan, RouteKind, WalkPlan

Vec = tuple[int, ...]


@dataclass(slots=True)
class ReadyNode:
    """A node instance whose inputs are all present."""

    node: str
    iteration: Vec
    inputs: dict[str, Any]
    stream_chunks: dict[str, Any]  # input name -> Chunk, for STREAM inputs


@dataclass(slots=True)
class _Frame:
    loop: str | None
    base: Vec  # iteration vector of the parent frame's current iteration
    it: int = 0
    started: bool = False
    remaining: set[str] = field(default_factory=set)  # members still running in this iteration
    outer_vals: dict[tuple[str, str], Any] = field(default_factory=dict)  # (node, input) -> value
    carried: dict[tuple[str, str], Any] = field(default_factory=dict)  # fed back for the next iteration
    exit_vals: dict[str, Any] = field(default_factory=dict)
    stop: bool = False
    deferred_stop: Any = None  # stop flag of the previous iteration, read one iteration late

    @property
    def vec(self) -> Vec:
        return self.base + (self.it,) if self.loop is not None else self.base


class WalkTracker:
    """Runs the dataflow of ``plan`` for one request.

    Callbacks: ``emit(name, value, modality, node)``, ``to_state(name, value)``,
    ``stream(partition, node, name, value)``, ``pull_stream(node, name)`` -> chunk or None (the
    tracker asks again via ``stream_ready`` when it returns None), ``read_stop(value)`` -> bool.
    """

    def __init__(self, plan: WalkPlan, walk_inputs: dict[str, Any], *,
                 emit: Callable[[str, Any, str | None, str], None],
                 to_state: Callable[[str, Any], None],
                 stream: Callable[[str, str, str, Any], None],
                 pull_stream: Callable[[str, str], Any] | None = None,
                 read_stop: Callable[[Any], bool] = bool) -> None:
        missing = [n for n in plan.inputs if n not in walk_inputs]
        if missing:
            raise ValueError(f"walk {plan.walk!r} needs inputs {missing} that the request does not have")
        self.plan = plan
        self.walk_inputs = walk_inputs
        self._emit, self._to_state, self._stream = emit, to_state, stream
        self._pull_stream = pull_stream
        self._read_stop = read_stop
        self.frames: dict[tuple[str | None, Vec], _Frame] = {}
        self.slots: dict[tuple[str, Vec], dict[str, Any]] = {}
        self.waiting_streams: dict[tuple[str, Vec], set[str]] = {}
        self.chunks: dict[tuple[str, Vec], dict[str, Any]] = {}
        self.ready: list[ReadyNode] = []
        self.running: set[tuple[str, Vec]] = set()
        self.done = False
        self._outer_needs = self._outer_requirements()
        # per frame: (member nodes, member loops, all members); per node: bindings set at iteration start
        self._members = {None: (*plan.frame_members(None), frozenset(plan.top_nodes + plan.top_loops))}
        for name, lp in plan.loops.items():
            self._members[name] = (lp.body_nodes, lp.inner_loops, frozenset(lp.body_nodes + lp.inner_loops))
        self._start_bindings = {n: [(i, b) for i, b in np_.inputs.items() if b.kind is not InputKind.LOCAL]
                                for n, np_ in plan.nodes.items()}
        self._self_loops = self._find_self_loops()

    # -- public --------------------------------------------------------------------------------
    def start(self) -> list[ReadyNode]:
        top = _Frame(None, ())
        self.frames[(None, ())] = top
        self._start_iteration(top)
        return self.take_ready()

    def take_ready(self) -> list[ReadyNode]:
        out, self.ready = self.ready, []
        for r in out:
            self.running.add((r.node, r.iteration))
        return out

    def node_done(self, node: str, vec: Vec, outputs: dict[str, Any]) -> list[ReadyNode]:
        """Route a finished node instance's outputs; return node instances that became ready."""
        key = (node, vec)
        if key not in self.running:
            raise RuntimeError(f"walk {self.plan.walk!r}: result for {node}{list(vec)} which is not running")
        self.running.discard(key)
        np_ = self.plan.nodes[node]
        frame = self.frames[(np_.frame, vec[:-1] if np_.frame is not None else ())]
        if np_.stop_signal is not None and self.plan.loops[np_.frame].defer_stop_check:
            if frame.deferred_stop is not None and self._read_stop(frame.deferred_stop):
                # the previous iteration already stopped: this one ran speculatively; drop it
                frame.stop = True
                frame.remaining.discard(node)
                self._maybe_end_iteration(frame, discard_current=True)
                return self.take_ready()
        fast = self._self_loops.get(np_.frame) if np_.frame is not None else None
        for route in np_.routes:
            if route.edge_name not in outputs:
                raise ValueError(f"node {node!r} (walk {self.plan.walk!r}) returned no output {route.edge_name!r}; "
                                 f"it returned {sorted(outputs)}")
            if fast is None or route.kind is not RouteKind.FEEDBACK:
                self._route(route, outputs[route.edge_name], vec, node, frame)
        for name in np_.loop_exit_names:
            self._record_exit(frame, name, outputs[name])
        if np_.stop_signal is not None:
            if np_.stop_signal not in outputs:
                raise ValueError(f"node {node!r} must return its loop's stop signal {np_.stop_signal!r}")
            if self.plan.loops[np_.frame].defer_stop_check:
                frame.deferred_stop = outputs[np_.stop_signal]
            elif self._read_stop(outputs[np_.stop_signal]):
                frame.stop = True
        if fast is not None:
            self._next_self_iteration(frame, node, fast, outputs)
            return self.take_ready()
        frame.remaining.discard(node)
        self._maybe_end_iteration(frame)
        return self.take_ready()

    def _next_self_iteration(self, frame: _Frame, node: str, invariant: tuple[str, ...], outputs) -> None:
        """Fast path for a loop whose body is one node feeding itself (AR decode, rollouts): the next
        iteration's inputs are this iteration's feedback plus the invariant inputs, directly."""
        frame.it += 1
        lp = self.plan.loops[frame.loop]
        if frame.stop or frame.it >= lp.max_iters:
            frame.remaining.discard(node)
            self._finish_loop(frame)
            return
        np_ = self.plan.nodes[node]
        inputs = {}
        for inp, b in np_.inputs.items():
            if inp in invariant:
                inputs[inp] = (self.walk_inputs[inp] if b.kind is InputKind.WALK_INPUT
                               else self._lookup_outer(frame, node, inp))
            else:
                inputs[inp] = outputs[inp]  # carried: the feedback edge has the input's name
        self.ready.append(ReadyNode(node, frame.vec, inputs, {}))

    def stream_ready(self) -> list[ReadyNode]:
        """New stream chunks arrived: retry nodes waiting on a stream input."""
        for (node, vec), names in list(self.waiting_streams.items()):
            for name in list(names):
                chunk = self._pull_stream(node, name)
                if chunk is None:
                    continue
                names.discard(name)
                self.chunks.setdefault((node, vec), {})[name] = chunk
                self._deliver(node, vec, name, list(chunk.items))
            if not names:
                del self.waiting_streams[(node, vec)]
        return self.take_ready()

    @property
    def waiting_on_stream(self) -> bool:
        return bool(self.waiting_streams)

    def _find_self_loops(self) -> dict[str, tuple[str, ...]]:
        """Loops whose body is one node, every input of which is fed back by that node or invariant:
        loop name -> the node's invariant inputs."""
        out = {}
        for name, lp in self.plan.loops.items():
            if len(lp.body_nodes) != 1 or lp.inner_loops:
                continue
            np_ = self.plan.nodes[lp.body_nodes[0]]
            invariant, ok = [], True
            for inp, b in np_.inputs.items():
                if b.kind is InputKind.CARRIED and b.producer.name == np_.name and not b.producer.is_loop \
                        and b.initial.kind in (InputKind.WALK_INPUT, InputKind.OUTER):
                    continue
                if b.kind in (InputKind.WALK_INPUT, InputKind.OUTER):
                    invariant.append(inp)
                else:
                    ok = False
            if ok and all(r.dest == np_.name for r in np_.routes if r.kind is RouteKind.FEEDBACK):
                out[name] = tuple(invariant)
        return out

    # -- frames --------------------------------------------------------------------------------
    def _outer_requirements(self) -> dict[str, set[tuple[str, str]]]:
        """Per loop: the (node, input) values its parent frame must hand in before it can start."""
        needs: dict[str, set[tuple[str, str]]] = {name: set() for name in self.plan.loops}
        for n in self.plan.nodes.values():
            for inp, b in n.inputs.items():
                base = b.initial if b.kind is InputKind.CARRIED else b
                if base.kind is InputKind.OUTER:
                    needs[self._entered_loop(base, n)].add((n.name, inp))
        return needs

    def _entered_loop(self, b: InputBinding, consumer: NodePlan) -> str:
        """The loop, directly inside the producer's frame, that contains ``consumer``."""
        prod = b.producer
        prod_frame = self.plan.loops[prod.name].parent if prod.is_loop else self.plan.nodes[prod.name].frame
        frame = consumer.frame
        while self.plan.loops[frame].parent != prod_frame:
            frame = self.plan.loops[frame].parent
        return frame

    def _frame_of(self, loop: str | None, vec: Vec) -> _Frame:
        return self.frames[(loop, vec)]

    def _start_iteration(self, frame: _Frame) -> None:
        frame.started = True
        nodes, loops, members = self._members[frame.loop]
        frame.remaining = set(members)
        vec = frame.vec
        for name in nodes:
            np_ = self.plan.nodes[name]
            for inp, b in self._start_bindings[name]:
                self._bind_start(frame, np_, inp, b, vec)
            if not np_.input_names:
                self._check_ready(name, vec)
        for loop in loops:
            child = _Frame(loop, vec)
            self.frames[(loop, vec)] = child
            self._maybe_start_loop(child)
        if not frame.remaining:
            self._maybe_end_iteration(frame)

    def _bind_start(self, frame: _Frame, np_: NodePlan, inp: str, b: InputBinding, vec: Vec) -> None:
        if b.kind is InputKind.CARRIED:
            if frame.it > 0:
                self._deliver(np_.name, vec, inp, frame.carried.pop((np_.name, inp)))
                return
            b = b.initial
        if b.kind is InputKind.WALK_INPUT:
            self._deliver(np_.name, vec, inp, self.walk_inputs[inp])
        elif b.kind is InputKind.OUTER:
            self._deliver(np_.name, vec, inp, self._lookup_outer(frame, np_.name, inp))
        elif b.kind is InputKind.STREAM:
            chunk = self._pull_stream(np_.name, inp) if self._pull_stream else None
            if chunk is None:
                self.waiting_streams.setdefault((np_.name, vec), set()).add(inp)
            else:
                self.chunks.setdefault((np_.name, vec), {})[inp] = chunk
                self._deliver(np_.name, vec, inp, list(chunk.items))

    def _lookup_outer(self, frame: _Frame, node: str, inp: str) -> Any:
        f: _Frame | None = frame
        while f is not None:
            if (node, inp) in f.outer_vals:
                return f.outer_vals[(node, inp)]
            if f.loop is None:
                break
            parent_loop = self.plan.loops[f.loop].parent
            f = self.frames[(parent_loop, f.base[:-1] if parent_loop is not None else ())]
        raise RuntimeError(f"walk {self.plan.walk!r}: no value for {node}.{inp} entering its loop")

    def _maybe_start_loop(self, frame: _Frame) -> None:
        if frame.started:
            return
        if self._outer_needs[frame.loop] <= frame.outer_vals.keys():
            self._start_iteration(frame)

    def _maybe_end_iteration(self, frame: _Frame, discard_current: bool = False) -> None:
        if frame.remaining:
            return
        if frame.loop is None:
            self.done = True
            return
        lp = self.plan.loops[frame.loop]
        if not discard_current:
            frame.it += 1
        if frame.stop or frame.it >= lp.max_iters:
            self._finish_loop(frame)
        else:
            self._start_iteration(frame)

    def _finish_loop(self, frame: _Frame) -> None:
        lp = self.plan.loops[frame.loop]
        parent = self._frame_of(lp.parent, frame.base[:-1] if lp.parent is not None else ())
        for ex in lp.exits:
            self._route(ex.route, frame.exit_vals[ex.name], frame.base, f"loop {lp.name}", parent)
            if parent.loop is not None and ex.name in self._parent_exit_names(parent.loop, lp.name):
                self._record_exit(parent, ex.name, frame.exit_vals[ex.name])
        frame.carried.clear()
        del self.frames[(frame.loop, frame.base)]
        parent.remaining.discard(frame.loop)
        self._maybe_end_iteration(parent)

    def _parent_exit_names(self, parent_loop: str, child_loop: str) -> set[str]:
        return {e.name for e in self.plan.loops[parent_loop].exits
                if e.producer.is_loop and e.producer.name == child_loop}

    def _record_exit(self, frame: _Frame, name: str, value: Any) -> None:
        lp = self.plan.loops[frame.loop]
        acc = any(e.accumulate for e in lp.exits if e.name == name)
        if acc:
            frame.exit_vals.setdefault(name, []).extend(value if isinstance(value, list) else [value])
        else:
            frame.exit_vals[name] = value

    # -- values --------------------------------------------------------------------------------
    def _route(self, route, value: Any, vec: Vec, src: str, frame: _Frame) -> None:
        kind = route.kind
        if kind is RouteKind.LOCAL:
            self._deliver(route.dest, vec, route.edge_name, value)
        elif kind is RouteKind.FEEDBACK:
            frame.carried[(route.dest, route.edge_name)] = value
        elif kind is RouteKind.ENTER:
            dest_plan = self.plan.nodes[route.dest]
            loop = dest_plan.frame
            while self.plan.loops[loop].parent != frame.loop:
                loop = self.plan.loops[loop].parent
            child = self.frames[(loop, vec)]
            child.outer_vals[(route.dest, route.edge_name)] = value
            self._maybe_start_loop(child)
        elif kind is RouteKind.EMIT:
            self._emit(route.edge_name, value, route.modality, src)
        elif kind is RouteKind.STATE:
            self._to_state(route.edge_name, value)
        elif kind is RouteKind.STREAM:
            self._stream(route.partition, route.dest, route.edge_name, value)

    def _deliver(self, node: str, vec: Vec, name: str, value: Any) -> None:
        slot = self.slots.setdefault((node, vec), {})
        if name in slot:
            raise RuntimeError(f"walk {self.plan.walk!r}: input {name!r} of {node}{list(vec)} delivered twice")
        slot[name] = value
        self._check_ready(node, vec)

    def _check_ready(self, node: str, vec: Vec) -> None:
        slot = self.slots.get((node, vec), {})
        if len(slot) == len(self.plan.nodes[node].input_names):
            del self.slots[(node, vec)]
            chunks = self.chunks.pop((node, vec), {})
            self.ready.append(ReadyNode(node, vec, slot, chunks))
