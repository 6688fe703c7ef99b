"""``KVSwap``: ``KVCacheEngine``'s moves of a request's KV blocks: to host memory and back (preemption)
and out to another rank and in (migration). The engine sets ``manager``, ``kv_caches``, ``_swapped``
and ``preemptions``, and drains its copy-on-write copies with ``_copy_pending`` before any move."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mstar.runtime.kv.block_pool import OutOfBlocks
from mstar.runtime.kv.records import SwappedKV
from mstar.runtime.kv.sizing import as_blocks, cdiv

if TYPE_CHECKING:
    from mstar.runtime.kv.cache_manager import KVCacheManager

__all__ = ["KVSwap"]


class KVSwap:
    """A request's blocks to host memory and back, and to another rank (module docstring)."""

    manager: KVCacheManager
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    _swapped: dict[str, SwappedKV]
    preemptions: int

    def _copy_pending(self) -> None:
        raise NotImplementedError

    # -- preemption: a request's blocks to host memory and back ------------------------------------
    def holders(self) -> list[str]:
        """Requests holding KV blocks here (swapped-out requests hold none)."""
        return [r for r in self.manager.request_ids() if self.blocks_of(r)]

    def blocks_of(self, request_id: str) -> int:
        return len(self.manager.snapshot(request_id)[0])

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    def swap_out(self, request_id: str, preempted: bool = True) -> None:
        """Save the request's blocks to host memory and free them; its next item swaps them back."""
        self._copy_pending()
        blocks, tables = self.manager.snapshot(request_id)
        idx = torch.tensor(blocks, dtype=torch.long, device=self.kv_caches[0][0].device)
        # indexing copies; .to("cpu") then moves device caches to host and leaves host ones as they are
        self._swapped[request_id] = SwappedKV(tables, [k[idx].to("cpu") for k, _ in self.kv_caches],
                                             [v[idx].to("cpu") for _, v in self.kv_caches])
        self.manager.free_request(request_id)
        self.preemptions += int(preempted)
        if preempted and self.trace_note is not None:
            self.trace_note(request_id, "preemptions", 1)

    def swap_in(self, request_id: str) -> bool:
        """Bring a swapped-out request's blocks back; False (nothing changed) when they do not fit."""
        saved = self._swapped[request_id]
        self._copy_pending()  # a queued copy may target a block this restore is about to reuse
        try:
            fresh = self.manager.restore(request_id, saved.num_blocks, saved.tables)
        except OutOfBlocks:
            return False
        del self._swapped[request_id]
        if fresh:
            idx = torch.tensor(fresh, dtype=torch.long, device=self.kv_caches[0][0].device)
            for (k, v), sk, sv in zip(self.kv_caches, saved.k, saved.v):
                k[idx] = sk.to(k.device, k.dtype)
                v[idx] = sv.to(v.device, v.dtype)
        return True

    # -- migration between ranks -------------------------------------------------------------------
    def _flat(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, kv_heads, head_dim]

    def export_request(self, request_id: str, free: bool = True) -> dict[str, Any]:
        """Gather every cache of the request into dense tensors (forked prefixes are copied); then free
        them here unless ``free`` is False (a copy for another rank)."""
        swapped = self._swapped.get(request_id)
        if swapped is not None:
            out = self._export_swapped(swapped)
            if free:
                del self._swapped[request_id]
            return out
        self._copy_pending()
        m = self.manager
        out = {}
        for name in m.cache_names(request_id):
            idx = torch.tensor(m.slot_mapping(request_id, name), dtype=torch.long)
            out[name] = {"num_tokens": m.num_tokens(request_id, name),
                         "k": [self._flat(k)[idx].clone() for k, _ in self.kv_caches],
                         "v": [self._flat(v)[idx].clone() for _, v in self.kv_caches]}
        if free:
            m.free_request(request_id)
        return out

    def _export_swapped(self, saved: SwappedKV) -> dict[str, Any]:
        bs = self.manager.block_size
        out = {}
        for name, (blocks, num_tokens) in saved.tables.items():
            idx = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(num_tokens)], dtype=torch.long)
            out[name] = {"num_tokens": num_tokens, "k": [self._flat(k)[idx].clone() for k in saved.k],
                         "v": [self._flat(v)[idx].clone() for v in saved.v]}
        return out

    def import_request(self, request_id: str, caches: dict[str, Any]) -> None:
        """Take caches exported by another rank. When they do not fit now they are kept swapped out,
        and the request's first item here swaps them in."""
        m = self.manager
        self._copy_pending()  # a queued copy may target a block this import is about to reuse
        for name in caches:
            if m.has(request_id, name):
                m.free(request_id, name)
        bs = m.block_size
        if sum(cdiv(c["num_tokens"], bs) for c in caches.values()) > m.pool.num_free or request_id in self._swapped:
            self._import_swapped(request_id, caches)
            return
        for name, c in caches.items():
            idx = torch.tensor(m.append_slots(request_id, name, c["num_tokens"]), dtype=torch.long)
            for layer, (k, v) in enumerate(self.kv_caches):
                self._flat(k)[idx] = c["k"][layer].to(k.device, k.dtype)
                self._flat(v)[idx] = c["v"][layer].to(v.device, v.dtype)

    def _import_swapped(self, request_id: str, caches: dict[str, Any]) -> None:
        """Keep imported dense caches in swapped form (each cache in its own blocks, the last one
        zero-padded), with whatever else of the request is here, so it swaps in as one."""
        if self.manager.cache_names(request_id):
            self.swap_out(request_id, preempted=False)
        saved = self._swapped.pop(request_id, None)
        bs, cache = self.manager.block_size, self.kv_caches[0][0]
        tables = dict(saved.tables) if saved else {}
        ks = [[t] for t in saved.k] if saved else [[] for _ in self.kv_caches]
        vs = [[t] for t in saved.v] if saved else [[] for _ in self.kv_caches]
        start = saved.num_blocks if saved else 0
        for name, c in caches.items():
            n = c["num_tokens"]
            nb = cdiv(n, bs)
            tables[name] = (list(range(start, start + nb)), n)
            start += nb
            for layer in range(len(self.kv_caches)):
                ks[layer].append(as_blocks(c["k"][layer], nb, bs, cache.dtype))
                vs[layer].append(as_blocks(c["v"][layer], nb, bs, cache.dtype))
        empty = torch.zeros((0, *cache.shape[1:]), dtype=cache.dtype)
        self._swapped[request_id] = SwappedKV(tables, [torch.cat([empty, *k]) for k in ks],
                                             [torch.cat([empty, *v]) for v in vs])
