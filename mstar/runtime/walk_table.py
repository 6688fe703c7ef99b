"""A worker's live walks: the walks homed on its rank, by key and by request partition.

A walk's tracker (``WalkTracker``) decides what runs next; its ``LiveWalk`` record is what the worker
keeps beside it (its params, the stream offsets its partition's earlier walks left, the values it
routed to state, the items it pushed). ``WalkTable`` owns the records: a walk is live from its
``StartWalk`` until it ends or its request is freed; an item that still refers to a dropped walk
sees ``live`` False.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mstar.runtime.keys import PartitionKey, StreamKey, WalkKey
from mstar.runtime.walk_tracker import WalkTracker

__all__ = ["LiveWalk", "WalkTable"]


@dataclass
class LiveWalk:
    key: WalkKey
    tracker: WalkTracker
    walk: str
    params: Any
    offsets: dict[StreamKey, int]  # items pushed by this partition's earlier walks
    state: dict[str, Any] = field(default_factory=dict)  # values routed TO_STATE
    pushed: Counter[StreamKey] = field(default_factory=Counter)  # items this walk pushed
    live: bool = True  # False once dropped from the table (an item may still refer to it)


class WalkTable:
    """The live walks of a rank. ``ended`` counts walks dropped so far: a holder of walk records
    (the running rows, ``runtime/running_rows.py``) rechecks them only when it moved."""

    def __init__(self) -> None:
        self._walks: dict[WalkKey, LiveWalk] = {}
        self._by_partition: dict[PartitionKey, dict[WalkKey, LiveWalk]] = {}
        self.ended = 0

    def __len__(self) -> int:
        return len(self._walks)

    def __contains__(self, key: WalkKey) -> bool:
        return key in self._walks

    def keys(self) -> Iterator[WalkKey]:
        return iter(list(self._walks))

    def get(self, key: WalkKey) -> LiveWalk | None:
        return self._walks.get(key)

    def add(self, w: LiveWalk) -> None:
        self._walks[w.key] = w
        self._by_partition.setdefault(PartitionKey(w.key.request_id, w.key.partition), {})[w.key] = w

    def of_partition(self, pkey: PartitionKey) -> list[LiveWalk]:
        """The partition's live walks (one a push wakes: not a scan of every walk)."""
        of = self._by_partition.get(pkey)
        return list(of.values()) if of else []

    def drop(self, key: WalkKey) -> LiveWalk | None:
        """Forget a walk, made not live (None: not known)."""
        w = self._walks.pop(key, None)
        if w is not None:
            pkey = PartitionKey(key.request_id, key.partition)
            of_partition = self._by_partition[pkey]
            del of_partition[key]
            if not of_partition:
                del self._by_partition[pkey]
            w.live = False
            self.ended += 1
        return w

    def drop_request(self, rid: str) -> None:
        for key in [k for k in self._walks if k.request_id == rid]:
            self.drop(key)

    @property
    def partitions(self) -> int:
        """Request partitions with a live walk here."""
        return len(self._by_partition)
