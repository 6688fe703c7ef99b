"""A tensor-parallel follower: repeats its leaders' calls, in order, on its shards.

Calls arrive as typed messages (``mstar.runtime.tp.groups``) and run in arrival order:

* ``TPRun`` / ``TPFree`` / ``TPSwapOut``: the same engine call as the leader's;
* ``TPMigrate``: a request's caches of the module leave for other groups (per-walk placement:
  prefill on one TP group, decode on another). The leader exports its shard to the destination
  leaders; each follower exports its own and sends it (``TPShard``) to the rank holding the same
  shard index in each destination group;
* ``TPImport``: the destination leader imported its shard; this follower imports the shard that
  came with the same token. When that shard has not arrived yet, this call and every later one
  wait (the backlog), so the engine still sees the leader's order; the leader, meanwhile, waits
  in the next collective at most;
* ``TPForget``: the leader freed the request for good (the conductor's ``FreeRequest``): shards of
  it not imported are dropped, and so are any that arrive later (their import never comes).

``TPRank`` is what a worker holds of tensor parallelism: the messages above and the stats barrier
(``TPStatsBarrier``) as handlers, and each followed module's engine wrapped in a ``FollowerEngine``
that the worker's own calls (a ``FreeRequest``, stats) cannot drive: only the leader's calls do.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mstar.runtime.tp.groups import (
    StatsBarrier,
    TPCall,
    TPContext,
    TPForget,
    TPFree,
    TPImport,
    TPMigrate,
    TPRun,
    TPStatsBarrier,
    TPSwapOut,
)
from mstar.runtime.wire.serialization import register_message

log = logging.getLogger(__name__)

__all__ = ["FollowerEngine", "TPFollower", "TPRank", "TPShard"]

_CALLS = (TPRun, TPFree, TPSwapOut, TPMigrate, TPImport, TPForget)


@register_message
@dataclass
class TPShard:
    """Source follower -> the destination group's follower of the same shard index: its shard of a
    request's caches (name -> {num_tokens, k, v}), to import when its leader says so."""

    module: str
    rid: str
    caches: dict[str, Any]
    token: int


class TPFollower:
    """The follower side of every TP module of one rank (see the module docstring)."""

    FORGOTTEN_KEPT = 100_000  # requests whose late shards are dropped

    def __init__(self, engines: dict[str, Any], transport: Any, ctx: TPContext) -> None:
        self.engines, self.transport, self.ctx = engines, transport, ctx
        self._backlog: deque[TPCall] = deque()
        self._shards: dict[tuple[str, int], dict[str, Any]] = {}
        self._forgotten: OrderedDict[str, None] = OrderedDict()

    def call(self, msg: TPCall) -> None:
        self._backlog.append(msg)
        self._drain()

    def shard(self, msg: TPShard) -> None:
        if msg.rid not in self._forgotten:
            self._shards[(msg.rid, msg.token)] = msg.caches
            self._drain()

    @property
    def waiting(self) -> int:
        """Calls held back until a shard arrives."""
        return len(self._backlog)

    @property
    def held_shards(self) -> int:
        """Shards received and not imported yet."""
        return len(self._shards)

    def _drain(self) -> None:
        while self._backlog:
            call = self._backlog[0]
            if type(call) is TPImport and (call.rid, call.token) not in self._shards:
                return  # its shard is still on the way
            self._backlog.popleft()
            try:
                self._execute(call)
            except Exception:  # noqa: BLE001 - the leader reports the request's failure; keep serving
                log.exception("tensor-parallel follower: %s of %s failed", type(call).__name__, call.module)

    def _execute(self, call: TPCall) -> None:
        eng = self.engines[call.module]
        if type(call) is TPRun:
            eng.run(call.items)
        elif type(call) is TPFree:
            eng.free_request(call.rid)
        elif type(call) is TPSwapOut:
            eng.swap_out(call.rid, call.preempted)
        elif type(call) is TPImport:
            eng.import_request(call.rid, self._shards.pop((call.rid, call.token)))
        elif type(call) is TPMigrate:
            self._migrate(call)
        elif type(call) is TPForget:
            self._forget(call.rid)
        else:
            raise TypeError(f"unknown tensor-parallel call {type(call).__name__}")

    def _migrate(self, call: TPMigrate) -> None:
        caches = self.engines[call.module].export_request(call.rid, free=not call.keep)
        index = self.ctx.layouts[call.module].index
        for dest, token in zip(call.dests, call.tokens):
            self.transport.send(self.ctx.shard_rank(call.module, dest, index),
                                TPShard(call.module, call.rid, caches, token))

    def _forget(self, rid: str) -> None:
        for key in [k for k in self._shards if k[0] == rid]:
            del self._shards[key]
        self._forgotten[rid] = None
        if len(self._forgotten) > self.FORGOTTEN_KEPT:
            self._forgotten.popitem(last=False)


class FollowerEngine:
    """A followed module's engine as the worker sees it: its stats, nothing it could drive (the
    leader's calls reach the shard through ``TPFollower``)."""

    def __init__(self, shard: Any) -> None:
        self.shard = shard
        self.holds_kv = shard.holds_kv
        self.module = shard.module

    @property
    def preemptions(self) -> int:
        return self.shard.preemptions

    def stats(self) -> dict[str, Any]:
        return self.shard.stats()

    def free_request(self, request_id: str) -> None:
        """Freed when the leader says so (``TPFree``), never by the worker's own ``FreeRequest``."""

    def forget(self, request_id: str) -> None:
        pass

    def run(self, items: list) -> list:
        raise RuntimeError(f"{type(self.shard.module).__name__} is followed on this rank: its leader runs it")


class TPRank:
    """A rank's tensor-parallel side, for its worker: the follower of the modules it follows, the
    stats barrier, and the handlers of their messages (none on a rank without tensor parallelism,
    ``ctx`` None). ``reply_stats(token)`` answers a stats request."""

    def __init__(self, ctx: TPContext | None, shards: dict[str, Any], transport: Any,
                 reply_stats: Callable[[int], None]) -> None:
        self.ctx, self.transport, self._reply = ctx, transport, reply_stats
        self.follower = TPFollower(shards, transport, ctx) if shards else None
        self._barrier = StatsBarrier()

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        if self.ctx is None:
            return {}
        out: dict[type, Callable[[Any], None]] = {TPStatsBarrier: self._barrier_arrived}
        if self.follower is not None:
            out.update({t: self.follower.call for t in _CALLS})
            out[TPShard] = self.follower.shard
        return out

    def stats_requested(self, token: int) -> None:
        """The conductor asked for stats: the followers' answers wait for this rank's barrier; a
        follower answers once its leader's barrier is here too."""
        if self.ctx is None:
            self._reply(token)
            return
        for rank in self.ctx.followers:
            self.transport.send(rank, TPStatsBarrier(token))
        if not self.ctx.follows or self._barrier.arrived(token, from_leader=False):
            self._reply(token)

    def _barrier_arrived(self, msg: TPStatsBarrier) -> None:
        if self._barrier.arrived(msg.token, from_leader=True):
            self._reply(msg.token)

    def stats(self, engines: dict[str, Any]) -> dict[str, Any]:
        if self.ctx is None:
            return {}
        return {b: {"ranks": list(lay.ranks), "role": "leader" if lay.is_leader else "follower"}
                for b, lay in self.ctx.layouts.items() if b in engines}
