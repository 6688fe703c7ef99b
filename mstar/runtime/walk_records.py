"""The records a ``WalkTracker`` hands out and keeps: ``ReadyNode``, ``Emitted``, ``Pushed``,
``Effects`` (what one call caused, for the worker to apply), ``Frame`` (one loop instance's
iteration state), and ``read_stop`` (a stop signal's truth)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Effects", "Emitted", "Frame", "Pushed", "ReadyNode", "Vec", "read_stop"]

Vec = tuple[int, ...]


@dataclass(slots=True)
class ReadyNode:
    """A node instance whose inputs are all present."""

    node: str
    iteration: Vec
    inputs: dict[str, Any]
    stream_chunks: dict[str, Any]  # input name -> Chunk, for STREAM inputs


@dataclass(slots=True)
class Emitted:
    """A value routed to the client (EMIT_TO_CLIENT)."""

    name: str
    value: Any
    modality: str | None
    node: str  # producing node, or "loop L" for a loop's exit


@dataclass(slots=True)
class Pushed:
    """Items streamed to input ``name`` of node ``node`` in consumer partition ``partition``."""

    partition: str
    node: str
    name: str
    items: list


@dataclass(slots=True)
class Effects:
    """What one call into the tracker caused, for the worker to apply."""

    ready: list[ReadyNode]
    emits: list[Emitted]
    state: dict[str, Any]  # values routed TO_STATE
    pushes: list[Pushed]
    done: bool = False  # the walk ended



def read_stop(value: Any) -> bool:
    """A stop signal is a per-request value: a bool, or a tensor / list whose entries are all truthy."""
    if isinstance(value, (list, tuple)):
        if len(value) == 1:  # the usual value: one flag in a list
            return read_stop(value[0])
        for v in value:
            if not read_stop(v):
                return False
        return bool(value)
    if getattr(value, "ndim", None) == 0:  # one flag (a 0-d tensor): its truth, without a reduction
        return bool(value)
    if hasattr(value, "numel"):
        return bool(value.numel() > 0 and bool(value.all()))
    return bool(value)


def put_exit(vals: dict[str, Any], name: str, accumulated: bool, value: Any) -> None:
    """A loop iteration's value of the exit ``name`` into its frame's ``exit_vals``: appended to the
    values so far when the exit accumulates, else the latest."""
    if accumulated:
        vals.setdefault(name, []).extend(value if isinstance(value, list) else [value])
    else:
        vals[name] = value


@dataclass(slots=True)
class Frame:
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
    invariant: dict[str, Any] | None = None  # a self-loop's invariant inputs, looked up once per frame

    @property
    def vec(self) -> Vec:
        return self.base + (self.it,) if self.loop is not None else self.base

