"""Paged attention (mstar.layers.paged_attention) against plain dense attention over unpaged sequences."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from mstar.layers.attention_backends import (
    AttentionBackend,
    BackendUnavailableError,
    TorchPagedBackend,
    available_backends,
    get_backend,
    register_backend,
)
from mstar.layers.paged_attention import (
    AttentionMetadata,
    QueryMode,
    copy_blocks,
    gather_kv,
    paged_attention,
    write_kv,
)
from mstar.runtime.kv.block_pool import BlockPool
from mstar.runtime.kv.cache_manager import KVCacheManager

CAUSAL, BLOCK, READ = QueryMode.CAUSAL_APPEND, QueryMode.BLOCK_APPEND, QueryMode.READ_ONLY
TOL = {"atol": 1e-5, "rtol": 1e-5}


def dense_attention(q, k, v, mask, scale=None):
    """softmax(Q K^T * scale + mask) V, unpaged; q [n,Hq,D], k/v [S,Hkv,D], mask [n,S] bool."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    scale = d ** -0.5 if scale is None else scale
    kv_head = torch.arange(hq) // (hq // hkv)  # query head h reads kv head h // group
    k, v = k[:, kv_head], v[:, kv_head]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def causal_mask(n_q, n_k):
    """Last n_q of n_k positions querying: query j sits at position n_k - n_q + j."""
    return torch.arange(n_k)[None, :] <= (n_k - n_q + torch.arange(n_q))[:, None]


class Harness:
    """A KV cache driven by KVCacheManager plus, per sequence, the unpaged K/V history it should hold."""

    def __init__(self, *, num_blocks=64, block_size=4, q_heads=2, kv_heads=2, head_dim=16, seed=0,
                 fragment=False):
        self.pool = BlockPool(num_blocks, block_size)
        self.mgr = KVCacheManager(self.pool)
        self.k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.gen = torch.Generator().manual_seed(seed)
        self.hist: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if fragment:  # free every block in random order, so allocation order is shuffled
            blocks = self.pool.allocate_many(num_blocks)
            random.Random(seed).shuffle(blocks)
            for b in blocks:
                self.pool.decref(b)

    def tokens(self, n):
        q = torch.randn(n, self.q_heads, self.head_dim, generator=self.gen)
        k = torch.randn(n, self.kv_heads, self.head_dim, generator=self.gen)
        v = torch.randn(n, self.kv_heads, self.head_dim, generator=self.gen)
        return q, k, v

    def empty(self):
        return torch.zeros(0, self.kv_heads, self.head_dim), torch.zeros(0, self.kv_heads, self.head_dim)

    def fork(self, src, dst, num_tokens=None):
        self.mgr.fork_from(src, "kv", dst, "kv", num_tokens)
        hk, hv = self.hist[src]
        n = hk.shape[0] if num_tokens is None else num_tokens
        self.hist[dst] = (hk[:n].clone(), hv[:n].clone())

    def meta_for(self, items):
        """items: (seq, mode, q, k, v). Reserves slots for append modes, performs pending copies."""
        lens, slots, tables, ctx = [], [], [], []
        for seq, mode, q, _, _ in items:
            n = q.shape[0]
            lens.append(n)
            slots += self.mgr.append_slots(seq, "kv", n) if mode.writes else [-1] * n
        copy_blocks(self.k_cache, self.v_cache, self.mgr.pop_pending_copies())
        for seq, _, _, _, _ in items:
            tables.append(self.mgr.block_table(seq, "kv") if self.mgr.has(seq, "kv") else [])
            ctx.append(self.mgr.num_tokens(seq, "kv"))
        return AttentionMetadata.build(lens, tables, ctx, [it[1] for it in items], slots)

    def step(self, items, scale=None):
        """Run one batched paged step; return (paged outputs, dense references) per sequence."""
        refs = []
        for seq, mode, q, k, v in items:
            hk, hv = self.hist.get(seq, self.empty())
            keys, vals = torch.cat([hk, k]), torch.cat([hv, v])
            n = q.shape[0]
            s = keys.shape[0]
            mask = causal_mask(n, s) if mode is CAUSAL else torch.ones(n, s, dtype=torch.bool)
            refs.append(dense_attention(q, keys, vals, mask, scale))
            if mode.writes:
                self.hist[seq] = (keys, vals)
        meta = self.meta_for(items)
        out = paged_attention(torch.cat([it[2] for it in items]), torch.cat([it[3] for it in items]),
                              torch.cat([it[4] for it in items]), self.k_cache, self.v_cache, meta, scale)
        outs = list(out.split(meta.query_lens()))
        self.check_cache()
        return outs, refs

    def check_cache(self):
        """Every sequence's cache, read back through its block table, equals its unpaged history."""
        for seq, (hk, hv) in self.hist.items():
            k, v = gather_kv(self.k_cache, self.v_cache, self.mgr.block_table(seq, "kv"), hk.shape[0])
            assert torch.equal(k, hk) and torch.equal(v, hv), seq


def assert_all_close(outs, refs):
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, **TOL)


# -------------------------------------------------------------------------------------------------- tests
def test_causal_prefill_batch_of_different_lengths():
    h = Harness()
    lens = [5, 17, 9, 1, 4]
    items = [(f"s{i}", CAUSAL, *h.tokens(n)) for i, n in enumerate(lens)]
    outs, _ = h.step(items)
    for (_, _, q, k, v), out in zip(items, outs):
        expect = dense_attention(q, k, v, causal_mask(q.shape[0], q.shape[0]))
        torch.testing.assert_close(out, expect, **TOL)


def test_chunked_prefill_equals_one_shot():
    q, k, v = Harness(seed=3).tokens(20)
    one = Harness(block_size=4)
    (one_out,), (ref,) = one.step([("s", CAUSAL, q, k, v)])
    torch.testing.assert_close(one_out, ref, **TOL)

    chunked = Harness(block_size=4)
    pieces, start = [], 0
    for n in (7, 6, 7):
        sl = slice(start, start + n)
        (out,), (r,) = chunked.step([("s", CAUSAL, q[sl], k[sl], v[sl])])
        torch.testing.assert_close(out, r, **TOL)
        pieces.append(out)
        start += n
    torch.testing.assert_close(torch.cat(pieces), one_out, **TOL)
    torch.testing.assert_close(torch.cat(pieces), dense_attention(q, k, v, causal_mask(20, 20)), **TOL)


def test_decode_steps():
    h = Harness(block_size=4)
    assert_all_close(*h.step([("a", CAUSAL, *h.tokens(6)), ("b", CAUSAL, *h.tokens(11))]))
    for _ in range(7):  # crosses block boundaries for both sequences
        assert_all_close(*h.step([("a", CAUSAL, *h.tokens(1)), ("b", CAUSAL, *h.tokens(1))]))
    assert h.mgr.num_tokens("a", "kv") == 13 and h.mgr.num_tokens("b", "kv") == 18


def test_gqa_8_q_heads_2_kv_heads():
    h = Harness(q_heads=8, kv_heads=2, head_dim=8)
    assert_all_close(*h.step([("a", CAUSAL, *h.tokens(9)), ("b", BLOCK, *h.tokens(5))]))
    for _ in range(3):
        assert_all_close(*h.step([("a", CAUSAL, *h.tokens(1)), ("b", READ, *h.tokens(3))]))
    # head grouping: query heads 0-3 use kv head 0, heads 4-7 kv head 1 (checked independently of the helper)
    h2 = Harness(q_heads=8, kv_heads=2, head_dim=8, seed=5)
    q, k, v = h2.tokens(6)
    (out,), _ = h2.step([("s", CAUSAL, q, k, v)])
    for head in range(8):
        kv = head // 4
        expect = dense_attention(q[:, head:head + 1], k[:, kv:kv + 1], v[:, kv:kv + 1], causal_mask(6, 6))
        torch.testing.assert_close(out[:, head:head + 1], expect, **TOL)


def test_block_append_frames():
    """A causal text prefix, then two frames; each frame sees everything before it and all of itself."""
    h = Harness(block_size=4)
    segs = [(CAUSAL, 3), (BLOCK, 6), (BLOCK, 6)]
    toks = [h.tokens(n) for _, n in segs]
    outs = []
    for (mode, _), (q, k, v) in zip(segs, toks):
        (o,), (r,) = h.step([("w", mode, q, k, v)])
        torch.testing.assert_close(o, r, **TOL)
        outs.append(o)
    q, k, v = (torch.cat(parts) for parts in zip(*toks))
    # full-sequence mask: positions 0-2 causal, 3-8 frame one, 9-14 frame two
    seg_id = torch.tensor([0, 1, 2] + [3] * 6 + [4] * 6)
    mask = seg_id[None, :] <= seg_id[:, None]
    torch.testing.assert_close(torch.cat(outs), dense_attention(q, k, v, mask), **TOL)
    # the second frame's first token really sees its later tokens (differs from causal)
    causal = dense_attention(q, k, v, causal_mask(15, 15))
    assert not torch.allclose(torch.cat(outs)[9], causal[9])


def test_read_only_leaves_cache_unchanged():
    h = Harness(block_size=4)
    qc, kc, vc = h.tokens(10)
    h.step([("ctx", CAUSAL, qc, kc, vc)])
    k_before, v_before = h.k_cache.clone(), h.v_cache.clone()
    q, k, v = h.tokens(5)
    (out,), (ref,) = h.step([("ctx", READ, q, k, v)])
    assert torch.equal(h.k_cache, k_before) and torch.equal(h.v_cache, v_before)
    assert h.mgr.num_tokens("ctx", "kv") == 10
    expect = dense_attention(q, torch.cat([kc, k]), torch.cat([vc, v]), torch.ones(5, 15, dtype=torch.bool))
    torch.testing.assert_close(out, expect, **TOL)
    torch.testing.assert_close(out, ref, **TOL)
    # even with real slot numbers in slot_mapping a read-only sequence writes nothing
    table = h.mgr.block_table("ctx", "kv")
    meta = AttentionMetadata.build([5], [table], [10], [READ], slot_mapping=[0, 1, 2, 3, 4])
    out2 = paged_attention(q, k, v, h.k_cache, h.v_cache, meta)
    assert torch.equal(h.k_cache, k_before) and torch.equal(h.v_cache, v_before)
    assert torch.equal(out2, out)


def test_read_only_with_empty_context():
    h = Harness()
    q, k, v = h.tokens(4)
    meta = AttentionMetadata.build([4], [[]], [0], [READ])
    out = paged_attention(q, k, v, h.k_cache, h.v_cache, meta)
    torch.testing.assert_close(out, dense_attention(q, k, v, torch.ones(4, 4, dtype=torch.bool)), **TOL)
    assert not h.k_cache.any()


def test_mixed_modes_in_one_batch():
    h = Harness(block_size=4, q_heads=4, kv_heads=2)
    assert_all_close(*h.step([("a", CAUSAL, *h.tokens(5)), ("b", CAUSAL, *h.tokens(3)),
                              ("c", CAUSAL, *h.tokens(7)), ("d", CAUSAL, *h.tokens(9))]))
    for _ in range(2):
        assert_all_close(*h.step([
            ("a", CAUSAL, *h.tokens(6)),   # next prefill chunk
            ("b", BLOCK, *h.tokens(4)),    # a frame
            ("c", READ, *h.tokens(5)),     # diffusion step over a cached context
            ("d", CAUSAL, *h.tokens(1)),   # decode
            ("e", CAUSAL, *h.tokens(0)),   # empty query: no output, nothing breaks
        ]))
    assert h.mgr.num_tokens("c", "kv") == 7


def test_non_contiguous_blocks_and_padded_block_table():
    h = Harness(num_blocks=40, block_size=4, fragment=True, seed=11)
    assert_all_close(*h.step([("a", CAUSAL, *h.tokens(13)), ("b", BLOCK, *h.tokens(10))]))
    for _ in range(3):
        assert_all_close(*h.step([("a", CAUSAL, *h.tokens(1)), ("b", CAUSAL, *h.tokens(2))]))
    table = h.mgr.block_table("a", "kv")
    assert table != list(range(table[0], table[0] + len(table)))  # not one contiguous run

    # a padded int tensor block table gives the same answer as the list form
    items = [("a", CAUSAL, *h.tokens(3)), ("b", READ, *h.tokens(2))]
    meta = h.meta_for(items)
    width = max(len(t) for t in meta.block_tables) + 2
    padded = torch.full((2, width), -1, dtype=torch.int64)
    for i, t in enumerate(meta.block_tables):
        padded[i, : len(t)] = torch.tensor(t)
    meta_t = AttentionMetadata(meta.cu_seqlens_q, meta.slot_mapping, padded, meta.context_lens, meta.modes)
    q, k, v = (torch.cat(x) for x in zip(*[it[2:] for it in items]))
    out_list = paged_attention(q, k, v, h.k_cache, h.v_cache, meta)
    out_tensor = paged_attention(q, k, v, h.k_cache, h.v_cache, meta_t)
    assert torch.equal(out_list, out_tensor)


def test_manually_shuffled_block_ids():
    """Block tables built by hand from a random permutation, without the manager."""
    bs, nb = 4, 16
    k_cache = torch.zeros(nb, bs, 2, 8)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(7)).tolist()
    tables = [perm[:3], perm[3:8]]
    lens = [10, 17]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lens), 4, 8, generator=gen)
    k = torch.randn(sum(lens), 2, 8, generator=gen)
    v = torch.randn(sum(lens), 2, 8, generator=gen)
    slots = [t[p // bs] * bs + p % bs for t, n in zip(tables, lens) for p in range(n)]
    meta = AttentionMetadata.build(lens, tables, lens, [CAUSAL, BLOCK], slots)
    out = paged_attention(q, k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(out[:10], dense_attention(q[:10], k[:10], v[:10], causal_mask(10, 10)), **TOL)
    full = torch.ones(17, 17, dtype=torch.bool)
    torch.testing.assert_close(out[10:], dense_attention(q[10:], k[10:], v[10:], full), **TOL)


def test_batch_invariance():
    """A sequence's output is bitwise identical whether it runs alone or batched with others."""
    data = Harness(seed=21)
    prefill = data.tokens(11)
    decodes = [data.tokens(1) for _ in range(3)]
    frame = data.tokens(5)
    probe = data.tokens(4)

    alone = Harness(seed=1)
    batched = Harness(seed=2, fragment=True)
    batched.step([("x", CAUSAL, *batched.tokens(7)), ("y", BLOCK, *batched.tokens(9))])

    def run(h, items, others):
        outs, _ = h.step(items + others if others else items)
        return outs[0]

    for items_fn in (
        lambda: [("s", CAUSAL, *prefill)],
        *[(lambda d=d: [("s", CAUSAL, *d)]) for d in decodes],
        lambda: [("s", BLOCK, *frame)],
        lambda: [("s", READ, *probe)],
    ):
        a = run(alone, items_fn(), None)
        b = run(batched, items_fn(), [("x", CAUSAL, *batched.tokens(1)), ("y", READ, *batched.tokens(3)),
                                      ("z", CAUSAL, *batched.tokens(6))])
        assert torch.equal(a, b)


def _row_meta(rows, mode=CAUSAL):
    """Metadata for a sub-batch of rows (query_len, block table, context_len, slots) already reserved."""
    return AttentionMetadata.build([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                                   [r[4] if len(r) > 4 else mode for r in rows], [s for r in rows for s in r[3]])


def _decode_batch(layout, lens, fragment):
    """16 sequences prefilled to ``lens`` tokens, then one decode step each (written). Returns the harness,
    the decode items, their dense references and each row's (1, table, context_len, [slot])."""
    q_heads, kv_heads, head_dim, block_size = layout
    h = Harness(num_blocks=600 * 16 // block_size, block_size=block_size, q_heads=q_heads, kv_heads=kv_heads,
                head_dim=head_dim, fragment=fragment, seed=31)
    h.step([(f"s{i}", CAUSAL, *h.tokens(n)) for i, n in enumerate(lens)])
    items = [(f"s{i}", CAUSAL, *h.tokens(1)) for i in range(len(lens))]
    refs = h.step(items)[1]  # writes every row's new K/V; rewriting the same values later is a no-op
    rows = []
    for seq, *_ in items:
        table, ctx = h.mgr.block_table(seq, "kv"), h.mgr.num_tokens(seq, "kv")
        last = table[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size  # where the step wrote
        rows.append((1, table, ctx, [last]))
    return h, items, refs, rows


@pytest.mark.parametrize("layout", [(8, 4, 64, 16), (3, 1, 5, 2)], ids=["gqa-8-4-64", "mqa-3-1-5"])
def test_decode_rows_batch_invariant_any_batch(threads, layout):
    """A decode row's output is bitwise the same alone and in batches of 1..16 rows at any position,
    with contexts of 30..400 tokens, next to other modes, and whether its blocks are scattered or
    consecutive (a view of the cache, unaligned for 3 x 5 heads); and it is right (close to dense)."""
    rng = random.Random(threads)
    block_size = layout[3]
    lens = [n + (n % block_size == 0) for n in (rng.randint(29, 399) for _ in range(16))]  # the step
    # token fits in the last block, so the unfragmented pool below keeps every row's blocks consecutive
    h, items, refs, rows = _decode_batch(layout, lens, fragment=True)
    extra = h.tokens(5)  # a read-only sequence over s0's context: the batch is not only decode rows

    def run(h, items, rows, idx, with_extra=False):
        sel = [rows[i] for i in idx] + ([(5, rows[0][1], rows[0][2] - 1, [-1] * 5, READ)] if with_extra else [])
        q, k, v = (torch.cat([items[i][j] for i in idx] + ([extra[j - 2]] if with_extra else []))
                   for j in (2, 3, 4))
        out = paged_attention(q, k, v, h.k_cache, h.v_cache, _row_meta(sel))
        return out[:len(idx)]

    alone = [run(h, items, rows, [i])[0] for i in range(16)]
    for i in range(16):
        torch.testing.assert_close(alone[i], refs[i][0], **TOL)
    for n in range(1, 17):
        for rep in range(3):
            idx = rng.sample(range(16), n)
            out = run(h, items, rows, idx, with_extra=rep == 2)
            for pos, i in enumerate(idx):
                assert torch.equal(out[pos], alone[i]), (n, rep, pos, i)
    h.check_cache()
    # the same tokens in an unfragmented pool: every row's blocks are consecutive
    h2, items2, _, rows2 = _decode_batch(layout, lens, fragment=False)
    assert all(r[1] == list(range(r[1][0], r[1][0] + len(r[1]))) for r in rows2)
    out = run(h2, items2, rows2, list(range(16)))
    for i in range(16):
        assert torch.equal(out[i], alone[i]), i


@pytest.mark.parametrize("mode", [CAUSAL, BLOCK, READ])
def test_sequence_batch_invariant_at_any_offset(threads, mode):
    """A prefill chunk / frame / read-only query gives the same bits whatever precedes it in the batch.
    With 3 heads x 5 dims (60 bytes per token) its rows then start at other, unaligned offsets of q."""
    for n in (2, 3, 7):
        h = Harness(num_blocks=96, block_size=4, q_heads=3, kv_heads=1, head_dim=5, fragment=True, seed=41)
        h.step([("ctx", CAUSAL, *h.tokens(57)), ("other", CAUSAL, *h.tokens(9))])
        probe = h.tokens(n)
        meta = h.meta_for([("ctx", mode, *probe)])  # reserves the probe's slots; rewriting them is a no-op
        target = (n, meta.block_tables[0], int(meta.context_lens[0]), meta.slot_mapping.tolist(), mode)
        other = (h.mgr.block_table("other", "kv"), h.mgr.num_tokens("other", "kv"))
        results = []
        for before in (0, 1, 2, 3, 5):
            lead = h.tokens(before)
            sel = ([(before, *other, [-1] * before, READ)] if before else []) + [target]
            q, k, v = (torch.cat(([lead[j]] if before else []) + [probe[j]]) for j in range(3))
            results.append(paged_attention(q, k, v, h.k_cache, h.v_cache, _row_meta(sel))[before:])
        for r in results[1:]:
            assert torch.equal(r, results[0]), n


def test_fork_mid_block_copy_on_write():
    """Context forked mid-block (e.g. CFG branch); both sides append; COW copies keep them independent."""
    h = Harness(block_size=4)
    h.step([("main", CAUSAL, *h.tokens(6))])
    h.fork("main", "cfg")
    h.fork("main", "short", num_tokens=5)
    for _ in range(3):
        assert_all_close(*h.step([("main", CAUSAL, *h.tokens(1)), ("cfg", CAUSAL, *h.tokens(2)),
                                  ("short", BLOCK, *h.tokens(1))]))
    # the shared full first block is still shared by all three
    first = {h.mgr.block_table(s, "kv")[0] for s in ("main", "cfg", "short")}
    assert len(first) == 1 and h.pool.refcount(first.pop()) == 3


def test_custom_scale():
    h = Harness()
    q, k, v = h.tokens(5)
    (out,), (ref,) = h.step([("s", CAUSAL, q, k, v)], scale=0.5)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(out, dense_attention(q, k, v, causal_mask(5, 5), scale=0.5), **TOL)


def test_write_kv_and_copy_blocks():
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros_like(k_cache)
    k = torch.arange(9.0).reshape(3, 1, 3)
    write_kv(k_cache, v_cache, k, -k, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(k_cache[0, 0], k[2])
    assert torch.equal(v_cache[2, 1], -k[0])
    assert k_cache.count_nonzero() == 5  # k[2]=[6,7,8], k[0]=[0,1,2]; the skipped row wrote nothing
    # copies apply in order: 2 -> 3 then 3 -> 1 (a chain)
    copy_blocks(k_cache, v_cache, [(2, 3), (3, 1)])
    assert torch.equal(k_cache[1], k_cache[2]) and torch.equal(v_cache[3], v_cache[2])


def test_metadata_validation():
    h = Harness()
    q, k, v = h.tokens(3)
    build = AttentionMetadata.build
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention(q, k, v, h.k_cache, h.v_cache, build([2], [[0]], [2], [CAUSAL], [0, 1]))
    with pytest.raises(ValueError, match="context_len"):
        paged_attention(q, k, v, h.k_cache, h.v_cache, build([3], [[0]], [2], [CAUSAL], [0, 1, 2]))
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q[:, :1].expand(3, 3, 16).contiguous(), k, v, h.k_cache, h.v_cache,
                        build([3], [[0]], [3], [CAUSAL], [0, 1, 2]))
    with pytest.raises(ValueError, match="block table"):
        paged_attention(q, k, v, h.k_cache, h.v_cache, build([3], [[]], [3], [CAUSAL], [0, 1, 2]))


# ------------------------------------------------------------------------------------------------ backends
def test_torch_backend_matches_function():
    backend = get_backend()
    assert isinstance(backend, TorchPagedBackend) and isinstance(backend, AttentionBackend)
    assert get_backend("torch") is backend
    assert "torch" in available_backends()
    h1, h2 = Harness(seed=4), Harness(seed=4)
    items1 = [("s", CAUSAL, *h1.tokens(6))]
    items2 = [("s", CAUSAL, *h2.tokens(6))]
    m1, m2 = h1.meta_for(items1), h2.meta_for(items2)
    a = paged_attention(*items1[0][2:], h1.k_cache, h1.v_cache, m1)
    b = backend.forward(*items2[0][2:], h2.k_cache, h2.v_cache, m2)
    assert torch.equal(a, b)


def test_a_backend_needing_a_missing_package_is_lazy_and_clear(monkeypatch):
    """A registered backend whose package is not installed: listed as unavailable, a clear error when
    asked for, and its module never imported."""
    from mstar.layers import attention_backends

    monkeypatch.setattr(attention_backends, "_REGISTRY", dict(attention_backends._REGISTRY))
    assert sorted(attention_backends._REGISTRY) == ["compiled", "torch"]  # the backends that exist
    register_backend("needs_pkg", "mstar.layers._no_such_backend_module:Ghost", ("_mstar_no_such_package",))
    assert "needs_pkg" not in available_backends()
    with pytest.raises(BackendUnavailableError, match="_mstar_no_such_package"):
        get_backend("needs_pkg")
    assert "mstar.layers._no_such_backend_module" not in sys.modules
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("nope")


def test_register_backend_missing_module():
    register_backend("ghost", "mstar.layers._no_such_backend_module:Ghost")
    with pytest.raises(BackendUnavailableError):
        get_backend("ghost")
    with pytest.raises(ValueError):
        register_backend("bad", "no_colon")
