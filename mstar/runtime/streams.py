"""Per-request stream buffers at a consumer partition's home worker.

One ``StreamBuffer`` per (request, consumer partition) holds one chunk policy per incoming
connection and the chunks that fired but were not consumed yet. Chunks are consumed by the
partition's walks (a top-level stream input takes one chunk per walk; an input inside a loop takes
one chunk per iteration). After every producer ended and every chunk was taken, a pull returns an
empty final chunk, so a consumer that keeps running (``continue_after_done``) sees the end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mstar.graph.chunking import Chunk, ChunkPolicy
from mstar.runtime.keys import PartitionKey


@dataclass
class _Input:
    policy: ChunkPolicy
    from_partition: str
    pending: deque = field(default_factory=deque)  # chunks that fired, not consumed yet
    next_offset: int = 0  # stream index of the next item to apply
    held: dict[int, list] = field(default_factory=dict)  # pushes that arrived ahead of their turn
    expected: int | None = None  # total items of the stream, known once the producer ended


class StreamBuffer:
    def __init__(self) -> None:
        self.inputs: dict[tuple[str, str], _Input] = {}  # (node, input name) -> policy + pending chunks
        self.walk_running = False
        self.notified = False
        self._ended: dict[str, dict[tuple[str, str], int]] = {}  # producer -> expected totals by (node, name)

    def ensure(self, node: str, name: str, from_partition: str, factory) -> _Input:
        key = (node, name)
        if key not in self.inputs:
            inp = self.inputs[key] = _Input(factory(), from_partition)
            if from_partition in self._ended:
                inp.expected = self._ended[from_partition].get(key, 0)
        return self.inputs[key]

    def push(self, node: str, name: str, from_partition: str, factory, items: list[Any], offset: int) -> None:
        inp = self.ensure(node, name, from_partition, factory)
        if items:  # an empty push carries nothing (and may arrive after the stream's end)
            inp.held[offset] = items
        while inp.next_offset in inp.held:
            batch = inp.held.pop(inp.next_offset)
            inp.pending.extend(inp.policy.push(batch))
            inp.next_offset += len(batch)
        self._maybe_finish(inp)

    def end(self, from_partition: str, expected: dict[tuple[str, str], int]) -> None:
        """The producer ended; ``expected``: (node, input name) -> items it pushed in all."""
        self._ended[from_partition] = dict(expected)
        for key, inp in self.inputs.items():
            if inp.from_partition == from_partition:
                inp.expected = expected.get(key, 0)
                self._maybe_finish(inp)

    @staticmethod
    def _maybe_finish(inp: _Input) -> None:
        if inp.expected is not None and inp.next_offset >= inp.expected and not inp.policy.done:
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

    def pending_from(self, partition: str) -> bool:
        """Some chunk from ``partition``'s streams fired and was not consumed yet."""
        return any(inp.pending for inp in self.inputs.values() if inp.from_partition == partition)

    def all_ended(self, producers: set[str]) -> bool:
        """Every producer ended and every item it announced has arrived (an input whose first push
        is still on its way, behind the end, has no policy here yet: not ended)."""
        if not producers <= self._ended.keys():
            return False
        if any(n and key not in self.inputs for p in producers for key, n in self._ended[p].items()):
            return False
        return all(inp.policy.done for inp in self.inputs.values())

    def buffered(self) -> int:
        return sum(inp.policy.buffered + sum(len(c.items) for c in inp.pending) for inp in self.inputs.values())


def holds_chunks(streams: Mapping[PartitionKey, StreamBuffer], request_id: str, partition: str,
                 consumers: Iterable[str]) -> bool:
    """Some consumer partition's buffer of the request (in ``streams``) holds chunks from
    ``partition`` it has not taken (``ModuleScheduler``: the producer's item is then never overdue)."""
    for consumer in consumers:
        buf = streams.get(PartitionKey(request_id, consumer))
        if buf is not None and buf.pending_from(partition):
            return True
    return False


class StreamInbox:
    """A worker's stream buffers: one per (request, consumer partition) homed on its rank. It takes
    the pushes and ends that reach the rank and says, per buffer, when its idle partition has
    work for the conductor (``notice``)."""

    def __init__(self, producers: Mapping[str, set[str]], consumers: Mapping[str, Iterable[str]],
                 roots: Iterable[str], factory) -> None:
        self.buffers: dict[PartitionKey, StreamBuffer] = {}
        self._producers, self._roots, self._factory = producers, frozenset(roots), factory
        self._consumers = {p: sorted(c) for p, c in consumers.items()}

    def walk_started(self, pkey: PartitionKey) -> StreamBuffer | None:
        """A walk of the partition starts: its buffer (None for a root partition that has none),
        marked running."""
        buf = self.buffers.get(pkey)
        if buf is None and pkey.partition not in self._roots:
            buf = self.buffers.setdefault(pkey, StreamBuffer())
        if buf is not None:
            buf.walk_running = True
            buf.notified = False
        return buf

    def walk_ended(self, pkey: PartitionKey) -> bool:
        """A walk of the partition ended: True when it has a buffer (look at it: ``notice``)."""
        buf = self.buffers.get(pkey)
        if buf is None:
            return False
        buf.walk_running = False
        return True

    def push(self, pkey: PartitionKey, from_partition: str, node: str, name: str, items: list, offset: int) -> None:
        buf = self.buffers.setdefault(pkey, StreamBuffer())
        buf.push(node, name, from_partition, self._factory(from_partition, pkey.partition, name), items, offset)

    def end(self, pkey: PartitionKey, from_partition: str, expected: dict[tuple[str, str], int]) -> None:
        self.buffers.setdefault(pkey, StreamBuffer()).end(from_partition, expected)

    def notice(self, pkey: PartitionKey) -> bool | None:
        """After new items or an end: None when the conductor need not hear of it (a walk of the
        partition runs, or it was told already); else whether every producer ended with nothing
        left (the partition has work, or is done)."""
        buf = self.buffers.get(pkey)
        if buf is None or buf.walk_running or buf.notified:  # (None: its request failed meanwhile)
            return None
        ended = buf.all_ended(self._producers[pkey.partition])
        if not (buf.has_pending() or ended):
            return None
        buf.notified = True
        return ended and not buf.has_pending()

    def ahead(self, request_id: str, partition: str) -> bool:
        """``holds_chunks`` for a partition's consumers homed here (``ModuleScheduler``)."""
        return holds_chunks(self.buffers, request_id, partition, self._consumers.get(partition, ()))

    def drop_request(self, rid: str) -> None:
        for key in [k for k in self.buffers if k.request_id == rid]:
            del self.buffers[key]
