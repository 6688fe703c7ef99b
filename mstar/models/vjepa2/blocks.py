"""The transformer block V-JEPA 2's encoder and predictor share (names: norm1, attn.qkv, attn.proj,
norm2, mlp.fc1/fc2[/fc3], as Meta's state dicts).

Attention is plain scaled dot product (scale ``head_dim ** -0.5``); the predictor masks it frame-causally:
a token of frame ``t`` sees every token of frames ``0..t`` (its own frame bidirectionally).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.cpu_ops import ops
from mstar.layers.norms import PrepackableLayerNorm
from mstar.layers.prepack import PrepackableLinear, hooked
from mstar.models.vjepa2.config import swiglu_hidden
from mstar.models.vjepa2.rope import rotate

__all__ = ["Attention", "Block", "GeluMLP", "LeanBlock", "SwiGLUMLP"]


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qkv_bias: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = PrepackableLinear(dim, 3 * dim, bias=qkv_bias)
        self.proj = PrepackableLinear(dim, dim)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # fused qkv: output channels are [3, heads, head_dim]
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def qkv_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``q, k, v`` of tokens ``x`` [L, dim] as rows [L, heads, head_dim] (views of one projection
        output), q and k rotated: the values of ``_qkv``. float32 on a CPU with the compiled kernels:
        rotated in place by ``rotary_pairs_`` (PyTorch's rounding, the same bits)."""
        ext = ops()
        if (ext is not None and x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu"
                and cos.dtype == torch.float32 and sin.dtype == torch.float32 and cos.is_contiguous()
                and sin.is_contiguous()):
            y = self.qkv(x)
            if y.dim() == 2 and y.stride(1) == 1 and y.dtype == torch.float32:
                ext.rotary_pairs_(y, cos, sin, 2 * self.num_heads, self.head_dim)
                y = y.unflatten(1, (3, self.num_heads, self.head_dim))
                return y[:, 0], y[:, 1], y[:, 2]
        q, k, v = self._qkv(x.unsqueeze(0), cos, sin)  # [1, heads, L, head_dim]
        return q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        return self.proj(o.transpose(1, 2).flatten(2))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self._qkv(x, cos, sin)
        return self._out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))



class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = PrepackableLinear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = PrepackableLinear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SwiGLUMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, wide_silu: bool) -> None:
        super().__init__()
        inner = swiglu_hidden(hidden, wide_silu)
        self.fc1 = PrepackableLinear(dim, inner)
        self.fc2 = PrepackableLinear(dim, inner)
        self.fc3 = PrepackableLinear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.silu(self.fc1(x)) * self.fc2(x))


@dataclass(frozen=True)
class LeanBlock:
    """``Block.forward_rows`` as direct kernel calls (``Block.lean``): the same calls with the same
    arguments, so the same bits, without the modules' calls and checks. Each linear is ``(kernel,
    packed weight, output columns, bias or None)``, each norm ``(kernel, weight, bias, eps)``."""

    norm1: tuple
    qkv: tuple
    heads: int
    head_dim: int
    proj: tuple
    norm2: tuple
    fc1: tuple
    fc2: tuple

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x: float32 contiguous [L, dim]; cos / sin float32 contiguous (``Block.lean``'s caller checks)."""
        (n1, w1, b1, e1), (n2, w2, b2, e2) = self.norm1, self.norm2
        kq, pq, nq, bq = self.qkv
        y = kq.linear(n1.layer_norm(x, w1, b1, e1), pq, nq, False, None, bq)
        kq.rotary_pairs_(y, cos, sin, 2 * self.heads, self.head_dim)
        y = y.unflatten(1, (3, self.heads, self.head_dim))
        o = attend(y[:, 0], y[:, 1], y[:, 2])
        kp, pp, np_, bp = self.proj
        x = kp.linear(o.reshape(o.shape[0], -1), pp, np_, False, x, bp)
        k1, p1, m1, c1 = self.fc1
        k2, p2, m2, c2 = self.fc2
        return k2.linear(k1.linear(n2.layer_norm(x, w2, b2, e2), p1, m1, False, None, c1, True), p2, m2, False, x, c2)


def _lean_linear(lin: PrepackableLinear) -> tuple | None:
    pre, b = lin.prepacked, lin.bias
    if (pre is None or pre.mode != "panel" or pre.silu_mul or not pre.fresh(lin.weight)
            or lin.weight.dtype != torch.float32
            or (b is not None and not (b.dtype == torch.float32 and b.dim() == 1 and b.is_contiguous()))):
        return None
    return pre._kernel, pre.packed, pre.n_out, b


def _lean_norm(norm: nn.Module) -> tuple | None:
    k = getattr(norm, "_kernel", None)
    if k is None or norm.weight is None or norm.weight.dtype != torch.float32 or norm.bias.dtype != torch.float32:
        return None
    return k, norm.weight, norm.bias, norm.eps


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, qkv_bias: bool, use_silu: bool,
                 wide_silu: bool, eps: float) -> None:
        super().__init__()
        self.norm1 = PrepackableLayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads, qkv_bias)
        self.norm2 = PrepackableLayerNorm(dim, eps=eps)
        self.mlp: nn.Module = SwiGLUMLP(dim, mlp_hidden, wide_silu) if use_silu else GeluMLP(dim, mlp_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


    def lean(self) -> LeanBlock | None:
        """This block's ``forward_rows`` as direct kernel calls (the same bits), or None where it would
        not take the kernels: a hook on any of its modules, a weight not prepacked or changed since,
        a SwiGLU MLP or a tanh GELU, norms without the compiled kernel."""
        attn, mlp = self.attn, self.mlp
        if (not isinstance(mlp, GeluMLP) or mlp.act.approximate != "none"
                or hooked(self, attn, mlp, self.norm1, self.norm2, attn.qkv, attn.proj, mlp.fc1, mlp.act, mlp.fc2)):
            return None
        parts = (_lean_norm(self.norm1), _lean_linear(attn.qkv), _lean_linear(attn.proj), _lean_norm(self.norm2),
                 _lean_linear(mlp.fc1), _lean_linear(mlp.fc2))
        if any(p is None for p in parts):
            return None
        n1, qkv, proj, n2, fc1, fc2 = parts
        return LeanBlock(n1, qkv, attn.num_heads, attn.head_dim, proj, n2, fc1, fc2)

    def forward_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The block over tokens ``x`` [L, dim] with ``attend(q, k, v)`` on rows [L, heads, head_dim]
        (the runtime's paged attention): ``forward``'s values. The projections after attention and the
        MLP go through their prepacked weights with bias and residual in the kernel's store, and the
        GELU MLP's activation in its first projection's store (within float32 rounding of ``nn.GELU``,
        not its bits), unless a hook is registered on them (then the modules run)."""
        attn, mlp = self.attn, self.mlp
        q, k, v = attn.qkv_rows(self.norm1(x), cos, sin)
        o = attend(q, k, v)
        x = attn.proj.forward_plus(o.reshape(o.shape[0], -1), x)
        if isinstance(mlp, GeluMLP) and not hooked(mlp, mlp.act) and mlp.act.approximate == "none":
            return mlp.fc2.forward_plus(mlp.fc1.forward_gelu(self.norm2(x)), x)
        return x + mlp(self.norm2(x))
