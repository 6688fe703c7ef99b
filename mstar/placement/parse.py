"""Reading a placement file's groups and runtime limits, and the checks that need no graph."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from mstar.placement.groups import (
    GROUP_KEYS,
    RUNTIME_KEYS,
    NodeGroup,
    PlacementError,
    RuntimeLimits,
    _fmt_list,
    _is_int,
)

if TYPE_CHECKING:
    from mstar.graph import WalkGraph


def _where(source: str, i: int, g: NodeGroup | None) -> str:
    return f"{source}: node_groups[{i}]" + (f" ({g.label})" if g is not None and g.node_names else "")


def _str_list(value: object, what: str, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise PlacementError(f"{where}: {what} must be a non-empty list of names, got {value!r}")
    for v in value:
        if not isinstance(v, str) or not v or v != v.strip():
            raise PlacementError(f"{where}: {what} must be a non-empty list of names, got {v!r} in {value!r}")
    dups = sorted({v for v in value if value.count(v) > 1})
    if dups:
        raise PlacementError(f"{where}: {what} lists {', '.join(map(repr, dups))} more than once")
    return tuple(value)


def _pos_int(value: object, what: str, where: str) -> int:
    if not _is_int(value) or value < 1:
        raise PlacementError(f"{where}: {what} must be a positive int, got {value!r}")
    return value


def _parse_group(i: int, raw: object, source: str) -> NodeGroup:
    where = f"{source}: node_groups[{i}]"
    if not isinstance(raw, Mapping):
        raise PlacementError(f"{where}: must be a mapping with node_names and ranks, got {raw!r}")
    names_raw = raw.get("node_names")
    if isinstance(names_raw, list) and all(isinstance(n, str) for n in names_raw) and names_raw:
        where = f"{where} ({', '.join(names_raw)})"
    unknown = [k for k in raw if k not in GROUP_KEYS]
    if unknown:
        raise PlacementError(f"{where}: unknown key(s) {_fmt_list(map(repr, unknown))}; "
                             f"valid keys: {', '.join(GROUP_KEYS)}")
    for key in ("node_names", "ranks"):
        if key not in raw:
            raise PlacementError(f"{where}: missing {key!r}")
    names = _str_list(names_raw, "node_names", where)
    ranks = raw["ranks"]
    if not isinstance(ranks, list) or not ranks or not all(_is_int(r) for r in ranks):
        raise PlacementError(f"{where}: ranks must be a non-empty list of ints, got {ranks!r}")
    walks = raw.get("graph_walks")
    if walks is not None:
        walks = _str_list(walks, "graph_walks", where + " (omit graph_walks to apply to every walk)")
    tp = raw.get("tp_size", 1)
    if not _is_int(tp):
        raise PlacementError(f"{where}: tp_size must be an int, got {tp!r}")
    mbs = raw.get("max_batch_size")
    if mbs is not None:
        mbs = _pos_int(mbs, "max_batch_size", where)
    threads = raw.get("threads")
    if threads is not None:
        threads = _pos_int(threads, "threads", where)
    return NodeGroup(node_names=names, ranks=tuple(ranks), graph_walks=walks, tp_size=tp, max_batch_size=mbs,
                     threads=threads)


def _parse_runtime(raw: object, source: str) -> RuntimeLimits:
    if raw is None:
        return RuntimeLimits()
    where = f"{source}: runtime"
    if not isinstance(raw, Mapping):
        raise PlacementError(f"{where}: must be a mapping, got {raw!r}")
    unknown = [k for k in raw if k not in RUNTIME_KEYS]
    if unknown:
        raise PlacementError(f"{where}: unknown key(s) {_fmt_list(map(repr, unknown))}; "
                             f"valid keys: {', '.join(RUNTIME_KEYS)}")
    memory = raw.get("kv_cache_memory_gib")
    values: dict[str, object] = {k: _pos_int(v, k, where) for k, v in raw.items()
                                 if k not in ("kv_cache_memory_gib", "prefix_caching", "scheduling",
                                              "scheduling_max_wait_ms", "trace_requests")}
    for key in ("scheduling", "scheduling_max_wait_ms", "trace_requests"):  # checked by RuntimeLimits
        if key in raw:
            values[key] = raw[key]
    if "prefix_caching" in raw:
        if not isinstance(raw["prefix_caching"], bool):
            raise PlacementError(f"{where}: prefix_caching must be true or false, got {raw['prefix_caching']!r}")
        values["prefix_caching"] = raw["prefix_caching"]
    if memory is not None and "kv_cache_blocks" not in values:  # an explicit block count wins
        if isinstance(memory, bool) or not isinstance(memory, int | float) or not memory > 0:
            raise PlacementError(f"{where}: kv_cache_memory_gib must be a positive number, got {memory!r}")
        values["kv_cache_memory_gib"] = float(memory)
    try:
        return RuntimeLimits(**values)
    except PlacementError as e:  # its own checks (scheduling): name the file
        raise PlacementError(f"{source}: {e}") from None


def _check_groups(groups: Iterable[NodeGroup], source: str) -> None:
    """Graph-independent checks of parsed (or hand-built) groups."""
    groups = list(groups)
    if not groups:
        raise PlacementError(f"{source}: node_groups is empty")
    for i, g in enumerate(groups):
        where = _where(source, i, g)
        if not g.node_names:
            raise PlacementError(f"{where}: node_names is empty")
        if len(set(g.node_names)) != len(g.node_names):
            raise PlacementError(f"{where}: node_names lists a node more than once")
        if g.graph_walks is not None and not g.graph_walks:
            raise PlacementError(f"{where}: graph_walks is empty (omit it to apply to every walk)")
        if not g.ranks:
            raise PlacementError(f"{where}: ranks is empty")
        if not all(_is_int(r) for r in g.ranks):
            raise PlacementError(f"{where}: ranks must be ints, got {list(g.ranks)}")
        negative = [r for r in g.ranks if r < 0]
        if negative:
            raise PlacementError(f"{where}: negative rank {negative[0]} in ranks {_fmt_list(g.ranks)}")
        dups = sorted({r for r in g.ranks if g.ranks.count(r) > 1})
        if dups:
            raise PlacementError(f"{where}: duplicate rank(s) {_fmt_list(dups)} in ranks "
                                 f"{_fmt_list(g.ranks)}")
        if not _is_int(g.tp_size) or g.tp_size < 1:
            raise PlacementError(f"{where}: tp_size must be a positive int, got {g.tp_size!r}")
        if len(g.ranks) != g.tp_size:
            raise PlacementError(
                f"{where}: ranks {_fmt_list(g.ranks)} has {len(g.ranks)} rank(s) but tp_size is {g.tp_size}; "
                f"a group is one tensor-parallel replica of exactly tp_size ranks (data-parallel replicas "
                f"are not supported yet)")
        if g.max_batch_size is not None and (not _is_int(g.max_batch_size) or g.max_batch_size < 1):
            raise PlacementError(f"{where}: max_batch_size must be a positive int, got {g.max_batch_size!r}")
        if g.threads is not None and (not _is_int(g.threads) or g.threads < 1):
            raise PlacementError(f"{where}: threads must be a positive int, got {g.threads!r}")
    _check_threads(groups, source)

    # at most one scoped and one unscoped group per (node, walk)
    for j, gj in enumerate(groups):
        for i in range(j):
            gi = groups[i]
            for n in gj.node_names:
                if n not in gi.node_names:
                    continue
                if gi.graph_walks is None and gj.graph_walks is None:
                    raise PlacementError(
                        f"{_where(source, j, gj)}: node {n!r} is already placed by node_groups[{i}] "
                        f"({gi.label}) for every walk (neither group sets graph_walks); a node may have "
                        f"only one group per walk")
                if gi.graph_walks is not None and gj.graph_walks is not None:
                    common = [w for w in gj.graph_walks if w in gi.graph_walks]
                    if common:
                        raise PlacementError(
                            f"{_where(source, j, gj)}: node {n!r} is already placed by node_groups[{i}] "
                            f"({gi.label}) for walk {common[0]!r}; a node may have only one group per walk")


def _check_threads(groups: list[NodeGroup], source: str) -> None:
    """Groups sharing a rank that both set ``threads`` must agree (a rank is one process)."""
    seen: dict[int, tuple[int, int]] = {}  # rank -> (threads, group index)
    for i, g in enumerate(groups):
        if g.threads is None:
            continue
        for r in g.ranks:
            if r in seen and seen[r][0] != g.threads:
                j = seen[r][1]
                raise PlacementError(f"{_where(source, i, g)}: threads {g.threads} for rank {r}, but node_groups[{j}] "
                                     f"({groups[j].label}) gives it {seen[r][0]}; a rank has one thread count")
            seen[r] = (g.threads, i)


def _applying_group(groups: Iterable[NodeGroup], node: str, walk: str) -> int | None:
    unscoped = None
    for i, g in enumerate(groups):
        if node not in g.node_names:
            continue
        if g.graph_walks is None:
            if unscoped is None:
                unscoped = i
        elif walk in g.graph_walks:
            return i
    return unscoped


def _graph_nodes_in_order(graph: WalkGraph) -> list[str]:
    """The graph's nodes in declaration order (walk by walk, then position in the walk)."""
    order: dict[str, None] = {}
    for w in graph.walks:
        plan = graph.plans[w]
        for n in plan.nodes:
            order[n] = None
    for n in sorted(graph.node_names):
        order.setdefault(n, None)
    return list(order)
