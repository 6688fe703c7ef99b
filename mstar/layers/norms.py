"""``RMSNorm``: the root-mean-square norm of the Llama-style families (Llama, Orpheus, BAGEL,
Qwen3-Omni), and ``PrepackableLayerNorm`` (V-JEPA 2-AC), both through the compiled kernels
(``mstar.layers.cpu_ops``) once ``prepack()`` ran."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mstar.layers.cpu_ops import ops

__all__ = ["PrepackableLayerNorm", "RMSNorm"]

_COMPILED_DTYPES = (torch.float32, torch.bfloat16)  # what the compiled norm takes


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in float32, the weight applied in the input's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps
        self.compiled = False  # through the compiled kernel (``prepack``)
        self._kernel: Any = None

    def prepack(self) -> bool:
        """Use the compiled RMSNorm (``mstar.layers.cpu_ops``) for float32 CPU inputs from now on."""
        self._kernel = ops()  # looked up once: ops() reads the environment at every call
        self.compiled = self._kernel is not None
        return self.compiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compiled and x.dtype in _COMPILED_DTYPES and self.weight.dtype == x.dtype and x.device.type == "cpu":
            if (x.dim() == 2 and x.is_contiguous()) or (x.dim() == 3 and x.stride(2) == 1
                                                        and x.stride(1) == x.shape[2] and x.stride(0) >= x.shape[1] * x.shape[2]):
                # a matrix, or per-head q/k norms [T, heads, D] over a view of a fused projection
                return self._kernel.rms_norm(x, self.weight, self.eps)
            # any other layout: one copy into rows, then the kernel
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return self._kernel.rms_norm(rows, self.weight, self.eps).view(x.shape)
        if x.dtype == torch.float32:  # the same arithmetic without the (no-op) casts' dispatch cost
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        in_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(in_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class PrepackableLayerNorm(nn.LayerNorm):
    """An ``nn.LayerNorm`` (same parameters and state-dict names) whose ``prepack()`` sends float32
    rows ``[L, H]`` of an affine norm through the compiled LayerNorm: a row's result does not depend
    on the batch, and is within float32 rounding of ``nn.LayerNorm``'s (which sums in another order).
    Other inputs (3-D, another dtype or device) take ``nn.LayerNorm``'s path."""

    _kernel: Any = None

    def prepack(self) -> bool:
        if self.weight is None or self.bias is None or len(self.normalized_shape) != 1:
            return False
        self._kernel = ops()  # looked up once: ops() reads the environment at every call
        return self._kernel is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self._kernel
        if (k is not None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
                and x.device.type == "cpu" and self.weight.dtype == torch.float32):
            return k.layer_norm(x, self.weight, self.bias, self.eps)
        return super().forward(x)
