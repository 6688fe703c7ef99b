"""Named keys for the runtime's in-memory state.

``WalkKey`` names one walk instance of one request; ``StreamKey`` names one stream into a consumer
partition. A stream key becomes a string only on the wire (message fields whose keys must be
``str``), and ``StreamKey.encode`` / ``StreamKey.decode`` are the only place that happens. The
encoding is a JSON list, so node and edge names may contain any character (``/`` included).
"""

from __future__ import annotations

import json
from typing import NamedTuple


class WalkKey(NamedTuple):
    """One walk instance: the ``walk_seq``-th walk of ``partition`` for a request."""

    request_id: str
    partition: str
    walk_seq: int


class PartitionKey(NamedTuple):
    """One partition of a request (its stream buffer on the partition's home worker)."""

    request_id: str
    partition: str


class StreamKey(NamedTuple):
    """A stream into ``partition`` (the consumer), feeding input ``name`` of its node ``node``."""

    partition: str
    node: str
    name: str

    def encode(self) -> str:
        return json.dumps([self.partition, self.node, self.name])

    @classmethod
    def decode(cls, text: str) -> StreamKey:
        partition, node, name = json.loads(text)
        return cls(partition, node, name)


def encode_counts(counts: dict[StreamKey, int]) -> dict[str, int]:
    """Items per stream, in wire form."""
    return {k.encode(): n for k, n in counts.items()}


def decode_counts(counts: dict[str, int]) -> dict[StreamKey, int]:
    return {StreamKey.decode(k): n for k, n in counts.items()}
