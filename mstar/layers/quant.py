"""Block-quantized weights (llama.cpp's Q8_0, Q4_0, Q4_1) kept as stored and multiplied as stored.

A GGUF checkpoint stores most projections in blocks of 32 weights of one output feature (along the
input), each block a float16 scale ``d`` (and, for Q4_1, a float16 offset ``m``) and 32 small
integers: Q8_0 ``w = d q`` (q in [-127, 127]), Q4_0 ``w = d (q - 8)``, Q4_1 ``w = d q + m`` (q in
[0, 15]). ``QuantizedWeight`` holds such a matrix as the file's bytes (``[out, in / 32, block
bytes]``); ``QuantizedLinear`` multiplies by it without ever widening it to float32 in memory:

* with the compiled kernels (``mstar.layers.cpu_ops``, ``csrc/quant_linear.cpp``) the blocks are
  re-laid out once into column panels of the same size (``pack_quantized``), the input is quantized
  per row and block of 32 as llama.cpp does (``dx = max|x| / 127``, ``xq = round(x / dx)``, ties
  to even), each block's integer dot product is computed exactly (the CPU's u8 x s8 dot products,
  AVX512-VNNI, where it has them) and scaled into one float32 accumulator per output, blocks in
  order: a row's result is the same bits in any batch and at any thread count;
* without them, the same arithmetic in PyTorch (``reference_linear``), within float32 rounding of
  the kernel (the kernel's multiply-adds may be fused).

The input's quantization is where results part from a float32 multiply by the dequantized weights
(``QuantizedWeight.dequantize()``): about 1 / 254 of each block's largest input, the same order as
the weights' own quantization error (tests bound it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.layers.cpu_ops import ops

__all__ = ["BLOCK", "QUANT_KINDS", "QuantizedEmbedding", "QuantizedLinear", "QuantizedWeight", "pack_quantized",
           "quantize_rows", "reference_linear"]

BLOCK = 32  # weights per block, along the input
PANEL = 64  # output columns per packed panel (the kernel's)
# kind -> (the kernel's code, bytes per block in the file)
QUANT_KINDS: dict[str, tuple[int, int]] = {"Q8_0": (0, 34), "Q4_0": (1, 18), "Q4_1": (2, 20)}


@dataclass(frozen=True)
class QuantizedWeight:
    """A ``[out, in]`` matrix as a GGUF file stores it: ``blocks`` ``[out, in / 32, block bytes]``
    uint8, the blocks of each output row in input order."""

    kind: str
    blocks: torch.Tensor

    def __post_init__(self) -> None:
        if self.kind not in QUANT_KINDS:
            raise ValueError(f"unknown quantized kind {self.kind!r} (known: {', '.join(QUANT_KINDS)})")
        b = self.blocks
        if b.dtype != torch.uint8 or b.dim() != 3 or b.shape[2] != QUANT_KINDS[self.kind][1]:
            raise ValueError(f"{self.kind} blocks must be uint8 [out, in / 32, {QUANT_KINDS[self.kind][1]}], "
                             f"got {b.dtype} {list(b.shape)}")

    @classmethod
    def from_bytes(cls, kind: str, data: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
        """From a tensor's raw bytes (any shape, ``out * in / 32 * block bytes`` of them) and its
        ``(out, in)`` shape."""
        out, inp = shape
        if kind not in QUANT_KINDS:
            raise ValueError(f"unknown quantized kind {kind!r} (known: {', '.join(QUANT_KINDS)})")
        if inp % BLOCK:
            raise ValueError(f"a {kind} matrix's input size must be a multiple of {BLOCK}, got {inp}")
        return cls(kind, data.reshape(out, inp // BLOCK, QUANT_KINDS[kind][1]).contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.blocks.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def rows(self, index: torch.Tensor | list[int]) -> QuantizedWeight:
        """The output rows ``index`` (a permutation, a selection), still quantized."""
        return QuantizedWeight(self.kind, self.blocks[torch.as_tensor(index, dtype=torch.long)].contiguous())

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Output rows of several matrices of one kind and input size, stacked."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1 or len({p.blocks.shape[1] for p in parts}) != 1:
            raise ValueError("only matrices of one kind and input size stack")
        return QuantizedWeight(parts[0].kind, torch.cat([p.blocks for p in parts]))

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(q, d, m)``: the integers as stored in the kernel's operand (``[out, in / 32, 32]`` uint8:
        Q8_0's q + 128, Q4's q), the float32 scales and Q4_1's float32 offsets (``[out, in / 32]``)."""
        b = self.blocks
        d = b[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
        if self.kind == "Q8_0":
            q = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
            return q, d, None
        start = 2 if self.kind == "Q4_0" else 4
        qs = b[..., start:start + 16]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # element i < 16: low nibble of byte i, else high of i - 16
        m = b[..., 2:4].contiguous().view(torch.float16)[..., 0].float() if self.kind == "Q4_1" else None
        return q, d, m

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The matrix (or its output rows ``rows``) in float32, as the format defines its values."""
        w = self if rows is None else self.rows(rows)
        q, d, m = w.fields()
        if w.kind == "Q8_0":
            vals = (q.to(torch.int16) - 128).float() * d[..., None]
        elif w.kind == "Q4_0":
            vals = (q.float() - 8.0) * d[..., None]
        else:
            vals = q.float() * d[..., None] + m[..., None]
        return vals.reshape(vals.shape[0], -1)


def pack_quantized(weight: QuantizedWeight, *, silu_mul: bool = False) -> torch.Tensor:
    """The kernel's layout (``csrc/quant_linear.cpp``): ``[panels, in / 32, block bytes]`` uint8,
    64 output columns per panel (zero-padded). ``silu_mul``: ``weight`` holds ``[gate; up]`` rows
    and each panel takes 32 gate rows then the same 32 up rows, as the fused epilogue reads them."""
    w = weight
    n, nb = w.blocks.shape[0], w.blocks.shape[1]
    if silu_mul:
        if n % 2:
            raise ValueError("silu_mul needs [gate; up] rows")
        half = n // 2
        groups = (half + PANEL // 2 - 1) // (PANEL // 2)
        index = []
        for g in range(groups):
            cols = range(g * PANEL // 2, (g + 1) * PANEL // 2)
            index += [c if c < half else -1 for c in cols] + [half + c if c < half else -1 for c in cols]
        pad = torch.zeros(1, nb, w.blocks.shape[2], dtype=torch.uint8)
        blocks = torch.cat([w.blocks, pad])[torch.tensor(index)]  # -1: the zero block
        w = QuantizedWeight(w.kind, blocks)
        n = blocks.shape[0]
    panels = (n + PANEL - 1) // PANEL
    q, d, m = w.fields()
    pad = panels * PANEL - n
    if pad:
        q = torch.cat([q, q.new_zeros(pad, nb, BLOCK)])
        d = torch.cat([d, d.new_zeros(pad, nb)])
        m = None if m is None else torch.cat([m, m.new_zeros(pad, nb)])
    if w.kind == "Q8_0":  # [P, 64, nb, 8 quads, 4] -> [P, nb, 8, 64, 4]
        body = q.view(panels, PANEL, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(panels, nb, 8 * PANEL * 4)
    else:  # quad pairs: the first quad in the low nibbles, the second in the high
        pairs = q.view(panels, PANEL, nb, 4, 2, 4)
        byte = pairs[..., 0, :] | (pairs[..., 1, :] << 4)
        body = byte.permute(0, 2, 3, 1, 4).reshape(panels, nb, 4 * PANEL * 4)

    def half(t: torch.Tensor) -> torch.Tensor:  # [P * 64, nb] -> [P, nb, 128] bytes of float16
        return t.to(torch.float16).view(panels, PANEL, nb).permute(0, 2, 1).contiguous().view(torch.uint8)

    parts = [body, half(d)] + ([half(m)] if m is not None else [])
    return torch.cat(parts, dim=2).contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 of each row of ``x`` ``[M, K]``, per block of 32: ``(xq [M, K / 32, 32]``
    (integers, float32), ``dx [M, K / 32]``, ``sum of xq [M, K / 32]``); a block holding a NaN or
    an infinity gets ``dx = NaN``, as the kernel does."""
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    amax = xb.abs().amax(-1)
    finite = torch.isfinite(xb).all(-1)
    dx = amax / 127.0
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    xq = torch.round(xb * inv[..., None]).clamp(-127, 127)
    xq = torch.where(finite[..., None], xq, torch.zeros_like(xq))
    dx = torch.where(finite, dx, torch.full_like(dx, float("nan")))
    return xq, dx, xq.sum(-1)


def reference_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x @ W.T`` computed as the kernel computes it (module docstring), in PyTorch: float32, each
    block's integer dot product exact, blocks summed in order."""
    xq, dx, xs = quantize_rows(x)
    q, d, m = weight.fields()
    s = torch.einsum("mbk,nbk->mnb", xq, q.float())  # integers below 2^24: exact in float32
    shift = {"Q8_0": 128.0, "Q4_0": 8.0, "Q4_1": 0.0}[weight.kind]
    acc = x.new_zeros(x.shape[0], q.shape[0], dtype=torch.float32)
    for b in range(q.shape[1]):
        acc += (d[None, :, b] * dx[:, b, None]) * (s[:, :, b] - shift * xs[:, b, None])
        if m is not None:
            acc += m[None, :, b] * (dx[:, b] * xs[:, b])[:, None]
    return acc


class QuantizedLinear:
    """``x @ W.T`` for a ``QuantizedWeight`` ``W`` ``[out, in]``, as stored (module docstring), with
    ``PrepackedLinear``'s call: ``silu_mul=True`` (W holds ``[gate; up]`` rows: returns
    ``silu(gate) * up``), ``__call__(x, residual, bias)``. ``mode`` is ``"quant"``."""

    mode = "quant"

    def __init__(self, weight: QuantizedWeight, *, silu_mul: bool = False) -> None:
        self.kind = weight.kind
        self.silu_mul = silu_mul
        self.in_features = weight.shape[1]
        self.n_out = weight.shape[0] // (2 if silu_mul else 1)
        self._kernel = ops()
        if self._kernel is not None:
            self.packed = self._kernel.to_huge_pages(pack_quantized(weight, silu_mul=silu_mul))
            self.weight = None
        else:  # the PyTorch path reads the file's blocks
            self.packed = None
            self.weight = weight

    @property
    def nbytes(self) -> int:
        """Bytes this linear keeps in memory."""
        return self.packed.numel() if self.packed is not None else self.weight.nbytes

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        if x.dim() != 2 or not x.is_contiguous():
            x = x.reshape(-1, shape[-1]).contiguous()
        if self._kernel is not None and x.dtype in (torch.float32, torch.bfloat16):
            fuse = residual is not None and residual.dtype == x.dtype and residual.is_contiguous() and not self.silu_mul
            fuse_bias = (bias is not None and not self.silu_mul and bias.dtype == x.dtype and bias.dim() == 1
                         and bias.is_contiguous() and (residual is None or fuse))
            if bias is not None and not fuse_bias:
                fuse = False
            y = self._kernel.quant_linear(x, self.packed, QUANT_KINDS[self.kind][0], self.n_out, self.silu_mul,
                                          residual.reshape(-1, self.n_out) if fuse else None,
                                          bias if fuse_bias else None)
            if bias is not None and not fuse_bias:
                y.add_(bias)
            if residual is not None and not fuse:
                y = y + residual.reshape(y.shape)
        else:
            y = self._reference(x)
            if self.silu_mul:
                y = torch.nn.functional.silu(y[:, :self.n_out]) * y[:, self.n_out:]
            y = y.to(x.dtype)
            if bias is not None:
                y.add_(bias)
            if residual is not None:
                y = y + residual.reshape(y.shape)
        return y.view(*shape[:-1], y.shape[-1]) if len(shape) != 2 else y

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight is not None else self.unpacked()
        return reference_linear(x, weight)

    def unpacked(self) -> QuantizedWeight:
        """The weight as the file stores it (rows in their original order), rebuilt from the packed
        layout where only that is kept."""
        if self.weight is not None:
            return self.weight
        return unpack_quantized(self.packed, self.kind, self.n_out * (2 if self.silu_mul else 1), silu_mul=self.silu_mul)

    def columns(self, index: torch.Tensor) -> torch.Tensor:
        """Output features ``index`` of W as float32 rows ``[len(index), in]`` (an embedding lookup
        of a tied head), dequantized from what is kept."""
        if self.silu_mul:
            raise ValueError("columns() of a silu_mul linear is not defined")
        if self.weight is not None:
            return self.weight.dequantize(index)
        panels = self.packed[torch.div(index, PANEL, rounding_mode="floor")]  # [n, nb, block bytes]
        return _panel_columns(panels, index.remainder(PANEL), self.kind).dequantize()


def _panel_columns(panels: torch.Tensor, cols: torch.Tensor, kind: str) -> QuantizedWeight:
    """Column ``cols[i]`` of packed panel rows ``panels[i]`` ``[n, nb, block bytes]`` back in the
    file's block layout ``[n, nb, file block bytes]``."""
    n, nb = panels.shape[0], panels.shape[1]
    ar = torch.arange(n)
    if kind == "Q8_0":
        body = panels[..., :8 * PANEL * 4].reshape(n, nb, 8, PANEL, 4)[ar, :, :, cols]  # [n, nb, 8, 4]
        q = (body.reshape(n, nb, BLOCK).to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
        scales_at = 8 * PANEL * 4
    else:
        body = panels[..., :4 * PANEL * 4].reshape(n, nb, 4, PANEL, 4)[ar, :, :, cols]  # [n, nb, 4 pairs, 4]
        vals = torch.stack([body & 0x0F, body >> 4], dim=3).reshape(n, nb, BLOCK)  # input order
        q = vals[..., :16] | (vals[..., 16:] << 4)  # the file's nibble order
        scales_at = 4 * PANEL * 4
    halves = panels[..., scales_at:].reshape(n, nb, -1, PANEL, 2)[ar, :, :, cols]  # [n, nb, 1 or 2, 2]
    blocks = torch.cat([halves.reshape(n, nb, -1), q], dim=2)
    return QuantizedWeight(kind, blocks.contiguous())


def unpack_quantized(packed: torch.Tensor, kind: str, rows: int, *, silu_mul: bool = False) -> QuantizedWeight:
    """``pack_quantized``'s inverse: the file's blocks of the ``rows`` output rows."""
    panels = packed.shape[0]
    index = torch.arange(panels * PANEL)
    got = _panel_columns(packed[torch.div(index, PANEL, rounding_mode="floor")], index.remainder(PANEL), kind)
    if not silu_mul:
        return got.rows(torch.arange(rows))
    half = rows // 2
    col = torch.arange(half)
    at_gate = (col // (PANEL // 2)) * PANEL + col % (PANEL // 2)
    return got.rows(torch.cat([at_gate, at_gate + PANEL // 2]))


class QuantizedEmbedding(torch.nn.Module):
    """An embedding table kept quantized: ``forward(ids)`` dequantizes the rows asked for. It reads
    the table through a ``QuantizedLinear`` (the tied LM head's, where the model ties them)."""

    def __init__(self, table: QuantizedLinear) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.n_out, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.long)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        return self.table.columns(flat).view(*ids.shape, self.embedding_dim)
