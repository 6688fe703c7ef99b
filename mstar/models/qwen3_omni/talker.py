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
different steps. The caches a step returns are views of one store per batch group
(``[layers, 2, b, 16, kv_heads, head_dim]``); the next step of the same requests finds that store
and writes into it, and its one-token steps run the compiled ``decode_step`` kernel over it.
The next talker input is the SUM of the 16 code embeddings
(``codec_embedding(c0) + sum_j code_predictor.codec_embedding[j](c_{j+1})``).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.attention_backends import AttentionBackend
from mstar.layers.norms import RMSNorm
from mstar.layers.paged_decode import kernel as attention_kernel
from mstar.layers.prepack import PrepackableLinear
from mstar.models.qwen3_omni.config import CodePredictorConfig, TalkerConfig
from mstar.models.qwen3_omni.moe import SwiGLU
from mstar.models.qwen3_omni.thinker import DecoderOutput, MoeDecoder, MRotary, QKNormAttention

__all__ = ["CodePredictor", "ResizeMLP", "TalkerLM", "empty_frame_cache", "suppress_mask"]


class ResizeMLP(nn.Module):
    def __init__(self, in_size: int, mid_size: int, out_size: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.linear_fc1 = PrepackableLinear(in_size, mid_size, bias=True, dtype=dtype)
        self.linear_fc2 = PrepackableLinear(mid_size, out_size, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))

    def row_invariant(self, x: torch.Tensor) -> bool:
        """Each row of ``self(x)`` is the same bits however many rows ``x`` has (``PrepackableLinear``)."""
        return self.linear_fc1.row_invariant(x) and self.linear_fc2.row_invariant(x)


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
        self.codec_head = PrepackableLinear(text.hidden_size, text.vocab_size, bias=False, dtype=dtype)
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


@dataclass
class _FrameGroup:
    """Requests of a code-predictor batch at the same point of their frames (the same new and cached
    lengths: usually the whole batch), attended together over one ``store``."""

    members: list[int]  # request indices, in batch order
    rows: torch.Tensor | None  # their rows of the flat token batch; None = every row, in order
    n: int  # new tokens per request
    cached: int  # cached positions per request
    store: torch.Tensor  # [layers, 2, b, capacity, Hkv, D]: positions < cached hold the members' caches

    def caches(self) -> list[torch.Tensor]:
        """Each member's grown cache ``[layers, 2, cached + n, Hkv, D]``: views of ``store``, so the
        next step of the same batch finds them there (``_store_of``) and copies nothing."""
        return list(self.store[:, :, :, :self.cached + self.n].unbind(2))


def _store_of(caches: list[torch.Tensor], need: int) -> torch.Tensor | None:
    """The store whose member rows 0, 1, ... the caches are, in order (the previous step's
    ``_FrameGroup.caches`` of the same requests), when it holds ``need`` positions; else None.
    Read back from the caches' common storage, which must be exactly one contiguous
    ``[layers, 2, b, capacity, Hkv, D]`` block (``capacity`` from the strides). Positions past a
    cache's length are written only by the step that grows it: earlier views never see them change."""
    c, b = caches[0], len(caches)
    layers, _, _, heads, d = c.shape
    row = heads * d
    if c.stride(1) % (b * row):
        return None
    capacity = c.stride(1) // (b * row)
    storage = c.untyped_storage()
    if (capacity < need or c.stride() != (2 * b * capacity * row, b * capacity * row, row, d, 1)
            or storage.nbytes() != layers * 2 * b * capacity * row * c.element_size()):
        return None
    for i, x in enumerate(caches):
        if (x.untyped_storage().data_ptr() != storage.data_ptr() or x.storage_offset() != i * capacity * row
                or x.shape != c.shape or x.stride() != c.stride() or x.dtype != c.dtype):
            return None
    return c.new_empty(0).set_(storage, 0, (layers, 2, b, capacity, heads, d))


def _known_store(caches: list[torch.Tensor], known: tuple[list[torch.Tensor], torch.Tensor] | None,
                 need: int) -> torch.Tensor | None:
    """The store of the previous step's single group when ``caches`` are its very views (the usual
    next step of the same batch: no per-cache check), holding ``need`` positions; else None."""
    if known is None:
        return None
    views, store = known
    if len(views) != len(caches) or store.shape[3] < need or any(a is not b for a, b in zip(caches, views)):
        return None
    return store


def _frame_groups(counts: list[int], caches: list[torch.Tensor], capacity: int,
                  known: tuple[list[torch.Tensor], torch.Tensor] | None = None) -> list[_FrameGroup]:
    keys: dict[tuple[int, int], list[int]] = {}
    for i, (n, c) in enumerate(zip(counts, caches)):
        keys.setdefault((n, c.shape[2]), []).append(i)
    starts = [0, *itertools.accumulate(counts[:-1])] if len(keys) > 1 else []
    groups = []
    for (n, cached), members in keys.items():
        mine = [caches[i] for i in members]
        store = None
        if cached:
            store = _known_store(mine, known, cached + n)
            if store is None:
                store = _store_of(mine, cached + n)
        if store is None:
            c = mine[0]
            store = c.new_empty(c.shape[0], 2, len(members), max(capacity, cached + n), *c.shape[3:])
            if cached:
                store[:, :, :, :cached] = torch.stack(mine, dim=2)
        rows = None if len(keys) == 1 else torch.tensor([starts[i] + k for i in members for k in range(n)])
        groups.append(_FrameGroup(members, rows, n, cached, store))
    return groups


class _DenseAttention(QKNormAttention):
    """The code predictor's attention over per-request dense caches (causal, GQA), one call per
    ``_FrameGroup``; the new K/V are written into the group's ``store``. A one-token step goes
    through the compiled ``decode_step`` kernel (store, then attend; batch-invariant), reading each
    member's cache rows of ``store`` as one block of a paged cache; other steps through SDPA."""

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[_FrameGroup],
               layer: int) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        if len(groups) == 1 and groups[0].rows is None:
            return self.o_proj(self._attend_group(groups[0], q, k, v, layer))
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        for g in groups:
            out[g.rows] = self._attend_group(g, q[g.rows], k[g.rows], v[g.rows], layer)
        return self.o_proj(out)

    def _attend_group(self, g: _FrameGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      layer: int) -> torch.Tensor:
        """The group's rows ``q`` [b * n, Hq, D] over its cache and new ``k``/``v`` -> [b * n, Hq * D]."""
        b, n, d, total = len(g.members), g.n, self.head_dim, g.cached + g.n
        k_cache, v_cache = g.store[layer, 0], g.store[layer, 1]  # [b, capacity, Hkv, D], contiguous
        ext = attention_kernel()  # the compiled attention (off with MSTAR_ATTENTION_KERNEL=torch)
        if (n == 1 and ext is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
                and k.dtype == v.dtype == q.dtype == k_cache.dtype and all(map(_rows_ok, (q, k, v)))):
            slots, tables, ctx = _decode_plan(b, k_cache.shape[1], g.cached)
            return ext.decode_step(q, k, v, k_cache, v_cache, slots, tables, ctx, d ** -0.5).reshape(b, -1)
        k_cache[:, g.cached:total] = k.view(b, n, self.num_kv_heads, d)
        v_cache[:, g.cached:total] = v.view(b, n, self.num_kv_heads, d)
        mask = None
        if n > 1:
            mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(g.cached)
        o = F.scaled_dot_product_attention(q.view(b, n, self.num_heads, d).transpose(1, 2),
                                           k_cache[:, :total].transpose(1, 2), v_cache[:, :total].transpose(1, 2),
                                           attn_mask=mask, scale=d ** -0.5,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return o.transpose(1, 2).reshape(b * n, -1)


def _rows_ok(x: torch.Tensor) -> bool:
    """``[T, H, D]`` with contiguous rows (the kernel's layout; a row may sit in a wider tensor)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


@functools.lru_cache(maxsize=256)
def _decode_plan(b: int, capacity: int, cached: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``decode_step``'s (slots, block tables, context lengths) for b members, member i's cache being
    block i of ``capacity`` positions, each appending at position ``cached``."""
    members = torch.arange(b, dtype=torch.int64)
    return members * capacity + cached, members[:, None].contiguous(), torch.full((b,), cached + 1, dtype=torch.int64)


class _PredictorLayer(nn.Module):
    def __init__(self, cfg: CodePredictorConfig, idx: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.idx = idx
        self.self_attn = _DenseAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                         cfg.head_dim, cfg.rms_norm_eps, idx, dtype=dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, x, cos, sin, groups):
        h = x + self.self_attn.attend(self.input_layernorm(x), cos, sin, groups, self.idx)
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
        self.lm_head = nn.ModuleList([PrepackableLinear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
                                      for _ in range(cfg.num_code_groups - 1)])
        self.rotary = MRotary(cfg.head_dim, cfg.rope_theta)
        self._rope_table: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_rows: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # the last step's caches when it was one group: (the views it returned, their store)
        self._last_views: tuple[list[torch.Tensor], torch.Tensor] | None = None

    def embed(self, step: int, codes: torch.Tensor) -> torch.Tensor:
        """``codec_embedding[step]`` of codes (the input after sampling code ``step + 1``)."""
        return self.model.codec_embedding[step](codes.to(self.lm_head[0].weight.device))

    def embed_steps(self, steps: list[int], codes: torch.Tensor) -> torch.Tensor:
        """Row i: ``codec_embedding[steps[i]](codes[i])`` -> ``[B, H]`` (one lookup per distinct step)."""
        codes = codes.to(self.lm_head[0].weight.device)
        if len(set(steps)) == 1:
            return self.model.codec_embedding[steps[0]](codes)
        out = self.model.codec_embedding[0].weight.new_empty(len(steps), self.config.hidden_size)
        for j, rows in _rows_by(steps).items():
            out[rows] = self.model.codec_embedding[j](codes[rows])
        return out

    def _rope(self, positions: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the positions (all within a frame: < num_code_groups + 1), from a table made once;
        the rows of a batch's positions are kept too (a frame's steps repeat the same few)."""
        if max(positions) > self.config.num_code_groups:
            return self.rotary(torch.tensor(positions, device=self.lm_head[0].weight.device), dtype)
        key = (dtype, tuple(positions))
        rows = self._rope_rows.get(key)
        if rows is not None:
            return rows
        table = self._rope_table.get(dtype)
        if table is None:
            span = torch.arange(self.config.num_code_groups + 1, device=self.lm_head[0].weight.device)
            table = self._rope_table[dtype] = self.rotary(span, dtype)
        idx = torch.tensor(positions, device=table[0].device)
        if len(self._rope_rows) >= 256:  # batch sizes x steps seen lately; dropped wholesale when full
            self._rope_rows.clear()
        rows = self._rope_rows[key] = (table[0][idx], table[1][idx])
        return rows

    def step(self, inputs: list[torch.Tensor], steps: list[int], caches: list[torch.Tensor]
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(logits ``[B, vocab]``, new caches): request i brings ``inputs[i]`` [n_i, H] (2 rows at step 0,
        then 1), is at step ``steps[i]`` and has the frame cache ``caches[i]`` (``empty_frame_cache``
        at step 0); the returned caches hold its new K/V too (the inputs are not modified)."""
        return self.step_rows(torch.cat(inputs), [x.shape[0] for x in inputs], steps, caches)

    def step_rows(self, h: torch.Tensor, counts: list[int], steps: list[int], caches: list[torch.Tensor]
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``step`` with the inputs already one ``[sum counts, H]`` tensor (request i: ``counts[i]``
        consecutive rows)."""
        cos, sin = self._rope([c.shape[2] + k for c, n in zip(caches, counts) for k in range(n)], h.dtype)
        groups = _frame_groups(counts, caches, self.config.num_code_groups, self._last_views)
        self._last_views = None
        for layer in self.model.layers:
            h = layer(h, cos, sin, groups)
        ends = list(itertools.accumulate(counts))
        last = self.model.norm(h[[e - 1 for e in ends]] if len(ends) != h.shape[0] else h)
        if len(set(steps)) == 1:
            logits = self.lm_head[steps[0]](last)
        else:  # one head per code group: the requests at step j together
            logits = last.new_empty(len(counts), self.config.vocab_size)
            for j, rows in _rows_by(steps).items():
                logits[rows] = self.lm_head[j](last[rows])
        if len(groups) == 1:
            views = groups[0].caches()
            self._last_views = (views, groups[0].store)
            return logits, views
        new_caches: list[torch.Tensor | None] = [None] * len(counts)
        for g in groups:
            for i, cache in zip(g.members, g.caches()):
                new_caches[i] = cache
        return logits, new_caches  # type: ignore[return-value]


def _rows_by(keys: list[int]) -> dict[int, list[int]]:
    """Row indices per distinct key, in order."""
    out: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        out.setdefault(k, []).append(i)
    return out
