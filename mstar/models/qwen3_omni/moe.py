"""Sparse mixture-of-experts block of the Qwen3-Omni thinker and talker, over a flat token batch.

Routing (as the reference): ``softmax(x @ gate.T)`` in float32 -> top-k experts per token ->
weights renormalised to sum to 1 when ``norm_topk_prob`` -> cast back to the activations' dtype.
Each chosen expert is a SwiGLU: ``down(silu(g) * u)`` with ``[g, u] = x @ gate_up.T``.

Expert weights are fused in memory (the transformers 5.x layout):

    experts.gate_up_proj  [E, 2I, H]   rows 0..I-1 = expert e's gate_proj, rows I..2I-1 = its up_proj
    experts.down_proj     [E, H, I]

while checkpoints store them per expert (``experts.{e}.{gate,up,down}_proj.weight``); the loader
stacks them (``fuse_expert_weights``). The talker's block adds a dense ``shared_expert`` scaled by
``sigmoid(shared_expert_gate(x))`` to every token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.prepack import (
    PrepackableLinear,
    PrepackedGroup,
    PrepackedLinear,
    can_prepack,
    unchanged,
    versions,
)
from mstar.models.qwen3_omni import kernels

__all__ = ["Experts", "SparseMoeBlock", "SwiGLU", "route"]


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, HF parameter names (``gate_proj``, ``up_proj``, ``down_proj``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"bias": False, "dtype": dtype}
        self.gate_proj = PrepackableLinear(hidden_size, intermediate_size, **kw)
        self.up_proj = PrepackableLinear(hidden_size, intermediate_size, **kw)
        self.down_proj = PrepackableLinear(intermediate_size, hidden_size, **kw)

        self.prepacked: PrepackedGroup | None = None  # gate/up with SiLU-mul in one multiply (``prepack``)

    def prepack(self) -> bool:
        """gate/up as one prepacked multiply with the SiLU-mul fused (``mstar.layers.prepack``)."""
        self.prepacked = PrepackedGroup.build([self.gate_proj, self.up_proj], silu_mul=True)
        return self.prepacked is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.prepacked
        if pre is not None and x.dtype == self.gate_proj.weight.dtype and x.device.type == "cpu" and pre.fresh():
            return self.down_proj(pre(x))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in ``logits.dtype``, expert ids [T, k]) of router logits ``[T, E]``: softmax in
    float32, top-k, renormalised when ``normalize`` (the reference's steps). No compiled router: at
    the real model's 128 experts a fused kernel does not beat these operators at decode or prefill
    batch sizes, so the block keeps one path, the reference's."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts



class Experts(nn.Module):
    """``num_experts`` SwiGLU experts in two fused parameters (module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size, dtype=dtype))

        self.prepacked: list[tuple[PrepackedLinear, PrepackedLinear]] | None = None  # per expert (``prepack``)
        self._packed_from: tuple = ()
        # panel route: every expert's packed gate/up and down stacked, for the kernel's ``moe_experts``
        # (the per-expert packs are views of these)
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        self._kernel = None  # Qwen3-Omni's extension (``moe_experts``), looked up at packing

    def prepack(self) -> bool:
        """Each expert's gate/up (SiLU-mul fused) and down projections prepacked (``mstar.layers.prepack``)."""
        if not can_prepack(self.gate_up_proj, self.down_proj):
            return False
        self.prepacked = [(PrepackedLinear(self.gate_up_proj[e], silu_mul=True), PrepackedLinear(self.down_proj[e]))
                          for e in range(self.num_experts)]
        self._stacked = None
        if all(gu.mode == "panel" and dn.mode == "panel" for gu, dn in self.prepacked):
            self._stacked = (torch.stack([gu.packed for gu, _ in self.prepacked]),
                             torch.stack([dn.packed for _, dn in self.prepacked]))
            for e, (gu, dn) in enumerate(self.prepacked):
                gu.packed, dn.packed = self._stacked[0][e], self._stacked[1][e]
            self._kernel = kernels.ops()
        self._packed_from = versions(self.gate_up_proj, self.down_proj)
        return True

    def _fresh(self) -> list[tuple[PrepackedLinear, PrepackedLinear]] | None:
        """The prepacked experts, if both fused parameters are the ones packed, unchanged since."""
        if self.prepacked is None or not unchanged(self._packed_from, self.gate_up_proj, self.down_proj):
            return None
        return self.prepacked

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``x`` [T, H]; ``weights`` / ``experts`` [T, k] from ``route``. Tokens are grouped by expert:
        one matrix multiply per expert hit, results scaled and summed back per token."""
        pre = self._fresh() if x.dtype == self.gate_up_proj.dtype and x.device.type == "cpu" else None
        if pre is not None and self._stacked is not None and self._kernel is not None and weights.dtype == x.dtype:
            # the loop below in one kernel call, the same bits (``moe_experts``: one parallel region
            # over (expert, row chunk) tasks, no per-expert Python)
            return self._kernel.moe_experts(x.contiguous(), weights.contiguous(), experts.contiguous(),
                                            *self._stacked, self.intermediate_size)
        out = torch.zeros_like(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // experts.shape[1]
        weight_of = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token_of[start:start + n]
            if pre is not None:
                y = pre[e][1](pre[e][0](x[rows])) * weight_of[start:start + n, None]
            else:
                g, u = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(g) * u, self.down_proj[e]) * weight_of[start:start + n, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += n
        return out


class SparseMoeBlock(nn.Module):
    """Router (``gate``) + fused ``experts``, and the optional gated ``shared_expert``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool = True, shared_intermediate_size: int = 0, *,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = PrepackableLinear(hidden_size, num_experts, bias=False, dtype=dtype)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, dtype=dtype)
        if shared_intermediate_size > 0:
            self.shared_expert = SwiGLU(hidden_size, shared_intermediate_size, dtype=dtype)
            self.shared_expert_gate = PrepackableLinear(hidden_size, 1, bias=False, dtype=dtype)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.norm_topk_prob)
        out = self.experts(x, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
