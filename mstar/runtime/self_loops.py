"""A ``WalkTracker``'s self-loops: loops whose body is one node fed back by itself (an AR decode
step, a rollout, a code predictor's step). Their iterations skip the general routing: the next
iteration's inputs are the node's fed-back outputs plus inputs that are the same at every iteration
(``_next_self_iteration``), and a node whose outputs only feed itself, reach the client, stream to
another partition or leave the loop is finished in one pass (``_SelfLoopStep``, looked up once per walk). ``continue_self_loop``
answers the usual iteration without an ``Effects``; ``rows_bound`` / ``catch_up_rows`` let
the worker run several iterations before the tracker catches up (``runtime/running_rows.py``), the
values its iterations give the loop's exits handed over as they come (``rows_exits``).

``SelfLoops`` is a base class of ``WalkTracker``, using its plan, frames and routing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mstar.graph.plan import InputKind, RouteKind
from mstar.runtime.walk_records import Effects, Emitted, Pushed, ReadyNode, Vec, read_stop

if TYPE_CHECKING:
    from mstar.runtime.walk_records import Frame

__all__ = ["NextIteration", "RowsBound", "LoopExits", "SelfLoops", "StreamOut"]


@dataclass(frozen=True, slots=True)
class StreamOut:
    """A self-loop node's output streamed to another partition: its values (a list of items per
    iteration, possibly empty) go to input ``name`` of ``node`` in ``partition``."""

    name: str
    partition: str
    node: str


@dataclass(slots=True)
class NextIteration:
    """``continue_self_loop``'s answer: the self-loop's next iteration is running with these inputs,
    and these outputs of the finished one go to the client."""

    iteration: Vec
    inputs: dict[str, Any]
    emits: tuple[tuple[str, str | None], ...]  # (edge name, modality); an empty list value sends nothing
    streams: tuple[StreamOut, ...] = ()  # outputs the worker pushes to their partitions' streams


@dataclass(frozen=True, slots=True)
class RowsBound:
    """What running a self-loop's next iterations without the tracker must respect
    (``WalkTracker.rows_bound``)."""

    steps_left: int  # usual continuations left before the loop's bound
    stop_signal: str | None
    defer_stop_check: bool
    outputs: tuple[str, ...]  # every output the node must return
    emits: tuple[tuple[str, str | None], ...]  # (edge name, modality) sent to the client
    exits: tuple[str, ...] = ()  # outputs whose values leave the loop when it ends (``rows_exits``)
    streams: tuple[StreamOut, ...] = ()  # outputs pushed to other partitions' streams, every iteration


@dataclass(slots=True)
class LoopExits:
    """Where the iterations a worker runs as running rows leave their values of the loop's exits: the
    loop instance's record (``WalkTracker.rows_exits``), as ``node_done`` would (a code
    predictor's codes, accumulated over its steps, and its running sum)."""

    vals: dict[str, Any]  # the frame's exit values
    names: tuple[str, ...]  # ``RowsBound.exits``
    accumulated: tuple[bool, ...]  # per name: its values are gathered over the iterations

    def add(self, values: Any) -> None:
        """One iteration's value of each exit, in ``names`` order (as the module returned them):
        ``put_exit`` of its ``as_values``, inlined (a call per row and step of running rows)."""
        vals = self.vals
        for name, acc, value in zip(self.names, self.accumulated, values):
            if type(value) is not list:
                value = list(value) if isinstance(value, tuple) else [value]
            if not acc:
                vals[name] = value
            elif (kept := vals.get(name)) is None:
                vals[name] = list(value)
            else:
                kept.extend(value)


@dataclass(frozen=True, slots=True)
class _SelfLoopStep:
    """What finishing an iteration of a self-loop's node does when its only routes besides the feedback
    are to the client (an AR decode step, a nested fixed loop like a code predictor's): looked up once
    per walk, not per step."""

    loop: str
    nested: bool  # the loop has a parent loop (its frame is keyed by the parent's iteration)
    outputs: tuple[str, ...]  # every output the node must return
    emits: tuple[tuple[str, str | None], ...]  # (edge name, modality)
    exits: tuple[str, ...]  # outputs that leave the loop when it ends
    stop_signal: str | None
    defer_stop_check: bool
    streams: tuple[StreamOut, ...] = ()


class SelfLoops:
    """``WalkTracker``'s self-loop paths (module docstring). The tracker sets ``_self_loops`` (loop ->
    its node's invariant inputs, ``_find_self_loops``) and ``_lean`` (node -> ``_SelfLoopStep``,
    ``_lean_steps``) when it is built."""

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

    def _lean_steps(self) -> dict[str, _SelfLoopStep]:
        """The nodes ``_self_loop_done`` handles: the body of a self-loop that routes its outputs only
        back to itself, to the client, to other partitions' streams and out of the loop (its exits)."""
        out = {}
        for loop in self._self_loops:
            lp = self.plan.loops[loop]
            np_ = self.plan.nodes[lp.body_nodes[0]]
            if any(r.kind not in (RouteKind.FEEDBACK, RouteKind.EMIT, RouteKind.STREAM) for r in np_.routes):
                continue
            names = tuple(dict.fromkeys([r.edge_name for r in np_.routes] + list(np_.loop_exit_names)
                                        + ([np_.stop_signal] if np_.stop_signal else [])))
            emits = tuple((r.edge_name, r.modality) for r in np_.routes if r.kind is RouteKind.EMIT)
            streams = tuple(StreamOut(r.edge_name, r.partition, r.dest) for r in np_.routes
                            if r.kind is RouteKind.STREAM)
            out[np_.name] = _SelfLoopStep(loop, lp.parent is not None, names, emits, tuple(np_.loop_exit_names),
                                          np_.stop_signal, lp.defer_stop_check, streams)
        return out

    def _self_loop_done(self, lean: _SelfLoopStep, node: str, vec: Vec, outputs: dict[str, Any]) -> Effects:
        """``node_done`` for a ``_SelfLoopStep`` node: the same checks and effects, in one pass."""
        frame = self.frames[(lean.loop, vec[:-1] if lean.nested else ())]
        if lean.defer_stop_check and frame.deferred_stop is not None and read_stop(frame.deferred_stop):
            # the previous iteration already stopped: this one ran speculatively; drop it
            self._stopped(frame, frame.deferred_stop)
            frame.remaining.discard(node)
            self._maybe_end_iteration(frame, discard_current=True)
            return self._effects()
        for name in lean.outputs:
            if name not in outputs:
                raise self._missing_output(node, name, outputs)
        for name, modality in lean.emits:
            value = outputs[name]
            if not (type(value) is list and not value):  # an empty list: nothing this iteration
                self._emits.append(Emitted(name, value, modality, node))
        for s in lean.streams:
            self._pushes.append(Pushed(s.partition, s.node, s.name, list(outputs[s.name])))
        for name in lean.exits:
            self._record_exit(frame, name, outputs[name])
        if lean.stop_signal is not None:
            if lean.defer_stop_check:
                frame.deferred_stop = outputs[lean.stop_signal]
            elif read_stop(outputs[lean.stop_signal]):
                self._stopped(frame, outputs[lean.stop_signal])
        self._next_self_iteration(frame, node, outputs)
        return self._effects()

    def _next_self_iteration(self, frame: Frame, node: str, outputs) -> None:
        """Fast path for a loop whose body is one node feeding itself (AR decode, rollouts): the next
        iteration's inputs are this iteration's feedback plus the invariant inputs, directly."""
        frame.it += 1
        lp = self.plan.loops[frame.loop]
        if frame.stop or frame.it >= lp.max_iters:
            frame.remaining.discard(node)
            self._finish_loop(frame)
            return
        fixed = frame.invariant
        if fixed is None:
            fixed = self._invariant_inputs(frame, node)
        # carried inputs: the feedback edge has the input's name; inputs keep the node's input order
        inputs = {inp: fixed[inp] if inp in fixed else outputs[inp] for inp in self.plan.nodes[node].inputs}
        self.ready.append(ReadyNode(node, frame.base + (frame.it,), inputs, {}))

    def _invariant_inputs(self, frame: Frame, node: str) -> dict[str, Any]:
        """A self-loop node's inputs that are the same at every iteration of ``frame``: looked up at its
        first continuation and kept on the frame."""
        np_ = self.plan.nodes[node]
        frame.invariant = {
            inp: self.walk_inputs[inp] if np_.inputs[inp].kind is InputKind.WALK_INPUT
            else self._lookup_outer(frame, node, inp) for inp in self._routed[node][0]}
        return frame.invariant

    def continue_self_loop(self, node: str, vec: Vec, outputs: dict[str, Any]) -> NextIteration | None:
        """``node_done`` for the usual iteration of a ``_SelfLoopStep`` node (an AR decode step): the
        loop goes on, so the next iteration is running when this returns, and nothing but the client
        values it names is routed. None, with nothing changed, in every other case (the last
        iteration, a stop, a speculative iteration to drop, a node of another kind, a missing
        output): then ``node_done`` decides. The worker's steady decode path calls it once per row."""
        lean = self._lean.get(node)
        if lean is None:
            return None
        key = (node, vec)
        running = self.running
        if key not in running:
            return None
        frame = self.frames[(lean.loop, vec[:-1] if lean.nested else ())]
        if frame.stop or frame.it + 1 >= self.plan.loops[lean.loop].max_iters:
            return None
        stop = lean.stop_signal
        if lean.defer_stop_check:
            if frame.deferred_stop is not None and read_stop(frame.deferred_stop):
                return None
        elif stop is not None and (stop not in outputs or read_stop(outputs[stop])):
            return None
        for name in lean.outputs:
            if name not in outputs:
                return None
        invariant = frame.invariant
        if invariant is None:  # the frame's first continuation: look its invariant inputs up
            invariant = self._invariant_inputs(frame, node)
        for name in lean.exits:
            self._record_exit(frame, name, outputs[name])
        if lean.defer_stop_check and stop is not None:
            frame.deferred_stop = outputs[stop]
        running.discard(key)
        frame.it += 1
        nxt = frame.base + (frame.it,)
        running.add((node, nxt))
        return NextIteration(nxt, {inp: invariant[inp] if inp in invariant else outputs[inp]
                               for inp in self.plan.nodes[node].inputs}, lean.emits, lean.streams)

    # -- the worker's running rows ---------------------------------------------------------
    def rows_bound(self, node: str, vec: Vec) -> RowsBound | None:
        """For a running iteration of a ``_SelfLoopStep`` node: what the worker needs to run its next
        iterations without calling the tracker (``catch_up_rows`` catches up later; a loop with
        exits takes their values through ``rows_exits``). None for any other node instance."""
        lean = self._lean.get(node)
        if lean is None or (node, vec) not in self.running:
            return None
        frame = self.frames.get((lean.loop, vec[:-1] if lean.nested else ()))
        if frame is None or frame.stop or frame.invariant is None or frame.it != vec[-1]:
            return None
        return RowsBound(self.plan.loops[lean.loop].max_iters - 1 - frame.it, lean.stop_signal,
                             lean.defer_stop_check, lean.outputs, lean.emits, lean.exits, lean.streams)

    def rows_exits(self, node: str, vec: Vec) -> LoopExits | None:
        """Where the worker puts the exit values of the running rows' iterations of the loop instance whose
        iteration ``vec`` of ``node`` runs (``rows_bound`` said yes to it): each iteration's, in
        order, once it ran as a usual continuation, as ``continue_self_loop`` records them."""
        lean = self._lean.get(node)
        if lean is None or not lean.exits:
            return None
        frame = self.frames.get((lean.loop, vec[:-1] if lean.nested else ()))
        if frame is None:
            return None
        accumulated = self._accumulated[lean.loop]
        return LoopExits(frame.exit_vals, lean.exits, tuple(name in accumulated for name in lean.exits))

    def catch_up_rows(self, node: str, vec: Vec, to: Vec, outputs: dict[str, Any]) -> dict[str, Any]:
        """Catch up on the iterations of a ``_SelfLoopStep`` node the worker ran as running rows, from
        ``vec`` (the iteration this tracker saw start) to ``to`` (the one running now): each was a
        usual continuation (no stop, within the bound, no exits; the worker checked), ``outputs`` the
        last finished one's. Returns the running iteration's inputs."""
        lean = self._lean[node]
        frame = self.frames[(lean.loop, vec[:-1] if lean.nested else ())]
        self.running.discard((node, vec))
        frame.it = to[-1]
        self.running.add((node, to))
        if lean.defer_stop_check and lean.stop_signal is not None:
            frame.deferred_stop = outputs[lean.stop_signal]
        fixed = frame.invariant
        return {inp: fixed[inp] if inp in fixed else outputs[inp] for inp in self.plan.nodes[node].inputs}
