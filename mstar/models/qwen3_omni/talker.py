"""The Qwen3-Omni talker: an MoE decoder over the paged KV cache that predicts codec layer 0 per frame,
and the code predictor that fills in the other 15 codebooks of the frame.

``TalkerLM`` (checkpoint names without the ``talker.`` prefix):

    model.codec_embedding   [vocab, H]    codec ids -> talker inputs (layer-0 codes, specials, speakers)
    model.layers.{i}.*                    the MoE decoder with a gated shared expert (thinker.py, moe.py)
    codec_head              [vocab, H]    layer-0 logits; ids >= vocab - 1024 except codec EOS are never
                                          sampled (``suppress_mask``)
    text_projection / hidden_projection   ResizeMLPs thinker hidden -> talker hidden
                                          (``linear_fc2(silu(linear_fc1(x)))``, with biases)

``CodePredictor`` (``code_predictor.*``): a dense Qwen3 decoder (q/k-norm, 1-D RoPE). For each frame
it starts a fresh cache: step 0 reads ``[talker hidden (post-norm), codec_embedding(c0)]`` and samples
code 1 with ``lm_head[0]``; step j (1..14) reads ``codec_embedding[j-1](c_j)`` and samples code j+1
with ``lm_head[j]``. The per-frame cache is a small dense tensor per request
(``[layers, 2, n, kv_heads, head_dim]``, carried from step to step), so a batch may mix requests at
different steps. The next talker input is the SUM of the 16 code
embeddings (``codec_embedding(c0) + sum_j code_predictor.codec_embedding[j](c_{j+1})``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.attention_backends import AttentionBackend
from mstar.layers.llama import RMSNorm
from mstar.models.qwen3_omni.config import CodePredictorConfig, TalkerConfig
from mstar.models.qwen3_omni.moe import SwiGLU
from mstar.models.qwen3_omni.thinker import DecoderOutput, MoeDecoder, MRotary, QKNormAttention

__all__ = ["CodePredictor", "ResizeMLP", "TalkerLM", "empty_frame_cache", "suppress_mask"]


class ResizeMLP(nn.Module):
    def __init__(self, in_size: int, mid_size: int, out_size: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_size, mid_size, bias=True, dtype=dtype)
        self.linear_fc2 = nn.Linear(mid_size, out_size, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


def suppress_mask(cfg: TalkerConfig) -> torch.Tensor:
    """bool ``[vocab]``: True for the codec ids the talker never samples."""
    mask = torch.zeros(cfg.text.vocab_size, dtype=torch.bool)
    mask[cfg.suppressed_from:] = True
    mask[cfg.codec_eos_id] = False
    return mask


class _TalkerBody(MoeDecoder):
    def __init__(self, cfg: TalkerConfig, *, dtype: torch.dtype | None = None,
                 backend: AttentionBackend | None = None) -> None:
        super().__init__(cfg.text, dtype=dtype, backend=backend)
        self.codec_embedding = nn.Embedding(cfg.text.vocab_size, cfg.text.hidden_size, dtype=dtype)


class TalkerLM(nn.Module):
    def __init__(self, cfg: TalkerConfig, *, dtype: torch.dtype | None = None,
                 backend: AttentionBackend | None = None) -> None:
        super().__init__()
        text = cfg.text
        self.config = cfg
        self.model = _TalkerBody(cfg, dtype=dtype, backend=backend)
        self.codec_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False, dtype=dtype)
        sizes = (cfg.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.text_projection = ResizeMLP(*sizes, dtype=dtype)
        self.hidden_projection = ResizeMLP(*sizes, dtype=dtype)
        self.register_buffer("suppressed", suppress_mask(cfg), persistent=False)

    def codec_embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.codec_embedding(ids.to(self.codec_head.weight.device))

    def forward(self, inputs_embeds: torch.Tensor, engine_inputs: Any, **kw: Any) -> DecoderOutput:
        return self.model.run(inputs_embeds, engine_inputs, **kw)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Layer-0 codec logits of normed hidden states, suppressed ids at -inf."""
        return self.codec_head(hidden).masked_fill(self.suppressed, float("-inf"))


# -- code predictor ------------------------------------------------------------------------------------


def empty_frame_cache(cfg: CodePredictorConfig, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A frame's code-predictor cache before its first step: ``[layers, 2 (K, V), 0, kv_heads, head_dim]``."""
    return torch.zeros(cfg.num_hidden_layers, 2, 0, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)


class _DenseAttention(QKNormAttention):
    """The code predictor's attention over per-request dense caches (causal, GQA). ``past[i]`` is
    request i's ``[2, n, Hkv, D]`` for this layer; the new K/V are appended into ``present[i]``.
    Requests at the same step (same new and cached lengths: the usual case) attend in one call."""

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, counts: list[int],
               past: list[torch.Tensor], present: list[torch.Tensor | None]) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        starts = [0, *torch.tensor(counts).cumsum(0).tolist()[:-1]]
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (n, old) in enumerate(zip(counts, past)):
            groups.setdefault((n, old.shape[1]), []).append(i)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        for (n, cached), members in groups.items():
            rows = torch.cat([torch.arange(starts[i], starts[i] + n) for i in members])
            new = torch.stack([k[rows], v[rows]]).view(2, len(members), n, self.num_kv_heads, self.head_dim)
            old = torch.stack([past[i] for i in members], dim=1).to(new)
            kv = torch.cat([old, new], dim=2)  # [2, b, total, Hkv, D]
            for slot, i in enumerate(members):
                present[i] = kv[:, slot]
            out[rows] = self._attend(q[rows].view(len(members), n, self.num_heads, self.head_dim), kv, cached)
        return self.o_proj(out)

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, cached: int) -> torch.Tensor:
        """``q`` [b, n, Hq, D] over ``kv`` [2, b, cached + n, Hkv, D] (causal) -> [b * n, Hq * D]."""
        b, n = q.shape[:2]
        rep = self.num_heads // self.num_kv_heads
        mask = torch.ones(n, cached + n, dtype=torch.bool, device=q.device).tril(cached)
        keys = kv[0].repeat_interleave(rep, dim=2).transpose(1, 2)
        values = kv[1].repeat_interleave(rep, dim=2).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                           scale=self.head_dim ** -0.5)
        return o.transpose(1, 2).reshape(b * n, -1)


class _PredictorLayer(nn.Module):
    def __init__(self, cfg: CodePredictorConfig, idx: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.idx = idx
        self.self_attn = _DenseAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                         cfg.head_dim, cfg.rms_norm_eps, idx, dtype=dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, x, cos, sin, counts, past, present):
        h = x + self.self_attn.attend(self.input_layernorm(x), cos, sin, counts, past, present)
        return h + self.mlp(self.post_attention_layernorm(h))


class _PredictorBody(nn.Module):
    def __init__(self, cfg: CodePredictorConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_PredictorLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.codec_embedding = nn.ModuleList([nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
                                              for _ in range(cfg.num_code_groups - 1)])


class CodePredictor(nn.Module):
    """The residual-codebook predictor (module docstring); one ``step`` advances every request of a
    batch by one code, each at its own step j."""

    def __init__(self, cfg: CodePredictorConfig, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = _PredictorBody(cfg, dtype)
        self.lm_head = nn.ModuleList([nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
                                      for _ in range(cfg.num_code_groups - 1)])
        self.rotary = MRotary(cfg.head_dim, cfg.rope_theta)

    def embed(self, step: int, codes: torch.Tensor) -> torch.Tensor:
        """``codec_embedding[step]`` of codes (the input after sampling code ``step + 1``)."""
        return self.model.codec_embedding[step](codes.to(self.lm_head[0].weight.device))

    def step(self, inputs: list[torch.Tensor], steps: list[int], caches: list[torch.Tensor]
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(logits ``[B, vocab]``, new caches): request i brings ``inputs[i]`` [n_i, H] (2 rows at step 0,
        then 1), is at step ``steps[i]`` and has the frame cache ``caches[i]`` (``empty_frame_cache``
        at step 0); the returned caches hold its new K/V too (the inputs are not modified)."""
        counts = [x.shape[0] for x in inputs]
        positions = torch.cat([torch.arange(c.shape[2], c.shape[2] + n) for c, n in zip(caches, counts)])
        h = torch.cat(inputs)
        cos, sin = self.rotary(positions.to(h.device), h.dtype)
        per_layer: list[list[torch.Tensor]] = []
        for i, layer in enumerate(self.model.layers):
            present: list[torch.Tensor | None] = [None] * len(inputs)
            h = layer(h, cos, sin, counts, [c[i] for c in caches], present)
            per_layer.append(present)  # type: ignore[arg-type]
        last = self.model.norm(h)[torch.tensor(counts).cumsum(0) - 1]
        logits = last.new_empty(len(inputs), self.config.vocab_size)
        for j in set(steps):  # one head per code group: the requests at step j together
            rows = torch.tensor([i for i, s in enumerate(steps) if s == j])
            logits[rows] = self.lm_head[j](last[rows])
        return logits, [torch.stack([layer[r] for layer in per_layer]) for r in range(len(inputs))]
