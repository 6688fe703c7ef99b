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

The tracker calls nothing outside itself: each public method returns an ``Effects`` record (node
instances that became ready, values for the client, for the request state and for other
partitions, and whether the walk ended), and the worker applies it in one place. Stream chunks
are read from a ``StreamSource`` (the partition's stream buffer), a plain data object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from mstar.graph.finish import FinishReason
from mstar.graph.plan import InputBinding, InputKind, RouteKind, WalkPlan
from mstar.runtime.loop_frames import LoopFrames
from mstar.runtime.self_loops import NextIteration, RowsBound, SelfLoops
from mstar.runtime.walk_records import Effects, Emitted, Frame, Pushed, ReadyNode, Vec, read_stop

__all__ = ["NextIteration", "Effects", "RowsBound", "ReadyNode", "StreamSource", "WalkTracker", "read_stop"]


@dataclass(frozen=True, slots=True)
class _PlanTables:
    """What a tracker reads of its plan, the same for every walk of it (``WalkTracker._derive``)."""

    outer_needs: dict[str, set[tuple[str, str]]]  # per loop: the (node, input) values its parent hands in
    members: dict[str | None, tuple]  # per frame: (member nodes, member loops, all members)
    start_bindings: dict[str, list[tuple[str, InputBinding]]]  # per node: bindings set at an iteration's start
    self_loops: dict[str, tuple[str, ...]]  # self-loop -> its node's invariant inputs
    routed: dict[str, tuple[tuple[str, ...] | None, tuple]]  # per node: (its self-loop's invariant inputs, its routes)
    accumulated: dict[str, set[str]]  # per loop: its accumulated exits
    lean: dict[str, Any]  # the self-loop bodies ``_self_loop_done`` takes (``_SelfLoopStep``)


# per plan (by identity, the plan kept with its tables): computed by the first tracker of it
_TABLES: dict[int, tuple[WalkPlan, _PlanTables]] = {}


class StreamSource(Protocol):
    def pull(self, node: str, name: str) -> Any:
        """The next chunk for a stream input, or None when none is ready yet."""


class WalkTracker(SelfLoops, LoopFrames):
    """Runs the dataflow of ``plan`` for one request.

    ``streams`` supplies the chunks of STREAM inputs (``pull`` returns None when none is ready: the
    tracker asks again in ``stream_ready``).
    """

    def __init__(self, plan: WalkPlan, walk_inputs: dict[str, Any], streams: StreamSource | None = None) -> None:
        missing = [n for n in plan.inputs if n not in walk_inputs]
        if missing:
            raise ValueError(f"walk {plan.walk!r} needs inputs {missing} that the request does not have")
        self.plan = plan
        self.walk_inputs = walk_inputs
        self._streams = streams
        self._emits: list[Emitted] = []
        self._state: dict[str, Any] = {}
        self._pushes: list[Pushed] = []
        self.frames: dict[tuple[str | None, Vec], Frame] = {}
        self.slots: dict[tuple[str, Vec], dict[str, Any]] = {}
        self.waiting_streams: dict[tuple[str, Vec], set[str]] = {}
        self.chunks: dict[tuple[str, Vec], dict[str, Any]] = {}
        self.ready: list[ReadyNode] = []
        self.running: set[tuple[str, Vec]] = set()
        self.done = False
        self.finish: FinishReason | None = None  # why the walk ended, when a dynamic loop of it says
        entry = _TABLES.get(id(plan))
        if entry is None or entry[0] is not plan:
            entry = (plan, self._derive())
            if len(_TABLES) >= 256:  # plans seen lately (a runtime has a few); dropped wholesale when full
                _TABLES.clear()
            _TABLES[id(plan)] = entry
        tables = entry[1]  # shared by every walk of the plan: read, never written
        self._outer_needs, self._members, self._start_bindings = tables.outer_needs, tables.members, tables.start_bindings
        self._self_loops, self._routed, self._accumulated, self._lean = (tables.self_loops, tables.routed,
                                                                         tables.accumulated, tables.lean)

    def _derive(self) -> _PlanTables:
        """The plan's tables (``_PlanTables``); a self-loop's feedback goes straight into its next
        iteration, not along its routes."""
        plan = self.plan
        members: dict[str | None, tuple] = {None: (*plan.frame_members(None), frozenset(plan.top_nodes + plan.top_loops))}
        for name, lp in plan.loops.items():
            members[name] = (lp.body_nodes, lp.inner_loops, frozenset(lp.body_nodes + lp.inner_loops))
        self._self_loops = self._find_self_loops()  # (``_lean_steps`` reads it)
        routed: dict[str, tuple[tuple[str, ...] | None, tuple]] = {}
        for name, np_ in plan.nodes.items():
            fast = self._self_loops.get(np_.frame) if np_.frame is not None else None
            routed[name] = (fast, tuple(r for r in np_.routes if fast is None or r.kind is not RouteKind.FEEDBACK))
        return _PlanTables(
            outer_needs=self._outer_requirements(), members=members,
            start_bindings={n: [(i, b) for i, b in np_.inputs.items() if b.kind is not InputKind.LOCAL]
                            for n, np_ in plan.nodes.items()},
            self_loops=self._self_loops, routed=routed,
            accumulated={name: {e.name for e in lp.exits if e.accumulate} for name, lp in plan.loops.items()},
            lean=self._lean_steps())

    # -- public --------------------------------------------------------------------------------
    def start(self) -> Effects:
        top = Frame(None, ())
        self.frames[(None, ())] = top
        self._start_iteration(top)
        return self._effects()

    def _effects(self) -> Effects:
        """Hand over what happened since the last call (ready nodes are now running)."""
        fx = Effects(self.ready, self._emits, self._state, self._pushes, self.done)
        for r in self.ready:
            self.running.add((r.node, r.iteration))
        self.ready, self._emits, self._state, self._pushes = [], [], {}, []
        return fx

    def node_done(self, node: str, vec: Vec, outputs: dict[str, Any]) -> Effects:
        """Route a finished node instance's outputs."""
        key = (node, vec)
        if key not in self.running:
            raise RuntimeError(f"walk {self.plan.walk!r}: result for {node}{list(vec)} which is not running")
        self.running.discard(key)
        lean = self._lean.get(node)
        if lean is not None:
            return self._self_loop_done(lean, node, vec, outputs)
        np_ = self.plan.nodes[node]
        frame = self.frames[(np_.frame, vec[:-1] if np_.frame is not None else ())]
        if np_.stop_signal is not None and self.plan.loops[np_.frame].defer_stop_check:
            if frame.deferred_stop is not None and read_stop(frame.deferred_stop):
                # the previous iteration already stopped: this one ran speculatively; drop it
                self._stopped(frame, frame.deferred_stop)
                frame.remaining.discard(node)
                self._maybe_end_iteration(frame, discard_current=True)
                return self._effects()
        fast, routed = self._routed[node]
        for route in np_.routes:
            if route.edge_name not in outputs:
                raise self._missing_output(node, route.edge_name, outputs)
        for route in routed:
            self._route(route, outputs[route.edge_name], vec, node, frame)
        for name in np_.loop_exit_names:
            self._record_exit(frame, name, outputs[name])
        if np_.stop_signal is not None:
            if np_.stop_signal not in outputs:
                raise self._missing_output(node, np_.stop_signal, outputs)
            if self.plan.loops[np_.frame].defer_stop_check:
                frame.deferred_stop = outputs[np_.stop_signal]
            elif read_stop(outputs[np_.stop_signal]):
                self._stopped(frame, outputs[np_.stop_signal])
        if fast is not None:
            self._next_self_iteration(frame, node, outputs)
            return self._effects()
        frame.remaining.discard(node)
        self._maybe_end_iteration(frame)
        return self._effects()

    def _missing_output(self, node: str, name: str, outputs: dict[str, Any]) -> ValueError:
        if name == self.plan.nodes[node].stop_signal:
            return ValueError(f"node {node!r} must return its loop's stop signal {name!r}")
        return ValueError(f"node {node!r} (walk {self.plan.walk!r}) returned no output {name!r}; "
                          f"it returned {sorted(outputs)}")

    def stream_ready(self) -> Effects:
        """New stream chunks arrived: retry nodes waiting on a stream input."""
        for (node, vec), names in list(self.waiting_streams.items()):
            for name in list(names):
                chunk = self._streams.pull(node, name)
                if chunk is None:
                    continue
                names.discard(name)
                self.chunks.setdefault((node, vec), {})[name] = chunk
                self._deliver(node, vec, name, list(chunk.items))
            if not names:
                del self.waiting_streams[(node, vec)]
        return self._effects()

    @property
    def waiting_on_stream(self) -> bool:
        return bool(self.waiting_streams)

    # -- values --------------------------------------------------------------------------------
    def _route(self, route, value: Any, vec: Vec, src: str, frame: Frame) -> None:
        kind = route.kind
        if kind is RouteKind.LOCAL:
            self._deliver(route.dest, vec, route.edge_name, value)
        elif kind is RouteKind.FEEDBACK:
            frame.carried[(route.dest, route.edge_name)] = value
        elif kind is RouteKind.ENTER:
            child = self.frames[(route.loop, vec)]
            child.outer_vals[(route.dest, route.edge_name)] = value
            self._maybe_start_loop(child)
        elif kind is RouteKind.EMIT:
            if not (isinstance(value, list) and not value):  # an empty list: nothing this iteration
                self._emits.append(Emitted(route.edge_name, value, route.modality, src))
        elif kind is RouteKind.STATE:
            self._state[route.edge_name] = value
        elif kind is RouteKind.STREAM:
            self._pushes.append(Pushed(route.partition, route.dest, route.edge_name, list(value)))

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
