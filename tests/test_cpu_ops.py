"""The compiled CPU kernels of mstar.layers.cpu_ops (panel linears, RMSNorm, rotary) against PyTorch."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import mstar.layers.cpu_ops as cpu_ops_mod
from mstar.layers.norms import RMSNorm
from mstar.layers.prepack import prepack_mode
from mstar.layers.rotary import RotaryEmbedding, apply_rotary


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (5, 33, 100), (7, 512, 1024), (61, 96, 130), (130, 40, 3), (16, 1400, 70), (3, 128, 4100)])
def test_linear_matches_matmul(ext, threads, m, k, n):
    x, w = _rand(m, k, seed=1), _rand(k, n, seed=2) / k ** 0.5
    y = ext.linear(x, ext.pack(w, False), n, False, None)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, (x.double() @ w.double()).float(), atol=2e-5, rtol=1e-5)


def test_small_calls_run_inline_with_the_same_bits(ext):
    """A call of less estimated work than ``inline_work`` (2^18 multiply-adds or element steps by
    default) runs its tasks on the calling thread: the same bits as spread over two threads, since a
    task's result never depends on the thread that runs it."""
    assert ext.inline_work() == 1 << 18
    before_threads, before_work = torch.get_num_threads(), ext.inline_work()
    x, w = _rand(16, 128, seed=1), ext.pack(_rand(128, 512, seed=2) / 12, False)  # 1M multiply-adds
    small, rows = _rand(1, 128, seed=3), _rand(64, 32, seed=4)  # 65k; 4 row tasks of 2k steps
    logits, norm_w = _rand(16, 64, seed=5), _rand(32, seed=6)
    outs = []
    try:
        torch.set_num_threads(2)
        for work in (0, 1 << 62):  # every call spread; every call inline
            ext.set_inline_work(work)
            outs.append([ext.linear(x, w, 512, False, None), ext.linear(small, w, 512, False, None),
                         ext.rms_norm(rows, norm_w, 1e-6), ext.argmax_rows(logits)])
    finally:
        ext.set_inline_work(before_work)
        torch.set_num_threads(before_threads)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("k", [320, 200])  # input rows in blocks of 64: whole blocks, and a short last one
# 700 outputs: one panel per task; 4100 (65 panels): runs of consecutive panels per task, whose length
# depends on the thread count
@pytest.mark.parametrize("n", [700, 4100])
def test_linear_rows_are_batch_and_thread_invariant(ext, threads, k, n):
    """A row's bits do not depend on the batch around it, its place in it or the thread count."""
    w = ext.pack(_rand(k, n, seed=3), False)
    x = _rand(67, k, seed=4)
    full = ext.linear(x, w, n, False, None)
    for rows in ([0], [5, 6, 7], list(range(13, 30)), list(range(60, 67))):
        part = ext.linear(x[rows].contiguous(), w, n, False, None)
        assert torch.equal(part, full[rows])
    torch.set_num_threads(3 - threads)  # the other count
    assert torch.equal(ext.linear(x, w, n, False, None), full)


def test_fused_silu_mul_and_residual(ext, threads):
    k, i = 96, 70
    x, gate_up = _rand(9, k, seed=5), _rand(k, 2 * i, seed=6) / k ** 0.5
    act = ext.linear(x, ext.pack(gate_up, True), i, True, None)
    ref = F.silu(x @ gate_up[:, :i]) * (x @ gate_up[:, i:])
    torch.testing.assert_close(act, ref, atol=1e-5, rtol=1e-5)
    w, res = _rand(k, 50, seed=7), _rand(9, 50, seed=8)
    plain = ext.linear(x, ext.pack(w, False), 50, False, None)
    assert torch.equal(ext.linear(x, ext.pack(w, False), 50, False, res), plain + res)


def test_silu_mul_over_the_whole_range_of_gates(ext):
    # the fused SiLU (a vectorised exp, vec_math.h) against PyTorch's from deep negative to large gates:
    # a few ulp apart; below -87 (where e^g underflows) both are within 1e-35 of zero; NaN stays NaN
    g = torch.cat([torch.linspace(-95, 95, 3801), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e30, float("nan")])])
    x = torch.stack([g, torch.ones_like(g)], dim=1)  # gate = g, up = 1
    act = ext.linear(x, ext.pack(torch.eye(2), True), 1, True, None)[:, 0]
    torch.testing.assert_close(act[:-1], F.silu(g[:-1]), atol=1e-35, rtol=2e-6)
    assert torch.isnan(act[-1])


def test_bfloat16_weights_and_inputs(ext):
    x, w = _rand(6, 128, seed=9), _rand(128, 90, seed=10)
    wb = w.to(torch.bfloat16)
    y = ext.linear(x, ext.pack(wb, False), 90, False, None)
    torch.testing.assert_close(y, x @ wb.float(), atol=2e-5, rtol=1e-5)
    xb = x.to(torch.bfloat16)
    yb = ext.linear(xb, ext.pack(wb, False), 90, False, None)
    assert yb.dtype == torch.bfloat16  # the output has the input's dtype (rounded once, at the store)
    torch.testing.assert_close(yb, (xb.float() @ wb.float()).to(torch.bfloat16), atol=0, rtol=8e-3)


# 128 inputs: the tile unit (AMX) where the CPU and OS have it; 200 (not a multiple of 32): the AVX512-BF16
# dot products everywhere. 40 rows: two whole 16-row tiles and a padded one.
@pytest.mark.parametrize("k", [128, 200])
def test_bfloat16_dot_products_on_pair_packed_weights(ext, threads, k):
    if not ext.dot_pairs_available():
        pytest.skip("built for a CPU without AVX512-BF16")
    assert not ext.tile_unit_available(200)
    xb, wb = _rand(40, k, seed=16, dtype=torch.bfloat16), _rand(k, 150, seed=17, dtype=torch.bfloat16)
    pairs = ext.pack(wb, False, True)
    y = ext.linear(xb, pairs, 150, False, None)
    torch.testing.assert_close(y, (xb.float() @ wb.float()).to(torch.bfloat16), atol=0, rtol=8e-3)
    for rows in ([0], [3, 4, 5], list(range(7, 23)), list(range(17, 40))):  # batch invariant, as float32
        assert torch.equal(ext.linear(xb[rows].contiguous(), pairs, 150, False, None), y[rows])
    torch.set_num_threads(3 - threads)  # the other count
    assert torch.equal(ext.linear(xb, pairs, 150, False, None), y)
    res = _rand(40, 150, seed=18, dtype=torch.bfloat16)
    fused = ext.linear(xb, pairs, 150, False, res)
    torch.testing.assert_close(fused, (xb.float() @ wb.float() + res.float()).to(torch.bfloat16), atol=0, rtol=8e-3)
    gate_up = _rand(k, 2 * 70, seed=19, dtype=torch.bfloat16)
    act = ext.linear(xb, ext.pack(gate_up, True, True), 70, True, None)
    g, u = (xb.float() @ gate_up.float()).split(70, dim=1)
    torch.testing.assert_close(act, (F.silu(g) * u).to(torch.bfloat16), atol=1e-2, rtol=1e-2)
    with pytest.raises(RuntimeError):
        ext.pack(_rand(5, 8, dtype=torch.bfloat16), False, True)  # odd input size


def test_bad_arguments_raise(ext):
    w = ext.pack(_rand(16, 8), False)
    with pytest.raises(RuntimeError):
        ext.linear(_rand(3, 17), w, 8, False, None)  # wrong input size
    with pytest.raises(RuntimeError):
        ext.linear(_rand(3, 16), w, 65, False, None)  # more columns than packed
    with pytest.raises(RuntimeError):
        ext.linear(_rand(3, 16), w, 8, False, _rand(2, 8))  # residual of the wrong shape


def test_rms_norm_and_rotary_match_pytorch(ext, threads):
    x, weight = _rand(37, 200, seed=11), _rand(200, seed=12)
    norm = RMSNorm(200, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(weight)
    ref = norm(x)
    assert norm.prepack() and norm.compiled
    torch.testing.assert_close(norm(x), ref, atol=1e-6, rtol=1e-6)
    rows = [ext.rms_norm(x[i:i + 1].contiguous(), norm.weight.detach(), 1e-6) for i in (0, 20)]
    full = ext.rms_norm(x, norm.weight.detach(), 1e-6)
    assert torch.equal(rows[0][0], full[0]) and torch.equal(rows[1][0], full[20])

    # per-head rows of a [T, heads, D] view of a wider fused projection: read in place, the same
    # bits as the copied rows; the module takes that path (and a copy for other layouts)
    fused = _rand(19, 4 * 32 + 64, seed=14)
    q = fused[:, 32:32 + 3 * 32].view(19, 3, 32)
    head_norm = RMSNorm(32, 1e-6)
    with torch.no_grad():
        head_norm.weight.copy_(_rand(32, seed=15))
    head_ref = head_norm(q)
    assert head_norm.prepack()
    rows_ref = ext.rms_norm(q.reshape(-1, 32).contiguous(), head_norm.weight.detach(), 1e-6).view(19, 3, 32)
    for got in (ext.rms_norm(q, head_norm.weight.detach(), 1e-6), head_norm(q), head_norm(q.transpose(0, 1))
                .transpose(0, 1)):
        assert got.shape == (19, 3, 32) and torch.equal(got, rows_ref)
    torch.testing.assert_close(rows_ref, head_ref, atol=1e-6, rtol=1e-6)
    q16, w16 = fused.to(torch.bfloat16)[:, 32:32 + 3 * 32].view(19, 3, 32), head_norm.weight.detach().to(torch.bfloat16)
    assert torch.equal(ext.rms_norm(q16, w16, 1e-6), ext.rms_norm(q16.reshape(-1, 32).contiguous(), w16, 1e-6)
                       .view(19, 3, 32))
    with pytest.raises(RuntimeError):
        ext.rms_norm(fused[:, :96].view(19, 32, 3).transpose(1, 2), head_norm.weight.detach(), 1e-6)

    heads, kv_heads, d = 4, 2, 32
    cos, sin = RotaryEmbedding(d, 10000.0)(torch.arange(11) * 7)
    y = _rand(11, (heads + 2 * kv_heads) * d, seed=13)
    ref_qk = apply_rotary(y[:, :(heads + kv_heads) * d].view(11, heads + kv_heads, d), cos, sin)
    out = y.clone()
    ext.rotary_(out, cos, sin, heads + kv_heads, d)
    torch.testing.assert_close(out[:, :(heads + kv_heads) * d].view(11, -1, d), ref_qk, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[:, (heads + kv_heads) * d:], y[:, (heads + kv_heads) * d:])  # v untouched


def test_layer_norm_matches_pytorch_and_is_row_invariant(ext, threads):
    """``PrepackableLayerNorm``: float32 rows through the compiled LayerNorm, within float32 rounding of
    ``nn.LayerNorm`` (widths with and without a tail of 16), a row the same bits alone and in the
    batch; 3-D inputs take ``nn.LayerNorm``'s path; hooks see the call."""
    from mstar.layers.norms import PrepackableLayerNorm

    for h in (256, 200):
        x = _rand(37, h, seed=14) * 3 + 1.5
        norm = PrepackableLayerNorm(h, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * _rand(h, seed=15))
            norm.bias.copy_(0.1 * _rand(h, seed=16))
        ref = F.layer_norm(x, (h,), norm.weight, norm.bias, 1e-6)
        assert norm.prepack()
        got = norm(x)
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
        for i in (0, 20, 36):
            assert torch.equal(norm(x[i:i + 1].contiguous()), got[i:i + 1])
        assert torch.equal(norm(x.unsqueeze(0)), F.layer_norm(x.unsqueeze(0), (h,), norm.weight, norm.bias, 1e-6))
        handle = norm.register_forward_hook(lambda m, a, out: None)
        assert torch.equal(norm(x), got)  # hooks run around forward: the same path
        handle.remove()
    with pytest.raises(RuntimeError, match="weight and bias"):
        ext.layer_norm(x, norm.weight.detach()[:10], norm.bias.detach(), 1e-6)


def test_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    def broken(verbose=False):
        raise RuntimeError("no compiler\nmore lines")

    monkeypatch.delenv("MSTAR_KERNELS", raising=False)
    monkeypatch.delenv("MSTAR_PREPACK", raising=False)
    monkeypatch.setattr(cpu_ops_mod._EXTENSION, "_state", {})
    monkeypatch.setattr(cpu_ops_mod._EXTENSION, "build", broken)
    with caplog.at_level(logging.WARNING, logger="mstar.layers.cpu_ops"):
        for _ in range(3):
            assert cpu_ops_mod.ops() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no compiler" in warnings[0].getMessage()
    assert prepack_mode() is None  # the loaders keep the plain path
    norm = RMSNorm(8)
    assert not norm.prepack()


def test_argmax_rows_matches_torch_argmax(ext, threads):
    x = _rand(9, 1000, seed=14)
    x[1, 5] = x[1, 900] = float("nan")  # the first NaN wins, as in torch.argmax
    x[2, :] = 1.0  # ties: the first index
    x[3, 10] = x[3, 500] = float("inf")
    x[4, 999] = 1e30  # the tail past the last full 16-lane vector
    assert torch.equal(ext.argmax_rows(x), torch.argmax(x, dim=-1))
    for shape in [(1, 1), (3, 17), (16, 32000)]:
        y = _rand(*shape, seed=15)
        assert torch.equal(ext.argmax_rows(y), torch.argmax(y, dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_first_index_across_lanes(ext, threads, dtype):
    """Each lane keeps its first maximum: the row's answer is the smallest index among the lanes that
    hold the maximum, wherever the ties fall (a later lane with an earlier index, the first element,
    the tail, rows shorter than a vector); bfloat16 rows give torch.argmax's index too."""
    x = _rand(12, 203, seed=16, dtype=dtype)
    x[0, 17] = x[0, 3] = 50.0  # lanes 1 and 3: index 3 comes first
    x[1, 0] = x[1, 40] = 50.0  # the first element
    x[2, 200] = 50.0  # only in the tail
    x[3, :] = float("-inf")
    x[4, 150] = float("-inf")
    x[5, 7], x[5, 8] = -0.0, 0.0  # equal values: the first index
    x[5, :7], x[5, 9:] = -1.0, -1.0
    x[6, 33] = float("nan")
    x[7, 100:] = 60.0  # a run of ties across every lane
    assert torch.equal(ext.argmax_rows(x), torch.argmax(x, dim=-1))
    short = _rand(3, 5, seed=17, dtype=dtype)
    assert torch.equal(ext.argmax_rows(short), torch.argmax(short, dim=-1))
    wide = _rand(16, 32000, seed=18, dtype=dtype)  # bfloat16: many ties in a row this wide
    assert torch.equal(ext.argmax_rows(wide), torch.argmax(wide.float(), dim=-1))


def test_linear_argmax_is_the_argmax_of_the_stored_product(ext, threads):
    """``linear_argmax``: each row's argmax of ``linear``'s product without storing it (the tasks keep
    per-run maxima, then reduce in column order), torch.argmax's index wherever the maxima fall:
    random rows over many panels and a partial last one; with one input (x = 1) the product is the
    weight row, so ties across panels and runs, NaN (the first wins), infinities, a row of -inf
    (column 0), equal signed zeros and a maximum in the last partial panel are set directly."""
    for m, k, n in [(1, 128, 151936), (16, 128, 20000), (7, 64, 1000), (13, 96, 130), (61, 40, 2577), (3, 32, 64)]:
        x, w = _rand(m, k, seed=40), _rand(k, n, seed=41) / k ** 0.5
        packed = ext.pack(w, False)
        assert torch.equal(ext.linear_argmax(x, packed, n), torch.argmax(ext.linear(x, packed, n, False, None), -1))
    n = 64 * 40 + 17  # 41 panels: several runs of panels, the last panel partial
    rows = {"ties across panels": {700: 50.0, 100: 50.0, 2300: 50.0}, "nan": {2000: "nan", 300: "nan", 5: 99.0},
            "inf": {2576: "inf", 5: "inf"}, "all -inf": "-inf", "last partial panel": {2570: 9.0},
            "signed zeros": {"rest": -1.0, 70: -0.0, 71: 0.0}, "first column": {0: 3.0, 64: 3.0}}
    for name, spec in rows.items():
        w = _rand(1, n, seed=42) * 0.1
        if spec == "-inf":
            w.fill_(float("-inf"))
        else:
            if "rest" in spec:
                w.fill_(spec.pop("rest"))
            for col, value in spec.items():
                w[0, col] = float(value)
        packed, one = ext.pack(w, False), torch.ones(1, 1)
        expected = torch.argmax(ext.linear(one, packed, n, False, None), -1)
        assert torch.equal(ext.linear_argmax(one, packed, n), expected), name
    with pytest.raises(RuntimeError, match="float32"):
        ext.linear_argmax(torch.ones(1, 64, dtype=torch.bfloat16), ext.pack(_rand(64, 64, seed=43), False), 64)


def test_bfloat16_rms_norm_and_rotary(ext):
    x, weight = _rand(9, 96, seed=20, dtype=torch.bfloat16), _rand(96, seed=21, dtype=torch.bfloat16)
    norm = RMSNorm(96, 1e-6, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(weight)
    ref = norm(x)  # the PyTorch path: statistics in float32, rounded as the reference's module
    torch.testing.assert_close(ext.rms_norm(x, norm.weight.detach(), 1e-6), ref, atol=0, rtol=8e-3)
    cos, sin = (t.to(torch.bfloat16) for t in RotaryEmbedding(16, 10000.0)(torch.arange(9) * 5))
    y = _rand(9, 3 * 16, seed=22, dtype=torch.bfloat16)
    ref_qk = apply_rotary(y[:, :32].float().view(9, 2, 16), cos.float(), sin.float())
    ext.rotary_(y, cos, sin, 2, 16)
    torch.testing.assert_close(y[:, :32].float().view(9, 2, 16), ref_qk, atol=1e-2, rtol=1e-2)


def test_the_kernels_build_where_a_compiler_is():
    """Every machine of ours has a C++ compiler, and there the kernels must build: a failed build only
    warns (models fall back to PyTorch) and every kernel test skips, which hid an AVX2-only CPU's
    build error (a register constraint only AVX-512 targets meet) behind a green suite."""
    import os
    import shutil

    if os.environ.get("MSTAR_KERNELS", "").strip().lower() == "torch":
        pytest.skip("MSTAR_KERNELS=torch turns the kernels off")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    from mstar.models.qwen3_omni import kernels as omni_kernels

    assert cpu_ops_mod.ops() is not None, "the compiled CPU kernels failed to build (see the warning above)"
    assert omni_kernels.ops() is not None, "the Qwen3-Omni kernels failed to build (see the warning above)"


class _Recording:
    """Stands in for a loaded extension: records every kernel looked up on it, then forwards."""

    def __init__(self, real):
        self.real, self.used = real, set()

    def __getattr__(self, name):
        self.used.add(name)
        return getattr(self.real, name)


_ATTENTION_KERNELS = {"paged_decode", "decode_step", "paged_block_", "store_kv_"}


def _greedy_llama_tiny(monkeypatch, **env):
    """One greedy llama-tiny generate with ``env`` set and every extension recording what it serves
    (the core's and Qwen3-Omni's): the kernels used, per extension."""
    from mstar.layers import attention_backends
    from mstar.models.qwen3_omni import kernels as omni_kernels
    from mstar.runtime.api import Runtime

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(attention_backends, "_INSTANCES", {})
    recorders = {}
    for mod in (cpu_ops_mod, omni_kernels):
        real = mod._EXTENSION.build()  # the cached build, whatever the switches say
        recorders[mod.__name__] = _Recording(real)
        monkeypatch.setattr(mod._EXTENSION, "_state", {"module": recorders[mod.__name__]})
    with Runtime("llama-tiny") as rt:
        out = rt.generate([{"input_ids": torch.tensor([1, 5, 9, 14])}], {"max_tokens": 4})
    assert out[0].finished
    return {name: r.used for name, r in recorders.items()}


def test_kernels_switch_turns_every_compiled_kernel_off(monkeypatch):
    """``MSTAR_KERNELS=torch``: no lookup module hands out its extension (core, attention,
    Qwen3-Omni's), the loaders keep the plain path, and a llama-tiny generate uses no kernel."""
    from mstar.layers import paged_decode
    from mstar.layers.attention_backends import TorchPagedBackend, default_backend
    from mstar.models.qwen3_omni import kernels as omni_kernels

    if cpu_ops_mod.ops() is None or omni_kernels.ops() is None:
        pytest.skip("the compiled CPU kernels are unavailable here")
    used = _greedy_llama_tiny(monkeypatch, MSTAR_KERNELS="torch")
    assert used == {"mstar.layers.cpu_ops": set(), "mstar.models.qwen3_omni.kernels": set()}
    assert cpu_ops_mod.ops() is None and omni_kernels.ops() is None and paged_decode.kernel() is None
    assert prepack_mode() is None
    assert isinstance(default_backend(), TorchPagedBackend)


def test_attention_switch_leaves_the_other_kernels_on(monkeypatch):
    """``MSTAR_ATTENTION_KERNEL=torch`` turns off only the compiled attention: the panel linears and
    norms still run (a llama-tiny generate uses them, and no attention kernel)."""
    from mstar.layers import paged_decode
    from mstar.layers.attention_backends import TorchPagedBackend, default_backend
    from mstar.layers.paged_decode import CompiledPagedBackend

    if cpu_ops_mod.ops() is None:
        pytest.skip("the compiled CPU kernels are unavailable here")
    monkeypatch.delenv("MSTAR_KERNELS", raising=False)
    monkeypatch.delenv("MSTAR_PREPACK", raising=False)
    with_attention = _greedy_llama_tiny(monkeypatch)["mstar.layers.cpu_ops"]
    assert with_attention & _ATTENTION_KERNELS and "linear" in with_attention  # both on by default
    used = _greedy_llama_tiny(monkeypatch, MSTAR_ATTENTION_KERNEL="torch")["mstar.layers.cpu_ops"]
    assert "linear" in used and not used & _ATTENTION_KERNELS, used
    assert paged_decode.kernel() is None and cpu_ops_mod.ops() is not None and prepack_mode() == "panel"
    assert isinstance(default_backend(), TorchPagedBackend)
    monkeypatch.delenv("MSTAR_ATTENTION_KERNEL")
    monkeypatch.setattr("mstar.layers.attention_backends._INSTANCES", {})
    assert isinstance(default_backend(), CompiledPagedBackend)


@pytest.mark.parametrize("d", [2, 18, 32, 64])
def test_rotary_pairs_has_pytorchs_bits(ext, threads, d):
    """Adjacent-pair rotation in place over the first heads of each row: exactly x * cos + swapped * sin
    as PyTorch rounds it (two products, then the sum), the heads past ``heads`` untouched."""
    from mstar.models.vjepa2.rope import rotate

    heads, tokens = 3, 37
    y = _rand(tokens, (heads + 1) * d, seed=30) * 4
    ang = _rand(tokens, d, seed=31) * 30
    cos, sin = ang.cos(), ang.sin()
    ref = rotate(y[:, :heads * d].view(tokens, heads, d).transpose(0, 1), cos, sin).transpose(0, 1)
    got = y.clone()
    ext.rotary_pairs_(got, cos, sin, heads, d)
    assert torch.equal(got[:, :heads * d].view(tokens, heads, d), ref)
    assert torch.equal(got[:, heads * d:], y[:, heads * d:])
