"""Sizes and layouts of KV blocks: how many fit in memory, and dense K/V as blocks."""

from __future__ import annotations

import torch

from mstar.model.submodule import KVSpec

__all__ = ["as_blocks", "blocks_in_memory", "cdiv"]


def blocks_in_memory(spec: KVSpec, block_size: int, gib: float) -> int:
    """How many KV blocks of ``spec`` fit in ``gib`` GiB: K and V of every layer, in its dtype."""
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    per_block = 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * itemsize
    blocks = int(gib * (1 << 30)) // per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_memory_gib={gib} holds no KV block of {per_block} bytes "
                         f"({spec.num_layers} layers, block size {block_size})")
    return blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def as_blocks(dense: torch.Tensor, num_blocks: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Dense per-token K or V ``[n, heads, dim]`` as ``[num_blocks, block_size, heads, dim]`` (host)."""
    out = torch.zeros((num_blocks * block_size, *dense.shape[1:]), dtype=dtype)
    out[:dense.shape[0]] = dense.to("cpu", dtype)
    return out.view(num_blocks, block_size, *dense.shape[1:])
