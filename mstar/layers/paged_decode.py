"""The compiled CPU attention kernels over the paged cache (``csrc/paged_decode.cpp``) and the backend
that uses them.

Decode rows (one causal query token) and multi-token append sequences (prefill chunks, causal; frame
and image blocks, bidirectional) read their K/V blocks in place through the block tables, instead of
gathering them into fresh tensors as the PyTorch path does; storing new K/V (outside the all-decode
step) and read-only sequences stay on the PyTorch path of ``mstar.layers.paged_attention``. Each
kernel splits the work into tasks (decode: a row or a range of its kv heads; multi-token: a sequence,
query head and tile of query rows, its keys taken in fixed chunks of 128 with an online softmax) and
computes each task on one thread in a fixed order, so a row's output is bitwise the same in any batch
and with any number of threads, for one build on one machine (it is built with ``-march=native``);
against the PyTorch path it agrees to about 1e-6.

The kernels are part of the core extension (``mstar.layers.cpu_ops``, built and loaded by
``mstar.layers.cpu_build``, cached per machine); ``kernel()`` is the one lookup of the attention
kernels. When the extension cannot be built, or ``MSTAR_ATTENTION_KERNEL=torch`` (this switch only:
the linears and norms keep their kernels) or ``MSTAR_KERNELS=torch`` is set, the PyTorch path is
used, with one warning line in the first case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mstar.layers.attention_backends import AttentionBackend
from mstar.layers.cpu_build import compiled_attention_enabled
from mstar.layers.cpu_ops import _EXTENSION, build, ops  # noqa: F401 - _EXTENSION: for tests
from mstar.layers.host_longs import long_tensor
from mstar.layers.paged_attention import (
    AttentionMetadata,
    DecodeRows,
    QueryMode,
    _batch_plan,
    _BatchPlan,
    _store,
    _table_row,
    _validate,
    attend_decode_rows,
    paged_attention,
)

__all__ = ["CompiledPagedBackend", "FusedBlock", "FusedDecode", "build", "kernel", "paged_block", "paged_decode", "store_kv"]

_DTYPES = (torch.float32, torch.bfloat16)


def kernel() -> Any | None:
    """The loaded extension (``mstar.layers.cpu_ops``) for its attention kernels, or None (the
    attention kernels are switched off, or the build failed)."""
    return ops() if compiled_attention_enabled() else None


def _tables(plan: DecodeRows, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode rows' block ids as one padded int64 ``[rows, width]`` tensor and their context
    lengths (memoized on the plan)."""
    if plan.kernel_tables is None:
        width = max(row.num_blocks for row in plan.per_row)
        flat = []
        for row in plan.per_row:
            flat += row.ids
            flat += [0] * (width - row.num_blocks)
        tables = long_tensor(flat).view(len(plan.per_row), width)
        ctx = long_tensor([row.ctx for row in plan.per_row])
        plan.kernel_tables = (tables.to(device), ctx.to(device))
    return plan.kernel_tables


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodeRows,
                 scale: float) -> torch.Tensor:
    """``[n, Hq, D]``: the decode rows of ``plan`` through the kernel (the PyTorch path where the
    kernel does not apply: not built, not CPU, another dtype, a non-contiguous cache)."""
    ext = kernel()
    if (ext is None or q.device.type != "cpu" or k_cache.dtype not in _DTYPES
            or v_cache.dtype != k_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return attend_decode_rows(q, k_cache, v_cache, plan, scale)
    tables, ctx = _tables(plan, q.device)
    # gathering and scaling the queries only copies and scales element by element: batch invariant
    queries = torch.mul(q.index_select(0, plan.q_rows).to(torch.float32), scale)
    return ext.paged_decode(queries, k_cache, v_cache, tables, ctx).to(q.dtype)


@dataclass
class _BlockArgs:
    """The kernel's view of a batch's multi-token append sequences (memoized on the batch plan)."""

    seqs: list[int]  # the sequences it computes
    rest: list[int]  # the sequences left for the PyTorch path (read-only ones)
    tables: torch.Tensor  # int64 [seqs, width]
    ctx: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    causal: torch.Tensor
    rows: torch.Tensor | None  # their query rows when they are not the whole batch


def _block_args(meta: AttentionMetadata, plan: _BatchPlan, k_cache: torch.Tensor, total_q: int) -> _BlockArgs:
    if plan.kernel_args is None:
        seqs = [i for i in plan.others if meta.modes[i] is not QueryMode.READ_ONLY]
        rest = [i for i in plan.others if meta.modes[i] is QueryMode.READ_ONLY]
        block_size, cu = k_cache.shape[1], plan.cu
        ids = [_table_row(meta.block_tables, i, -(-plan.ctx[i] // block_size)) for i in seqs]
        width = max((len(row) for row in ids), default=1)
        col = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        rows = [r for i in seqs for r in range(cu[i], cu[i + 1])]
        plan.kernel_args = _BlockArgs(
            seqs, rest, col([row + [0] * (width - len(row)) for row in ids]).view(len(seqs), width),
            col([plan.ctx[i] for i in seqs]), col([cu[i] for i in seqs]), col([cu[i + 1] - cu[i] for i in seqs]),
            col([int(meta.modes[i] is QueryMode.CAUSAL_APPEND) for i in seqs]),
            None if len(rows) == total_q else col(rows))
    return plan.kernel_args


def paged_block(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                plan: _BatchPlan, scale: float, out: torch.Tensor) -> list[int]:
    """The multi-token causal and block-append sequences of the batch through the kernel, written into
    their rows of ``out``; returns the sequences left for the PyTorch path (read-only ones, or all of
    them where the kernel does not apply: not built, not CPU, another dtype, a head_dim that is not a
    multiple of 16)."""
    ext = kernel()
    if (ext is None or q.device.type != "cpu" or q.dtype not in _DTYPES or k_cache.dtype not in _DTYPES
            or v_cache.dtype != k_cache.dtype or q.shape[-1] % 16
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return plan.others
    args = _block_args(meta, plan, k_cache, q.shape[0])
    if not args.seqs:
        return args.rest
    queries = q.to(torch.float32).contiguous()
    into = out if out.dtype == torch.float32 and out.is_contiguous() else torch.zeros_like(queries)
    ext.paged_block_(into, queries, k_cache, v_cache, args.tables, args.ctx, args.q_start, args.q_len,
                     args.causal, scale)
    if into is not out:
        if args.rows is None:
            out.copy_(into)
        else:
            out.index_copy_(0, args.rows, into.index_select(0, args.rows).to(out.dtype))
    return args.rest


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _BatchPlan) -> None:
    """The batch's new K/V into the cache through the kernel (``store_kv_``: the values and slots of
    ``paged_attention._store``, without its per-call index and conversion copies) where it applies:
    every row written, CPU float32 / bfloat16 rows and contiguous caches; else ``_store``."""
    ext = kernel()
    if (ext is None or plan.write_slots is None or plan.write_rows is not None or k.device.type != "cpu"
            or k_cache.device.type != "cpu"
            or k.dtype not in _DTYPES or v.dtype != k.dtype or k_cache.dtype not in _DTYPES
            or v_cache.dtype != k_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or not (_rows_ok(k) and _rows_ok(v)) or k.shape != v.shape):
        _store(k_cache, v_cache, k, v, plan)
        return
    ext.store_kv_(k, v, k_cache, v_cache, plan.write_slots)


def _rows_ok(x: torch.Tensor) -> bool:
    """``[T, H, D]`` with contiguous rows (a row may sit inside a wider packed projection output)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _fused_args(q, k, v, k_cache, v_cache, meta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``decode_step``'s per-batch arguments (the rows' write slots, block tables and context
    lengths) when every row of the batch is a one-token causal append on a CPU cache; None otherwise."""
    if not (q.device.type == "cpu" and q.dtype in _DTYPES and k.dtype == v.dtype == q.dtype
            and k_cache.dtype in _DTYPES and v_cache.dtype == k_cache.dtype and k_cache.is_contiguous()
            and v_cache.is_contiguous() and k.shape == v.shape and k.shape[0] == q.shape[0]
            and _rows_ok(q) and _rows_ok(k) and _rows_ok(v)):
        return None
    if meta._all_decode and isinstance(meta.block_tables, list):
        return _decode_only_args(q, k, v, k_cache, meta)
    plan = _batch_plan(meta, q, k, v, k_cache)
    if not plan.direct or plan.write_rows is not None or plan.write_slots is None:
        return None
    tables, ctx = _tables(plan.decode, q.device)
    return plan.write_slots, tables, ctx


def _decode_only_args(q, k, v, k_cache, meta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_fused_args`` of a batch built as decode rows only (``AttentionMetadata._all_decode``): the
    metadata's own slot and context tensors and one padded table of its block lists, without the
    general batch plan and its per-row records (memoized on the metadata: every layer reuses it).
    The kernel reads the same slots, block ids and lengths as through the plan."""
    if meta._decode_args is not None:
        return meta._decode_args
    cu, ctx, _ = meta._host
    tables, n = meta.block_tables, len(ctx)
    if (q.dim() != 3 or k.shape != v.shape or k.shape[0] != n or q.shape[0] != n or k.shape[2] != q.shape[2]
            or q.shape[1] % k.shape[1] or tuple(k_cache.shape[2:]) != tuple(k.shape[1:]) or len(cu) != n + 1
            or len(tables) != n or meta.slot_mapping.shape[0] != n or min(ctx) < 1):
        _validate(q, k, v, k_cache, meta, cu, ctx)  # raises the precise error
    block_size, width = k_cache.shape[1], max(map(len, tables))
    flat: list[int] = []
    for i, row in enumerate(tables):
        if len(row) * block_size < ctx[i]:
            _table_row(tables, i, -(-ctx[i] // block_size))  # raises: too few blocks
        flat += row
        if len(row) < width:
            flat += [0] * (width - len(row))
    device = q.device
    args = (meta.slot_mapping.to(device), long_tensor(flat).view(n, width).to(device), meta.context_lens.to(device))
    meta._decode_args = args
    return args


def _fused_step(ext: Any, q, k, v, k_cache, v_cache, meta, scale) -> torch.Tensor | None:
    """The whole layer's attention in one kernel call (store the new K/V, then decode) when every
    row of the batch is a one-token causal append on a CPU cache; None otherwise."""
    args = _fused_args(q, k, v, k_cache, v_cache, meta)
    if args is None:
        return None
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return ext.decode_step(q, k, v, k_cache, v_cache, *args, scale)


@dataclass(frozen=True)
class FusedDecode:
    """A batch's fused decode step, planned once for all the layers of a forward: ``ext.decode_step``
    with the batch's write slots, block tables and context lengths. ``__call__`` is what
    ``CompiledPagedBackend.forward`` computes for the batch (the same kernel call), for any layer
    whose caches have the planned layer's dtype and shape."""

    ext: Any
    write_slots: torch.Tensor
    tables: torch.Tensor
    ctx: torch.Tensor

    def __call__(self, q, k, v, k_cache, v_cache, scale: float) -> torch.Tensor:
        return self.ext.decode_step(q, k, v, k_cache, v_cache, self.write_slots, self.tables, self.ctx, scale)


@dataclass(frozen=True)
class FusedBlock:
    """A batch of multi-token append sequences only (prefill chunks, frame blocks; every row stored,
    no decode or read-only rows), planned once for all the layers of a forward: each layer stores
    its K/V (``store_kv_``) and attends (``paged_block_``) with the batch's slots and block arguments.
    ``__call__`` computes what ``CompiledPagedBackend.forward`` does for the batch (the same kernel
    calls), for any layer whose inputs and caches have the planned layer's dtypes and shapes (else
    None: call ``forward``)."""

    ext: Any
    write_slots: torch.Tensor
    args: _BlockArgs
    shapes: tuple  # (q, k, cache) shapes and dtypes it was planned for

    def __call__(self, q, k, v, k_cache, v_cache, scale: float | None = None) -> torch.Tensor | None:
        if ((q.shape, q.dtype, k.shape, k.dtype, k_cache.shape, k_cache.dtype) != self.shapes
                or v.shape != k.shape or v.dtype != k.dtype or v_cache.shape != k_cache.shape
                or v_cache.dtype != k_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous())
                or not (_rows_ok(k) and _rows_ok(v))):
            return None
        a = self.args
        self.ext.store_kv_(k, v, k_cache, v_cache, self.write_slots)
        q = q.contiguous()  # the kernel's layout (rows of a packed projection output are strided)
        out = torch.empty_like(q)  # every row is a sequence's query: the kernel writes them all
        self.ext.paged_block_(out, q, k_cache, v_cache, a.tables, a.ctx, a.q_start, a.q_len, a.causal,
                              1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
        return out


class CompiledPagedBackend(AttentionBackend):
    """Paged attention with decode rows and multi-token append sequences through the compiled CPU
    kernels (module docstring). A batch of decode rows only (every decode step) takes one kernel call
    per layer for storing its K/V and attending (``decode_step``: the same stores and the same
    arithmetic as the two steps apart)."""

    name = "compiled"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale=None):
        ext = kernel()
        if ext is not None and q.dim() == 3:
            out = _fused_step(ext, q, k, v, k_cache, v_cache, meta, scale)
            if out is not None:
                return out
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale, decode=paged_decode, block=paged_block,
                               store=store_kv)

    def fused_block(self, q, k, v, k_cache, v_cache, meta) -> FusedBlock | None:
        """The batch's planned block step (``FusedBlock``) where ``forward`` would store every row and
        compute every sequence in the block kernel (float32 queries, append sequences only); None
        where it would not (then call ``forward``)."""
        ext = kernel()
        if (ext is None or q.dim() != 3 or q.device.type != "cpu" or q.dtype != torch.float32
                or q.shape[-1] % 16 or k_cache.dtype not in _DTYPES or k.dtype not in _DTYPES):
            return None
        plan = _batch_plan(meta, q, k, v, k_cache)
        if plan.decode is not None or plan.write_rows is not None or plan.write_slots is None or not plan.others:
            return None
        args = _block_args(meta, plan, k_cache, q.shape[0])
        if args.rest or args.rows is not None:
            return None
        return FusedBlock(ext, plan.write_slots, args, (q.shape, q.dtype, k.shape, k.dtype, k_cache.shape,
                                                        k_cache.dtype))

    def fused_decode(self, q, k, v, k_cache, v_cache, meta) -> FusedDecode | None:
        """The batch's fused decode step (``FusedDecode``) where ``forward`` would take it; None where it
        would not (then call ``forward``)."""
        ext = kernel()
        if ext is None or q.dim() != 3:
            return None
        args = _fused_args(q, k, v, k_cache, v_cache, meta)
        return None if args is None else FusedDecode(ext, *args)
