"""Gemma building blocks and the PaliGemma prefix LLM (Gemma-2B in ``pi05_base``).

A layer is used in two halves, because the prefix and the action expert attend jointly over the
paged cache: ``GemmaLayer.qkv`` (input norm, projections, RoPE) and ``GemmaLayer.finish`` (output
projection, residual, post-attention norm, MLP, residual). The attention between them is the
caller's (``nodes.Pi05LLMNode``). Numerics follow the reference (lerobot's ``PiGemmaModel`` on
transformers 5.x): RMS statistics in float32, ``x * rsqrt(mean(x^2) + eps) * (1 + w)``, the gated
``down(gelu_tanh(gate(x)) * up(x))`` MLP, rotate-half RoPE, text embeddings scaled by ``sqrt(width)``.

Module names equal the checkpoint's (``layers.{i}.self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``, ...), so loading is a prefix replacement (``loader.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.prepack import PrepackedLinear, can_prepack
from mstar.models.pi05.config import GemmaConfig

__all__ = ["GemmaLayer", "GemmaMLP", "GemmaRMSNorm", "PaliGemmaPrefix", "Rotary", "rms_normalize"]


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps)``, the statistics in float32."""
    var = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
    return x * torch.rsqrt(var + eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the learned weight is an offset from 1."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, modulation: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(normed, gate)``; a plain norm has no gate (None)."""
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).type_as(x), None


class _Projections(nn.Module):
    """A module whose children are bias-free projections, optionally prepacked (``prepack()``,
    called through ``mstar.layers.prepack.prepack_linears``). A prepacked copy is
    used only while the weight it was packed from is unchanged; otherwise the plain ``nn.Linear``."""

    prepacked: dict[str, PrepackedLinear] | None = None

    def prepack(self) -> bool:
        linears = {n: m for n, m in self.named_children() if isinstance(m, nn.Linear)}
        if not can_prepack(*(m.weight for m in linears.values())):
            return False
        self.prepacked = {n: PrepackedLinear(m.weight) for n, m in linears.items()}
        return True

    def project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[n, in]`` through the projection ``name``."""
        linear = getattr(self, name)
        pre = self.prepacked.get(name) if self.prepacked else None
        return pre(x) if pre is not None and pre.fresh(linear.weight) else linear(x)


class GemmaMLP(_Projections):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.gelu(self.project("gate_proj", x), approximate="tanh")
        return self.project("down_proj", gate * self.project("up_proj", x))


class _Attention(_Projections):
    """The projections of one Gemma attention block (the attention itself runs over the paged cache)."""

    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.q_proj = nn.Linear(cfg.width, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.width, bias=False)


class Rotary:
    """Rotate-half RoPE tables: ``cos, sin`` ``[n, head_dim]`` for integer positions ``[n]``."""

    def __init__(self, head_dim: int, theta: float) -> None:
        # an explicit device: the table is computed here even when the module is laid out on "meta"
        steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
        self.inv_freq = 1.0 / (theta ** (steps / head_dim))

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[n, heads, head_dim]``; the tables broadcast over heads."""
        cos, sin = cos[:, None, :].to(x.device, x.dtype), sin[:, None, :].to(x.device, x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class GemmaLayer(nn.Module):
    """One decoder layer, split around the attention. ``norm`` builds its two norms (plain
    ``GemmaRMSNorm`` here; the expert's adaptive norm in ``expert.py``)."""

    def __init__(self, cfg: GemmaConfig, norm: type[nn.Module] = GemmaRMSNorm) -> None:
        super().__init__()
        self.cfg = cfg
        self.self_attn = _Attention(cfg)
        self.mlp = GemmaMLP(cfg.width, cfg.mlp_dim)
        self.input_layernorm = norm(cfg.width, cfg.rms_eps)
        self.post_attention_layernorm = norm(cfg.width, cfg.rms_eps)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, modulation: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``x`` ``[n, width]`` -> ``q [n, heads, d]``, ``k, v [n, kv_heads, d]`` (RoPE applied) and the
        input norm's gate (None for a plain norm)."""
        c, a = self.cfg, self.self_attn
        h, gate = self.input_layernorm(x, modulation)
        q = a.project("q_proj", h).view(-1, c.num_heads, c.head_dim)
        k = a.project("k_proj", h).view(-1, c.num_kv_heads, c.head_dim)
        v = a.project("v_proj", h).view(-1, c.num_kv_heads, c.head_dim)
        return Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin), v, gate

    def finish(self, x: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor | None,
               modulation: torch.Tensor | None = None) -> torch.Tensor:
        """``attn`` ``[n, heads, d]`` (the attention output) -> the layer's output ``[n, width]``."""
        out = self.self_attn.project("o_proj", attn.reshape(attn.shape[0], -1).to(x.dtype))
        x = x + out if gate is None else x + out * gate
        h, gate = self.post_attention_layernorm(x, modulation)
        out = self.mlp(h)
        return x + out if gate is None else x + out * gate


class PaliGemmaPrefix(nn.Module):
    """The prefix LLM: scaled token embeddings and the decoder layers. Only each layer's K/V are
    needed at inference (the suffix reads them), so the final ``norm`` is held for the checkpoint
    but never applied, and the last layer's post-attention half is skipped for prefix tokens."""

    def __init__(self, cfg: GemmaConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(vocab_size, cfg.width)
        self.layers = nn.ModuleList(GemmaLayer(cfg) for _ in range(cfg.depth))
        self.norm = GemmaRMSNorm(cfg.width, cfg.rms_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def embed_text(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` ids -> ``[n, width]`` embeddings times ``sqrt(width)`` (rounded to the weight dtype
        first, as transformers' ``GemmaTextScaledWordEmbedding``)."""
        w = self.embed_tokens.weight
        return self.embed_tokens(token_ids.to(w.device)) * torch.tensor(self.cfg.width ** 0.5).to(w.device, w.dtype)
