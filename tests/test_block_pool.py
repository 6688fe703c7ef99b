"""Tests for the paged KV-cache bookkeeping (mstar.runtime.kv.block_pool, mstar.runtime.kv.cache_manager)."""

from __future__ import annotations

import pickle
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar.runtime.kv.block_pool import BlockPool, OutOfBlocks, prefix_hashes
from mstar.runtime.kv.cache_manager import BlockTable, KVCacheManager


def check_invariants(mgr: KVCacheManager) -> None:
    """Recompute every refcount from the live tables and compare with the pool."""
    pool = mgr.pool
    bs = pool.block_size
    counts: Counter[int] = Counter()
    for key, table in mgr.iter_tables():
        assert len(table.blocks) == -(-table.num_tokens // bs), key
        assert len(set(table.blocks)) == len(table.blocks), f"duplicate block in {key}"
        counts.update(table.blocks)
    for b in range(pool.num_blocks):
        assert pool.refcount(b) == counts.get(b, 0), f"block {b}"
    assert pool.num_used == len(counts)
    assert pool.num_free + pool.num_used == pool.num_blocks
    free = pool.free_blocks() + pool.cached_blocks()
    assert len(set(free)) == len(free) == pool.num_free
    assert all(pool.refcount(b) == 0 for b in free)


def snapshot(mgr: KVCacheManager):
    pool = mgr.pool
    return (
        dict(mgr.iter_tables()),
        [pool.refcount(b) for b in range(pool.num_blocks)],
        pool.free_blocks(),
        mgr.pending_copies(),
    )


# ------------------------------------------------------------------------------------------- BlockPool
def test_pool_allocate_and_free():
    pool = BlockPool(4, 16)
    assert (pool.num_free, pool.num_used, pool.block_size) == (4, 0, 16)
    blocks = [pool.allocate() for _ in range(4)]
    assert blocks == [0, 1, 2, 3]
    assert pool.num_free == 0 and pool.num_used == 4
    with pytest.raises(OutOfBlocks, match="need 1, only 0 free"):
        pool.allocate()
    pool.incref(2)
    assert pool.refcount(2) == 2
    pool.decref(2)
    assert pool.num_free == 0
    pool.decref(2)
    assert pool.num_free == 1 and pool.refcount(2) == 0
    with pytest.raises(ValueError):
        pool.decref(2)
    with pytest.raises(ValueError):
        pool.incref(2)
    with pytest.raises(IndexError):
        pool.refcount(4)
    assert pool.allocate() == 2
    with pytest.raises(OutOfBlocks):
        pool.allocate_many(1)


def test_pool_allocate_many_all_or_nothing():
    pool = BlockPool(3, 2)
    pool.allocate()
    with pytest.raises(OutOfBlocks) as info:
        pool.allocate_many(3)
    assert (info.value.needed, info.value.free) == (3, 2)
    assert pool.num_free == 2
    assert len(pool.allocate_many(2)) == 2


def test_out_of_blocks_pickles():
    err = pickle.loads(pickle.dumps(OutOfBlocks(5, 2, "x")))
    assert (err.needed, err.free) == (5, 2) and "need 5, only 2 free" in str(err)


def test_pool_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockPool(0, 4)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


# ------------------------------------------------------------------------------------- KVCacheManager
def test_append_slots_and_slot_mapping():
    mgr = KVCacheManager(BlockPool(8, 4))
    assert not mgr.has("r", "main") and mgr.num_tokens("r", "main") == 0
    slots = mgr.append_slots("r", "main", 6)
    assert slots == [0, 1, 2, 3, 4, 5]
    assert mgr.block_table("r", "main") == [0, 1]
    assert mgr.append_slots("r", "main", 3) == [6, 7, 8]
    assert mgr.block_table("r", "main") == [0, 1, 2]
    assert mgr.num_tokens("r", "main") == 9
    assert mgr.slot_mapping("r", "main") == list(range(9))
    assert mgr.slot_mapping("r", "main", 4, 6) == [4, 5]
    assert mgr.append_slots("r", "main", 0) == []
    assert mgr.stats() == {"blocks_total": 8, "blocks_used": 3, "blocks_free": 5, "blocks_cached": 0,
                           "block_size": 4, "sequences": 1}
    check_invariants(mgr)
    mgr.free_request("r")
    assert mgr.pool.num_used == 0 and not mgr.has("r", "main")


def test_append_all_or_nothing():
    mgr = KVCacheManager(BlockPool(3, 4))
    mgr.append_slots("a", "main", 6)  # 2 blocks
    before = snapshot(mgr)
    assert not mgr.can_append("a", "main", 7)  # needs 2 more, 1 free
    with pytest.raises(OutOfBlocks) as info:
        mgr.append_slots("a", "main", 7)
    assert (info.value.needed, info.value.free) == (2, 1)
    assert snapshot(mgr) == before
    # a brand-new sequence that does not fit is not created
    with pytest.raises(OutOfBlocks):
        mgr.append_slots("b", "main", 5)
    assert not mgr.has("b", "main")
    assert snapshot(mgr) == before
    assert mgr.can_append("a", "main", 6)
    mgr.append_slots("a", "main", 6)
    assert mgr.pool.num_free == 0
    check_invariants(mgr)


def test_fork_shares_blocks():
    mgr = KVCacheManager(BlockPool(8, 4))
    mgr.append_slots("r", "main", 8)  # exactly two full blocks
    mgr.fork("r", "main", "cfg")
    assert mgr.block_table("r", "cfg") == mgr.block_table("r", "main") == [0, 1]
    assert mgr.num_tokens("r", "cfg") == 8
    assert mgr.pool.refcount(0) == mgr.pool.refcount(1) == 2
    assert mgr.pool.num_used == 2
    # full blocks are never written again: appending needs no copy on either side
    assert mgr.append_slots("r", "cfg", 1) == [8]
    assert mgr.append_slots("r", "main", 1) == [12]
    assert mgr.pop_pending_copies() == []
    check_invariants(mgr)
    with pytest.raises(ValueError):
        mgr.fork("r", "main", "cfg")  # dst exists
    with pytest.raises(KeyError):
        mgr.fork("r", "nope", "x")
    with pytest.raises(ValueError):
        mgr.fork("r", "main", "x", num_tokens=100)


def test_snapshot_and_restore_keep_a_requests_sharing():
    mgr = KVCacheManager(BlockPool(8, 4))
    mgr.append_slots("r", "main", 6)
    mgr.fork("r", "main", "cfg", 5)
    mgr.append_slots("r", "cfg", 2)  # copy-on-write of the shared second block
    mgr.pop_pending_copies()
    mgr.append_slots("s", "main", 3)
    blocks, tables = mgr.snapshot("r")
    assert blocks == [0, 1, 2] and tables == {"main": ([0, 1], 6), "cfg": ([0, 2], 7)}
    mgr.free_request("r")
    assert mgr.request_ids() == ["s"]
    with pytest.raises(OutOfBlocks):
        mgr.restore("r", 8, tables)
    check_invariants(mgr)
    fresh = mgr.restore("r", len(blocks), tables)
    assert mgr.block_table("r", "main") == fresh[:2] and mgr.block_table("r", "cfg") == [fresh[0], fresh[2]]
    assert mgr.pool.refcount(fresh[0]) == 2 and mgr.num_tokens("r", "cfg") == 7
    check_invariants(mgr)
    with pytest.raises(ValueError):
        mgr.restore("r", 1, {"x": ([0], 1)})


@pytest.mark.parametrize("writer", ["dst", "src"])
def test_cow_on_first_divergent_write(writer):
    """Fork mid-block; whichever side writes into the shared partial block first gets a private copy."""
    mgr = KVCacheManager(BlockPool(8, 4))
    mgr.append_slots("r", "main", 6)  # blocks [0, 1], block 1 holds 2 tokens
    mgr.fork("r", "main", "cfg")
    assert mgr.pool.refcount(1) == 2
    other = "main" if writer == "dst" else "cfg"
    me = "cfg" if writer == "dst" else "main"
    other_before = mgr.block_table("r", other)

    slots = mgr.append_slots("r", me, 3)  # writes offsets 2,3 of the shared block, then a new block
    pairs = mgr.pop_pending_copies()
    assert len(pairs) == 1
    src, dst = pairs[0]
    assert src == 1 and dst not in (0, 1)
    assert mgr.block_table("r", me) == [0, dst, mgr.block_table("r", me)[2]]
    assert slots[:2] == [dst * 4 + 2, dst * 4 + 3]
    assert mgr.block_table("r", other) == other_before  # untouched
    assert mgr.pool.refcount(1) == 1 and mgr.pool.refcount(0) == 2 and mgr.pool.refcount(dst) == 1
    assert mgr.pop_pending_copies() == []  # drained
    check_invariants(mgr)

    # The other side now owns block 1 alone and writes into it in place, without a copy.
    assert mgr.append_slots("r", other, 1) == [1 * 4 + 2]
    assert mgr.pop_pending_copies() == []
    check_invariants(mgr)


def test_fork_partial_prefix_and_across_requests():
    mgr = KVCacheManager(BlockPool(16, 4))
    mgr.append_slots("ctx", "main", 10)  # blocks [0,1,2]
    mgr.fork_from("ctx", "main", "s1", "main", num_tokens=5)
    assert mgr.block_table("s1", "main") == [0, 1] and mgr.num_tokens("s1", "main") == 5
    mgr.fork_from("ctx", "main", "s2", "main", num_tokens=8)
    assert mgr.block_table("s2", "main") == [0, 1]
    mgr.fork_from("ctx", "main", "s3", "main", num_tokens=0)
    assert mgr.block_table("s3", "main") == [] and mgr.has("s3", "main")
    assert mgr.pool.refcount(0) == 3 and mgr.pool.refcount(1) == 3 and mgr.pool.refcount(2) == 1
    # s1 writes at token 5 = offset 1 of shared block 1 -> copy
    mgr.append_slots("s1", "main", 1)
    assert mgr.pop_pending_copies() == [(1, mgr.block_table("s1", "main")[1])]
    # s2 stops at a block boundary: its append allocates a new block, no copy
    mgr.append_slots("s2", "main", 1)
    assert mgr.pop_pending_copies() == []
    check_invariants(mgr)
    mgr.free_request("ctx")
    check_invariants(mgr)
    for r in ("s1", "s2", "s3"):
        mgr.free_request(r)
    assert mgr.pool.num_used == 0


def test_truncate():
    mgr = KVCacheManager(BlockPool(8, 4))
    mgr.append_slots("r", "main", 11)  # [0,1,2]
    mgr.truncate("r", "main", 8)
    assert mgr.block_table("r", "main") == [0, 1] and mgr.pool.num_used == 2
    mgr.truncate("r", "main", 5)
    assert mgr.block_table("r", "main") == [0, 1] and mgr.num_tokens("r", "main") == 5
    assert mgr.append_slots("r", "main", 2) == [5, 6]  # rewrites the private block in place
    mgr.truncate("r", "main", 0)
    assert mgr.block_table("r", "main") == [] and mgr.pool.num_used == 0
    with pytest.raises(ValueError):
        mgr.truncate("r", "main", 1)
    with pytest.raises(KeyError):
        mgr.truncate("zz", "main", 0)
    check_invariants(mgr)


def test_truncate_into_shared_block_then_append_copies():
    mgr = KVCacheManager(BlockPool(8, 4))
    mgr.append_slots("r", "main", 8)
    mgr.fork("r", "main", "cfg")
    mgr.truncate("r", "cfg", 6)  # shared full block 1 becomes cfg's partial last block
    assert mgr.pool.refcount(1) == 2
    mgr.append_slots("r", "cfg", 1)
    (src, dst), = mgr.pop_pending_copies()
    assert src == 1 and mgr.block_table("r", "cfg") == [0, dst]
    check_invariants(mgr)


def test_free_and_free_request_idempotent():
    mgr = KVCacheManager(BlockPool(8, 4))
    mgr.append_slots("r", "a", 5)
    mgr.fork("r", "a", "b")
    mgr.append_slots("q", "a", 3)
    assert sorted(mgr.cache_names("r")) == ["a", "b"]
    mgr.free("r", "a")
    mgr.free("r", "a")
    assert mgr.has("r", "b") and mgr.pool.num_used == 3
    check_invariants(mgr)
    mgr.free_request("r")
    mgr.free_request("r")
    mgr.free_request("never-existed")
    assert mgr.cache_names("r") == [] and mgr.pool.num_used == 1
    mgr.free_request("q")
    assert mgr.pool.num_used == 0 and mgr.stats()["sequences"] == 0
    check_invariants(mgr)


# ---------------------------------------------------------------------------------------- stress tests
class Simulator:
    """Drives a KVCacheManager and a shadow model of the physical KV contents.

    ``store[block][offset]`` is the token id physically held in a slot; ``logical[key]`` is the token sequence
    each table should read back. After every write the pending copies are applied (in order) before the new
    tokens are stored, as the runtime would, and every table's readback is compared with its logical view.
    This catches a missing copy-on-write (a write leaking into another sequence) as well as refcount bugs.
    """

    def __init__(self, num_blocks: int, block_size: int, rng: random.Random) -> None:
        self.mgr = KVCacheManager(BlockPool(num_blocks, block_size))
        self.store = [[None] * block_size for _ in range(num_blocks)]
        self.logical: dict[tuple[str, str], list[int]] = {}
        self.rng = rng
        self.next_token = 0

    def keys(self, request_id=None):
        return [k for k in self.logical if request_id is None or k[0] == request_id]

    def append(self, key, n, toks=None):
        mgr = self.mgr
        predicted = mgr.can_append(*key, n)
        before = snapshot(mgr)
        try:
            slots = mgr.append_slots(*key, n)
        except OutOfBlocks:
            assert not predicted
            assert snapshot(mgr) == before
            return
        assert predicted
        bs = mgr.block_size
        for src, dst in mgr.pop_pending_copies():
            assert src != dst
            self.store[dst] = list(self.store[src])
        if toks is None:
            toks = list(range(self.next_token, self.next_token + n))
            self.next_token += n
        for s, t in zip(slots, toks):
            assert mgr.pool.refcount(s // bs) == 1, "writing into a shared block"
            self.store[s // bs][s % bs] = t
        self.logical.setdefault(key, []).extend(toks)

    def prompt(self, key, tokens):
        """A prompt entering an empty cache as the engine does it: adopt the cached prefix, append
        the rest, register the full blocks (or, without room, empty the cache again)."""
        mgr, bs = self.mgr, self.mgr.block_size
        hashes = prefix_hashes(tokens, bs)
        got = mgr.adopt_prefix(*key, hashes[:(len(tokens) - 1) // bs])
        self.logical[key] = list(tokens[:got])
        self.check()  # the adopted blocks hold this prompt's tokens
        if not mgr.can_append(*key, len(tokens) - got):
            self.truncate(key, 0)
            return got
        self.append(key, len(tokens) - got, toks=list(tokens[got:]))
        mgr.register_prefix(*key, hashes)
        return got

    def fork(self, src, dst, n):
        self.mgr.fork_from(*src, *dst, num_tokens=n)
        self.logical[dst] = self.logical[src][:n]

    def truncate(self, key, n):
        self.mgr.truncate(*key, n)
        del self.logical[key][n:]

    def free(self, key):
        self.mgr.free(*key)
        self.logical.pop(key, None)

    def free_request(self, rid):
        self.mgr.free_request(rid)
        self.mgr.free_request(rid)  # idempotent
        for k in self.keys(rid):
            del self.logical[k]

    def check(self):
        check_invariants(self.mgr)
        bs = self.mgr.block_size
        assert {k for k, _ in self.mgr.iter_tables()} == set(self.logical)
        for key, table in self.mgr.iter_tables():
            assert table.num_tokens == len(self.logical[key])
            got = [self.store[table.blocks[p // bs]][p % bs] for p in range(table.num_tokens)]
            assert got == self.logical[key], key


def test_random_stress_500_requests():
    rng = random.Random(1234)
    sim = Simulator(num_blocks=48, block_size=4, rng=rng)
    created = 0
    live: list[str] = []
    ops = 0
    while created < 500 or live:
        ops += 1
        r = rng.random()
        if created < 500 and (not live or (r < 0.15 and len(live) < 24)):
            rid = f"req{created}"
            created += 1
            sim.append((rid, "main"), rng.randint(0, 13))
            if sim.mgr.has(rid, "main"):
                live.append(rid)
        elif r < 0.55:
            key = rng.choice(sim.keys(rng.choice(live)) or [(rng.choice(live), "main")])
            sim.append(key, rng.choice([1, 1, 1, 2, 3, 5, 8]))
        elif r < 0.65:
            rid = rng.choice(live)
            srcs = sim.keys(rid)
            if srcs:
                src = rng.choice(srcs)
                dst_rid = rid if rng.random() < 0.6 else rng.choice(live)  # sometimes across requests
                dst = (dst_rid, f"f{ops}")
                n = rng.randint(0, len(sim.logical[src])) if rng.random() < 0.7 else None
                sim.fork(src, dst, len(sim.logical[src]) if n is None else n)
        elif r < 0.72:
            keys = sim.keys(rng.choice(live))
            if keys:
                key = rng.choice(keys)
                sim.truncate(key, rng.randint(0, len(sim.logical[key])))
        elif r < 0.78:
            keys = sim.keys(rng.choice(live))
            if keys:
                sim.free(rng.choice(keys))
        elif r < 0.90 or len(live) > 20:
            # finish or abort (same cleanup path; aborts may hit requests mid-fork)
            rid = live.pop(rng.randrange(len(live)))
            sim.free_request(rid)
        # requests with no sequences left are finished
        live = [rid for rid in live if sim.keys(rid)] if rng.random() < 0.1 else live
        sim.check()
    for k in list(sim.logical):
        sim.free(k)
    assert sim.mgr.pool.num_used == 0
    assert sim.mgr.stats()["sequences"] == 0
    assert ops > 2000


_op = st.one_of(
    st.tuples(st.just("append"), st.integers(0, 3), st.integers(0, 2), st.integers(0, 9)),
    st.tuples(st.just("fork"), st.integers(0, 3), st.integers(0, 2), st.integers(0, 3), st.integers(0, 2),
              st.integers(0, 40)),
    st.tuples(st.just("truncate"), st.integers(0, 3), st.integers(0, 2), st.integers(0, 40)),
    st.tuples(st.just("free"), st.integers(0, 3), st.integers(0, 2)),
    st.tuples(st.just("abort"), st.integers(0, 3)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=40), block_size=st.sampled_from([1, 2, 4]))
def test_hypothesis_ops_keep_invariants(ops, block_size):
    sim = Simulator(num_blocks=12, block_size=block_size, rng=random.Random(0))
    for op in ops:
        kind = op[0]
        key = (f"r{op[1]}", f"c{op[2]}") if len(op) > 2 else None
        if kind == "append":
            sim.append(key, op[3])
        elif kind == "fork":
            dst = (f"r{op[3]}", f"c{op[4]}")
            if key in sim.logical and dst not in sim.logical:
                sim.fork(key, dst, min(op[5], len(sim.logical[key])))
        elif kind == "truncate":
            if key in sim.logical:
                sim.truncate(key, min(op[3], len(sim.logical[key])))
        elif kind == "free":
            sim.free(key)
        else:
            sim.free_request(f"r{op[1]}")
        sim.check()
    for rid in {k[0] for k in sim.logical}:
        sim.free_request(rid)
    assert sim.mgr.pool.num_used == 0


def test_block_table_dataclass_defaults():
    t = BlockTable()
    assert t.blocks == [] and t.num_tokens == 0


# ---------------------------------------------------------------------------------------- prefix caching
def test_prefix_hashes_chain_whole_blocks_only():
    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2 and prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    assert prefix_hashes([1, 2, 3, 4, 0, 6, 7, 8], 4)[0] == a[0]
    assert prefix_hashes([1, 2, 3, 4, 0, 6, 7, 8], 4)[1] != a[1]  # a block's hash covers its whole prefix
    assert prefix_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)[1] != a[1]
    assert prefix_hashes(list(range(20)), 4, limit=3) == prefix_hashes(list(range(20)), 4)[:3]


def test_released_prefix_blocks_are_reused_then_evicted_least_recent_first():
    mgr = KVCacheManager(BlockPool(4, 2))
    a, b = [1, 2, 3, 4, 5], [7, 8, 9, 10, 11]
    assert mgr.adopt_prefix("r1", "m", prefix_hashes(a, 2)) == 0
    mgr.append_slots("r1", "m", 5)
    mgr.register_prefix("r1", "m", prefix_hashes(a, 2))
    first = mgr.block_table("r1", "m")
    mgr.free_request("r1")
    assert mgr.pool.num_free == 4 and mgr.pool.num_cached == 2  # two full blocks kept, the tail freed
    check_invariants(mgr)
    assert mgr.adopt_prefix("r2", "m", prefix_hashes(a, 2)) == 4
    assert mgr.block_table("r2", "m") == first[:2] and mgr.pool.num_cached == 0
    mgr.append_slots("r2", "m", 1)
    check_invariants(mgr)
    mgr.free_request("r2")
    mgr.adopt_prefix("r3", "m", prefix_hashes(b, 2))  # no hit: three fresh blocks needed, one is cached
    mgr.append_slots("r3", "m", 5)
    mgr.register_prefix("r3", "m", prefix_hashes(b, 2))
    assert mgr.pool.num_cached == 1  # the least recently released cached block was taken
    assert mgr.adopt_prefix("r4", "m", prefix_hashes(a, 2)) == 2  # its first block survived
    check_invariants(mgr)


def test_a_cached_block_written_again_after_a_truncate_forgets_its_prefix():
    mgr = KVCacheManager(BlockPool(4, 2))
    toks = [1, 2, 3, 4]
    mgr.append_slots("r", "m", 4)
    mgr.register_prefix("r", "m", prefix_hashes(toks, 2))
    mgr.truncate("r", "m", 3)
    mgr.append_slots("r", "m", 1)  # overwrites slot 3: block 1 no longer holds [3, 4]
    mgr.free_request("r")
    assert mgr.adopt_prefix("q", "m", prefix_hashes(toks, 2)) == 2
    check_invariants(mgr)


def test_register_keeps_the_first_block_for_a_prefix_computed_twice():
    mgr = KVCacheManager(BlockPool(4, 2))
    h = prefix_hashes([1, 2], 2)
    for rid in ("a", "b"):
        mgr.append_slots(rid, "m", 2)
        mgr.register_prefix(rid, "m", h)
    mgr.free_request("a")
    mgr.free_request("b")
    assert mgr.pool.num_cached == 1 and mgr.pool.num_free == 4
    assert mgr.adopt_prefix("c", "m", h) == 2 and mgr.block_table("c", "m") == [0]
    check_invariants(mgr)


def test_random_stress_with_shared_prompts_keeps_contents_right():
    """Requests with prompts drawn from a few shared prefixes, mixed with appends, forks, truncates
    and frees: every adopted block holds exactly its prompt's tokens, and the pool stays consistent."""
    rng = random.Random(99)
    sim = Simulator(num_blocks=40, block_size=4, rng=rng)
    stems = [[rng.randrange(1000, 1100) for _ in range(rng.randint(4, 17))] for _ in range(4)]
    live, reused = [], 0
    for i in range(600):
        r = rng.random()
        if r < 0.3 or not live:
            prompt = rng.choice(stems) + [rng.randrange(1000, 1100) for _ in range(rng.randint(0, 6))]
            rid = f"p{i}"
            reused += sim.prompt((rid, "main"), prompt)
            live.append(rid)
        elif r < 0.6:
            rid = rng.choice(live)
            keys = sim.keys(rid)
            if keys:
                sim.append(rng.choice(keys), rng.choice([1, 1, 2, 5]))
        elif r < 0.7:
            keys = sim.keys(rng.choice(live))
            if keys:
                src = rng.choice(keys)
                sim.fork(src, (src[0], f"f{i}"), rng.randint(0, len(sim.logical[src])))
        elif r < 0.78:
            keys = sim.keys(rng.choice(live))
            if keys:
                key = rng.choice(keys)
                sim.truncate(key, rng.randint(0, len(sim.logical[key])))
        else:
            sim.free_request(live.pop(rng.randrange(len(live))))
        sim.check()
    for rid in live:
        sim.free_request(rid)
    assert sim.mgr.pool.num_used == 0 and reused > 100


def test_append_token_matches_append_slots_or_leaves_it_the_case():
    """A decode step's fast append gives the slots and tables ``append_slots(.., 1)`` gives, across
    block boundaries; a shared last block (after a fork), a named prefix block, a full pool or a
    missing table get None with nothing changed."""
    fast, ref = KVCacheManager(BlockPool(8, 4)), KVCacheManager(BlockPool(8, 4))
    for mgr in (fast, ref):
        mgr.append_slots("r", "c", 3)
    for _ in range(6):  # through two block boundaries
        before = ref.num_tokens("r", "c")
        got = fast.append_token("r", "c")
        assert got is not None
        assert (got[0], [got[1]], list(got[2])) == (before, ref.append_slots("r", "c", 1), ref.block_table("r", "c"))
        check_invariants(fast)
    assert fast.append_token("r", "other") is None

    mgr = KVCacheManager(BlockPool(8, 4))
    mgr.append_slots("r", "c", 2)
    mgr.fork("r", "c", "d")  # the half-full last block is now shared
    before = snapshot(mgr)
    assert mgr.append_token("r", "c") is None and snapshot(mgr) == before

    mgr = KVCacheManager(BlockPool(2, 4))
    mgr.append_slots("r", "c", 8)  # every block taken, the last one full
    assert mgr.append_token("r", "c") is None and mgr.num_tokens("r", "c") == 8

    mgr = KVCacheManager(BlockPool(8, 4))
    mgr.append_slots("r", "c", 4)
    mgr.register_prefix("r", "c", prefix_hashes([1, 2, 3, 4], 4))
    mgr.truncate("r", "c", 3)  # the named block is partly written again
    assert mgr.append_token("r", "c") is None


def test_append_to_held_tables_is_append_tokens_and_refuses_a_freed_table():
    """A decode batch holds its rows' tables (``tables_of``) across steps: ``append_to`` gives what
    ``append_tokens`` gives by key; a row that cannot take the fast append undoes the rows before it;
    a table freed since (and one registered again under its key) is refused with nothing changed."""
    held, ref = KVCacheManager(BlockPool(16, 4)), KVCacheManager(BlockPool(16, 4))
    keys = [("a", "c"), ("b", "c"), ("c", "c")]
    for mgr in (held, ref):
        for (rid, name), n in zip(keys, (3, 4, 5)):
            mgr.append_slots(rid, name, n)
    tables = held.tables_of(keys)
    assert tables is not None and held.tables_of([*keys, ("x", "c")]) is None
    for _ in range(6):  # across block boundaries
        got, want = held.append_to(tables), ref.append_tokens(keys)
        assert got is not None and (got[0], got[1], [list(b) for b in got[2]]) == (want[0], want[1],
                                                                                    [list(b) for b in want[2]])
        check_invariants(held)
    held.fork("c", "c", "d")  # row "c"'s half-full last block is now shared: it takes ``append_slots``
    before = snapshot(held)
    assert held.append_to(tables) is None and snapshot(held) == before  # rows "a" and "b" undone
    held.free("c", "d")
    held.free("b", "c")
    before = snapshot(held)
    assert tables[1].freed and held.append_to(tables) is None and snapshot(held) == before
    held.append_slots("b", "c", 2)  # a new table under the freed one's key: the held list is still refused
    assert held.append_to(tables) is None and held.append_to(held.tables_of(keys)) is not None
    check_invariants(held)
