"""A rank's side of moving KV caches between ranks (per-walk placement: prefill on one rank,
decode on another) and of the conductor freeing one module's caches of a request: the worker's
handlers of ``MigrateKV``, ``KVImport`` and ``FreeKV``. A sharded engine
(``runtime/tp/groups.py``) moves its other shards itself, behind the same engine calls."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mstar.runtime.failures import FailureKind
from mstar.runtime.wire.messages import FreeKV, KVImport, KVMoved, MigrateKV

__all__ = ["KVMover"]


class KVMover:
    def __init__(self, rank: int, engines: Mapping[str, Any], transport: Any, guarded: Callable,
                 fail: Callable[[str, str, FailureKind], None], tell: Callable[[Any], None]) -> None:
        self.rank, self.engines, self.transport = rank, engines, transport
        self._guarded, self._fail, self._tell = guarded, fail, tell

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        return {MigrateKV: self.migrate, KVImport: self.import_, FreeKV: self.free}

    def migrate(self, msg: MigrateKV) -> None:
        eng = self.engines.get(msg.module)
        caches = eng.export_migrating(msg.request_id, list(msg.dests), list(msg.tokens), msg.keep) \
            if eng is not None else {}
        for dest, token in zip(msg.dests, msg.tokens):
            self.transport.send(dest, KVImport(msg.request_id, msg.module, caches, token))

    def import_(self, msg: KVImport) -> None:
        eng = self.engines.get(msg.module)
        if eng is not None:
            self._guarded(msg.request_id, lambda: eng.import_migrated(msg.request_id, msg.caches, msg.token))
        elif msg.caches:
            self._fail(msg.request_id, f"rank {self.rank} received KV of {msg.module!r}, which it does not hold",
                       FailureKind.INTERNAL)
        self._tell(KVMoved(msg.request_id, msg.token))

    def free(self, msg: FreeKV) -> None:
        eng = self.engines.get(msg.module)
        if eng is not None:
            eng.free_request(msg.request_id)
