"""Paged KV-cache blocks (pure Python, no tensors): ``BlockPool`` (which blocks are free, shared or
cached), ``prefix_hashes`` (the content hashes of a token sequence's full blocks). The sequences'
block tables over a pool are ``kv/cache_manager.py``'s.

The KV cache of every attention layer is one tensor of ``num_blocks`` blocks of ``block_size`` token slots.
This bookkeeping only decides *which* slots a token's K/V lives in; the tensors themselves are handled by
``mstar.layers.paged_attention``. A flat slot index is ``block * block_size + offset``.

Invariant (checked by the tests after every operation): a block is either free (refcount 0, on the free
list exactly once, or, when it holds a registered prefix, in the cached LRU exactly once) or used
(refcount >= 1, on neither). ``num_free + num_used == num_blocks``; cached blocks count as free: they are
handed out (and forget their prefix) only when the free list is empty, least recently released first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["BlockPool", "OutOfBlocks", "cdiv", "prefix_hashes"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class OutOfBlocks(RuntimeError):
    """An allocation could not be satisfied. ``needed`` blocks were required, only ``free`` were free.

    Raised before any state changes: every allocating operation in this module is all-or-nothing.
    """

    def __init__(self, needed: int, free: int, detail: str = "") -> None:
        self.needed = needed
        self.free = free
        self.detail = detail
        msg = f"out of KV-cache blocks: need {needed}, only {free} free"
        super().__init__(f"{msg} ({detail})" if detail else msg)

    def __reduce__(self):  # keep the exception picklable despite the custom __init__
        return (type(self), (self.needed, self.free, self.detail))


class BlockPool:
    """A fixed pool of ``num_blocks`` reference-counted blocks of ``block_size`` token slots.

    ``allocate`` hands out a free block with refcount 1; ``incref``/``decref`` share and release it; a block
    whose refcount drops to 0 returns to the free list. Freed blocks are reused most-recently-freed first;
    a fresh pool hands out blocks in increasing id order.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        """Prefix caching: ``register`` names a full block by the hash of its contents (see
        ``prefix_hashes``); a registered block whose last reference goes is kept in the cached LRU
        instead of the free list, so ``take_cached`` can hand it to a later request with the same
        prefix, until an allocation finds the free list empty and reuses it."""
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcounts = [0] * num_blocks
        # Used as a stack: pop() from the end, so the lowest id comes out first on a fresh pool.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # refcount-0 registered blocks, LRU first
        self._hash_of: dict[int, int] = {}  # block -> content hash
        self._block_of: dict[int, int] = {}  # content hash -> block

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that still hold a registered prefix (counted in ``num_free``)."""
        return len(self._cached)

    def free_blocks(self) -> list[int]:
        """A copy of the free list, in the order blocks will be handed out last-to-first."""
        return list(self._free)

    def cached_blocks(self) -> list[int]:
        """Unreferenced blocks kept for their prefix, least recently released first."""
        return list(self._cached)

    def _check(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block id {block} out of range [0, {self.num_blocks})")

    def allocate(self) -> int:
        """Take one free block (an uncached one if any, else the least recently released cached one,
        which forgets its prefix); its refcount becomes 1. :class:`OutOfBlocks` if none is free."""
        if self._free:
            block = self._free.pop()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            self.unregister(block)
        else:
            raise OutOfBlocks(1, 0)
        self._refcounts[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        """Take ``n`` free blocks, all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free)
        return [self.allocate() for _ in range(n)]

    # -- prefix caching -------------------------------------------------------------------------
    def register(self, block: int, content_hash: int) -> None:
        """Name a used, full block by its contents. A hash already naming another block keeps it (two
        requests that computed the same prefix at once); a block keeps its first name."""
        self._check(block)
        if self._refcounts[block] == 0:
            raise ValueError(f"register of free block {block}")
        if content_hash in self._block_of or block in self._hash_of:
            return
        self._block_of[content_hash] = block
        self._hash_of[block] = content_hash

    def unregister(self, block: int) -> None:
        """Forget a block's prefix (before it is written again); a cached block becomes plainly free."""
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
            if block in self._cached:
                del self._cached[block]
                self._free.append(block)

    def take_cached(self, content_hash: int) -> int | None:
        """The block holding this prefix hash, with one more reference (revived from the cached LRU
        when unreferenced), or None."""
        block = self._block_of.get(content_hash)
        if block is None:
            return None
        if self._refcounts[block] == 0:
            del self._cached[block]
        self._refcounts[block] += 1
        return block

    def incref(self, block: int) -> None:
        """Add a reference to a used block. Sharing a free block is an error (ValueError)."""
        self._check(block)
        if self._refcounts[block] == 0:
            raise ValueError(f"incref of free block {block}")
        self._refcounts[block] += 1

    def decref(self, block: int) -> None:
        """Drop a reference; at 0 the block returns to the free list. Decref of a free block: ValueError."""
        self._check(block)
        if self._refcounts[block] == 0:
            raise ValueError(f"decref of free block {block}")
        self._refcounts[block] -= 1
        if self._refcounts[block] == 0:
            if block in self._hash_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    def refcount(self, block: int) -> int:
        self._check(block)
        return self._refcounts[block]

    def writable(self, block: int) -> bool:
        """Held by one table and not named as a cached prefix: a token may be written into it as it is
        (no copy-on-write, no prefix to forget). Unchecked: for the decode path's hot loop."""
        return self._refcounts[block] == 1 and block not in self._hash_of

    def __repr__(self) -> str:
        return (f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"used={self.num_used}, free={self.num_free}, cached={self.num_cached})")


def prefix_hashes(tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """Content hashes of the first full blocks of a token sequence (at most ``limit``): block i's
    hash covers tokens ``[0, (i + 1) * block_size)``, chained through the previous block's hash, so
    equal hashes mean equal prefixes (up to a 64-bit collision). Same ids -> same hashes in every
    process (Python's ``hash`` of a tuple of ints is not salted)."""
    n = len(tokens) // block_size
    if limit is not None:
        n = min(n, limit)
    out, prev = [], 0
    for i in range(n):
        prev = hash((prev, tuple(tokens[i * block_size:(i + 1) * block_size])))
        out.append(prev)
    return out
