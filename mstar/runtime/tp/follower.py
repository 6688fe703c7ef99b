"""A tensor-parallel follower: repeats its leaders' calls, in order, on its shards.

Calls arrive as ``TPCall`` (``mstar.runtime.tp.groups``) and run in arrival order:

* ``run`` / ``free_request`` / ``swap_out``: the same engine call as the leader's;
* ``migrate``: a request's caches of the module leave for other groups (per-walk placement:
  prefill on one TP group, decode on another). The leader exports its shard to the destination
  leaders; each follower exports its own and sends it (``TPShard``) to the rank holding the same
  shard index in each destination group;
* ``import``: the destination leader imported its shard; this follower imports the shard that
  came with the same token. When that shard has not arrived yet, this call and every later one
  wait (the backlog), so the engine still sees the leader's order; the leader, meanwhile, waits
  in the next collective at most;
* ``forget``: the leader freed the request for good (the conductor's ``FreeRequest``): shards of
  it not imported are dropped, and so are any that arrive later (their import never comes).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from mstar.runtime.tp.groups import MIRRORED, TPCall, TPContext
from mstar.runtime.wire.serialization import register_message

log = logging.getLogger(__name__)

__all__ = ["TPFollower", "TPShard"]


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
            if call.method == "import" and tuple(call.args) not in self._shards:
                return  # its shard is still on the way
            self._backlog.popleft()
            try:
                self._execute(call)
            except Exception:  # noqa: BLE001 - the leader reports the request's failure; keep serving
                log.exception("tensor-parallel follower: %s of %s failed", call.method, call.module)

    def _execute(self, call: TPCall) -> None:
        eng = self.engines[call.module]
        if call.method in MIRRORED:
            getattr(eng, call.method)(*call.args)
        elif call.method == "import":
            rid, token = call.args
            eng.import_request(rid, self._shards.pop((rid, token)))
        elif call.method == "migrate":
            self._migrate(call)
        elif call.method == "forget":
            self._forget(call.args[0])
        else:
            raise ValueError(f"unknown tensor-parallel call {call.method!r}")

    def _migrate(self, call: TPCall) -> None:
        rid, dests, tokens, keep = call.args
        caches = self.engines[call.module].export_request(rid, free=not keep)
        index = self.ctx.layouts[call.module].index
        for dest, token in zip(dests, tokens):
            self.transport.send(self.ctx.shard_rank(call.module, dest, index),
                                TPShard(call.module, rid, caches, token))

    def _forget(self, rid: str) -> None:
        for key in [k for k in self._shards if k[0] == rid]:
            del self._shards[key]
        self._forgotten[rid] = None
        if len(self._forgotten) > self.FORGOTTEN_KEPT:
            self._forgotten.popitem(last=False)
