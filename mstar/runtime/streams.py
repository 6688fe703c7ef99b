"""Per-request stream buffers at a consumer partition's home worker.

One ``StreamBuffer`` per (request, consumer partition) holds one chunk policy per incoming
connection and the chunks that fired but were not consumed yet. Chunks are consumed by the
partition's walks (a top-level stream input takes one chunk per walk; an input inside a loop takes
one chunk per iteration). After every producer ended and every chunk was taken, a pull returns an
empty final chunk, so a consumer that keeps running (``continue_after_done``) sees the end.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from mstar.graph.chunking import Chunk, ChunkPolicy


@dataclass
class _Input:
    policy: ChunkPolicy
    from_partition: str
    pending: deque = field(default_factory=deque)


class StreamBuffer:
    def __init__(self) -> None:
        self.inputs: dict[tuple[str, str], _Input] = {}  # (node, input name) -> policy + pending chunks
        self.walk_running = False
        self.notified = False
        self._ended: set[str] = set()

    def ensure(self, node: str, name: str, from_partition: str, factory) -> _Input:
        key = (node, name)
        if key not in self.inputs:
            self.inputs[key] = _Input(factory(), from_partition)
            if from_partition in self._ended:
                self._finish(self.inputs[key])
        return self.inputs[key]

    def push(self, node: str, name: str, from_partition: str, factory, items: list[Any]) -> None:
        inp = self.ensure(node, name, from_partition, factory)
        inp.pending.extend(inp.policy.push(items))

    def end(self, from_partition: str) -> None:
        self._ended.add(from_partition)
        for inp in self.inputs.values():
            if inp.from_partition == from_partition and not inp.policy.done:
                self._finish(inp)

    @staticmethod
    def _finish(inp: _Input) -> None:
        inp.pending.extend(inp.policy.finish())

    def pull(self, node: str, name: str) -> Chunk | None:
        inp = self.inputs.get((node, name))
        if inp is None:
            return None
        if inp.pending:
            return inp.pending.popleft()
        if inp.policy.done:
            return Chunk((), inp.policy.total, inp.policy.total, True)
        return None

    def has_pending(self) -> bool:
        return any(inp.pending for inp in self.inputs.values())

    def all_ended(self, producers: set[str]) -> bool:
        return producers <= self._ended

    def buffered(self) -> int:
        return sum(inp.policy.buffered + sum(len(c.items) for c in inp.pending) for inp in self.inputs.values())
