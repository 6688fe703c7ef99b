"""What the KV engine (``mstar.runtime.kv.engine.KVCacheEngine``) records: ``KVPlan``, the attention
bookkeeping of one batch; ``PrefixUse``, an item's prompt for the prefix cache; ``SwappedKV``, a
preempted request's blocks in host memory."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mstar.layers.host_longs import long_tensor
from mstar.layers.paged_attention import QueryMode

__all__ = ["KVPlan", "PrefixUse", "SwappedKV"]


@dataclass
class KVPlan:
    """The attention bookkeeping of one batch, sequence by sequence."""

    query_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    modes: list[QueryMode] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    positions: list[tuple[int, int]] = field(default_factory=list)  # (first position, tokens) per sequence

    def add(self, mode: QueryMode, first: int, n: int, context_len: int, table: list[int]) -> None:
        """One sequence's entries (its slots are added by the caller): ``n`` queries from position
        ``first``, attending to ``context_len`` cached tokens through ``table``."""
        self.query_lens.append(n)
        self.tables.append(table)
        self.context_lens.append(context_len)
        self.modes.append(mode)
        self.positions.append((first, n))

    def position_tensor(self) -> torch.Tensor:
        """Every planned token's absolute position, sequence after sequence (int64 [tokens]): one
        tensor from the Python ints when every sequence has one token (a decode step), else one
        ``arange`` per sequence."""
        if all(n == 1 for _, n in self.positions):
            return long_tensor([first for first, _ in self.positions])
        return torch.cat([torch.arange(first, first + n, dtype=torch.long) for first, n in self.positions])

    def mark(self) -> tuple[int, int]:
        return len(self.query_lens), len(self.slots)

    def reset(self, mark: tuple[int, int]) -> None:
        """Forget the sequences added since ``mark``."""
        seqs, slots = mark
        for name in ("query_lens", "tables", "context_lens", "modes", "positions"):
            del getattr(self, name)[seqs:]
        del self.slots[slots:]


@dataclass(slots=True)
class PrefixUse:
    """An item's prompt, for the prefix cache: which cache, its full-block hashes, tokens reused."""

    request_id: str
    cache_name: str
    hashes: list[int]
    num_tokens: int
    reused: int


@dataclass
class SwappedKV:
    """A preempted request's KV blocks in host memory: ``tables`` index into the saved blocks."""

    tables: dict[str, tuple[list[int], int]]  # cache name -> (block indices, num_tokens)
    k: list[torch.Tensor]  # per layer [num_blocks, block_size, kv_heads, head_dim]
    v: list[torch.Tensor]

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0] if self.k else 0

