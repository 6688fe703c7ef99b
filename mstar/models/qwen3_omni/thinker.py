"""Qwen3-Omni's MoE decoder over the runtime's paged KV cache, and the thinker (decoder + LM head).

Every block works on a flat token batch ``[T, hidden]`` (all requests' new tokens concatenated; rows
and cache slots described by the ``EngineInputs`` the runtime builds), like ``mstar.layers.llama``.

Attention: q/k/v projections, per-head RMSNorm of q and k (``q_norm``, ``k_norm``, over head_dim),
then rotary embedding, then paged attention (GQA).

Interleaved M-RoPE (``MRotary``): each token has three position ids (temporal, height, width; for
text all three equal the 1-D position). The ``head_dim / 2`` frequencies are assigned to the axes
round-robin, T H W T H W ..., for the first ``3 * mrope_section[1]`` (H) and ``3 * mrope_section[2]``
(W) slots; every other slot is temporal::

    slot   0 1 2 3 4 5 6 7 ...           (mrope_section [4, 2, 2], head_dim 16: 8 slots)
    axis   T H W T H W T T

then the slot angles are repeated twice along head_dim (rotate-half convention).

``MoeDecoder.forward`` returns the final-normed hidden states and, on request, the output of one
decoder layer before the final norm (the talker's ``accept_hidden_layer`` conditioning).
Parameter names follow the checkpoint without its ``thinker.`` prefix (``model.layers.{i}...``,
``lm_head.weight``), with the experts fused (``mstar.models.qwen3_omni.moe``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.layers.attention_backends import AttentionBackend, default_backend
from mstar.layers.cpu_ops import ops
from mstar.layers.llama import y_rotatable
from mstar.layers.norms import RMSNorm
from mstar.layers.paged_attention import paged_attention
from mstar.layers.prepack import PrepackableLinear, PrepackedGroup
from mstar.layers.rotary import apply_rotary, compute_inv_freq
from mstar.models.qwen3_omni.config import MoeTextConfig
from mstar.models.qwen3_omni.moe import SparseMoeBlock, SwiGLU

__all__ = ["DecoderOutput", "MRotary", "MoeDecoder", "MoeDecoderLayer", "QKNormAttention", "ThinkerLM",
           "mrope_positions"]


class MRotary:
    """cos/sin ``[T, head_dim]`` of interleaved M-RoPE (module docstring); no section: plain 1-D RoPE."""

    def __init__(self, head_dim: int, theta: float, section: Sequence[int] = ()) -> None:
        self.inv_freq = compute_inv_freq(head_dim, theta)
        self.section = tuple(section)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # float32 cos/sin of 0..n-1

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions``: int ``[T]`` (text: the same id on every axis) or ``[3, T]`` (T, H, W ids).
        Text positions (one id on every axis: every decode step) are rows of a table of cos/sin made
        once (grown as positions grow), the values ``_compute`` gives them."""
        ids = self._text_ids(positions)
        if ids is None or ids.numel() == 0:
            return self._compute(positions, dtype)
        lo, hi = torch.aminmax(ids)
        if int(lo) < 0:
            return self._compute(positions, dtype)
        cos, sin = self._table(int(hi) + 1, positions.device)
        return cos[ids].to(dtype), sin[ids].to(dtype)

    def _text_ids(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The ids of positions that are the same on every axis (or read on one), else None."""
        if positions.dim() == 1:
            return positions
        if not self.section or positions.stride(0) == 0:  # 1-D RoPE reads the temporal ids; an expanded row
            return positions[0]
        if positions.shape[0] == 3 and torch.equal(positions[0], positions[1]) and torch.equal(positions[0], positions[2]):
            return positions[0]
        return None

    def _table(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables.get(device)
        if table is None or table[0].shape[0] < n:
            size = max(64, 1 << (n - 1).bit_length())
            table = self._tables[device] = self._compute(torch.arange(size, device=device), torch.float32)
        return table

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = positions.to(torch.float32)
        if pos.dim() == 2 and not self.section:  # 1-D RoPE reads the temporal ids
            pos = pos[0]
        inv = self.inv_freq.to(positions.device)
        if pos.dim() == 1:
            freqs = pos[:, None] * inv[None, :]
        else:
            axes = pos[:, :, None] * inv[None, None, :]  # [3, T, D/2]
            freqs = axes[0].clone()
            for axis in (1, 2):
                idx = slice(axis, 3 * self.section[axis], 3)
                freqs[:, idx] = axes[axis][:, idx]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_positions(ids: torch.Tensor, image_grids: torch.Tensor | None, image_token: int,
                    merge: int, per_second: int) -> tuple[torch.Tensor, int]:
    """(positions ``[3, P]``, delta) of a prompt as the reference's ``get_rope_index`` gives them for
    text, audio and images: every non-image token takes the next position on all three axes; the
    run of image i's tokens takes ``next + (t * per_second, h, w)`` over its merged ``(t, h/merge,
    w/merge)`` grid, and the next position continues after the largest. ``delta`` = the largest
    position + 1 - P: the cache offset + delta is the position of every later token."""
    out = torch.empty(3, ids.numel(), dtype=torch.long)
    nxt, i, image = 0, 0, 0
    tokens = ids.tolist()
    starts = (ids == image_token).nonzero().reshape(-1).tolist()  # image placeholders, in order
    while i < len(tokens):
        if tokens[i] != image_token:  # the text run up to the next placeholder: consecutive positions
            k = bisect.bisect_right(starts, i)
            end = starts[k] if k < len(starts) else len(tokens)
            out[:, i:end] = torch.arange(nxt, nxt + end - i)
            nxt, i = nxt + end - i, end
            continue
        if image_grids is None or image >= image_grids.shape[0]:
            raise ValueError("the prompt has more image placeholders than images")
        t, h, w = (int(x) for x in image_grids[image])
        h, w = h // merge, w // merge
        grid = torch.stack(torch.meshgrid(torch.arange(t) * per_second, torch.arange(h), torch.arange(w),
                                          indexing="ij")).reshape(3, -1)
        if tokens[i:i + grid.shape[1]] != [image_token] * grid.shape[1]:
            raise ValueError(f"image {image} needs {grid.shape[1]} placeholders in a row")
        out[:, i:i + grid.shape[1]] = grid + nxt
        nxt, i, image = int(out[:, i:i + grid.shape[1]].max()) + 1, i + grid.shape[1], image + 1
    return out, nxt - ids.numel()


class QKNormAttention(nn.Module):
    """GQA attention with q/k RMSNorm over head_dim, attending through layer ``layer_idx``'s cache."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 layer_idx: int, *, dtype: torch.dtype | None = None,
                 backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.backend = backend
        kw = {"bias": False, "dtype": dtype}
        self.q_proj = PrepackableLinear(hidden_size, num_heads * head_dim, **kw)
        self.k_proj = PrepackableLinear(hidden_size, num_kv_heads * head_dim, **kw)
        self.v_proj = PrepackableLinear(hidden_size, num_kv_heads * head_dim, **kw)
        self.o_proj = PrepackableLinear(num_heads * head_dim, hidden_size, **kw)
        self.q_norm = RMSNorm(head_dim, eps, dtype=dtype)
        self.k_norm = RMSNorm(head_dim, eps, dtype=dtype)
        self.prepacked: PrepackedGroup | None = None  # q/k/v in one multiply (``prepack``)

    def prepack(self) -> bool:
        """q/k/v as one prepacked multiply (``mstar.layers.prepack``); o is a ``PrepackableLinear``."""
        self.prepacked = PrepackedGroup.build([self.q_proj, self.k_proj, self.v_proj])
        return self.prepacked is not None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotated q ``[T, Hq, D]``, k ``[T, Hkv, D]`` and v ``[T, Hkv, D]``."""
        t = x.shape[0]
        pre = self.prepacked
        if pre is not None and pre.fresh() and x.dtype == self.q_proj.weight.dtype and y_rotatable(x, cos, sin):
            nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            y = pre(x)  # [T, nq + 2 nkv]: normed into fresh q and k rows, rotated in place by the kernel
            q = self.q_norm(y[:, :nq].view(t, self.num_heads, self.head_dim)).view(t, nq)
            k = self.k_norm(y[:, nq:nq + nkv].view(t, self.num_kv_heads, self.head_dim)).view(t, nkv)
            ops().rotary_(q, cos, sin, self.num_heads, self.head_dim)
            ops().rotary_(k, cos, sin, self.num_kv_heads, self.head_dim)
            return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                    y[:, nq + nkv:].view(t, self.num_kv_heads, self.head_dim))
        q = apply_rotary(self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rotary(self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)), cos, sin)
        return q, k, self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, engine_inputs: Any) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        k_cache, v_cache = engine_inputs.kv_caches[self.layer_idx]
        meta, scale = engine_inputs.attention, self.head_dim ** -0.5
        if self.backend is None:
            out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=scale)
        else:
            out = self.backend.forward(q, k, v, k_cache, v_cache, meta, scale=scale)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))


class MoeDecoderLayer(nn.Module):
    """Pre-norm attention and (MoE or dense) MLP blocks, each with a residual connection."""

    def __init__(self, cfg: MoeTextConfig, layer_idx: int, *, dtype: torch.dtype | None = None,
                 backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.self_attn = QKNormAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                         cfg.head_dim, cfg.rms_norm_eps, layer_idx, dtype=dtype, backend=backend)
        if cfg.is_sparse(layer_idx):
            self.mlp: nn.Module = SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                                 cfg.moe_intermediate_size, cfg.norm_topk_prob,
                                                 cfg.shared_expert_intermediate_size, dtype=dtype)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, engine_inputs: Any) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, engine_inputs)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class DecoderOutput:
    hidden: torch.Tensor  # [T, hidden], after the final norm
    captured: torch.Tensor | None = None  # [T, hidden], output of the requested layer (pre-norm)


class MoeDecoder(nn.Module):
    """Decoder layers + final norm over ``inputs_embeds`` (the embedding table belongs to the caller:
    the thinker's ``embed_tokens``, the talker's ``codec_embedding``)."""

    def __init__(self, cfg: MoeTextConfig, *, dtype: torch.dtype | None = None,
                 backend: AttentionBackend | None = None) -> None:
        super().__init__()
        backend = default_backend() if backend is None else backend
        self.layers = nn.ModuleList([MoeDecoderLayer(cfg, i, dtype=dtype, backend=backend)
                                     for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.rotary = MRotary(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)

    def run(self, h: torch.Tensor, engine_inputs: Any, capture: int | None = None,
            mrope_positions: torch.Tensor | None = None,
            deepstack: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> DecoderOutput:
        """``capture`` k: also return the output of decoder layer k-1 (0: the inputs; the last layer's
        output is returned normed, as the reference's last hidden state). ``mrope_positions`` [3, T]
        replaces the 1-D ``engine_inputs.positions`` for the rotary embedding (images, audio).
        ``deepstack[i] = (rows, embeds)`` is added to layer i's output at those rows."""
        positions = engine_inputs.positions if mrope_positions is None else mrope_positions
        if positions is None or positions.shape[-1] != h.shape[0]:
            raise ValueError(f"need one position per token ({h.shape[0]})")
        cos, sin = self.rotary(positions.to(h.device), h.dtype)
        captured = h if capture == 0 else None
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, engine_inputs)
            if capture == i + 1 and capture < len(self.layers):
                captured = h  # the layer's own output, before the deepstack features (as the reference records it)
            if i < len(deepstack):
                rows, embeds = deepstack[i]
                h = h.index_add(0, rows.to(h.device), embeds.to(h))
        out = self.norm(h)
        return DecoderOutput(out, out if capture == len(self.layers) else captured)


class _ThinkerBody(MoeDecoder):
    """``embed_tokens`` + the decoder: the checkpoint's ``thinker.model.*`` names."""

    def __init__(self, cfg: MoeTextConfig, *, dtype: torch.dtype | None = None,
                 backend: AttentionBackend | None = None) -> None:
        super().__init__(cfg, dtype=dtype, backend=backend)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)


class ThinkerLM(nn.Module):
    """The thinker's language model: ``model`` (embeddings + decoder) and ``lm_head``."""

    def __init__(self, cfg: MoeTextConfig, *, dtype: torch.dtype | None = None,
                 backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = _ThinkerBody(cfg, dtype=dtype, backend=backend)
        self.lm_head = PrepackableLinear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids.to(self.lm_head.weight.device))

    def forward(self, inputs_embeds: torch.Tensor, engine_inputs: Any, capture: int | None = None,
                **kw: Any) -> DecoderOutput:
        """Normed hidden states of the new tokens (and the captured layer's); logits via ``lm_head``."""
        return self.model.run(inputs_embeds, engine_inputs, capture, **kw)
