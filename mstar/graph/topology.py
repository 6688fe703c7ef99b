"""Partitions: parts of one request that run concurrently and stream to each other.

A model with one partition (most models) never mentions this module. Qwen3-Omni has three
(Thinker -> Talker -> Code2Wav); Orpheus has two (LLM -> codec). A ``Connection`` names the
streaming edge that links two partitions and the chunk policy that decides when the consumer fires.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT_PARTITION = "main"


@dataclass(frozen=True)
class Connection:
    from_partition: str
    to_partition: str
    edge_name: str
    chunk_policy_factory: Callable[[], object]

    def __post_init__(self) -> None:
        for label, value in (("from_partition", self.from_partition), ("to_partition", self.to_partition),
                             ("edge_name", self.edge_name)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"Connection.{label} must be a non-empty string, got {value!r}")
        if self.from_partition == self.to_partition:
            raise ValueError(f"Connection {self.edge_name!r} links partition {self.from_partition!r} to itself")
        if not callable(self.chunk_policy_factory):
            raise ValueError(
                f"Connection {self.edge_name!r}: chunk_policy_factory must be a zero-argument callable "
                f"returning a ChunkPolicy (e.g. lambda: FixedChunkPolicy(chunk_size=1))"
            )


@dataclass(frozen=True)
class PartitionTopology:
    """How the partitions of a request stream to one another.

    ``partitions`` may be omitted: it is then the set of partitions named by the model's walks.
    Partitions that receive no connection are *roots*: they start when the request starts. The
    others start when their first chunk arrives.
    """

    connections: Sequence[Connection] = ()
    partitions: Sequence[str] | None = None

    def __post_init__(self) -> None:
        conns = tuple(self.connections)
        seen: set[tuple[str, str, str]] = set()
        for c in conns:
            if not isinstance(c, Connection):
                raise ValueError(f"PartitionTopology.connections must hold Connection, got {type(c).__name__}")
            key = (c.from_partition, c.to_partition, c.edge_name)
            if key in seen:
                raise ValueError(f"duplicate Connection {c.from_partition} -> {c.to_partition} ({c.edge_name})")
            seen.add(key)
        object.__setattr__(self, "connections", conns)
        if self.partitions is not None:
            parts = tuple(self.partitions)
            if len(set(parts)) != len(parts):
                raise ValueError(f"duplicate partition names in {list(parts)}")
            object.__setattr__(self, "partitions", parts)

    def connection(self, from_partition: str, to_partition: str, edge_name: str) -> Connection | None:
        for c in self.connections:
            if (c.from_partition, c.to_partition, c.edge_name) == (from_partition, to_partition, edge_name):
                return c
        return None

    def consumers(self) -> set[str]:
        return {c.to_partition for c in self.connections}
