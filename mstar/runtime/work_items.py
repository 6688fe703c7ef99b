"""What a worker queues and its engines run: ``WorkItem`` (one node instance of one request),
``Prepared`` (an item with its module's ``prepare_inputs``), and an item's outcomes besides its
outputs: ``DEFERRED`` (no KV blocks now: queue it again) and ``ItemError`` (it failed alone)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mstar.model.submodule import ForwardInfo, KVSequence, NodeInputs
from mstar.runtime.failures import FailureKind, describe
from mstar.runtime.keys import WalkKey

__all__ = ["DEFERRED", "ItemError", "Prepared", "WorkItem", "as_values"]


@dataclass(slots=True)
class WorkItem:
    """One node instance of one request, ready to run."""

    seq: int  # arrival order on this worker (FCFS)
    request_id: str
    partition: str
    walk: str
    walk_seq: int
    node: str
    iteration: tuple[int, ...]
    inputs: dict[str, list[torch.Tensor]]
    chunks: dict[str, Any]
    params: Mapping[str, Any]
    home: int
    queued_at: float = 0.0  # time.monotonic() when it joined its module's queue on this worker
    walk_ref: Any = None  # the home worker's record of the walk, when the item runs there (no lookup)

    @property
    def walk_key(self) -> WalkKey:
        return WalkKey(self.request_id, self.partition, self.walk_seq)


@dataclass(slots=True)
class Prepared:
    """A work item and what its module's ``prepare_inputs`` made of it."""

    item: WorkItem
    inputs: NodeInputs
    info: ForwardInfo

    def sequences(self) -> list[KVSequence]:
        """The cache sequences this item brings (one, unless the module listed several)."""
        ni = self.inputs
        if ni.sequences is not None:
            return ni.sequences
        return [KVSequence(ni.cache_name or self.item.node, ni.num_tokens, ni.mode, ni.fork_from)]


class _Deferred:
    """The result of an item that could not get its KV blocks now: run it again later."""

    def __repr__(self) -> str:
        return "DEFERRED"


DEFERRED = _Deferred()


class ItemError(Exception):
    """One item of a batch failed; ``kind`` classifies the original error."""

    def __init__(self, item: WorkItem, error: BaseException):
        super().__init__(f"node {item.node!r} (walk {item.walk!r}) failed: {describe(error)}")
        self.item = item
        self.kind = FailureKind.of(error)


def as_values(v: Any) -> list:
    """One request's output value as the list an edge carries (a list the module made is kept)."""
    return v if type(v) is list else list(v) if isinstance(v, (list, tuple)) else [v]
