"""Placement building blocks: node groups, runtime limits, the error type and the file's keys."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

TOP_LEVEL_KEYS = ("model", "name", "node_groups", "runtime")
GROUP_KEYS = ("node_names", "ranks", "graph_walks", "tp_size", "max_batch_size")
RUNTIME_KEYS = ("max_batch_size", "kv_cache_blocks", "kv_block_size", "max_queue")

DEFAULT_RANK = 0
"""Rank that runs every node no group mentions."""


class PlacementError(ValueError):
    """A placement file (or dict) is malformed or does not fit the model's Walk Graph."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _fmt_list(items: Iterable[object]) -> str:
    return "[" + ", ".join(str(x) for x in items) + "]"


# ------------------------------------------------------------------------------------------------
# data classes
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RuntimeLimits:
    """Runtime sizes shared by every rank (all positive ints)."""

    max_batch_size: int = 32
    kv_cache_blocks: int = 1024
    kv_block_size: int = 16
    max_queue: int = 1024

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not _is_int(v) or v < 1:
                raise PlacementError(f"runtime.{f.name} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class NodeGroup:
    """Nodes placed together on ``ranks`` (one tensor-parallel replica of ``tp_size`` ranks).

    ``graph_walks`` is None for a group that applies to every walk, or the walks it is limited to.
    ``max_batch_size`` is None to use ``RuntimeLimits.max_batch_size``.
    """

    node_names: tuple[str, ...]
    ranks: tuple[int, ...]
    graph_walks: tuple[str, ...] | None = None
    tp_size: int = 1
    max_batch_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "node_names", tuple(self.node_names))
        object.__setattr__(self, "ranks", tuple(self.ranks))
        if self.graph_walks is not None:
            object.__setattr__(self, "graph_walks", tuple(self.graph_walks))

    @property
    def scoped(self) -> bool:
        return self.graph_walks is not None

    def applies_to(self, walk: str) -> bool:
        return self.graph_walks is None or walk in self.graph_walks

    @property
    def label(self) -> str:
        return ", ".join(self.node_names)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"node_names": list(self.node_names), "ranks": list(self.ranks)}
        if self.graph_walks is not None:
            d["graph_walks"] = list(self.graph_walks)
        if self.tp_size != 1:
            d["tp_size"] = self.tp_size
        if self.max_batch_size is not None:
            d["max_batch_size"] = self.max_batch_size
        return d
