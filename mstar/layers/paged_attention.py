"""Attention over the paged KV cache: cache access and the pure-PyTorch reference kernel (the batch's
metadata: ``mstar.layers.attention_metadata``; backends and their registry:
``mstar.layers.attention_backends``).

KV storage for one layer is a pair of tensors ``k_cache, v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; flat slot ``s`` is
``cache[s // block_size, s % block_size]``.
Which slots belong to which sequence is decided by ``mstar.runtime.kv.block_pool`` (pure bookkeeping).

A batch is a ragged concatenation of sequences; every sequence has its own query mode (``QueryMode``):

* ``CAUSAL_APPEND``: the new tokens are written; new token ``j`` attends to all previously cached tokens
  and to new tokens ``0..j`` (prefill, chunked prefill, decode with one token).
* ``BLOCK_APPEND``: the new tokens are written; each attends to all previously cached tokens and to *all*
  new tokens (bidirectional within the block: world-model frames, image token blocks).
* ``READ_ONLY``: nothing is written; the new tokens attend to all cached tokens and bidirectionally to
  each other through the K/V passed in (diffusion steps querying a cached context).

Invariants of the reference implementation:

* Each sequence is computed independently from its own slice of ``q`` and its own cache blocks, by kernel
  calls whose operands' shapes, strides and alignment depend only on that sequence, so its output does not
  depend on the rest of the batch nor on its position in it (batch invariance: bitwise for the torch
  backend, for a given number of intra-op threads).
* Read-only sequences never modify the cache; append sequences modify exactly the slots in their
  ``slot_mapping`` entries.
* The layer imports nothing from the runtime; it is driven only by tensors and the explicit
  ``AttentionMetadata``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mstar.layers.attention_metadata import AttentionMetadata, BlockTables, QueryMode
from mstar.layers.host_longs import long_tensor
from mstar.layers.paged_cache import copy_blocks, gather_kv, write_kv

__all__ = [
    "AttentionMetadata",
    "BlockFn",
    "DecodeFn",
    "DecodeRows",
    "QueryMode",
    "attend_decode_rows",
    "copy_blocks",
    "gather_kv",
    "paged_attention",
    "write_kv",
]


# ----------------------------------------------------------------------------------------------- masks
#
#   One sequence, n = 3 new query tokens, context_len = 7 after the write, so P = 4 tokens were cached before.
#   Keys are the cache positions 0..context_len-1 (new tokens were just written at positions P..P+n-1).
#
#                         |<------ cached (P) ------>|<--- new (n) --->|
#        key position:       0     1     2     3        4     5     6
#   CAUSAL_APPEND
#     query 0 (pos 4)        x     x     x     x        x     .     .
#     query 1 (pos 5)        x     x     x     x        x     x     .
#     query 2 (pos 6)        x     x     x     x        x     x     x
#   BLOCK_APPEND             every entry x (the new tokens see each other in both directions)
#
#   READ_ONLY: nothing was written, so context_len = P; keys are cache[0:P] then the n passed-in K/V:
#                         |<------ cache (P) ------->|<- passed in (n) ->|   (all x)
#
def _build_mask(mode: QueryMode, n: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[n, num_keys]`` mask, True = may attend. Every row has a True (key 0 or itself)."""
    if mode is QueryMode.CAUSAL_APPEND:
        prev = num_keys - n
        query_pos = prev + torch.arange(n, device=device)
        key_pos = torch.arange(num_keys, device=device)
        return key_pos[None, :] <= query_pos[:, None]
    return torch.ones(n, num_keys, dtype=torch.bool, device=device)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """q ``[n, Hq, D]``, k/v ``[S, Hkv, D]`` (Hq % Hkv == 0; query head h uses kv head h // (Hq // Hkv)).
    ``mask`` None: every query sees every key."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              meta: AttentionMetadata, cu: list[int], ctx: list[int]) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"expected q [T, Hq, D], k/v [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on tokens or head_dim")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match k/v heads and head_dim "
                         f"{tuple(k.shape[1:])}")
    b = meta.num_seqs
    if len(cu) != b + 1 or cu[0] != 0 or cu[-1] != q.shape[0] or any(x > y for x, y in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens_q {cu} inconsistent with {b} sequences and {q.shape[0]} query tokens")
    if len(ctx) != b or len(meta.block_tables) != b:
        raise ValueError(f"context_lens ({len(ctx)}) / block_tables ({len(meta.block_tables)}) "
                         f"must have {b} entries")
    if meta.slot_mapping.shape[0] != q.shape[0]:
        raise ValueError(f"slot_mapping has {meta.slot_mapping.shape[0]} entries for "
                         f"{q.shape[0]} query tokens")
    for i, mode in enumerate(meta.modes):
        n = cu[i + 1] - cu[i]
        if ctx[i] < 0 or (mode.writes and ctx[i] < n):
            raise ValueError(f"sequence {i} ({mode.name}): context_len {ctx[i]} < {n} new tokens")


# Decode rows (one causal query token) attend one row at a time. A kernel whose batch spans several
# rows does not keep a row's arithmetic fixed: with more than one thread the CPU SDPA kernel computes
# a batch of one row differently from a batch of several, and a batched matmul over rows changes its
# blocking with the batch even on one thread, so a row's result depended on its neighbours. Here each
# row runs its own matmul -> softmax -> matmul on operands whose shapes, strides and alignment depend
# only on that row (its context length and the model's head layout): the same row gives the same bits
# in any batch, at any position, for a given thread count. Alignment matters as well (kernels take
# other paths for operands that do not start on a vector boundary), so every operand starts at a
# multiple of _ALIGN_BYTES. Gathering and scaling the queries is batched: it only copies and scales
# element by element.
_ALIGN_BYTES = 64


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Decode arithmetic runs in float32 for half types (softmax and sums need the range)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass
class _DecodeRow:
    ctx: int  # keys attended to
    ids: list[int]  # its block ids, in order
    consecutive: bool  # ids[0], ids[0] + 1, ...: the cached keys are one slice of the cache
    _blocks: torch.Tensor | None = None  # int64 ids for index_select (made on first use)

    @property
    def first(self) -> int:
        return self.ids[0]

    @property
    def num_blocks(self) -> int:
        return len(self.ids)

    def blocks(self, device: torch.device) -> torch.Tensor:
        if self._blocks is None:
            self._blocks = torch.tensor(self.ids, dtype=torch.int64, device=device)
        return self._blocks


@dataclass
class DecodeRows:
    """The decode rows of a batch (one causal query token each): planned once, read by every layer."""

    rows: list[int]  # sequence indices, in batch order
    q_rows: torch.Tensor  # their query rows in q (int64 [n])
    q_stride: int  # elements between two rows' queries in the aligned query buffer
    per_row: list[_DecodeRow]
    kernel_tables: Any = None  # a compiled kernel's own form of the rows' block tables (memoized)


def _own(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous and starting at a multiple of ``_ALIGN_BYTES`` (copied only when it is not)."""
    if x.is_contiguous() and x.data_ptr() % _ALIGN_BYTES == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)  # a fresh allocation: aligned


def _table_row(tables: BlockTables, i: int, needed: int) -> list[int]:
    row = tables[i]
    ids = row[:needed].tolist() if isinstance(row, torch.Tensor) else list(row[:needed])
    if len(ids) < needed:
        raise ValueError(f"block table of sequence {i} has {len(ids)} blocks, {needed} needed")
    return ids


def _decode_plan(meta: AttentionMetadata, cu: list[int], ctx: list[int], q: torch.Tensor,
                 k_cache: torch.Tensor) -> DecodeRows | None:
    """Where every decode row's query and keys lie (memoized on ``meta``: every layer reuses it)."""
    if meta._decode_plan is not None:
        return meta._decode_plan
    rows = [i for i, mode in enumerate(meta.modes)
            if mode is QueryMode.CAUSAL_APPEND and cu[i + 1] - cu[i] == 1]
    if not rows:
        return None
    block_size = k_cache.shape[1]
    per_row = []
    for i in rows:
        ids = _table_row(meta.block_tables, i, -(-ctx[i] // block_size))
        per_row.append(_DecodeRow(ctx[i], ids, ids[-1] - ids[0] == len(ids) - 1
                                  and ids == list(range(ids[0], ids[0] + len(ids)))))
    per_vector = _ALIGN_BYTES // math.gcd(_ALIGN_BYTES, _compute_dtype(q.dtype).itemsize)
    q_stride = -(-q.shape[1] * q.shape[2] // per_vector) * per_vector
    plan = DecodeRows(rows, long_tensor([cu[i] for i in rows]).to(q.device),
                      q_stride, per_row)
    meta._decode_plan = plan
    return plan


def _row_keys(cache: torch.Tensor, row: _DecodeRow, dtype: torch.dtype) -> torch.Tensor:
    """A decode row's cached keys (or values) ``[ctx, kv_heads, head_dim]``: contiguous, aligned."""
    if row.consecutive:  # a view of the cache, unless it is misaligned
        keys = cache[row.first:row.first + row.num_blocks].flatten(0, 1)[:row.ctx]
    else:  # a fresh allocation
        keys = cache.index_select(0, row.blocks(cache.device)).flatten(0, 1)[:row.ctx]
    return _own(keys.to(dtype))


def attend_decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodeRows,
                       scale: float) -> torch.Tensor:
    """``[n, Hq, D]``: every decode row's single query over its cached keys, one row at a time."""
    n, hq, d = len(plan.rows), q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    dtype = _compute_dtype(q.dtype)
    queries = torch.empty(n, plan.q_stride, dtype=dtype, device=q.device)  # row j at j * q_stride: aligned
    torch.mul(q.index_select(0, plan.q_rows).to(dtype).view(n, hq * d), scale, out=queries[:, :hq * d])
    outs = []
    for j, row in enumerate(plan.per_row):
        keys, vals = _row_keys(k_cache, row, dtype), _row_keys(v_cache, row, dtype)
        # query head h reads kv head h // (Hq // Hkv): [Hkv, Hq // Hkv, D] x [Hkv, D, ctx]
        scores = torch.bmm(queries[j, :hq * d].view(hkv, hq // hkv, d), keys.permute(1, 2, 0))
        outs.append(torch.bmm(scores.softmax(-1), vals.transpose(0, 1)))
    return torch.stack(outs).view(n, hq, d).to(q.dtype)


# how a backend computes the decode rows: (q, k_cache, v_cache, rows, scale) -> [rows, Hq, D]
DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DecodeRows, float], torch.Tensor]


@dataclass
class _BatchPlan:
    """What every layer of one forward shares (built at the first layer, memoized on the metadata)."""

    cu: list[int]
    ctx: list[int]
    write_rows: torch.Tensor | None  # rows of k/v stored (None: every row)
    write_slots: torch.Tensor | None  # their flat cache slots (None: nothing is stored)
    decode: DecodeRows | None  # the single-token causal rows (None: there are none)
    others: list[int]  # every other sequence with query tokens, attended on its own
    direct: bool  # the decode rows are the whole batch, in order: their result is the output
    kernel_args: Any = None  # a backend's per-batch arguments for the other sequences (memo)


# how a backend computes some of the other sequences (multi-token queries): (q, k_cache, v_cache,
# meta, plan, scale, out) writes their rows of ``out`` and returns the sequences it left for the
# PyTorch path
BlockFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, _BatchPlan, float,
                    torch.Tensor], list[int]]


# how a backend stores the batch's new K/V: (k_cache, v_cache, k, v, plan), what ``_store`` does
StoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, _BatchPlan], None]


def _batch_plan(meta: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor) -> _BatchPlan:
    plan = meta._batch_plan
    if plan is not None:
        return plan
    if meta._host is not None:  # the lists the metadata was built from
        cu, ctx, written = meta._host
    else:
        cu, ctx, written = meta.cu_seqlens_q.tolist(), meta.context_lens.tolist(), False
    _validate(q, k, v, k_cache, meta, cu, ctx)
    writes = [i for i, mode in enumerate(meta.modes) if mode.writes and cu[i + 1] > cu[i]]
    rows = [r for i in writes for r in range(cu[i], cu[i + 1])]
    slots = meta.slot_mapping
    if slots.device != k_cache.device or slots.dtype != torch.int64:
        slots = slots.to(device=k_cache.device, dtype=torch.int64)
    write_rows, write_slots = None, None
    if rows:
        if len(rows) == q.shape[0]:
            write_slots = slots
        else:
            write_rows = torch.tensor(rows, dtype=torch.int64, device=q.device)
            write_slots = slots.index_select(0, write_rows.to(slots.device))
        keep = None if written else write_slots >= 0  # a negative slot is never written
        if keep is not None and not bool(keep.all()):
            sel = keep.nonzero().squeeze(1)
            write_rows = (sel if write_rows is None else write_rows.index_select(0, sel.to(write_rows.device)))
            write_slots = write_slots.index_select(0, sel)
            if write_slots.numel() == 0:
                write_rows = write_slots = None
    decode = _decode_plan(meta, cu, ctx, q, k_cache)
    decoded = set(decode.rows) if decode is not None else set()
    others = [i for i in range(meta.num_seqs) if cu[i + 1] > cu[i] and i not in decoded]
    direct = decode is not None and len(decode.rows) == meta.num_seqs == q.shape[0]
    plan = meta._batch_plan = _BatchPlan(cu, ctx, write_rows, write_slots, decode, others, direct)
    return plan


def _store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           plan: _BatchPlan) -> None:
    if plan.write_slots is None:
        return
    if plan.write_rows is not None:
        k, v = k.index_select(0, plan.write_rows), v.index_select(0, plan.write_rows)
    if k_cache.is_contiguous() and v_cache.is_contiguous():  # flat views: one index_copy each
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, plan.write_slots, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, plan.write_slots, v.to(v_cache.dtype))
    else:
        write_kv(k_cache, v_cache, k, v, plan.write_slots)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float | None = None, *,
                    decode: DecodeFn | None = None, block: BlockFn | None = None,
                    store: StoreFn | None = None) -> torch.Tensor:
    """Attention of a ragged batch over the paged cache; returns ``[total_q, q_heads, head_dim]`` (q's dtype).

    ``q`` is ``[total_q, q_heads, head_dim]``; ``k``/``v`` are the new tokens'
    ``[total_q, kv_heads, head_dim]``; q_heads must be a multiple of kv_heads (GQA/MQA).
    First writes k/v of the append-mode sequences into their slots, then, per sequence, gathers its cached K/V
    through its block table and attends with the mask of its mode. ``scale`` defaults to ``head_dim ** -0.5``.
    The batch's bookkeeping (validation, write slots, decode rows) is done at the first call and reused
    by every later layer of the same forward (same ``meta``). ``decode`` computes the decode rows
    (default ``attend_decode_rows``; a compiled kernel: ``mstar.layers.paged_decode``); ``block``, when
    given, computes the multi-token sequences it can (the rest take the PyTorch path); ``store``, when
    given, writes the new K/V in place of ``_store`` (the same values at the same slots).
    """
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"expected q [T, Hq, D], k/v [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    plan = _batch_plan(meta, q, k, v, k_cache)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])

    # 1. Store the new K/V of append-mode sequences (read-only sequences' rows are never written).
    (store or _store)(k_cache, v_cache, k, v, plan)

    # 2. Attend: decode rows one by one, every other sequence on its own (a sequence's computation
    #    never depends on the rest of the batch).
    decode = decode or attend_decode_rows
    if plan.direct:
        return decode(q, k_cache, v_cache, plan.decode, scale)
    out = torch.zeros_like(q)
    if plan.decode is not None:
        out.index_copy_(0, plan.decode.q_rows, decode(q, k_cache, v_cache, plan.decode, scale))
    cu, ctx = plan.cu, plan.ctx
    others = plan.others if block is None or not plan.others else block(q, k_cache, v_cache, meta, plan, scale, out)
    for i in others:
        mode = meta.modes[i]
        s, e = cu[i], cu[i + 1]
        k_seq, v_seq = gather_kv(k_cache, v_cache, meta.block_tables[i], ctx[i])
        k_seq, v_seq = k_seq.to(q.dtype), v_seq.to(q.dtype)
        if mode is QueryMode.READ_ONLY:
            k_seq = torch.cat([k_seq, k[s:e].to(q.dtype)])
            v_seq = torch.cat([v_seq, v[s:e].to(q.dtype)])
        # the bidirectional modes see every key: no mask needed
        mask = _build_mask(mode, e - s, k_seq.shape[0], q.device) if mode is QueryMode.CAUSAL_APPEND else None
        # where a sequence's q sits in the batch, and whether its blocks happen to be consecutive (a view
        # of the cache), must not change its result: SDPA's output can depend on operand alignment
        out[s:e] = _attend(_own(q[s:e]), _own(k_seq), _own(v_seq), mask, scale)
    return out
