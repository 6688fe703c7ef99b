"""Tensor-parallel groups in the runtime: process groups, and the leader / follower protocol.

A node group with ``tp_size: N`` is one replica of its modules sharded over its N ranks
(``mstar.layers.tensor_parallel.apply_tp``). Routing sends every node of such a module to the
group's first rank, the **leader**: it alone queues work items, schedules batches, allocates KV
blocks, preempts, samples what it routes on, and talks to the rest of the runtime. The other
ranks, **followers**, hold a plain engine over their shard and only repeat the leader's engine
calls (typed messages, ``TPRun`` / ``TPFree`` / ``TPSwapOut``...), in the order the leader made them.
Each engine's block pool therefore goes through the same sequence of operations on every rank
and makes the same decisions (which items are admitted, which blocks they get), so all ranks
run the same forwards over the same token rows and meet in the collectives in the same order.
A follower drops the outputs of its forwards; nothing else reaches its engine (a ``FreeRequest``
from the conductor frees its walks and buffers, never its follower engines). ``follower.py``
has the follower's side, including KV migration between groups of equal ``tp_size`` (shard i to
shard i) for per-walk placement.

Process groups: when any group has ``tp_size > 1`` every rank joins one ``torch.distributed``
world (gloo on CPU, NCCL on CUDA devices, imported only then) through a ``TCPStore`` the driver
binds on 127.0.0.1 (port chosen by the OS, handed to the workers); then every rank creates the
group of every distinct TP rank tuple in sorted order (``new_group`` is collective: unequal calls
deadlock). A dead rank cannot rejoin that world, so a runtime with TP does not restart workers.

Not supported yet (rejected by ``check_tp_placement``): a TP module placed on groups of different
sizes (KV resharding), and a rank in two TP groups.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from mstar.layers.tensor_parallel import TPGroup
from mstar.model.base import ModelDef
from mstar.placement import Placement, PlacementError
from mstar.runtime.engine import StatelessEngine, WorkItem
from mstar.runtime.kv.engine import KVCacheEngine
from mstar.runtime.wire.serialization import register_message

log = logging.getLogger(__name__)

register_message(WorkItem)  # a leader's batch travels to its followers as the items themselves

TIMEOUT_S = float(os.environ.get("MSTAR_DIST_TIMEOUT_S", "300"))
NO_RESTART = "tensor-parallel ranks cannot rejoin their process group (a runtime with tp_size > 1 does not " \
             "restart workers)"


# Leader -> followers: the engine calls a follower repeats on its shard of ``module``, one typed
# message per call (``TPFollower`` runs them in arrival order). A request's id is ``rid``, not
# ``request_id``: the worker drops messages of requests it freed, and these must reach the engine.
@register_message
@dataclass
class TPRun:
    """Run this batch (the leader's ``run``)."""

    module: str
    items: list


@register_message
@dataclass
class TPFree:
    """Free a request's state (the leader's ``free_request``)."""

    module: str
    rid: str


@register_message
@dataclass
class TPSwapOut:
    """Swap a request's blocks out to host memory (the leader's ``swap_out``)."""

    module: str
    rid: str
    preempted: bool


@register_message
@dataclass
class TPMigrate:
    """A request's caches leave for other groups: each follower exports its own shard and sends it
    to the rank of the same shard index in each destination group."""

    module: str
    rid: str
    dests: list
    tokens: list
    keep: bool


@register_message
@dataclass
class TPImport:
    """Import the shard of migrated caches that came with ``token`` (``TPShard``)."""

    module: str
    rid: str
    token: int


@register_message
@dataclass
class TPForget:
    """The request is freed for good: drop its shards not imported, and any that arrive later."""

    module: str
    rid: str


TPCall = TPRun | TPFree | TPSwapOut | TPMigrate | TPImport | TPForget


@register_message
@dataclass
class TPStatsBarrier:
    """Leader -> followers, after the conductor asked for stats: a follower answers that request
    only once this arrives too, so its figures include every call its leader mirrored before."""

    token: int


class StatsBarrier:
    """A follower's stats requests: answered when both the conductor's request and the leader's
    barrier for its token arrived (in either order)."""

    def __init__(self) -> None:
        self._half: set[tuple[int, bool]] = set()

    def arrived(self, token: int, from_leader: bool) -> bool:
        """Record one half; True when the other half is already here (answer now)."""
        other = (token, not from_leader)
        if other in self._half:
            self._half.discard(other)
            return True
        self._half.add((token, from_leader))
        return False


@dataclass(frozen=True)
class TPLayout:
    """A module's tensor-parallel group as one rank sees it."""

    module: str
    ranks: tuple[int, ...]
    index: int  # this rank's place in ``ranks``

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    @property
    def followers(self) -> tuple[int, ...]:
        return self.ranks[1:]


def tp_rank_tuples(placement: Placement) -> list[tuple[int, ...]]:
    """Every distinct rank tuple of a group with ``tp_size > 1``, sorted."""
    return sorted({g.ranks for g in placement.node_groups if g.tp_size > 1})


def check_tp_placement(model: ModelDef, placement: Placement) -> None:
    """Reject TP layouts the runtime cannot run yet (see the module docstring)."""
    tuples = tp_rank_tuples(placement)
    for i, a in enumerate(tuples):
        for b in tuples[i + 1:]:
            shared = sorted(set(a) & set(b))
            if shared:
                raise PlacementError(f"{placement.source}: rank {shared[0]} is in two tensor-parallel groups "
                                     f"{list(a)} and {list(b)}; a rank may be in one only")
    by_module: dict[str, set[tuple[int, ...]]] = {}
    for g in placement.node_groups:
        for n in g.node_names:
            by_module.setdefault(model.module_of(n), set()).add(g.ranks if g.tp_size > 1 else (g.ranks[0],))
    for module, layouts in sorted(by_module.items()):
        if len({len(r) for r in layouts}) > 1:
            raise PlacementError(f"{placement.source}: module {module!r} is placed on groups of different "
                                 f"tp_size {sorted(map(list, layouts))} across its nodes or walks; its KV "
                                 f"shards move only between groups of one size (resharding is not supported "
                                 f"yet)")


def layouts_on(model: ModelDef, placement: Placement, rank: int) -> dict[str, TPLayout]:
    """The tensor-parallel modules of ``rank``: module -> its layout."""
    out: dict[str, TPLayout] = {}
    for g in placement.node_groups:
        if g.tp_size > 1 and rank in g.ranks:
            for n in g.node_names:
                module = model.module_of(n)
                out[module] = TPLayout(module, g.ranks, g.ranks.index(rank))
    return out


# -- process groups ---------------------------------------------------------------------------------
class Rendezvous:
    """The ``TCPStore`` the ranks meet at: bound on 127.0.0.1, a port the OS picks (no race)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=TIMEOUT_S))
        self.address = f"127.0.0.1:{self.store.port}"

    def close(self) -> None:
        self.store = None


def open_rendezvous(placement: Placement) -> Rendezvous | None:
    """A rendezvous when the placement has a TP group, else None."""
    return Rendezvous() if tp_rank_tuples(placement) else None


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def join_process_groups(placement: Placement, rank: int, address: str, device: str) -> dict[tuple[int, ...], Any]:
    """Join the world through ``address`` and create every TP group (same order on every rank)."""
    import torch
    import torch.distributed as dist

    backend = backend_for(device)
    if backend == "nccl":  # untested here: one device per rank, "cuda" meaning this rank's
        torch.cuda.set_device(rank % torch.cuda.device_count())
    host, port = address.rsplit(":", 1)
    timeout = timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=placement.num_ranks, timeout=timeout)
    return {ranks: dist.new_group(list(ranks), timeout=timeout) for ranks in tp_rank_tuples(placement)}


@dataclass
class TPContext:
    """What a worker needs to run its TP modules: their layouts and process groups."""

    layouts: dict[str, TPLayout]
    groups: dict[tuple[int, ...], Any]
    peers: dict[tuple[str, int], tuple[int, ...]]  # (module, leader rank) -> that group's ranks

    def shard_rank(self, module: str, leader: int, index: int) -> int:
        """The rank holding shard ``index`` of ``module`` in the group led by ``leader``."""
        return self.peers[(module, leader)][index]

    @property
    def followers(self) -> tuple[int, ...]:
        """The ranks following this one (it leads their group), sorted."""
        return tuple(sorted({r for lay in self.layouts.values() if lay.is_leader for r in lay.followers}))

    @property
    def follows(self) -> bool:
        return any(not lay.is_leader for lay in self.layouts.values())

    def tp_group(self, module: str) -> TPGroup:
        layout = self.layouts[module]
        return TPGroup(layout.index, len(layout.ranks), self.groups[layout.ranks])


def connect(model: ModelDef, placement: Placement, rank: int, address: str | None, device: str) -> TPContext | None:
    """A worker process's TP context (None without TP): joins the process groups."""
    if address is None:
        return None
    import torch

    # one rank's spinning OpenMP threads would delay its peers at every collective: share the cores
    # (unless the placement gives the rank its threads)
    torch.set_num_threads(placement.threads_of(rank) or max(1, len(os.sched_getaffinity(0)) // placement.num_ranks))
    groups = join_process_groups(placement, rank, address, device)
    peers = {(model.module_of(n), g.ranks[0]): g.ranks for g in placement.node_groups if g.tp_size > 1
             for n in g.node_names}
    return TPContext(layouts_on(model, placement, rank), groups, peers)


# -- leader and followers ---------------------------------------------------------------------------
class _Mirror:
    """Engine calls made by the worker on a TP leader, sent to its followers before they run.

    Calls the engine makes on itself (a swap-in during a run, a swap-out during an import) are
    not sent: the follower's engine makes them itself while repeating the outer call.
    """

    continues_batches = False  # a follower prepares every item it is sent: the leader does the same

    def _init_mirror(self, module: str, followers: tuple[int, ...], transport: Any) -> None:
        self._tp_module, self._tp_followers, self._tp_transport = module, followers, transport
        self._tp_depth = 0

    @contextmanager
    def _mirrored(self, call: TPCall):
        if self._tp_depth == 0:
            for rank in self._tp_followers:
                self._tp_transport.send(rank, call)
        self._tp_depth += 1
        try:
            yield
        finally:
            self._tp_depth -= 1

    def _tell(self, call: TPCall) -> None:
        """Send the followers a call with no engine call here."""
        with self._mirrored(call):
            pass

    def export_migrating(self, request_id: str, dests: list[int], tokens: list[int], keep: bool) -> dict[str, Any]:
        self._tell(TPMigrate(self._tp_module, request_id, list(dests), list(tokens), keep))  # each sends its shard
        return super().export_migrating(request_id, dests, tokens, keep)

    def import_migrated(self, request_id: str, caches: dict[str, Any], token: int) -> None:
        """Import this rank's shard of migrated caches; each follower imports the shard of ``token``."""
        with self._mirrored(TPImport(self._tp_module, request_id, token)):
            super().import_request(request_id, caches)

    def forget(self, request_id: str) -> None:
        self._tell(TPForget(self._tp_module, request_id))

    def run(self, items: list[WorkItem]) -> list:
        # the followers get the items without the leader's local walk records
        sent = [dataclasses.replace(it, walk_ref=None) if it.walk_ref is not None else it for it in items]
        with self._mirrored(TPRun(self._tp_module, sent)):
            return super().run(items)

    def free_request(self, request_id: str) -> None:
        with self._mirrored(TPFree(self._tp_module, request_id)):
            super().free_request(request_id)

    def swap_out(self, request_id: str, preempted: bool = True) -> None:
        with self._mirrored(TPSwapOut(self._tp_module, request_id, preempted)):
            super().swap_out(request_id, preempted)


class TPLeaderKVEngine(_Mirror, KVCacheEngine):
    """A KV engine whose top-level calls its followers repeat."""


class TPLeaderEngine(_Mirror, StatelessEngine):
    """A stateless engine whose batches its followers repeat."""

    def swap_out(self, request_id: str, preempted: bool = True) -> None:
        raise TypeError("a stateless engine has no KV blocks to swap out")


def build_tp_engine(module: Any, layout: TPLayout, transport: Any, num_blocks: int, block_size: int,
                    device: str, prefix_caching: bool = False) -> StatelessEngine:
    """The engine of a sharded module: mirroring on the leader, plain on a follower. Prefix caching
    stays in step: a follower replays the leader's calls on an identical pool, so it reuses and names
    the same blocks."""
    kv = module.kv_spec is not None
    if not layout.is_leader:
        return (KVCacheEngine(module, num_blocks, block_size, device, prefix_caching=prefix_caching) if kv
                else StatelessEngine(module))
    eng = (TPLeaderKVEngine(module, num_blocks, block_size, device, prefix_caching=prefix_caching) if kv
           else TPLeaderEngine(module))
    eng._init_mirror(layout.module, layout.followers, transport)
    return eng
