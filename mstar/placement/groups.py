"""Placement building blocks: node groups, runtime limits, the error type and the file's keys."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

TOP_LEVEL_KEYS = ("model", "name", "nodes", "node_groups", "runtime")
GROUP_KEYS = ("node_names", "ranks", "graph_walks", "tp_size", "max_batch_size", "threads")
RUNTIME_KEYS = ("max_batch_size", "kv_cache_blocks", "kv_block_size", "max_queue", "kv_cache_memory_gib",
                "prefix_caching", "scheduling", "scheduling_max_wait_ms", "trace_requests")
SCHEDULING_POLICIES = ("downstream_first", "fcfs")

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
    """Runtime sizes shared by every rank (positive ints; ``kv_cache_memory_gib`` a positive number).

    ``kv_cache_memory_gib``, when set, sizes each KV module's block pool from memory instead of
    ``kv_cache_blocks``: as many blocks as that many GiB hold (K and V, every layer, the module's
    dtype). A placement file that also gives ``kv_cache_blocks`` keeps that explicit count.
    ``prefix_caching`` (a bool, default on): KV nodes that declare reusable prompts (the Llama-family
    LMs, the Qwen3-Omni Thinker) reuse the cached blocks of an earlier request's identical leading
    tokens.
    ``scheduling``: which module a rank runs next. ``fcfs``: the one whose oldest queued item came
    first. ``downstream_first`` (default): the module of the partition furthest down the streams
    (Code2Wav before Talker before Thinker), so a stream's consumer turns what it has into output
    before its producer runs ahead; an item that waited more than ``scheduling_max_wait_ms``
    (default 20) goes first whatever its partition (oldest first), so a producer's new prompts
    and other requests are never starved; except an item whose request's consumer here still
    holds chunks it streamed and has not taken them (running it would only grow that backlog).
    Models without streams have one partition: FCFS.
    ``trace_requests`` (default 256; 0: none): how many of the latest requests' walk traces the
    runtime keeps (``Runtime.trace``, ``GET /v1/requests/{id}/trace``).
    """

    max_batch_size: int = 32
    kv_cache_blocks: int = 1024
    kv_block_size: int = 16
    max_queue: int = 1024
    kv_cache_memory_gib: float | None = None
    prefix_caching: bool = True
    scheduling: str = "downstream_first"
    scheduling_max_wait_ms: float = 20.0
    trace_requests: int = 256

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "scheduling":
                if v not in SCHEDULING_POLICIES:
                    raise PlacementError(f"runtime.scheduling must be one of {', '.join(SCHEDULING_POLICIES)}, "
                                         f"got {v!r}")
            elif f.name == "scheduling_max_wait_ms":
                if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
                    raise PlacementError(f"runtime.scheduling_max_wait_ms must be a number >= 0, got {v!r}")
            elif f.name == "trace_requests":
                if not _is_int(v) or v < 0:
                    raise PlacementError(f"runtime.trace_requests must be an int >= 0, got {v!r}")
            elif f.name == "prefix_caching":
                if not isinstance(v, bool):
                    raise PlacementError(f"runtime.prefix_caching must be true or false, got {v!r}")
            elif f.name == "kv_cache_memory_gib":
                if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not v > 0):
                    raise PlacementError(f"runtime.{f.name} must be a positive number of GiB, got {v!r}")
            elif not _is_int(v) or v < 1:
                raise PlacementError(f"runtime.{f.name} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class NodeGroup:
    """Nodes placed together on ``ranks`` (one tensor-parallel replica of ``tp_size`` ranks).

    ``graph_walks`` is None for a group that applies to every walk, or the walks it is limited to.
    ``max_batch_size`` is None to use ``RuntimeLimits.max_batch_size``.
    ``threads``: the intra-op threads of each of its ranks' processes (None: torch's default, every
    core; a tensor-parallel runtime's ranks share the cores). Ranks that compute at once should
    split the cores between them rather than each spin threads on all of them.
    """

    node_names: tuple[str, ...]
    ranks: tuple[int, ...]
    graph_walks: tuple[str, ...] | None = None
    tp_size: int = 1
    max_batch_size: int | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "node_names", tuple(self.node_names))
        object.__setattr__(self, "ranks", tuple(self.ranks))
        if self.graph_walks is not None:
            object.__setattr__(self, "graph_walks", tuple(self.graph_walks))

    @property
    def scoped(self) -> bool:
        return self.graph_walks is not None

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
        if self.threads is not None:
            d["threads"] = self.threads
        return d
