"""The compiled decode-attention kernel (mstar.layers.paged_decode) against the PyTorch reference path."""

from __future__ import annotations

import logging
import random

import pytest
import torch

import mstar.layers.paged_decode as paged_decode_mod
from mstar.layers.attention_backends import TorchPagedBackend, default_backend, get_backend
from mstar.layers.host_longs import HostLongs
from mstar.layers.paged_attention import AttentionMetadata, paged_attention
from mstar.layers.paged_decode import CompiledPagedBackend, paged_decode
from tests.test_paged_attention import (
    BLOCK,
    CAUSAL,
    READ,
    TOL,
    Harness,
    _decode_batch,
    _row_meta,
    dense_attention,
)


def _random_rows(ctx_lens, layout, scattered, seed=0, dtype=torch.float32):
    """A cache holding ``len(ctx_lens)`` decode rows' keys, their block tables and queries."""
    q_heads, kv_heads, head_dim, block_size = layout
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in ctx_lens]
    ids = list(range(sum(needed) + 3))
    if scattered:
        random.Random(seed).shuffle(ids)
    tables, start = [], 0
    for n in needed:
        tables.append(ids[start:start + n])
        start += n
    shape = (len(ids), block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(len(ctx_lens), q_heads, head_dim, generator=gen).to(dtype)
    kv = torch.zeros(len(ctx_lens), kv_heads, head_dim, dtype=dtype)  # nothing is written: slots -1
    return q, kv, k_cache, v_cache, tables


def _meta(tables, ctx_lens):
    return AttentionMetadata.build([1] * len(ctx_lens), tables, ctx_lens, [CAUSAL] * len(ctx_lens))


@pytest.mark.parametrize("layout", [(8, 4, 64, 16), (3, 1, 5, 2), (4, 4, 32, 8)],
                         ids=["gqa-8-4-64", "mqa-3-1-5", "mha-4-32"])
@pytest.mark.parametrize("scattered", [True, False], ids=["scattered", "consecutive"])
def test_kernel_matches_torch_path_and_dense(ext, layout, scattered):
    """Contexts 1..400 (block boundaries included): within 1e-5 of the reference and of dense attention."""
    ctx_lens = [1, 2, 3, 15, 16, 17, 31, 64, 100, 129, 255, 256, 257, 399, 400]
    q, kv, k_cache, v_cache, tables = _random_rows(ctx_lens, layout, scattered)
    out = paged_attention(q, kv, kv, k_cache, v_cache, _meta(tables, ctx_lens), decode=paged_decode)
    ref = paged_attention(q, kv, kv, k_cache, v_cache, _meta(tables, ctx_lens))
    assert (out - ref).abs().max().item() < 1e-6
    for i, n in enumerate(ctx_lens):
        keys = k_cache[tables[i]].flatten(0, 1)[:n]
        vals = v_cache[tables[i]].flatten(0, 1)[:n]
        dense = dense_attention(q[i:i + 1], keys, vals, torch.ones(1, n, dtype=torch.bool))
        torch.testing.assert_close(out[i:i + 1], dense, **TOL)


def test_kernel_bfloat16_cache(ext):
    """A bf16 cache and bf16 queries: arithmetic in float32, like the reference path."""
    ctx_lens = [5, 40, 333]
    q, kv, k_cache, v_cache, tables = _random_rows(ctx_lens, (8, 2, 64, 16), True, dtype=torch.bfloat16)
    out = paged_attention(q, kv, kv, k_cache, v_cache, _meta(tables, ctx_lens), decode=paged_decode)
    ref = paged_attention(q, kv, kv, k_cache, v_cache, _meta(tables, ctx_lens))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)  # bf16 output rounding


@pytest.mark.parametrize("layout", [(8, 4, 64, 16), (3, 1, 5, 2)], ids=["gqa-8-4-64", "mqa-3-1-5"])
def test_kernel_decode_rows_batch_invariant(ext, threads, layout):
    """A decode row's kernel output is bitwise the same alone and in batches of 1..16 at any position,
    next to a read-only sequence, with scattered or consecutive blocks, and the same at 1 and 2
    threads (each row's arithmetic runs whole on one thread)."""
    rng = random.Random(threads)
    block_size = layout[3]
    lens = [n + (n % block_size == 0) for n in (rng.randint(29, 399) for _ in range(16))]
    h, items, refs, rows = _decode_batch(layout, lens, fragment=True)
    extra = h.tokens(5)

    def run(h, items, rows, idx, with_extra=False):
        sel = [rows[i] for i in idx] + ([(5, rows[0][1], rows[0][2] - 1, [-1] * 5, READ)] if with_extra else [])
        q, k, v = (torch.cat([items[i][j] for i in idx] + ([extra[j - 2]] if with_extra else []))
                   for j in (2, 3, 4))
        return CompiledPagedBackend().forward(q, k, v, h.k_cache, h.v_cache, _row_meta(sel))[:len(idx)]

    alone = [run(h, items, rows, [i])[0] for i in range(16)]
    for i in range(16):
        torch.testing.assert_close(alone[i], refs[i][0], **TOL)
    for n in (1, 2, 3, 5, 8, 13, 16):
        for rep in range(2):
            idx = rng.sample(range(16), n)
            out = run(h, items, rows, idx, with_extra=rep == 1)
            for pos, i in enumerate(idx):
                assert torch.equal(out[pos], alone[i]), (n, rep, pos, i)
    other = 3 - threads  # the other thread count
    torch.set_num_threads(other)
    out = run(h, items, rows, list(range(16)))
    torch.set_num_threads(threads)
    for i in range(16):
        assert torch.equal(out[i], alone[i]), ("threads", i)
    h2, items2, _, rows2 = _decode_batch(layout, lens, fragment=False)
    out = run(h2, items2, rows2, list(range(16)))
    for i in range(16):
        assert torch.equal(out[i], alone[i]), ("consecutive", i)


def test_backend_on_mixed_batches_and_cache_writes(ext):
    """Through the backend: prefill, decode, block and read-only sequences in one batch, as the
    Harness drives them (cache contents and outputs checked against dense attention)."""
    h = Harness(block_size=4, q_heads=4, kv_heads=2, fragment=True, seed=9)
    backend = get_backend("compiled")
    for step in range(4):
        items = [("a", CAUSAL, *h.tokens(6 if step == 0 else 1)), ("b", CAUSAL, *h.tokens(3 if step else 9)),
                 ("c", READ, *h.tokens(2))]
        refs = []
        for seq, mode, q, k, v in items:
            hk, hv = h.hist.get(seq, h.empty())
            keys, vals = torch.cat([hk, k]), torch.cat([hv, v])
            n, s = q.shape[0], keys.shape[0]
            mask = (torch.arange(s)[None, :] <= (s - n + torch.arange(n))[:, None]) if mode is CAUSAL \
                else torch.ones(n, s, dtype=torch.bool)
            refs.append(dense_attention(q, keys, vals, mask))
            if mode.writes:
                h.hist[seq] = (keys, vals)
        meta = h.meta_for(items)
        q, k, v = (torch.cat([it[j] for it in items]) for j in (2, 3, 4))
        outs = backend.forward(q, k, v, h.k_cache, h.v_cache, meta).split(meta.query_lens())
        for out, ref in zip(outs, refs):
            torch.testing.assert_close(out, ref, **TOL)
        h.check_cache()


def test_non_contiguous_cache_uses_the_torch_path(ext):
    ctx_lens = [7, 20]
    q, kv, k_cache, v_cache, tables = _random_rows(ctx_lens, (4, 2, 8, 4), True)
    wide_k = torch.cat([k_cache, k_cache], dim=-1)[..., :8]  # same values, not contiguous
    wide_v = torch.cat([v_cache, v_cache], dim=-1)[..., :8]
    out = paged_attention(q, kv, kv, wide_k, wide_v, _meta(tables, ctx_lens), decode=paged_decode)
    ref = paged_attention(q, kv, kv, k_cache, v_cache, _meta(tables, ctx_lens))
    assert torch.equal(out, ref)


def test_env_forces_the_torch_path(monkeypatch):
    monkeypatch.setenv("MSTAR_ATTENTION_KERNEL", "torch")
    assert isinstance(default_backend(), TorchPagedBackend)
    assert paged_decode_mod.kernel() is None
    ctx_lens = [9, 33]
    q, kv, k_cache, v_cache, tables = _random_rows(ctx_lens, (4, 2, 16, 4), True)
    out = CompiledPagedBackend().forward(q, kv, kv, k_cache, v_cache, _meta(tables, ctx_lens))
    assert torch.equal(out, paged_attention(q, kv, kv, k_cache, v_cache, _meta(tables, ctx_lens)))
    monkeypatch.delenv("MSTAR_ATTENTION_KERNEL")
    assert isinstance(default_backend(), CompiledPagedBackend)


def test_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    def broken(verbose=False):
        raise RuntimeError("no compiler\nmore lines")

    monkeypatch.delenv("MSTAR_ATTENTION_KERNEL", raising=False)
    monkeypatch.setattr(paged_decode_mod._EXTENSION, "_state", {})
    monkeypatch.setattr(paged_decode_mod._EXTENSION, "build", broken)
    ctx_lens = [3, 18]
    q, kv, k_cache, v_cache, tables = _random_rows(ctx_lens, (4, 2, 16, 4), False)
    with caplog.at_level(logging.WARNING, logger="mstar.layers.cpu_ops"):
        for _ in range(3):
            out = CompiledPagedBackend().forward(q, kv, kv, k_cache, v_cache, _meta(tables, ctx_lens))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no compiler" in warnings[0].getMessage()
    assert "more lines" not in warnings[0].getMessage()
    assert torch.equal(out, paged_attention(q, kv, kv, k_cache, v_cache, _meta(tables, ctx_lens)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_decode_step_equals_store_then_kernel(ext, threads, dtype):
    """A batch of decode rows only takes one call per layer (store the new K/V, then attend): the
    same caches and the same output bits as ``paged_attention``'s store followed by the kernel,
    with q/k/v as strided views of one packed projection output, as the Llama blocks pass them."""
    ctx_lens = [1, 5, 16, 17, 40, 129]
    hq, hkv, d, bs = 8, 4, 16, 16
    _, _, k_cache, v_cache, tables = _random_rows(ctx_lens, (hq, hkv, d, bs), True, seed=3, dtype=dtype)
    slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, ctx_lens)]
    y = torch.randn(len(ctx_lens), (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(4)).to(dtype)
    q = y[:, :hq * d].view(-1, hq, d)
    k = y[:, hq * d:(hq + hkv) * d].view(-1, hkv, d)
    v = y[:, (hq + hkv) * d:].view(-1, hkv, d)

    def meta():
        return AttentionMetadata.build([1] * len(ctx_lens), tables, ctx_lens, [CAUSAL] * len(ctx_lens), slots)

    kc, vc = k_cache.clone(), v_cache.clone()
    fused = CompiledPagedBackend().forward(q, k, v, kc, vc, meta())
    kr, vr = k_cache.clone(), v_cache.clone()
    ref = paged_attention(q, k, v, kr, vr, meta(), decode=paged_decode)
    assert fused.dtype == dtype and torch.equal(fused, ref)
    assert torch.equal(kc, kr) and torch.equal(vc, vr) and not torch.equal(kc, k_cache)
    bad = AttentionMetadata.build([1] * len(ctx_lens), tables, ctx_lens, [CAUSAL] * len(ctx_lens),
                                  [*slots[:-1], 10 ** 9])
    with pytest.raises((RuntimeError, ValueError)):
        CompiledPagedBackend().forward(q, k, v, kc, vc, bad)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_only_metadata_takes_the_short_plan_with_the_same_bits(ext, dtype):
    """Metadata built as decode rows only (``AttentionMetadata.decode``) gives the fused step its slots,
    block ids and lengths without the general batch plan: the same output and cache bits as the same
    metadata through the plan, with block lists longer than needed too; bad metadata is refused."""
    ctx_lens = [3, 16, 17, 64, 100]
    hq, hkv, d, bs = 8, 2, 32, 16
    _, _, k_cache, v_cache, tables = _random_rows(ctx_lens, (hq, hkv, d, bs), True, seed=5, dtype=dtype)
    spare = k_cache.shape[0] - 1
    tables = [t + [spare] * (i % 3) for i, t in enumerate(tables)]  # some lists longer than needed
    slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, ctx_lens)]
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(len(ctx_lens), hq, d, generator=gen).to(dtype)
    k, v = (torch.randn(len(ctx_lens), hkv, d, generator=gen).to(dtype) for _ in range(2))
    short = AttentionMetadata.decode(tables, ctx_lens, slots)
    assert short._all_decode and _meta(tables, ctx_lens)._all_decode is False  # (no slot written there)
    planned = AttentionMetadata.decode(tables, ctx_lens, slots)
    planned._all_decode = False
    kc, vc = k_cache.clone(), v_cache.clone()
    out = CompiledPagedBackend().forward(q, k, v, kc, vc, short)
    assert short._decode_args is not None and short._batch_plan is None  # the plan was not made
    kr, vr = k_cache.clone(), v_cache.clone()
    ref = CompiledPagedBackend().forward(q, k, v, kr, vr, planned)
    assert planned._decode_args is None and planned._batch_plan is not None
    assert torch.equal(out, ref) and torch.equal(kc, kr) and torch.equal(vc, vr)
    few = [list(t) for t in tables]
    few[3] = few[3][:2]  # 64 tokens need 4 blocks of 16
    with pytest.raises(ValueError, match="sequence 3 has 2 blocks, 4 needed"):
        CompiledPagedBackend().forward(q, k, v, kc, vc, AttentionMetadata.decode(few, ctx_lens, slots))
    with pytest.raises(ValueError, match="inconsistent"):
        CompiledPagedBackend().forward(q[:4], k[:4], v[:4], kc, vc, AttentionMetadata.decode(tables, ctx_lens, slots))
    with pytest.raises(ValueError, match="context_len 0"):
        CompiledPagedBackend().forward(q, k, v, kc, vc, AttentionMetadata.decode(tables, [0, *ctx_lens[1:]], slots))

# ------------------------------------------------------------------ multi-token sequences (paged_block)
def _block_batch(specs, layout, seed=0, dtype=torch.float32):
    """A scattered cache holding every sequence of ``specs`` ((mode, new tokens, context)) and the
    step's inputs: ``(q, k, v, k_cache, v_cache, meta)``; append sequences' new K/V go to their last
    ``n`` slots."""
    q_heads, kv_heads, head_dim, block_size = layout
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-ctx // block_size) for _, _, ctx in specs]
    ids = list(range(sum(needed) + 2))
    random.Random(seed).shuffle(ids)
    tables, slots, start = [], [], 0
    for (mode, n, ctx), m in zip(specs, needed):
        table = ids[start:start + m]
        start += m
        tables.append(table)
        slots += ([table[t // block_size] * block_size + t % block_size for t in range(ctx - n, ctx)]
                  if mode.writes else [-1] * n)
    shape = (len(ids), block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    total = sum(n for _, n, _ in specs)
    q = torch.randn(total, q_heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    meta = AttentionMetadata.build([n for _, n, _ in specs], tables, [c for _, _, c in specs],
                                   [mode for mode, _, _ in specs], slots)
    return q, k, v, k_cache, v_cache, meta


_MIXED = [(CAUSAL, 5, 5), (BLOCK, 66, 330), (READ, 3, 40), (CAUSAL, 1, 50), (CAUSAL, 200, 300),
          (BLOCK, 7, 130), (CAUSAL, 129, 129), (BLOCK, 1, 1)]


@pytest.mark.parametrize("layout", [(8, 4, 64, 16), (6, 2, 48, 8), (4, 4, 32, 66)],
                         ids=["gqa-8-4-64", "gqa-6-2-48", "mha-4-32-block66"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_kernel_matches_torch_path(ext, layout, dtype):
    """Prefill chunks (causal, up to 200 queries over 300 keys: query tiles and key chunks), frame /
    image blocks (bidirectional) and a one-token block, next to decode and read-only rows: the
    backend's output and stored cache agree with the PyTorch path (which is checked against dense
    attention in test_paged_attention)."""
    q, k, v, k_cache, v_cache, meta = _block_batch(_MIXED, layout, dtype=dtype)
    kr, vr = k_cache.clone(), v_cache.clone()
    out = CompiledPagedBackend().forward(q, k, v, k_cache, v_cache, meta)
    meta_ref = AttentionMetadata.build(meta.query_lens(), meta.block_tables, meta.context_lens.tolist(),
                                       meta.modes, meta.slot_mapping)
    ref = paged_attention(q, k, v, kr, vr, meta_ref)
    assert out.dtype == dtype and torch.equal(k_cache, kr) and torch.equal(v_cache, vr)
    tol = TOL if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}  # bf16 output rounding
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_block_kernel_is_used_for_append_sequences(ext, monkeypatch):
    """The kernel takes the causal and block sequences and leaves only read-only ones to the torch
    path (a head_dim that is not a multiple of 16 leaves all of them)."""
    seen = []
    real = paged_decode_mod.paged_block

    def spy(q, k_cache, v_cache, meta, plan, scale, out):
        rest = real(q, k_cache, v_cache, meta, plan, scale, out)
        seen.append(([meta.modes[i] for i in plan.others], [meta.modes[i] for i in rest]))
        return rest

    monkeypatch.setattr(paged_decode_mod, "paged_block", spy)
    for head_dim, left in ((32, [READ]), (8, [BLOCK, READ, CAUSAL])):
        seen.clear()
        q, k, v, k_cache, v_cache, meta = _block_batch([(BLOCK, 4, 12), (READ, 2, 8), (CAUSAL, 3, 9)],
                                                       (2, 1, head_dim, 4))
        out = CompiledPagedBackend().forward(q, k, v, k_cache, v_cache, meta)
        assert seen == [([BLOCK, READ, CAUSAL], left)]
        assert torch.isfinite(out).all()


def test_block_kernel_batch_invariant(ext, threads):
    """Block sequences and causal prefill chunks give the same bits alone and in a batch at any
    position (next to decode and read-only rows), and at 1 and 2 threads (every sequence the kernels
    compute): each query row's arithmetic depends only on its keys and the fixed key chunks."""
    layout, specs = (8, 4, 64, 16), _MIXED
    q, k, v, k_cache, v_cache, meta = _block_batch(specs, layout, seed=3)
    full = CompiledPagedBackend().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    cu = meta.cu_seqlens_q.tolist()

    def alone(i):
        sub = AttentionMetadata.build([cu[i + 1] - cu[i]], [meta.block_tables[i]], [meta.context_lens[i].item()],
                                      [meta.modes[i]], meta.slot_mapping[cu[i]:cu[i + 1]])
        rows = slice(cu[i], cu[i + 1])
        return CompiledPagedBackend().forward(q[rows], k[rows], v[rows], k_cache.clone(), v_cache.clone(), sub)

    for i in (1, 4, 5, 6):
        assert torch.equal(alone(i), full[cu[i]:cu[i + 1]]), i
    # the same batch in another order: sequence 4 first, then the rest reversed
    order = [4] + [j for j in reversed(range(len(specs))) if j != 4]
    rows = torch.cat([torch.arange(cu[j], cu[j + 1]) for j in order])
    shuffled = AttentionMetadata.build([cu[j + 1] - cu[j] for j in order], [meta.block_tables[j] for j in order],
                                       [meta.context_lens[j].item() for j in order], [meta.modes[j] for j in order],
                                       meta.slot_mapping[rows])
    out = CompiledPagedBackend().forward(q[rows], k[rows], v[rows], k_cache.clone(), v_cache.clone(), shuffled)
    assert torch.equal(out, full[rows])
    torch.set_num_threads(3 - threads)  # the other thread count
    try:
        again = CompiledPagedBackend().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    finally:
        torch.set_num_threads(threads)
    for i, (mode, _, _) in enumerate(specs):  # the read-only row's SDPA may change with the threads
        if mode is not READ:
            assert torch.equal(again[cu[i]:cu[i + 1]], full[cu[i]:cu[i + 1]]), ("threads", i)


def test_block_kernel_rejects_bad_arguments(ext):
    """The kernel checks what it is given (the backend never passes such arguments)."""
    q, k, v, k_cache, v_cache, meta = _block_batch([(BLOCK, 4, 12)], (2, 1, 16, 4))
    i64 = lambda *xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    tables = torch.tensor([meta.block_tables[0]], dtype=torch.int64)
    out = torch.zeros_like(q)
    with pytest.raises(RuntimeError, match="bad q_start"):  # more queries than keys
        ext.paged_block_(out, q, k_cache, v_cache, tables, i64(3), i64(0), i64(4), i64(0), 0.25)
    with pytest.raises(RuntimeError, match="block table too short"):
        ext.paged_block_(out, q, k_cache, v_cache, tables[:, :1], i64(12), i64(0), i64(4), i64(0), 0.25)
    bad = tables.clone()
    bad[0, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        ext.paged_block_(out, q, k_cache, v_cache, bad, i64(12), i64(0), i64(4), i64(0), 0.25)


@pytest.mark.parametrize("rows_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_store_kv_writes_what_the_pytorch_store_writes(rows_dtype, cache_dtype):
    """The compiled backend's K/V store (``store_kv``) leaves the caches exactly as ``_store`` does:
    the rows converted to the cache dtype (bf16: nearest even) at their slots, strided rows (views of
    a packed projection output) included; a batch with rows it does not write takes ``_store``."""
    from mstar.layers.paged_attention import QueryMode, _batch_plan, _store
    from mstar.layers.paged_decode import kernel, store_kv

    if kernel() is None:
        pytest.skip("the compiled kernels are not built here")
    g = torch.Generator().manual_seed(7)
    shape = (12, 4, 2, 16)  # blocks, block size, kv heads, head dim
    packed = torch.randn(9, 3, 2, 16, generator=g).to(rows_dtype)  # q | k | v side by side per token
    k, v = packed[:, 1], packed[:, 2]
    for modes in ([QueryMode.BLOCK_APPEND, QueryMode.CAUSAL_APPEND], [QueryMode.READ_ONLY, QueryMode.CAUSAL_APPEND]):
        meta = AttentionMetadata.build([4, 5], [[3, 7], [0, 5, 9]], [6, 9], modes,
                                       [13, 14, 15, 28, 1, 2, 3, 20, 21])
        plan = _batch_plan(meta, k.repeat(1, 2, 1), k, v, torch.zeros(shape, dtype=cache_dtype))
        assert (plan.write_rows is None) == (modes[0] is QueryMode.BLOCK_APPEND)  # kernel path / _store
        ref = [torch.randn(shape, generator=g).to(cache_dtype) for _ in range(2)]
        got = [c.clone() for c in ref]
        _store(*ref, k, v, plan)
        store_kv(*got, k, v, plan)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_fused_block_step_equals_the_backend_forward(ext):
    """``CompiledPagedBackend.fused_block``: a batch of append sequences only (causal chunks and frame
    blocks; the queries strided rows of a packed projection) is planned once and each layer's call
    stores the same cache and returns the same bits as ``forward``; a batch with decode or read-only
    rows gets no plan, and a call with other shapes returns None."""
    specs = [(CAUSAL, 5, 5), (BLOCK, 66, 330), (CAUSAL, 129, 129), (BLOCK, 7, 130)]
    layout = (8, 4, 32, 16)
    q, k, v, k_cache, v_cache, meta = _block_batch(specs, layout)
    packed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # [T, (8 + 4 + 4) * 32]
    qs, ks, vs = packed[:, :256].view(q.shape), packed[:, 256:384].view(k.shape), packed[:, 384:].view(v.shape)
    backend = CompiledPagedBackend()
    kr, vr = k_cache.clone(), v_cache.clone()
    step = backend.fused_block(qs, ks, vs, k_cache, v_cache, meta)
    assert step is not None
    for layer in range(2):  # planned once, used for every layer
        out = step(qs, ks, vs, k_cache, v_cache)
        ref = backend.forward(qs, ks, vs, kr, vr, meta)
        assert torch.equal(out, ref) and torch.equal(k_cache, kr) and torch.equal(v_cache, vr), layer
    assert step(qs[:-1], ks[:-1], vs[:-1], k_cache, v_cache) is None
    assert step(qs, ks, vs, k_cache.bfloat16(), v_cache.bfloat16()) is None
    for others in ([(CAUSAL, 1, 50)], [(READ, 3, 40)]):
        q2, k2, v2, kc2, vc2, meta2 = _block_batch(specs + others, layout)
        assert backend.fused_block(q2, k2, v2, kc2, vc2, meta2) is None


def test_host_longs_write_in_place():
    """``HostLongs``: a tensor over Python ints whose values ``write`` replaces in the same memory;
    another number of values is refused with nothing changed."""
    longs = HostLongs([3, 1, 4])
    t = longs.tensor
    assert t.dtype == torch.int64 and t.tolist() == [3, 1, 4]
    assert longs.write([2, 7, 1]) and longs.tensor is t and t.tolist() == [2, 7, 1]
    assert not longs.write([1, 2]) and t.tolist() == [2, 7, 1]
    empty = HostLongs([])
    assert empty.tensor.shape == (0,) and not empty.write([])


def test_next_decode_is_a_fresh_decode_metadata(ext):
    """The runtime's decode rows carry one metadata from step to step (``next_decode``): the next
    step's fields, the fused step's output and caches are those of a fresh ``AttentionMetadata.decode``."""
    ctx_lens = [5, 16, 31]
    hq, hkv, d, bs = 4, 2, 16, 16
    _, _, k_cache, v_cache, tables = _random_rows([n + 1 for n in ctx_lens], (hq, hkv, d, bs), True, seed=8)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(len(ctx_lens), hq, d, generator=gen)
    k, v = (torch.randn(len(ctx_lens), hkv, d, generator=gen) for _ in range(2))

    def slots(lens):
        return [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)]

    carried = AttentionMetadata.decode(tables, ctx_lens, slots(ctx_lens))
    CompiledPagedBackend().forward(q, k, v, k_cache.clone(), v_cache.clone(), carried)  # memoizes its plan
    held = carried.slot_mapping, carried.context_lens
    nxt = [n + 1 for n in ctx_lens]
    carried.next_decode(tables, nxt, slots(nxt))
    fresh = AttentionMetadata.decode(tables, nxt, slots(nxt))
    assert carried.slot_mapping is held[0] and carried.context_lens is held[1]  # rewritten in place
    assert carried._decode_args is None and carried._host == fresh._host
    for name in ("cu_seqlens_q", "slot_mapping", "context_lens"):
        assert torch.equal(getattr(carried, name), getattr(fresh, name))
    kc, vc, kf, vf = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    assert torch.equal(CompiledPagedBackend().forward(q, k, v, kc, vc, carried),
                       CompiledPagedBackend().forward(q, k, v, kf, vf, fresh))
    assert torch.equal(kc, kf) and torch.equal(vc, vf)
    with pytest.raises(ValueError, match="same number of sequences"):
        carried.next_decode(tables[:2], nxt[:2], slots(nxt)[:2])
    assert carried.context_lens.tolist() == nxt  # a refused call changed nothing
    with pytest.raises(ValueError, match="same number of sequences"):
        _meta(tables, ctx_lens).next_decode(tables, nxt, slots(nxt))  # not built as decode rows
