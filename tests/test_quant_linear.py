"""Block-quantized linears (Q8_0, Q4_0, Q4_1) multiplied as stored: the format read as the gguf
package reads it, the packed layout, the kernel against the same arithmetic in PyTorch and against
the dequantized float32 multiply (within the input quantization's bound), batch / thread invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mstar.layers.quant as quant
from mstar.layers.cpu_ops import ops
from mstar.layers.quant import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    pack_quantized,
    quantize_rows,
    reference_linear,
    unpack_quantized,
)

gguf = pytest.importorskip("gguf")
KINDS = ("Q8_0", "Q4_0", "Q4_1")
needs_kernel = pytest.mark.skipif(ops() is None, reason="the compiled kernels are not built here")


def quantized(kind: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random matrix quantized by the gguf package, and its dequantization by the same package."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w, qtype)
    ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))
    return QuantizedWeight.from_bytes(kind, torch.from_numpy(raw.view(np.uint8).copy()), (n, k)), ref


def input_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The largest difference the input's quantization can make to ``x @ w.T``: per block, half a
    step (dx / 2) times the block's sum of |w|."""
    _, dx, _ = quantize_rows(x)
    wabs = w.abs().reshape(w.shape[0], -1, quant.BLOCK).sum(-1)  # [N, nb]
    return (dx / 2) @ wabs.T


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_matches_the_gguf_package(kind):
    w, ref = quantized(kind, 70, 96)
    assert w.shape == (70, 96)
    assert torch.equal(w.dequantize(), ref)
    assert torch.equal(w.dequantize(torch.tensor([3, 69])), ref[[3, 69]])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("silu_mul", [False, True])
def test_packed_layout_round_trips(kind, silu_mul):
    w, _ = quantized(kind, 150, 64)  # not a multiple of the panel: padded
    packed = pack_quantized(w, silu_mul=silu_mul)
    assert packed.dtype == torch.uint8 and packed.shape[1:] == (2, {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind] * 64)
    assert torch.equal(unpack_quantized(packed, kind, 150, silu_mul=silu_mul).blocks, w.blocks)


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="unknown quantized kind"):
        QuantizedWeight.from_bytes("Q5_K", torch.zeros(10, dtype=torch.uint8), (1, 32))
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight.from_bytes("Q8_0", torch.zeros(34, dtype=torch.uint8), (1, 30))
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight("Q8_0", torch.zeros(1, 1, 20, dtype=torch.uint8))


@pytest.mark.parametrize("kind", KINDS)
def test_reference_arithmetic_is_within_the_input_quantization_bound(kind):
    w, ref = quantized(kind, 96, 128, seed=1)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    y = reference_linear(x, w)
    exact = x @ ref.T
    err = (y - exact).abs()
    bound = input_bound(x, ref) + 1e-4 * exact.abs() + 1e-4
    assert torch.all(err <= bound), float((err - bound).max())
    assert float(err.max()) > 0  # the input IS quantized (a float32 multiply would give ~0 here)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_matches_the_reference_arithmetic(kind):
    w, ref = quantized(kind, 200, 576, seed=3)
    lin = QuantizedLinear(w)
    assert lin.nbytes == pack_quantized(w).numel() and lin.weight is None
    g = torch.Generator().manual_seed(4)
    for rows in (1, 3, 16, 130):  # one tile, a partial tile, a decode batch, several row chunks
        x = torch.randn(rows, 576, generator=g)
        y, r = lin(x), reference_linear(x, w)
        torch.testing.assert_close(y, r, rtol=1e-5, atol=1e-4)
        exact = x @ ref.T
        assert torch.all((y - exact).abs() <= input_bound(x, ref) + 1e-4 * exact.abs() + 1e-4)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_epilogues(kind):
    w, _ = quantized(kind, 128, 64, seed=5)
    g = torch.Generator().manual_seed(6)
    x, res, bias = torch.randn(9, 64, generator=g), torch.randn(9, 128, generator=g), torch.randn(128, generator=g)
    plain = QuantizedLinear(w)
    y = plain(x)
    torch.testing.assert_close(plain(x, res), y + res, rtol=0, atol=1e-5)
    torch.testing.assert_close(plain(x, bias=bias), y + bias, rtol=0, atol=1e-5)
    gated = QuantizedLinear(w, silu_mul=True)
    assert gated.n_out == 64
    torch.testing.assert_close(gated(x), torch.nn.functional.silu(y[:, :64]) * y[:, 64:], rtol=1e-5, atol=1e-5)
    xb = x.to(torch.bfloat16)  # bfloat16 rows: quantized from their own values, output bfloat16
    yb = plain(xb)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), reference_linear(xb.float(), w), rtol=1e-2, atol=1e-2)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_rows_are_batch_and_thread_invariant(kind):
    w, _ = quantized(kind, 640, 256, seed=7)
    lin = QuantizedLinear(w, silu_mul=True)
    x = torch.randn(23, 256, generator=torch.Generator().manual_seed(8)) * 3
    batch = lin(x)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(x.shape[0])])
    assert torch.equal(batch, alone)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = lin(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batch, one_thread)


@needs_kernel
def test_non_finite_inputs_stay_in_their_row():
    w, _ = quantized("Q4_1", 64, 64, seed=9)
    lin = QuantizedLinear(w)
    x = torch.randn(3, 64)
    x[1, 5] = float("inf")
    y = lin(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
    assert torch.equal(y[[0, 2]], lin(x[[0, 2]]))


@pytest.mark.parametrize("kind", KINDS)
def test_pytorch_path_without_the_kernel(kind, monkeypatch):
    w, _ = quantized(kind, 96, 64, seed=10)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(11))
    monkeypatch.setattr(quant, "ops", lambda: None)
    lin = QuantizedLinear(w, silu_mul=True)
    assert lin.packed is None and lin.nbytes == w.nbytes
    y = reference_linear(x, w)
    torch.testing.assert_close(lin(x), torch.nn.functional.silu(y[:, :48]) * y[:, 48:], rtol=1e-6, atol=1e-6)
    if ops() is not None:
        monkeypatch.undo()
        torch.testing.assert_close(QuantizedLinear(w, silu_mul=True)(x), lin(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", [True, False])
def test_embedding_reads_the_head(kernel, monkeypatch):
    if kernel and ops() is None:
        pytest.skip("the compiled kernels are not built here")
    if not kernel:
        monkeypatch.setattr(quant, "ops", lambda: None)
    w, ref = quantized("Q8_0", 130, 64, seed=12)
    emb = QuantizedEmbedding(QuantizedLinear(w))
    ids = torch.tensor([[0, 129], [64, 7]])
    assert torch.equal(emb(ids), ref[ids])
    with pytest.raises(IndexError, match="out of range"):
        emb(torch.tensor([130]))
