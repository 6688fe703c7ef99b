"""Placement: which ranks run each logical node of a model's Walk Graph, walk by walk.

A placement file (YAML) lists *node groups*. Each group puts some nodes on some ranks, optionally
only for some walks::

    model: "bagel"                      # optional; checked against the served model (check_model)
    name: "bagel, CFG views on 3 GPUs"  # optional free text
    node_groups:
      - { node_names: [vit_encoder, vae_encoder, vae_decoder], ranks: [0] }
      - { node_names: [LLM, combine_cfg],                      ranks: [0] }
      - { node_names: [LLM_cfg_text], ranks: [1], graph_walks: [image_gen_cfg] }
      - { node_names: [LLM_cfg_img],  ranks: [2], graph_walks: [image_gen_cfg] }
    nodes:                              # optional: logical hosts and their ranks (``placement/cluster.py``)
      - { name: a, ranks: [0, 1, 2] }
    runtime:                            # optional; defaults shown
      max_batch_size: 32                # per node; a group may override it with its own max_batch_size
      kv_cache_blocks: 1024
      kv_block_size: 16
      max_queue: 1024
      # kv_cache_memory_gib: 4        # size every KV pool from memory instead (kv_cache_blocks, if
                                      # also given, wins)
      prefix_caching: true
      scheduling: downstream_first    # or fcfs (RuntimeLimits)
      scheduling_max_wait_ms: 20      # an item waiting longer goes first, whatever its partition
      trace_requests: 256             # walk traces kept of the latest requests (0: none)

Group keys: ``node_names`` and ``ranks`` (required), ``graph_walks`` (restrict the group to these
walks), ``tp_size`` (default 1), ``max_batch_size`` (override of ``runtime.max_batch_size``) and
``threads`` (each of its ranks' intra-op threads; groups sharing a rank must agree).

Rules (``Placement.validate`` checks them against the model's ``WalkGraph``):

* A group is one tensor-parallel replica: its ``ranks`` are exactly ``tp_size`` distinct ranks.
  Data-parallel replicas (several replicas in one group) are not supported yet. With
  ``tp_size > 1`` the group's modules are sharded over its ranks and its first rank leads
  (``mstar.runtime.tp.groups``); such a module may be placed per walk only on groups of one
  ``tp_size`` (its KV shards move shard by shard), and a rank may belong to one tensor-parallel
  group only (both checked when the runtime is built, as ``PlacementError``).
* For a given walk, the group that applies to a node is the group that names the node and lists
  the walk in ``graph_walks``; failing that, the group that names the node without ``graph_walks``.
  At most one group of each kind may apply, so ``LLM`` may run on rank 0 for the prefill walks and
  on rank 1 for ``decode`` (two scoped groups), or on rank 0 everywhere except ``decode``
  (an unscoped group and a ``decode``-scoped one).
* Nodes of the graph that no group mentions run on rank 0 (``validate`` adds an unscoped group for
  them). The paper's single-GPU BAGEL file, for instance, lists only the encoders, the decoder and
  ``LLM``; the CFG views and ``combine_cfg`` then share rank 0 with ``LLM``.
* A node that is mentioned, but only by groups scoped to other walks, has no placement for the
  remaining walks that use it: that is an error, not a default.
* The ranks in use must be exactly ``0..N-1``.

Every error is a ``PlacementError`` whose message starts with the file (or ``<dict>``) and, where a
group is at fault, ``node_groups[i] (its node names)``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import yaml

from mstar.placement.cluster import ClusterNode, check_nodes, parse_nodes
from mstar.placement.groups import (
    DEFAULT_RANK,
    TOP_LEVEL_KEYS,
    NodeGroup,
    PlacementError,
    RuntimeLimits,
    _fmt_list,
)
from mstar.placement.parse import (
    _applying_group,
    _check_groups,
    _graph_nodes_in_order,
    _parse_group,
    _parse_runtime,
    _where,
)

if TYPE_CHECKING:
    from mstar.graph import WalkGraph

__all__ = ["ClusterNode", "NodeGroup", "Placement", "PlacementError", "RuntimeLimits"]


@dataclass(frozen=True)
class Placement:
    """Node groups plus runtime limits; see the module docstring for the file format and rules.

    ``walk_nodes`` is filled by ``validate``: (walk, nodes it uses) for every walk of the graph. A
    validated placement answers ``ranks_of`` for every (node, walk) pair the graph has and rejects
    the others; an unvalidated one answers from its groups alone.
    """

    model: str | None
    node_groups: tuple[NodeGroup, ...]
    limits: RuntimeLimits = field(default_factory=RuntimeLimits)
    source: str = "<dict>"
    name: str | None = None
    walk_nodes: tuple[tuple[str, frozenset[str]], ...] | None = field(default=None, repr=False, compare=False)
    cluster_nodes: tuple[ClusterNode, ...] = ()  # the file's ``nodes:`` section (empty: this host)

    def __post_init__(self) -> None:
        object.__setattr__(self, "node_groups", tuple(self.node_groups))
        object.__setattr__(self, "cluster_nodes", tuple(self.cluster_nodes))

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Placement:
        """Read and parse a placement YAML file (graph-independent checks only; then ``validate``)."""
        source = os.fspath(path)
        try:
            with open(source, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise PlacementError(f"{source}: cannot read placement file: {e.strerror or e}") from e
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise PlacementError(f"{source}: invalid YAML: {e}") from e
        return cls.from_dict(data, source=source)

    @classmethod
    def from_dict(cls, d: object, source: str = "<dict>") -> Placement:
        """Parse the structure of a placement file (already loaded from YAML)."""
        if not isinstance(d, Mapping):
            raise PlacementError(f"{source}: a placement must be a mapping with a 'node_groups' list, "
                                 f"got {type(d).__name__}")
        unknown = [k for k in d if k not in TOP_LEVEL_KEYS]
        if unknown:
            raise PlacementError(f"{source}: unknown key(s) {_fmt_list(map(repr, unknown))}; "
                                 f"valid keys: {', '.join(TOP_LEVEL_KEYS)}")
        model = d.get("model")
        if model is not None and (not isinstance(model, str) or not model.strip()):
            raise PlacementError(f"{source}: model must be a non-empty string, got {model!r}")
        name = d.get("name")
        if name is not None and not isinstance(name, str):
            raise PlacementError(f"{source}: name must be a string, got {name!r}")
        if "node_groups" not in d:
            raise PlacementError(f"{source}: missing 'node_groups' (a list of "
                                 f"{{node_names: [...], ranks: [...]}} mappings)")
        raw_groups = d["node_groups"]
        if not isinstance(raw_groups, list):
            raise PlacementError(f"{source}: node_groups must be a list, got {type(raw_groups).__name__}")
        if not raw_groups:
            raise PlacementError(f"{source}: node_groups is empty")
        groups = tuple(_parse_group(i, g, source) for i, g in enumerate(raw_groups))
        limits = _parse_runtime(d.get("runtime"), source)
        _check_groups(groups, source)
        nodes = parse_nodes(d.get("nodes"), source)
        check_nodes(nodes, groups, source, complete=False)
        return cls(model=model, node_groups=groups, limits=limits, source=source, name=name, cluster_nodes=nodes)

    @classmethod
    def single_rank(cls, graph: WalkGraph, model: str | None = None) -> Placement:
        """Every node of ``graph`` on rank 0 (validated)."""
        nodes = _graph_nodes_in_order(graph)
        group = NodeGroup(node_names=tuple(nodes), ranks=(DEFAULT_RANK,))
        return cls(model=model, node_groups=(group,), source="<default>").validate(graph)

    def to_dict(self) -> dict[str, Any]:
        """The placement as a YAML-ready dict (``from_dict(p.to_dict())`` gives back the groups)."""
        d: dict[str, Any] = {}
        if self.model is not None:
            d["model"] = self.model
        if self.name is not None:
            d["name"] = self.name
        if self.cluster_nodes:
            d["nodes"] = [n.to_dict() for n in self.cluster_nodes]
        d["node_groups"] = [g.to_dict() for g in self.node_groups]
        runtime = dataclasses.asdict(self.limits)
        # the memory size, when set, governs: an explicit kv_cache_blocks beside it would win on reading
        runtime.pop("kv_cache_blocks" if self.limits.kv_cache_memory_gib is not None else "kv_cache_memory_gib")
        d["runtime"] = runtime
        return d

    # -- queries -----------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return max((r for g in self.node_groups for r in g.ranks), default=-1) + 1

    @property
    def validated(self) -> bool:
        return self.walk_nodes is not None

    @property
    def walks(self) -> tuple[str, ...]:
        """The graph's walks (validated placements), else the walks named by ``graph_walks``."""
        if self.walk_nodes is not None:
            return tuple(w for w, _ in self.walk_nodes)
        return tuple(dict.fromkeys(w for g in self.node_groups for w in (g.graph_walks or ())))

    @property
    def node_names(self) -> tuple[str, ...]:
        """Every node some group mentions, in order of first mention."""
        return tuple(dict.fromkeys(n for g in self.node_groups for n in g.node_names))

    def cluster_node_of(self, rank: int) -> str | None:
        """The ``nodes:`` entry that runs ``rank`` (None without a ``nodes:`` section)."""
        for n in self.cluster_nodes:
            if rank in n.ranks:
                return n.name
        return None

    def group_for(self, node: str, walk: str) -> NodeGroup:
        """The group that places ``node`` for ``walk`` (a walk-scoped group wins over an unscoped one)."""
        self._check_pair(node, walk)
        idx = _applying_group(self.node_groups, node, walk)
        if idx is None:
            mentioned = [i for i, g in enumerate(self.node_groups) if node in g.node_names]
            if not mentioned:
                raise PlacementError(f"{self.source}: node {node!r} is in no node group; nodes: "
                                     f"{_fmt_list(self.node_names)}")
            raise PlacementError(f"{self.source}: node {node!r} has no placement for walk {walk!r}: "
                                 f"only {self._describe_groups(mentioned)} place it")
        return self.node_groups[idx]

    def threads_of(self, rank: int) -> int | None:
        """The intra-op threads a group gives ``rank`` (None: none sets it)."""
        return next((g.threads for g in self.node_groups if rank in g.ranks and g.threads is not None), None)

    def ranks_of(self, node: str, walk: str) -> tuple[int, ...]:
        """Ranks that run ``node`` during ``walk``."""
        return self.group_for(node, walk).ranks

    def nodes_on(self, rank: int, walk: str | None = None) -> frozenset[str]:
        """Nodes that ``rank`` runs during ``walk``; with no walk, every node it runs in any walk."""
        if walk is None:
            return frozenset(n for g in self.node_groups if rank in g.ranks for n in g.node_names)
        wn = self._walk_nodes()
        if wn is not None:
            if walk not in wn:
                raise PlacementError(f"{self.source}: unknown walk {walk!r}; walks: {_fmt_list(wn)}")
            candidates: Iterable[str] = wn[walk]
        else:
            candidates = self.node_names
        out = set()
        for n in candidates:
            idx = _applying_group(self.node_groups, n, walk)
            if idx is not None and rank in self.node_groups[idx].ranks:
                out.add(n)
        return frozenset(out)

    def max_batch_size(self, node: str, walk: str | None = None) -> int:
        """Batch limit of ``node`` (its group's override, else ``limits.max_batch_size``).

        With no walk and groups that disagree (e.g. LLM with one limit for prefill and another for
        decode), the smallest applies.
        """
        if walk is not None:
            g = self.group_for(node, walk)
            return g.max_batch_size if g.max_batch_size is not None else self.limits.max_batch_size
        groups = [g for g in self.node_groups if node in g.node_names]
        if not groups and self.walk_nodes is not None:
            raise PlacementError(f"{self.source}: unknown node {node!r}; nodes: {_fmt_list(self.node_names)}")
        sizes = [g.max_batch_size if g.max_batch_size is not None else self.limits.max_batch_size
                 for g in groups]
        return min(sizes, default=self.limits.max_batch_size)

    def check_model(self, name: str, *aliases: str | None) -> Placement:
        """Raise if the placement names a model other than ``name`` (or one of ``aliases``, e.g. the
        family a tiny twin belongs to); return self."""
        if self.model is not None and self.model != name and self.model not in aliases:
            raise PlacementError(f"{self.source}: placement is for model {self.model!r}, but the model being "
                                 f"served is {name!r}")
        return self

    # -- validation --------------------------------------------------------------------------------
    def validate(self, graph: WalkGraph) -> Placement:
        """Check the placement against ``graph``; return a copy with unmentioned nodes on rank 0."""
        src = self.source
        groups = list(self.node_groups)
        _check_groups(groups, src)
        order = _graph_nodes_in_order(graph)
        walk_names = list(graph.walks)
        walk_nodes = {w: frozenset(graph.nodes_in(w)) for w in walk_names}

        for i, g in enumerate(groups):
            where = _where(src, i, g)
            unknown = [n for n in g.node_names if n not in graph.node_names]
            if unknown:
                what = f"unknown node {unknown[0]!r}" if len(unknown) == 1 else f"unknown nodes {unknown}"
                raise PlacementError(f"{where}: {what}; the model's nodes: {_fmt_list(order)}")
            if g.graph_walks is None:
                continue
            for w in g.graph_walks:
                if w not in walk_nodes:
                    raise PlacementError(f"{where}: unknown walk {w!r}; walks: {_fmt_list(walk_names)}")
            for w in g.graph_walks:
                for n in g.node_names:
                    if n not in walk_nodes[w]:
                        raise PlacementError(f"{where}: node {n!r} is not used by walk {w!r} (it uses "
                                             f"{_fmt_list(n2 for n2 in order if n2 in walk_nodes[w])})")

        mentioned = {n for g in groups for n in g.node_names}
        unmentioned = tuple(n for n in order if n not in mentioned)
        if unmentioned:
            groups.append(NodeGroup(node_names=unmentioned, ranks=(DEFAULT_RANK,)))

        for w in walk_names:
            for n in order:
                if n not in walk_nodes[w] or _applying_group(groups, n, w) is not None:
                    continue
                scoped = [i for i, g in enumerate(groups) if n in g.node_names]
                first = scoped[0]
                others = f" (also {self._describe_groups(scoped[1:], groups)})" if scoped[1:] else ""
                raise PlacementError(
                    f"{_where(src, first, groups[first])}: node {n!r} has no placement for walk {w!r}, which "
                    f"uses it: the group applies only to walks {_fmt_list(groups[first].graph_walks or ())}"
                    f"{others}; add {w!r} to graph_walks or place {n!r} in a group without graph_walks")

        used = {r for g in groups for r in g.ranks}
        n_ranks = max(used) + 1
        missing = [r for r in range(n_ranks) if r not in used]
        if missing:
            raise PlacementError(f"{src}: ranks must be 0..N-1 (here N = {n_ranks}); missing "
                                 f"{', '.join(map(str, missing))}")
        check_nodes(self.cluster_nodes, groups, src)
        return dataclasses.replace(self, node_groups=tuple(groups),
                                   walk_nodes=tuple((w, walk_nodes[w]) for w in walk_names))

    # -- rendering ---------------------------------------------------------------------------------
    def describe(self) -> str:
        """Text table: one row per walk, one column per node, cells = ranks ('-' = not used)."""
        title = self.name or self.model or "placement"
        lines = [f"{title} ({self.source}): {self.num_ranks} rank(s)",
                 "runtime: " + ", ".join(f"{k}={v}" for k, v in self.to_dict()["runtime"].items())]
        for i, g in enumerate(self.node_groups):
            extra = ""
            if g.graph_walks is not None:
                extra += f", walks {_fmt_list(g.graph_walks)}"
            if g.tp_size != 1:
                extra += f", tp_size={g.tp_size}"
            if g.max_batch_size is not None:
                extra += f", max_batch_size={g.max_batch_size}"
            lines.append(f"  node_groups[{i}]: {g.label} -> ranks {_fmt_list(g.ranks)}{extra}")

        wn = self._walk_nodes()
        nodes = list(self.node_names)
        header = ["walk", *nodes]
        rows: list[list[str]] = []
        for w in self.walks:
            row = [w]
            for n in nodes:
                idx = _applying_group(self.node_groups, n, w)
                if (wn is not None and n not in wn[w]) or idx is None:
                    row.append("-")
                else:
                    row.append(",".join(map(str, self.node_groups[idx].ranks)))
            rows.append(row)
        if wn is None:  # unvalidated: one row for the walks no group names
            row = ["(other walks)"]
            for n in nodes:
                idx = next((i for i, g in enumerate(self.node_groups)
                            if n in g.node_names and not g.scoped), None)
                row.append("-" if idx is None else ",".join(map(str, self.node_groups[idx].ranks)))
            rows.append(row)
        widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
        for r in [header, *rows]:
            lines.append("  ".join(cell.ljust(wd) for cell, wd in zip(r, widths)).rstrip())
        return "\n".join(lines)

    # -- helpers -----------------------------------------------------------------------------------
    def _walk_nodes(self) -> dict[str, frozenset[str]] | None:
        return None if self.walk_nodes is None else dict(self.walk_nodes)

    def _check_pair(self, node: str, walk: str) -> None:
        wn = self._walk_nodes()
        if wn is None:
            return
        if walk not in wn:
            raise PlacementError(f"{self.source}: unknown walk {walk!r}; walks: {_fmt_list(wn)}")
        if node not in wn[walk]:
            raise PlacementError(f"{self.source}: node {node!r} is not used by walk {walk!r}")

    def _describe_groups(self, idxs: Iterable[int], groups: Iterable[NodeGroup] | None = None) -> str:
        gs = list(self.node_groups if groups is None else groups)
        parts = []
        for i in idxs:
            g = gs[i]
            scope = f" for walks {_fmt_list(g.graph_walks)}" if g.graph_walks is not None else ""
            parts.append(f"node_groups[{i}] ({g.label}){scope}")
        return ", ".join(parts)


# ------------------------------------------------------------------------------------------------
# parsing and graph-independent checks
# ------------------------------------------------------------------------------------------------
