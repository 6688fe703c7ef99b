"""BAGEL's Mixture-of-Transformers (MoT) LLM over the runtime's paged KV cache.

Every decoder layer holds two weight sets: the understanding set (text and ViT tokens) and the
generation set (VAE latent tokens, parameter names suffixed ``_moe_gen``). Each token of the flat
batch ``x [T, hidden]`` goes through the norms, q/k/v/o projections, q/k norms and MLP of its own
set (chosen by the boolean ``gen_mask [T]``, True = generation token), while attention is ONE
paged attention over all tokens together.

Parameter names equal the checkpoint's after stripping ``language_model.``::

    model.embed_tokens.weight
    model.layers.{i}.self_attn.{q,k,v}_proj[_moe_gen].{weight,bias}
    model.layers.{i}.self_attn.o_proj[_moe_gen].weight
    model.layers.{i}.self_attn.{q,k}_norm[_moe_gen].weight          (qk_norm only)
    model.layers.{i}.mlp[_moe_gen].{gate,up,down}_proj.weight
    model.layers.{i}.{input,post_attention}_layernorm[_moe_gen].weight
    model.norm[_moe_gen].weight
    lm_head.weight
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.layers.attention_backends import AttentionBackend, default_backend
from mstar.layers.llama import LlamaMLP, token_embedding
from mstar.layers.norms import RMSNorm
from mstar.layers.prepack import PrepackableLinear
from mstar.layers.rotary import RotaryEmbedding, apply_rotary
from mstar.model.submodule import KVSpec
from mstar.models.bagel.config import BagelLLMConfig

__all__ = ["MoTAttention", "MoTDecoderLayer", "MoTLLM", "MoTModel", "MoTRouting"]

GEN_SUFFIX = "_moe_gen"


@dataclass(frozen=True)
class MoTRouting:
    """Which rows of a flat token batch use which weight set; build once per forward, reuse in every layer.

    ``kind`` is ``"und"`` (all understanding), ``"gen"`` (all generation) or ``"mixed"`` (then
    ``und_idx``/``gen_idx`` hold the int64 rows of each set).
    """

    kind: str
    num_tokens: int
    und_idx: torch.Tensor | None = None
    gen_idx: torch.Tensor | None = None

    @classmethod
    def from_mask(cls, gen_mask: torch.Tensor | None, num_tokens: int) -> MoTRouting:
        if gen_mask is None:
            return cls("und", num_tokens)
        if gen_mask.dtype != torch.bool or gen_mask.shape != (num_tokens,):
            raise ValueError(f"gen_mask must be a bool tensor of shape ({num_tokens},), got "
                             f"{gen_mask.dtype} {tuple(gen_mask.shape)}")
        gen_idx = gen_mask.nonzero().squeeze(1)
        n_gen = gen_idx.numel()
        if n_gen == 0:
            return cls("und", num_tokens)
        if n_gen == num_tokens:
            return cls("gen", num_tokens)
        return cls("mixed", num_tokens, (~gen_mask).nonzero().squeeze(1), gen_idx)

    def apply(self, x: torch.Tensor, f_und: Callable[[torch.Tensor], torch.Tensor],
              f_gen: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Row ``t`` of the result is ``f(x[t])`` with ``f`` the function of token ``t``'s set (``f`` acts
        row-wise on dim 0)."""
        if self.kind == "und":
            return f_und(x)
        if self.kind == "gen":
            return f_gen(x)
        n_und = self.und_idx.numel()
        if 4 * n_und <= self.num_tokens or 4 * (self.num_tokens - n_und) <= self.num_tokens:
            # one set holds few rows (an image block's start/end tokens): run the other set's function
            # on every row, then redo those few rows -- two small ops instead of two full-size copies
            und_few = 2 * n_und <= self.num_tokens
            f_most, f_few = (f_gen, f_und) if und_few else (f_und, f_gen)
            few = self.und_idx if und_few else self.gen_idx
            out = f_most(x)
            out.index_copy_(0, few, f_few(x.index_select(0, few)).to(out.dtype))
            return out
        out_und = f_und(x.index_select(0, self.und_idx))
        out_gen = f_gen(x.index_select(0, self.gen_idx))
        out = out_und.new_empty((self.num_tokens, *out_und.shape[1:]))
        out.index_copy_(0, self.und_idx, out_und)
        out.index_copy_(0, self.gen_idx, out_gen.to(out.dtype))
        return out


def _routing(gen_mask: torch.Tensor | MoTRouting | None, num_tokens: int) -> MoTRouting:
    if isinstance(gen_mask, MoTRouting):
        if gen_mask.num_tokens != num_tokens:
            raise ValueError(f"routing is for {gen_mask.num_tokens} tokens, the batch has {num_tokens}")
        return gen_mask
    return MoTRouting.from_mask(gen_mask, num_tokens)


class MoTAttention(nn.Module):
    """GQA self-attention of layer ``layer_idx`` with per-token q/k/v/o (and q/k norm) weight sets."""

    def __init__(self, cfg: BagelLLMConfig, layer_idx: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scaling = self.head_dim ** -0.5
        self.backend = default_backend() if backend is None else backend
        self.qk_norm = cfg.qk_norm
        kw = {"dtype": dtype, "device": device}
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for sfx in ("", GEN_SUFFIX):
            setattr(self, f"q_proj{sfx}", PrepackableLinear(cfg.hidden_size, q_out, bias=True, **kw))
            setattr(self, f"k_proj{sfx}", PrepackableLinear(cfg.hidden_size, kv_out, bias=True, **kw))
            setattr(self, f"v_proj{sfx}", PrepackableLinear(cfg.hidden_size, kv_out, bias=True, **kw))
            setattr(self, f"o_proj{sfx}", PrepackableLinear(q_out, cfg.hidden_size, bias=False, **kw))
            if self.qk_norm:
                setattr(self, f"q_norm{sfx}", RMSNorm(self.head_dim, cfg.rms_norm_eps, **kw))
                setattr(self, f"k_norm{sfx}", RMSNorm(self.head_dim, cfg.rms_norm_eps, **kw))

    def shard_tp(self, tp: Any) -> None:
        """Keep this rank's heads of both weight sets (``mstar.layers.tensor_parallel``): q/k/v and
        their biases column-parallel by whole heads, o row-parallel, the output summed over the group;
        the q/k norms act per head and stay as they are."""
        from mstar.layers.tensor_parallel import column_shard, head_shard, row_shard

        s, d = head_shard(self.num_heads, self.num_kv_heads, tp), self.head_dim
        for sfx in ("", GEN_SUFFIX):
            for name, start, n in (("q", s.q0, s.nq), ("k", s.kv0, s.nkv), ("v", s.kv0, s.nkv)):
                proj = f"{name}_proj{sfx}"
                setattr(self, proj, column_shard(getattr(self, proj), start * d, n * d))
            setattr(self, f"o_proj{sfx}", row_shard(getattr(self, f"o_proj{sfx}"), s.q0 * d, s.nq * d, tp))
        self.num_heads, self.num_kv_heads = s.nq, s.nkv
        self.register_forward_hook(tp.reduce_output)

    def _qkv(self, x: torch.Tensor, gen: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sfx = GEN_SUFFIX if gen else ""
        t = x.shape[0]
        q = getattr(self, f"q_proj{sfx}")(x).view(t, self.num_heads, self.head_dim)
        k = getattr(self, f"k_proj{sfx}")(x).view(t, self.num_kv_heads, self.head_dim)
        v = getattr(self, f"v_proj{sfx}")(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = getattr(self, f"q_norm{sfx}")(q)
            k = getattr(self, f"k_norm{sfx}")(k)
        return q, k, v

    def forward(self, x: torch.Tensor, gen_mask: torch.Tensor | MoTRouting | None, cos: torch.Tensor,
                sin: torch.Tensor, engine_inputs: Any) -> torch.Tensor:
        """``x`` ``[T, hidden]`` (already normed by each token's set); ``cos``/``sin`` ``[T, head_dim]``."""
        t = x.shape[0]
        route = _routing(gen_mask, t)
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim

        def packed(gen: bool) -> Callable[[torch.Tensor], torch.Tensor]:
            def f(rows: torch.Tensor) -> torch.Tensor:
                q, k, v = self._qkv(rows, gen)
                return torch.cat([q.reshape(-1, nq), k.reshape(-1, nkv), v.reshape(-1, nkv)], dim=-1)
            return f

        qkv = route.apply(x, packed(False), packed(True))
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        q = apply_rotary(q.reshape(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.reshape(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = engine_inputs.kv_caches[self.layer_idx]
        meta = engine_inputs.attention
        out = self.backend.forward(q, k, v, k_cache, v_cache, meta, scale=self.scaling)
        return route.apply(out.reshape(t, nq), self.o_proj, self.o_proj_moe_gen)


class MoTDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals; norms and MLP per token set."""

    def __init__(self, cfg: BagelLLMConfig, layer_idx: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.self_attn = MoTAttention(cfg, layer_idx, backend=backend, **kw)
        for sfx in ("", GEN_SUFFIX):
            setattr(self, f"mlp{sfx}", LlamaMLP(cfg.hidden_size, cfg.intermediate_size, **kw))
            setattr(self, f"input_layernorm{sfx}", RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw))
            setattr(self, f"post_attention_layernorm{sfx}", RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw))

    def forward(self, x: torch.Tensor, gen_mask: torch.Tensor | MoTRouting | None, cos: torch.Tensor,
                sin: torch.Tensor, engine_inputs: Any) -> torch.Tensor:
        route = _routing(gen_mask, x.shape[0])
        normed = route.apply(x, self.input_layernorm, self.input_layernorm_moe_gen)
        h = x + self.self_attn(normed, route, cos, sin, engine_inputs)
        normed = route.apply(h, self.post_attention_layernorm, self.post_attention_layernorm_moe_gen)
        return h + route.apply(normed, self.mlp, self.mlp_moe_gen)


class MoTModel(nn.Module):
    """Token embedding -> MoT decoder layers -> final norm (per token set), over a flat batch.

    Reads ``engine_inputs.positions``, ``engine_inputs.attention`` and ``engine_inputs.kv_caches``
    like ``mstar.layers.llama.LlamaBackbone``.
    """

    def __init__(self, cfg: BagelLLMConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.embed_tokens = token_embedding(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList([MoTDecoderLayer(cfg, i, backend=backend, **kw)
                                     for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.norm_moe_gen = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, input_ids: torch.Tensor | None, engine_inputs: Any,
                gen_mask: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]``; ``gen_mask`` None means all understanding tokens."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids.to(self.embed_tokens.weight.device))
        h = inputs_embeds
        t = h.shape[0]
        positions = engine_inputs.positions
        if positions is None or positions.shape[0] != t:
            got = None if positions is None else tuple(positions.shape)
            raise ValueError(f"engine_inputs.positions must hold one position per token ({t}), got {got}")
        if engine_inputs.kv_caches is None or len(engine_inputs.kv_caches) < len(self.layers):
            raise ValueError(f"engine_inputs.kv_caches must hold one (k, v) cache per layer "
                             f"({len(self.layers)})")
        route = MoTRouting.from_mask(gen_mask, t)
        cos, sin = self.rotary_emb(positions, dtype=h.dtype, device=h.device)
        for layer in self.layers:
            h = layer(h, route, cos, sin, engine_inputs)
        return route.apply(h, self.norm, self.norm_moe_gen)


class MoTLLM(nn.Module):
    """``model`` (``MoTModel``) and ``lm_head``: BAGEL's ``language_model`` with its checkpoint names."""

    def __init__(self, cfg: BagelLLMConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = MoTModel(cfg, dtype=dtype, device=device, backend=backend)
        self.lm_head = PrepackableLinear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)

    def kv_spec(self, dtype: torch.dtype = torch.float32) -> KVSpec:
        """The paged-cache shape this LLM attends over (one cache shared by both weight sets)."""
        return KVSpec(self.cfg.num_hidden_layers, self.cfg.num_key_value_heads, self.cfg.head_dim, dtype)

    def forward(self, input_ids: torch.Tensor | None, engine_inputs: Any,
                gen_mask: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` (see ``MoTModel.forward``)."""
        return self.model(input_ids, engine_inputs, gen_mask=gen_mask, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
