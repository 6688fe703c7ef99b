"""The block tables of KV sequences over one ``BlockPool`` (pure Python, no tensors): ``BlockTables``
(per request and cache name: read, truncate, free, swap out and back), ``KVCacheManager`` (writes:
append with copy-on-write, fork, prefix adoption), ``BlockTable``.

Invariants (checked by the tests after every operation):

* the refcount of every block equals the number of block tables that contain it (a table never contains
  the same block twice), and every table satisfies ``len(blocks) == ceil(num_tokens / block_size)``;
* token ``p`` of a sequence lives in slot ``blocks[p // block_size] * block_size + p % block_size``;
* a shared block (refcount > 1) is never written: before a sequence writes into a shared, partially filled
  last block it gets a private copy (copy-on-write, see :meth:`KVCacheManager.append_slots`). Full blocks
  are never written again, so they may be shared freely. Slots past a table's ``num_tokens`` hold garbage
  and are never read through that table.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from mstar.runtime.kv.block_pool import BlockPool, OutOfBlocks, cdiv

__all__ = ["BlockTable", "BlockTables", "KVCacheManager"]


@dataclass
class BlockTable:
    """The blocks holding one growing KV sequence, in token order.

    Invariant: ``len(blocks) == ceil(num_tokens / block_size)``; only the last block may be partially filled.
    """

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    freed: bool = False  # forgotten by its manager (``KVCacheManager.free``): a holder must not use it


Key = tuple[str, str]


class BlockTables:
    """The block tables of a pool, per request and cache name: who holds which blocks, read, truncated,
    freed, and swapped out and back (``snapshot`` / ``restore``). ``KVCacheManager`` writes into them.

    Tables persist across the walks of a request and are freed by :meth:`free_request`. Keys are
    ``(request_id: str, cache_name: str)``. A table that does not exist behaves as an empty sequence
    for :meth:`num_tokens`.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._tables: dict[Key, BlockTable] = {}
        self._by_request: dict[str, dict[str, None]] = {}  # request -> ordered set of cache names

    def has(self, request_id: str, cache_name: str) -> bool:
        return (request_id, cache_name) in self._tables

    def num_tokens(self, request_id: str, cache_name: str) -> int:
        """Tokens held by the sequence (0 if the table does not exist)."""
        table = self._tables.get((request_id, cache_name))
        return 0 if table is None else table.num_tokens

    def _get(self, request_id: str, cache_name: str) -> BlockTable:
        try:
            return self._tables[(request_id, cache_name)]
        except KeyError:
            raise KeyError(f"no KV sequence for request {request_id!r}, cache {cache_name!r}") from None

    def block_table(self, request_id: str, cache_name: str) -> list[int]:
        """A copy of the sequence's block ids, in token order. KeyError if absent."""
        return list(self._get(request_id, cache_name).blocks)

    def slot_mapping(self, request_id: str, cache_name: str, start: int = 0,
                     end: int | None = None) -> list[int]:
        """Flat slot indices of tokens ``[start, end)`` (default: all tokens) of the sequence."""
        table = self._get(request_id, cache_name)
        end = table.num_tokens if end is None else end
        if not 0 <= start <= end <= table.num_tokens:
            raise ValueError(f"token range [{start}, {end}) outside sequence of {table.num_tokens} tokens")
        bs = self.block_size
        return [table.blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def blocks_held(self, request_id: str) -> int:
        """Blocks in the request's tables (a block shared by two of them, or with another request, counts once here)."""
        return len({b for name in self._by_request.get(request_id, ()) for b in self._tables[(request_id, name)].blocks})

    def cache_names(self, request_id: str) -> list[str]:
        return list(self._by_request.get(request_id, ()))

    def request_ids(self) -> list[str]:
        """Requests holding at least one table, in the order they first got one."""
        return list(self._by_request)

    def iter_tables(self) -> Iterator[tuple[Key, BlockTable]]:
        """All live tables as ``((request_id, cache_name), copy_of_table)``."""
        for key, table in self._tables.items():
            yield key, BlockTable(list(table.blocks), table.num_tokens)

    def stats(self) -> dict:
        return {
            "blocks_total": self.pool.num_blocks,
            "blocks_used": self.pool.num_used,
            "blocks_free": self.pool.num_free,
            "blocks_cached": self.pool.num_cached,
            "block_size": self.block_size,
            "sequences": len(self._tables),
        }

    def snapshot(self, request_id: str) -> tuple[list[int], dict[str, tuple[list[int], int]]]:
        """The request's distinct blocks (first-use order) and each table as indices into them.

        With :meth:`restore` this moves a request out of the pool and back without losing the
        sharing between its own tables (forks): a block shared by two tables is listed once.
        """
        blocks: dict[int, int] = {}  # block id -> index in the distinct list
        tables = {}
        for name in self._by_request.get(request_id, ()):
            table = self._tables[(request_id, name)]
            tables[name] = ([blocks.setdefault(b, len(blocks)) for b in table.blocks], table.num_tokens)
        return list(blocks), tables

    def restore(self, request_id: str, num_blocks: int, tables: dict[str, tuple[list[int], int]]) -> list[int]:
        """Give the request ``num_blocks`` fresh blocks and rebuild ``tables`` (as :meth:`snapshot`
        describes them) over them; returns the new block ids, index for index. All or nothing."""
        if request_id in self._by_request:
            raise ValueError(f"request {request_id!r} already holds KV tables")
        fresh = self.pool.allocate_many(num_blocks)
        for name, (idx, num_tokens) in tables.items():
            blocks = [fresh[i] for i in idx]
            self._register((request_id, name), BlockTable(blocks, num_tokens))
        counts = [0] * num_blocks
        for idx, _ in tables.values():
            for i in idx:
                counts[i] += 1
        for block, n in zip(fresh, counts):
            for _ in range(n - 1):
                self.pool.incref(block)
            if n == 0:
                self.pool.decref(block)  # no table refers to it: nothing to hold
        return fresh

    def _register(self, key: Key, table: BlockTable) -> None:
        self._tables[key] = table
        self._by_request.setdefault(key[0], {})[key[1]] = None

    def truncate(self, request_id: str, cache_name: str, num_tokens: int) -> None:
        """Drop tokens past ``num_tokens``, releasing whole blocks no longer covered. KeyError if absent."""
        self._truncate(self._get(request_id, cache_name), num_tokens)

    def _truncate(self, table: BlockTable, num_tokens: int) -> None:
        if not 0 <= num_tokens <= table.num_tokens:
            raise ValueError(f"cannot truncate a sequence of {table.num_tokens} tokens to {num_tokens}")
        keep = cdiv(num_tokens, self.block_size)
        for b in reversed(table.blocks[keep:]):
            self.pool.decref(b)
        del table.blocks[keep:]
        table.num_tokens = num_tokens

    def free(self, request_id: str, cache_name: str) -> None:
        """Release one sequence's blocks and forget its table. Idempotent."""
        table = self._tables.pop((request_id, cache_name), None)
        if table is None:
            return
        table.freed = True
        for b in reversed(table.blocks):
            self.pool.decref(b)
        names = self._by_request.get(request_id)
        if names is not None:
            names.pop(cache_name, None)
            if not names:
                del self._by_request[request_id]

    def free_request(self, request_id: str) -> None:
        """Release every sequence of a request (finish or abort). Idempotent."""
        for name in list(self._by_request.get(request_id, ())):
            self.free(request_id, name)


class KVCacheManager(BlockTables):
    """Writes into the block tables: appends (with copy-on-write), forks, prefix adoption.

    A table that does not exist behaves as an empty sequence for :meth:`can_append` and
    :meth:`append_slots` (which creates it).

    Copy-on-write contract: operations that must stop sharing a block record ``(src_block, dst_block)``
    pairs. The caller drains them with :meth:`pop_pending_copies` and must perform them *in order*, on every
    layer's K and V cache, before the forward pass that writes the newly reserved slots. Block ids in
    pending pairs are not pinned: a src block freed in the meantime keeps its contents until a forward pass
    writes to it, which is why the copies must run first.
    """

    def __init__(self, pool: BlockPool) -> None:
        super().__init__(pool)
        self._pending: list[tuple[int, int]] = []

    def _plan_append(self, table: BlockTable | None, n: int) -> tuple[bool, int]:
        """(needs copy-on-write of the last block, number of new blocks) for appending n tokens."""
        if n < 0:
            raise ValueError(f"cannot append {n} tokens")
        if table is None:
            return False, cdiv(n, self.block_size)
        if n == 0:
            return False, 0
        cur = table.num_tokens
        cow = cur % self.block_size != 0 and self.pool.refcount(table.blocks[-1]) > 1
        return cow, cdiv(cur + n, self.block_size) - len(table.blocks)

    def blocks_needed(self, request_id: str, cache_name: str, n: int) -> int:
        """Free blocks that appending n tokens would consume (including a copy-on-write block)."""
        cow, new = self._plan_append(self._tables.get((request_id, cache_name)), n)
        return int(cow) + new

    def can_append(self, request_id: str, cache_name: str, n: int) -> bool:
        return self.blocks_needed(request_id, cache_name, n) <= self.pool.num_free

    def append_slots(self, request_id: str, cache_name: str, n: int) -> list[int]:
        """Reserve ``n`` new token slots at the end of the sequence; return their flat slot indices.

        Creates the table if absent (even for ``n == 0``). All-or-nothing: on :class:`OutOfBlocks` nothing
        changes. If the last block is partially filled and shared (refcount > 1, e.g. after a mid-block
        fork, on either side of the fork), it is replaced by a fresh private block, the old one is decref'd
        and ``(old, fresh)`` is queued for :meth:`pop_pending_copies`.
        """
        key = (request_id, cache_name)
        table = self._tables.get(key)
        cow, new = self._plan_append(table, n)
        needed = int(cow) + new
        if needed > self.pool.num_free:
            raise OutOfBlocks(needed, self.pool.num_free, f"appending {n} tokens to {key}")
        if table is None:
            table = BlockTable()
            self._register(key, table)
        if cow:
            old = table.blocks[-1]
            fresh = self.pool.allocate()
            self._pending.append((old, fresh))
            table.blocks[-1] = fresh
            self.pool.decref(old)  # refcount was > 1, so old stays alive for its other holders
        elif n and table.num_tokens % self.block_size:
            self.pool.unregister(table.blocks[-1])  # written again (after a truncate): no longer that prefix
        table.blocks.extend(self.pool.allocate() for _ in range(new))
        start = table.num_tokens
        table.num_tokens = start + n
        bs = self.block_size
        return [table.blocks[p // bs] * bs + p % bs for p in range(start, start + n)]

    def append_token(self, request_id: str, cache_name: str) -> tuple[int, int, list[int]] | None:
        """``append_slots(request_id, cache_name, 1)`` for a decode step's usual case (the sequence
        exists; its last block has room and is its own, or it is full and a free block is taken):
        (tokens before, the token's slot, the live block list: read it, do not keep it). None, with
        nothing changed, in every other case (``append_slots`` then decides)."""
        table = self._tables.get((request_id, cache_name))
        if table is None:
            return None
        cur, bs, blocks, pool = table.num_tokens, self.block_size, table.blocks, self.pool
        off = cur % bs
        if off:
            last = blocks[-1]
            if not pool.writable(last):  # shared (copy-on-write) or a named prefix: append_slots handles both
                return None
        elif len(blocks) * bs == cur and pool.num_free:
            last = pool.allocate()
            blocks.append(last)
        else:
            return None
        table.num_tokens = cur + 1
        return cur, last * bs + off, blocks

    def tables_of(self, keys: Sequence[tuple[str, str]]) -> list[BlockTable] | None:
        """The live tables of the (request id, cache name) sequences, in order (for ``append_to``); None
        when one does not exist."""
        tables = [self._tables.get(key) for key in keys]
        return None if None in tables else tables

    def append_tokens(self, keys: Sequence[tuple[str, str]]) -> tuple[list[int], list[int], list[list[int]]] | None:
        """``append_token`` for one token of each (request id, cache name) sequence, in order: (tokens
        before, slots, the live block lists: read them, do not keep them). None, with nothing
        changed, when any of them needs ``append_slots``."""
        tables = self.tables_of(keys)
        return None if tables is None else self.append_to(tables)

    def append_to(self, tables: Sequence[BlockTable]) -> tuple[list[int], list[int], list[list[int]]] | None:
        """``append_tokens`` of tables from ``tables_of``, held across steps (a decode batch's rows; a
        table freed since is refused)."""
        bs, pool = self.block_size, self.pool
        writable = pool.writable
        before, slots, lists = [], [], []
        for table in tables:
            if table.freed:
                break
            cur, blocks = table.num_tokens, table.blocks
            off = cur % bs
            if off:
                last = blocks[-1]
                if not writable(last):
                    break
            elif len(blocks) * bs == cur and pool.num_free:
                last = pool.allocate()
                blocks.append(last)
            else:
                break
            table.num_tokens = cur + 1
            before.append(cur)
            slots.append(last * bs + off)
            lists.append(blocks)
        else:
            return before, slots, lists
        for table, n in zip(tables, before):
            self._truncate(table, n)
        return None

    def adopt_prefix(self, request_id: str, cache_name: str, hashes: Sequence[int]) -> int:
        """Start an empty sequence with the cached blocks of its longest cached prefix (``hashes`` from
        ``prefix_hashes``); returns the tokens it now holds (a multiple of the block size, maybe 0).
        Allocates nothing, so it cannot raise OutOfBlocks."""
        key = (request_id, cache_name)
        table = self._tables.get(key)
        if table is not None and table.num_tokens:
            raise ValueError(f"KV sequence {key} is not empty: cannot adopt a cached prefix")
        blocks = []
        for h in hashes:
            block = self.pool.take_cached(h)
            if block is None:
                break
            blocks.append(block)
        if table is None:
            table = BlockTable()
            self._register(key, table)
        table.blocks.extend(blocks)
        table.num_tokens = len(blocks) * self.block_size
        return table.num_tokens

    def register_prefix(self, request_id: str, cache_name: str, hashes: Sequence[int]) -> None:
        """Name the sequence's first full blocks by ``hashes`` (their contents are written)."""
        table = self._get(request_id, cache_name)
        for block, h in zip(table.blocks[:table.num_tokens // self.block_size], hashes):
            self.pool.register(block, h)

    def pending_copies(self) -> list[tuple[int, int]]:
        """A copy of the queued copy-on-write copies, without draining them."""
        return list(self._pending)

    @property
    def has_pending_copies(self) -> bool:
        return bool(self._pending)

    def pop_pending_copies(self) -> list[tuple[int, int]]:
        """Drain the queued ``(src_block, dst_block)`` copy-on-write copies, oldest first."""
        pending, self._pending = self._pending, []
        return pending

    def fork(self, request_id: str, src_cache: str, dst_cache: str, num_tokens: int | None = None) -> None:
        """Make ``dst_cache`` share the first ``num_tokens`` (default all) tokens of ``src_cache``."""
        self.fork_from(request_id, src_cache, request_id, dst_cache, num_tokens)

    def fork_from(self, src_request: str, src_cache: str, dst_request: str, dst_cache: str,
                  num_tokens: int | None = None) -> None:
        """Create ``(dst_request, dst_cache)`` sharing the first ``num_tokens`` tokens' blocks of the source.

        No data is copied and no block is allocated (cannot raise OutOfBlocks): the covered blocks are
        incref'd. If ``num_tokens`` ends mid-block, that block is shared too; whichever side writes into it
        first gets a private copy (copy-on-write in :meth:`append_slots`). Raises KeyError if the source is
        absent, ValueError if the destination exists or ``num_tokens`` exceeds the source's length.
        """
        src = self._get(src_request, src_cache)
        dst_key = (dst_request, dst_cache)
        if dst_key in self._tables:
            raise ValueError(f"KV sequence {dst_key} already exists")
        nt = src.num_tokens if num_tokens is None else num_tokens
        if not 0 <= nt <= src.num_tokens:
            raise ValueError(f"cannot fork {nt} tokens from a sequence of {src.num_tokens}")
        blocks = src.blocks[: cdiv(nt, self.block_size)]
        for b in blocks:
            self.pool.incref(b)
        self._register(dst_key, BlockTable(list(blocks), nt))
