"""The metadata of one attention batch over the paged KV cache (``paged_attention.py`` has the layout,
the query modes' semantics and the kernels): each sequence's query rows, written slots, block table,
context length and ``QueryMode``, and the Python lists a batch keeps to plan its kernels once."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.layers.host_longs import HostLongs, long_tensor

__all__ = ["AttentionMetadata", "BlockTables", "QueryMode"]


class QueryMode(enum.Enum):
    """How the new tokens of one sequence attend, and whether their K/V are stored (see module docstring)."""

    CAUSAL_APPEND = "causal_append"
    BLOCK_APPEND = "block_append"
    READ_ONLY = "read_only"

    @property
    def writes(self) -> bool:
        return self is not QueryMode.READ_ONLY


BlockTables = list[list[int]] | torch.Tensor


def _on(x: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    return x if device is None else x.to(device)


@dataclass
class AttentionMetadata:
    """Per-batch metadata built by the runtime, passed explicitly to every attention call (no globals).

    The batch is a ragged concatenation of ``B`` sequences: query tokens of sequence ``i`` are
    ``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]``.

    Fields:
      cu_seqlens_q: int64 ``[B+1]``, non-decreasing, ``cu_seqlens_q[0] == 0``,
        ``cu_seqlens_q[-1] == total_q``.
      slot_mapping: int64 ``[total_q]``, the flat cache slot where each query token's new K/V is WRITTEN.
        Entries of ``READ_ONLY`` sequences are ignored (use -1); a negative slot is never written.
      block_tables: either ``list[list[int]]`` (one list of block ids per sequence, token order, any length
        >= ``ceil(context_lens[i] / block_size)``) or a padded int tensor ``[B, max_blocks]`` whose row ``i``
        holds the same ids padded with -1. Entries past ``ceil(context_lens[i] / block_size)`` are ignored.
      context_lens: int64 ``[B]``, cached tokens sequence ``i`` attends to AFTER this step's writes. For
        append modes this includes the new tokens (so ``context_lens[i] >= n_i``); for ``READ_ONLY`` it is
        the cached context only (the new tokens are attended to from the passed-in K/V).
      modes: ``B`` query modes.
    """

    cu_seqlens_q: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: BlockTables
    context_lens: torch.Tensor
    modes: list[QueryMode]
    # per-batch memo of the decode rows' gather plan (the same for every layer of a forward)
    _decode_plan: Any = field(default=None, repr=False, compare=False)
    _batch_plan: Any = field(default=None, repr=False, compare=False)
    # ``build``'s Python values (cu_seqlens_q, context_lens as lists; every slot >= 0), so the batch
    # plan reads them instead of converting the tensors back
    _host: tuple[list[int], list[int], bool] | None = field(default=None, repr=False, compare=False)
    # built as one-token causal appends only, every slot written (``decode``; ``build`` of such a batch):
    # the compiled decode step reads the tensors above directly (``paged_decode._decode_only_args``)
    _all_decode: bool = field(default=False, repr=False, compare=False)
    _decode_args: Any = field(default=None, repr=False, compare=False)  # that step's memo
    # the slot and context tensors' host buffers (``decode`` on the host): ``next_decode`` writes them
    _longs: tuple[HostLongs, HostLongs] | None = field(default=None, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.modes)

    def query_lens(self) -> list[int]:
        cu = self.cu_seqlens_q.tolist()
        return [b - a for a, b in zip(cu[:-1], cu[1:])]

    @classmethod
    def decode(cls, block_tables: list[list[int]], context_lens: list[int], slot_mapping: list[int]) -> AttentionMetadata:
        """``build`` for a decode batch on the host: one causal-append query per sequence, each written
        to its (non-negative) slot; ``context_lens`` Python ints."""
        n = len(context_lens)
        cu = list(range(n + 1))
        slots, ctx = HostLongs(slot_mapping), HostLongs(context_lens)
        return cls(cu_seqlens_q=long_tensor(cu), slot_mapping=slots.tensor, block_tables=block_tables,
                   context_lens=ctx.tensor, modes=[QueryMode.CAUSAL_APPEND] * n,
                   _host=(cu, context_lens, True), _all_decode=n > 0, _longs=(slots, ctx))

    def next_decode(self, block_tables: list[list[int]], context_lens: list[int], slot_mapping: list[int]) -> None:
        """Make this metadata (from ``decode``) the next step's of the same sequences, in place: their
        new block lists, context lengths and slots; ``cu_seqlens_q`` and ``modes`` stay (one query
        each). For the runtime's decode rows, whose last forward no longer reads it: the slot and
        context tensors of host metadata are the same objects, their values rewritten."""
        if not self._all_decode or len(context_lens) != len(self.modes) or len(slot_mapping) != len(self.modes):
            raise ValueError("next_decode continues a decode batch of the same number of sequences")
        longs = self._longs  # the tensors written in place (the last forward is done with them)
        if not (longs is not None and longs[0].write(slot_mapping) and longs[1].write(context_lens)):
            slots, ctx, device = HostLongs(slot_mapping), HostLongs(context_lens), self.slot_mapping.device
            if device.type != "cpu":  # where ``build`` put them
                self.slot_mapping, self.context_lens, self._longs = slots.tensor.to(device), ctx.tensor.to(device), None
            else:
                self.slot_mapping, self.context_lens, self._longs = slots.tensor, ctx.tensor, (slots, ctx)
        self.block_tables = block_tables
        self._host = (self._host[0], context_lens, True)
        self._decode_plan = self._batch_plan = self._decode_args = None

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        block_tables: BlockTables,
        context_lens: Sequence[int],
        modes: Sequence[QueryMode | str],
        slot_mapping: Sequence[int] | torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> AttentionMetadata:
        """Convenience constructor from Python lists (``slot_mapping=None`` means "write nothing": all -1)."""
        one_each = all(n == 1 for n in query_lens)
        if one_each:  # a decode batch: one query per sequence
            cu = list(range(len(query_lens) + 1))
        else:
            cu = [0]
            for n in query_lens:
                cu.append(cu[-1] + int(n))
        if slot_mapping is None:
            slot_mapping = [-1] * cu[-1]
        if isinstance(slot_mapping, torch.Tensor):
            slots, written = torch.as_tensor(slot_mapping, dtype=torch.int64, device=device), False
        else:
            slots = _on(long_tensor(slot_mapping), device)
            written = len(slot_mapping) > 0 and bool(min(slot_mapping) >= 0)
        ctx = [int(n) for n in context_lens]
        modes = list(modes) if all(type(m) is QueryMode for m in modes) else [QueryMode(m) for m in modes]
        return cls(
            cu_seqlens_q=_on(long_tensor(cu), device),
            slot_mapping=slots,
            block_tables=block_tables,
            context_lens=_on(long_tensor(ctx), device),
            modes=modes,
            _host=(cu, ctx, written),
            _all_decode=(one_each and written and len(modes) == len(cu) - 1
                         and all(m is QueryMode.CAUSAL_APPEND for m in modes)),
        )
