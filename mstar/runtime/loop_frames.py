"""``LoopFrames``: ``WalkTracker``'s loop frames (the tracker's module docstring draws them): an
iteration starts with its inputs bound (walk inputs, values from before the loop, fed-back values),
ends when every member finished, and the loop ends at its stop flag or bound, routing its exits into
the parent frame. The tracker sets ``plan``, ``frames``, ``walk_inputs``, ``finish`` and the plan's
tables (``_outer_needs``, ``_members``, ``_start_bindings``, ``_accumulated``) when it is built."""

from __future__ import annotations

from typing import Any

from mstar.graph.finish import FinishReason, reason_of
from mstar.graph.plan import InputBinding, InputKind, NodePlan, RouteKind
from mstar.runtime.walk_records import Frame, Vec, put_exit

__all__ = ["LoopFrames"]


class LoopFrames:
    """Loop frames: start, bind, end an iteration; stop or finish a loop (module docstring)."""

    # -- frames --------------------------------------------------------------------------------
    def _outer_requirements(self) -> dict[str, set[tuple[str, str]]]:
        """Per loop: the (node, input) values its parent frame must hand in before it can start."""
        needs: dict[str, set[tuple[str, str]]] = {name: set() for name in self.plan.loops}
        routes = [r for n in self.plan.nodes.values() for r in n.routes]
        routes += [ex.route for lp in self.plan.loops.values() for ex in lp.exits]
        for r in routes:
            if r.kind is RouteKind.ENTER:
                needs[r.loop].add((r.dest, r.edge_name))
        return needs

    def _frame_of(self, loop: str | None, vec: Vec) -> Frame:
        return self.frames[(loop, vec)]

    def _start_iteration(self, frame: Frame) -> None:
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
            child = Frame(loop, vec)
            self.frames[(loop, vec)] = child
            self._maybe_start_loop(child)
        if not frame.remaining:
            self._maybe_end_iteration(frame)

    def _bind_start(self, frame: Frame, np_: NodePlan, inp: str, b: InputBinding, vec: Vec) -> None:
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
            chunk = self._streams.pull(np_.name, inp) if self._streams is not None else None
            if chunk is None:
                self.waiting_streams.setdefault((np_.name, vec), set()).add(inp)
            else:
                self.chunks.setdefault((np_.name, vec), {})[inp] = chunk
                self._deliver(np_.name, vec, inp, list(chunk.items))

    def _lookup_outer(self, frame: Frame, node: str, inp: str) -> Any:
        f: Frame | None = frame
        while f is not None:
            if (node, inp) in f.outer_vals:
                return f.outer_vals[(node, inp)]
            if f.loop is None:
                break
            parent_loop = self.plan.loops[f.loop].parent
            f = self.frames[(parent_loop, f.base[:-1] if parent_loop is not None else ())]
        raise RuntimeError(f"walk {self.plan.walk!r}: no value for {node}.{inp} entering its loop")

    def _maybe_start_loop(self, frame: Frame) -> None:
        if frame.started:
            return
        if self._outer_needs[frame.loop] <= frame.outer_vals.keys():
            self._start_iteration(frame)

    def _maybe_end_iteration(self, frame: Frame, discard_current: bool = False) -> None:
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

    def _stopped(self, frame: Frame, flag: Any) -> None:
        """``frame``'s loop ends after this iteration: its stop node raised ``flag`` (its
        ``FinishReason``, if it carries one, is the walk's)."""
        frame.stop = True
        reason = reason_of(flag)
        if reason is not None:
            self.finish = reason

    def _finish_loop(self, frame: Frame) -> None:
        lp = self.plan.loops[frame.loop]
        if lp.dynamic and not frame.stop:  # ran out of iterations before its stop node stopped it
            self.finish = FinishReason.LENGTH
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

    def _record_exit(self, frame: Frame, name: str, value: Any) -> None:
        put_exit(frame.exit_vals, name, name in self._accumulated[frame.loop], value)
