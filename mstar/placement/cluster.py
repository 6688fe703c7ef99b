"""The optional ``nodes:`` section of a placement file: which ranks share a machine.

::

    nodes:                                # logical hosts; the deployment decides which machine is which
      - { name: a, ranks: [0] }
      - { name: b, ranks: [1, 2] }

Names only, never addresses. Each rank the placement uses is on exactly one node, names are unique.
Without the section every rank runs on the serving host. ``workers="ray"`` makes one placement-group
bundle per node (``mstar.runtime.drivers.ray``); the other modes run every node on this host.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mstar.placement.groups import NodeGroup, PlacementError, _fmt_list, _is_int

log = logging.getLogger("mstar.placement")

NODE_KEYS = ("name", "ranks")


@dataclass(frozen=True)
class ClusterNode:
    """One logical host and the ranks it runs."""

    name: str
    ranks: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "ranks": list(self.ranks)}


def parse_nodes(raw: object, source: str) -> tuple[ClusterNode, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise PlacementError(f"{source}: nodes must be a non-empty list of {{name, ranks}} mappings, got {raw!r}")
    out = []
    for i, item in enumerate(raw):
        where = f"{source}: nodes[{i}]"
        if not isinstance(item, Mapping):
            raise PlacementError(f"{where}: must be a mapping with name and ranks, got {item!r}")
        unknown = [k for k in item if k not in NODE_KEYS]
        if unknown:
            raise PlacementError(f"{where}: unknown key(s) {_fmt_list(map(repr, unknown))}; "
                                 f"valid keys: {', '.join(NODE_KEYS)}")
        name, ranks = item.get("name"), item.get("ranks")
        if not isinstance(name, str) or not name or name != name.strip():
            raise PlacementError(f"{where}: name must be a non-empty string, got {name!r}")
        if not isinstance(ranks, list) or not ranks or not all(_is_int(r) and r >= 0 for r in ranks):
            raise PlacementError(f"{where} ({name}): ranks must be a non-empty list of ranks, got {ranks!r}")
        out.append(ClusterNode(name, tuple(ranks)))
    return tuple(out)


def check_nodes(nodes: tuple[ClusterNode, ...], groups: Iterable[NodeGroup], source: str,
                complete: bool = True) -> None:
    """Unique names, each rank on at most one node; with ``complete`` (the validated groups) also every
    rank in use on a node and no rank that no group uses. A tensor-parallel group split over nodes is
    allowed but logged (its collectives cross the network)."""
    if not nodes:
        return
    groups = list(groups)
    names = [n.name for n in nodes]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise PlacementError(f"{source}: nodes: name(s) {', '.join(map(repr, dups))} used more than once")
    where: dict[int, str] = {}
    for node in nodes:
        for r in node.ranks:
            if r in where:
                raise PlacementError(f"{source}: nodes: rank {r} is on both {where[r]!r} and {node.name!r}")
            where[r] = node.name
    if not complete:
        return
    used = sorted({r for g in groups for r in g.ranks})
    missing = [r for r in used if r not in where]
    if missing:
        raise PlacementError(f"{source}: nodes: rank(s) {_fmt_list(missing)} on no node (every rank the "
                             f"node_groups use must be on one)")
    extra = sorted(r for r in where if r not in used)
    if extra:
        raise PlacementError(f"{source}: nodes: rank(s) {_fmt_list(extra)} are used by no node group")
    for g in groups:
        spread = sorted({where[r] for r in g.ranks})
        if len(spread) > 1:
            log.warning("%s: node group %s (tp_size %d) spans nodes %s: its collectives cross the network",
                        source, g.label, g.tp_size, ", ".join(spread))
