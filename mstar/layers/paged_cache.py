"""Reading and writing a paged KV cache as tensors (the PyTorch path's cache access; the compiled
kernels read and write the blocks in place): ``write_kv`` (new K/V into their slots), ``gather_kv``
(a sequence's cached K/V, a view when its blocks are consecutive), ``copy_blocks`` (copy-on-write).

A cache is ``[num_blocks, block_size, kv_heads, head_dim]``; a token's flat slot is
``block * block_size + offset``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["copy_blocks", "gather_kv", "write_kv"]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new ``k``/``v`` ``[total_q, kv_heads, head_dim]`` into their slots; negative slots are skipped.

    Slots must be unique among the non-negative entries. Works for non-contiguous caches (2-D indexing).
    """
    if k.shape != v.shape or k.shape[0] != slot_mapping.shape[0]:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} / "
                         f"slot_mapping {tuple(slot_mapping.shape)} mismatch")
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    if slots.numel() == 0:
        return
    block_size = k_cache.shape[1]
    blk, off = slots // block_size, slots % block_size
    k_cache[blk, off] = k.to(k_cache.dtype)
    v_cache[blk, off] = v.to(v_cache.dtype)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
              num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``num_tokens`` cached K and V of a sequence, each ``[num_tokens, kv_heads, head_dim]``."""
    block_size = k_cache.shape[1]
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=k_cache.device)
    needed = math.ceil(num_tokens / block_size)
    if ids.numel() < needed:
        raise ValueError(f"block table has {ids.numel()} blocks, {num_tokens} tokens need {needed}")
    ids = ids[:needed]  # whole blocks, then the first num_tokens slots of them
    first = int(ids[0]) if needed else 0
    if needed and int(ids[-1]) - first == needed - 1 and bool((ids == torch.arange(
            first, first + needed, device=ids.device)).all()):
        # consecutive blocks (the common case for a request that grew alone): a view, no copy
        return (k_cache[first:first + needed].flatten(0, 1)[:num_tokens],
                v_cache[first:first + needed].flatten(0, 1)[:num_tokens])
    k = k_cache.index_select(0, ids).flatten(0, 1)[:num_tokens]
    v = v_cache.index_select(0, ids).flatten(0, 1)[:num_tokens]
    return k, v


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
    """Perform pending copy-on-write copies ``(src_block, dst_block)`` in order.

    Order matters: a chain ``(a, b), (b, c)`` must see the first copy before the second.

    Call once per layer with the pairs from ``KVCacheManager.pop_pending_copies()``, before the forward pass.
    """
    for src, dst in pairs:
        k_cache[dst].copy_(k_cache[src])
        v_cache[dst].copy_(v_cache[src])
