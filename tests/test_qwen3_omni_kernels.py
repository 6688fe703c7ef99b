"""Qwen3-Omni's compiled kernels (``mstar.models.qwen3_omni.kernels``: the Code2Wav vocoder's SnakeBeta,
narrow convolutions, residual units and transposed-convolution taps) against PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture(scope="module")
def ext():
    """The family's extension (this file's kernels), built once per machine into its cache; the test
    skips where it cannot be."""
    from mstar.models.qwen3_omni.kernels import ops

    module = ops()
    if module is None:
        pytest.skip("the compiled Qwen3-Omni kernels are unavailable here (MSTAR_KERNELS=torch, or no compiler)")
    return module


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_snake_beta_matches_pytorch(ext, threads):
    """Code2Wav's activation: the fused pass equals the PyTorch formula to float rounding, tails
    (time not a multiple of 16) and inputs beyond the polynomial's range (std::sin) included; a
    row's tail takes the vector code."""
    x = _rand(2, 5, 1000 + 7, seed=11) * 4
    x[1, 2, 100:120] = 3e5  # a whole vector beyond the polynomial's range
    alpha, inv_beta = _rand(5, seed=12).exp(), 1.0 / (_rand(5, seed=13).exp() + 1e-9)
    ref = x.double() + inv_beta.double()[None, :, None] * torch.sin(x.double() * alpha.double()[None, :, None]) ** 2
    y = ext.snake_beta(x, alpha, inv_beta)
    assert y.shape == x.shape and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=2e-6, rtol=1e-6)
    u = torch.linspace(-3.0e4, 3.0e4, 200_003).view(1, 1, -1)  # the range reduction over many periods
    s2 = ext.snake_beta(u, torch.ones(1), torch.ones(1)).double() - u.double()
    assert (s2 - torch.sin(u.double()) ** 2).abs().max() <= 2 * 2.0 ** -9  # 2 ulp of 3e4
    nan = ext.snake_beta(torch.full((1, 1, 20), float("nan")), torch.ones(1), torch.ones(1))
    assert nan.isnan().all()
    # a step's value does not depend on where its row ends (a streamed chunk's): the last < 16 steps
    # go through the same vector code, on a zero-padded copy
    for end in (7, 150, 1001):
        assert torch.equal(ext.snake_beta(x[..., :end].contiguous(), alpha, inv_beta), y[..., :end])
    with pytest.raises(RuntimeError, match="snake_beta"):
        ext.snake_beta(x[:, :, ::2], alpha, inv_beta)
    with pytest.raises(RuntimeError, match="snake_beta"):
        ext.snake_beta(x, alpha[:3], inv_beta)
    # with a left part: the causal convolution's kept tail copied in front of the activated row
    left = _rand(2, 5, 6, seed=14)
    padded = ext.snake_beta(x, alpha, inv_beta, left)
    assert padded.shape == (2, 5, 6 + x.shape[2])
    assert torch.equal(padded[..., :6], left) and torch.equal(padded[..., 6:], y)
    with pytest.raises(RuntimeError, match="snake_beta"):
        ext.snake_beta(x, alpha, inv_beta, left[:1])


@pytest.mark.parametrize("c_in,c_out,dilation,steps", [
    (8, 8, 1, 8213), (8, 8, 9, 8213), (16, 16, 3, 8213), (8, 1, 1, 8213), (96, 1, 1, 8213), (5, 8, 2, 8213),
    (64, 32, 3, 1100), (24, 48, 1, 37), (64, 128, 1, 9)])
def test_narrow_conv1d_matches_conv1d(ext, threads, c_in, c_out, dilation, steps):
    """Code2Wav's convolutions (1, 8 or a multiple of 16 outputs): against F.conv1d (float64), tails
    included (steps not a multiple of 16; inputs shorter than one vector), and a row's bits the same
    alone and in a batch."""
    k = 7
    x = _rand(3, c_in, steps + (k - 1) * dilation, seed=21)
    w, b = _rand(c_out, c_in, k, seed=22) / (c_in * k) ** 0.5, _rand(c_out, seed=23)
    y = ext.narrow_conv1d(x, w, b, dilation)
    ref = F.conv1d(x.double(), w.double(), b.double(), dilation=dilation)
    assert y.shape == (3, c_out, steps)
    tol = 1e-7 * c_in * k  # float32 sums of c_in * k terms
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=1e-6)
    assert torch.equal(ext.narrow_conv1d(x[1:2].contiguous(), w, b, dilation), y[1:2])
    torch.testing.assert_close(ext.narrow_conv1d(x, w, None, dilation).double(), ref - b.double()[:, None],
                               atol=tol, rtol=1e-6)
    residual = _rand(3, c_out, steps, seed=25)  # the fused residual rounds as one add after the sum
    assert torch.equal(ext.narrow_conv1d(x, w, b, dilation, residual), y + residual)
    for n in (steps - 37, 100, 23):  # a step's bits do not depend on where the row ends (which of the
        if 0 < n < steps:  # kernel's loops, 4 x 16 steps, 16 steps or the padded tail, computes it)
            head = x[..., :n + (k - 1) * dilation].contiguous()
            assert torch.equal(ext.narrow_conv1d(head, w, b, dilation), y[..., :n])


@pytest.mark.parametrize("c_in,c_out,k,steps", [(8, 8, 1, 8213), (16, 16, 1, 3016), (16, 1, 1, 37), (8, 1, 7, 301),
                                                (8, 8, 3, 9)])
def test_narrow_conv1d_with_the_snake_fused_on_its_inputs(ext, threads, c_in, c_out, k, steps):
    """SnakeBeta applied as the convolution loads its inputs: within float32 rounding of snake_beta's
    output convolved (the last steps of a row go through the vector code, where snake_beta's tail takes
    std::sin), with the residual; a row's bits the same alone and in a batch; scales of the wrong size
    are an error."""
    x = _rand(3, c_in, steps + k - 1, seed=31) * 2
    w, b = _rand(c_out, c_in, k, seed=32) / (c_in * k) ** 0.5, _rand(c_out, seed=33)
    alpha, inv_beta = _rand(c_in, seed=34).exp(), 1 / (_rand(c_in, seed=35).exp() + 1e-9)
    residual = _rand(3, c_out, steps, seed=36)
    fused = ext.narrow_conv1d(x, w, b, 1, residual, alpha, inv_beta)
    ref = F.conv1d(ext.snake_beta(x, alpha, inv_beta).double(), w.double(), b.double()) + residual.double()
    torch.testing.assert_close(fused.double(), ref, atol=1e-6 * c_in * k, rtol=1e-5)
    assert torch.equal(ext.narrow_conv1d(x[2:].contiguous(), w, b, 1, residual[2:].contiguous(), alpha, inv_beta),
                       fused[2:])
    if steps > 21:  # the bits do not depend on where the row ends
        head = x[..., :steps - 21 + k - 1].contiguous()
        assert torch.equal(ext.narrow_conv1d(head, w, b, 1, residual[..., :steps - 21].contiguous(), alpha, inv_beta),
                           fused[..., :steps - 21])
    with pytest.raises(RuntimeError, match="snake"):
        ext.narrow_conv1d(x, w, b, 1, None, alpha[:-1], inv_beta[:-1])
    with pytest.raises(RuntimeError, match="snake"):
        ext.narrow_conv1d(x, w, b, 1, None, alpha, None)


def _unit_in_three_kernels(ext, x, left, a1, b1, w_a, bias_a, d, a2, b2, w_b, bias_b):
    """A residual unit as the vocoder ran it before ``residual_unit``: snake_beta writing the padded
    activated input, the causal convolution, the kernel-1 one with the second SnakeBeta (fused on
    its loads up to 16 channels, else a snake_beta pass) and the residual."""
    keep = (w_a.shape[2] - 1) * d
    xin = ext.snake_beta(x, a1, b1, left if left is not None else x.new_zeros(x.shape[0], x.shape[1], keep))
    y = ext.narrow_conv1d(xin, w_a, bias_a, d)
    if x.shape[1] <= 16:
        out = ext.narrow_conv1d(y, w_b, bias_b, 1, x, a2, b2)
    else:
        out = ext.narrow_conv1d(ext.snake_beta(y, a2, b2), w_b, bias_b, 1, x)
    return out, xin[..., xin.shape[-1] - keep:]


@pytest.mark.parametrize("channels,steps,dilation", [(8, 9045, 9), (8, 37, 3), (16, 3016, 1), (32, 755, 9),
                                                      (64, 152, 3), (64, 5, 9)])
def test_residual_unit_has_the_three_kernel_bits(ext, threads, channels, steps, dilation):
    """A vocoder residual unit in one pass: the output and the kept tail are the bits of the three
    kernels it replaces, for first chunks (zero padding) and continuing ones (a kept tail in front),
    with inputs beyond the sine polynomial's range (std::sin for their whole register); a row's bits
    the same alone; bad shapes are errors."""
    c, batch = channels, 3
    x = _rand(batch, c, steps, seed=41) * 2
    x[1, c // 2, steps // 3:steps // 3 + 3] = 2e5
    a1, a2 = _rand(c, seed=42).exp(), _rand(c, seed=43).exp()
    b1, b2 = 1 / (_rand(c, seed=44).exp() + 1e-9), 1 / (_rand(c, seed=45).exp() + 1e-9)
    w_a, w_b = _rand(c, c, 7, seed=46) / (7 * c) ** 0.5, _rand(c, c, 1, seed=47) / c ** 0.5
    bias_a, bias_b = _rand(c, seed=48), _rand(c, seed=49)
    left = _rand(batch, c, 6 * dilation, seed=50)
    first = None
    for tail_in in (None, left):
        out, tail = ext.residual_unit(x, tail_in, a1, b1, w_a, bias_a, dilation, a2, b2, w_b, bias_b)
        want, want_tail = _unit_in_three_kernels(ext, x, tail_in, a1, b1, w_a, bias_a, dilation, a2, b2, w_b, bias_b)
        assert out.shape == x.shape and tail.shape == (batch, c, 6 * dilation)
        assert torch.equal(out, want) and torch.equal(tail, want_tail)
        one, one_tail = ext.residual_unit(x[2:].contiguous(), None if tail_in is None else tail_in[2:].contiguous(),
                                          a1, b1, w_a, bias_a, dilation, a2, b2, w_b, bias_b)
        assert torch.equal(one, out[2:]) and torch.equal(one_tail, tail[2:])
        first = out if first is None else first
    ref = x.double() + F.conv1d(_snake64(F.conv1d(F.pad(_snake64(x, a1, b1), (6 * dilation, 0)), w_a.double(),
                                                  bias_a.double(), dilation=dilation), a2, b2), w_b.double(), bias_b.double())
    rows = [0, 2]  # row 1 holds the out-of-range inputs
    torch.testing.assert_close(first.double()[rows], ref[rows], atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="residual_unit"):
        ext.residual_unit(x[:, :, ::2], None, a1, b1, w_a, bias_a, dilation, a2, b2, w_b, bias_b)
    with pytest.raises(RuntimeError, match="residual_unit"):
        ext.residual_unit(x, left[..., 1:].contiguous(), a1, b1, w_a, bias_a, dilation, a2, b2, w_b, bias_b)
    with pytest.raises(RuntimeError, match="residual_unit"):
        ext.residual_unit(x, None, a1[:-1], b1, w_a, bias_a, dilation, a2, b2, w_b, bias_b)
    with pytest.raises(RuntimeError, match="residual_unit"):
        ext.residual_unit(x[:, :4].contiguous(), None, a1[:4], b1[:4], w_a[:4, :4], bias_a[:4], dilation,
                          a2[:4], b2[:4], w_b[:4, :4], bias_b[:4])  # 4 channels: not a compiled width


def _snake64(x, alpha, inv_beta):
    x = x.double()
    return x + inv_beta.double()[None, :, None] * torch.sin(x * alpha.double()[None, :, None]) ** 2


@pytest.mark.parametrize("trimmed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("r,channels,steps", [(3, 8, 40), (8, 64, 5), (2, 16, 1)])
def test_upsample_taps_has_the_unfused_bits(ext, threads, trimmed, bias, r, channels, steps):
    """A transposed convolution's output from its taps: the bits of the PyTorch steps it replaces (the
    two taps' sum of a trimmed one, the interleaving copy, then the bias)."""
    k, batch = (2 * r if trimmed else r), 3
    z, b = _rand(batch, k * channels, steps, seed=7), _rand(channels, seed=8) if bias else None
    v = z.view(batch, k, channels, steps)
    if trimmed:
        v = v[:, :r, :, 1:] + v[:, r:, :, :-1]
    expected = v.permute(0, 2, 3, 1).reshape(batch, channels, -1)
    if b is not None:
        expected = expected + b[:, None]
    got = ext.upsample_taps(z, r, trimmed, b)
    assert got.shape == (batch, channels, (steps - trimmed) * r) and torch.equal(got, expected)
    assert torch.equal(ext.upsample_taps(z[1:2].contiguous(), r, trimmed, b), expected[1:2])  # a row alone


def test_upsample_taps_rejects_bad_shapes(ext):
    with pytest.raises(RuntimeError, match="taps"):
        ext.upsample_taps(_rand(1, 10, 4), 3, False, None)
    with pytest.raises(RuntimeError, match="bias"):
        ext.upsample_taps(_rand(1, 12, 4), 3, False, _rand(5))


def test_narrow_conv1d_rejects_bad_shapes(ext):
    x = _rand(1, 8, 100, seed=24)
    with pytest.raises(RuntimeError, match="narrow_conv1d"):
        ext.narrow_conv1d(x, _rand(4, 8, 7), None, 1)  # 4 outputs: not a compiled width
    with pytest.raises(RuntimeError, match="narrow_conv1d"):
        ext.narrow_conv1d(x, _rand(24, 8, 7), None, 1)  # nor 24
    with pytest.raises(RuntimeError, match="narrow_conv1d"):
        ext.narrow_conv1d(x, _rand(8, 7, 7), None, 1)  # input channels differ
    with pytest.raises(RuntimeError, match="narrow_conv1d"):
        ext.narrow_conv1d(x[:, :, :5].contiguous(), _rand(8, 8, 7), None, 1)  # shorter than the kernel
    with pytest.raises(RuntimeError, match="narrow_conv1d"):
        ext.narrow_conv1d(x, _rand(8, 8, 7), None, 1, _rand(1, 8, 93))  # residual of another length
