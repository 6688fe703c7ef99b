"""Llama building blocks over a flat token batch, attending through the runtime's paged KV cache.

Every block works on ``[T, hidden]``: the tokens of all requests of a batch concatenated (their
rows and cache slots are described by the ``EngineInputs`` the runtime builds). Parameter names
mirror the Hugging Face checkpoint layout, so a ``LlamaBackbone`` stored as attribute ``model`` of
a module next to an ``lm_head`` has exactly the checkpoint's names::

    model.embed_tokens.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.layers.{i}.{input,post_attention}_layernorm.weight
    model.norm.weight
    lm_head.weight

Families built on Llama (Orpheus TTS, ...) reuse these blocks with their own heads.
Biases in the projections are not supported (``attention_bias`` / ``mlp_bias`` must be false).

Packed weights (``pack_weights``, called by the Llama loader before the checkpoint is copied in):
on a CPU, ``x @ W`` with ``W`` stored ``[in, out]`` streams the weight in the order the multiply
reads it, where ``x @ W.T`` with ``W`` stored ``[out, in]`` (nn.Linear's layout) does not; at the
few rows of a decode batch the multiply is bound by reading the weight, so the layout decides it.
So each projection's weight is re-laid out ``[in, out]`` (the parameter is a transposed view: same
name, shape ``[out, in]`` and values), and q/k/v and gate/up share one ``[in, 3 * out]`` tensor each,
so a layer runs one matrix multiply for them. A module whose parameters were replaced afterwards
(``.to()``, ``load_state_dict(assign=True)``) falls back to the plain per-projection path.

Prepacked weights (``prepack()``, called through ``mstar.layers.prepack.prepack_linears`` once the
weights are loaded): the packed q/k/v, o, gate/up and down weights are also kept in the
prepacked layout of the route in use (column panels for mstar's kernel, gate/up interleaved for
the fused SiLU-mul; or oneDNN's blocked layout), used while the weights they came from are
unchanged; the norms and the rotary embedding then run through the compiled kernels too.

Weights as stored (``use_stored``): ``mstar.layers.quant.QuantizedLinear`` s take the prepacked
projections' place for good (the ``nn.Linear`` parameters are then unused; no repacking, no shards).

Attention goes through ``backend``; ``LlamaBackbone`` defaults to ``default_backend()`` (decode rows
through the compiled kernel where it can be built, see ``mstar.layers.paged_decode``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.attention_backends import AttentionBackend, default_backend
from mstar.layers.cpu_ops import ops
from mstar.layers.norms import RMSNorm
from mstar.layers.paged_attention import paged_attention
from mstar.layers.prepack import PrepackedLinear, can_prepack, hooked
from mstar.layers.quant import QuantizedLinear
from mstar.layers.rotary import RopeScaling, RotaryEmbedding, apply_rotary

__all__ = [
    "LlamaArchitecture",
    "LlamaAttention",
    "LlamaBackbone",
    "LlamaDecoderLayer",
    "LlamaMLP",
    "check_llama_architecture",
    "pack_linears",
    "token_embedding",
]


_COMPILED_DTYPES = (torch.float32, torch.bfloat16)  # what the compiled norm / rotary take
_ATTN_BIAS = ("attention_bias=True is not supported by mstar's Llama layers "
              "(q/k/v/o projections must have no bias)")
_STORED = "projections kept as stored (quantized) cannot be replaced (tensor parallelism needs dequantized weights)"
_MLP_BIAS = ("mlp_bias=True is not supported by mstar's Llama layers "
             "(gate/up/down projections must have no bias)")


class LlamaArchitecture(Protocol):
    """What the blocks read from a config (``mstar.models.llama.config.LlamaConfig`` provides it)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None


def check_llama_architecture(cfg: Any) -> None:
    """Raise ValueError, naming the field, for what these blocks do not implement."""
    if getattr(cfg, "attention_bias", False):
        raise ValueError(_ATTN_BIAS)
    if getattr(cfg, "mlp_bias", False):
        raise ValueError(_MLP_BIAS)
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported by mstar's Llama layers (only 'silu')")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
                         f"num_key_value_heads ({cfg.num_key_value_heads})")


def pack_linears(*linears: nn.Linear) -> torch.Tensor:
    """One contiguous ``[in, sum(out)]`` tensor with the linears' weights side by side; each
    linear's ``weight`` becomes a (transposed) view of its columns, values and shape unchanged, so a
    copy into the parameter (checkpoint loading) fills the packed tensor. ``F.linear`` on such a view
    runs the fast ``x @ W`` path; ``x @ packed`` computes every linear at once."""
    weights = [lin.weight for lin in linears]
    if len({w.shape[1] for w in weights}) != 1:
        raise ValueError("packed linears must share their input size")
    with torch.no_grad():
        packed = torch.cat([w.detach().t() for w in weights], dim=1).contiguous()
    off = 0
    for lin, w in zip(linears, weights):
        n = w.shape[0]
        lin.weight = nn.Parameter(packed[:, off:off + n].t(), requires_grad=w.requires_grad)
        off += n
    return packed


def y_rotatable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The compiled in-place rotary applies: float32 or bfloat16 CPU activations and contiguous
    tables of their dtype."""
    return (x.dtype in _COMPILED_DTYPES and x.device.type == "cpu" and cos.dtype == x.dtype
            and sin.dtype == x.dtype and cos.is_contiguous() and sin.is_contiguous() and ops() is not None)


def packed_weight(packed: torch.Tensor | None, linears: tuple[nn.Linear, ...], views: tuple) -> torch.Tensor | None:
    """``packed`` if the linears still hold the views made by ``pack_linears`` (else None)."""
    if packed is None:
        return None
    for lin, view in zip(linears, views):
        if lin.weight is not view:
            return None
    return packed


class LlamaAttention(nn.Module):
    """GQA self-attention of layer ``layer_idx`` over ``engine_inputs.kv_caches[layer_idx]``."""

    def __init__(self, cfg: LlamaArchitecture, layer_idx: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        if getattr(cfg, "attention_bias", False):
            raise ValueError(_ATTN_BIAS)
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scaling = self.head_dim ** -0.5
        self.backend = backend
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, **kw)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, **kw)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, **kw)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, **kw)
        self._qkv: torch.Tensor | None = None
        self._qkv_views: tuple = ()
        # forward(..., residual) adds it; False where the output must be reduced first (TP shards)
        self.takes_residual = True
        self.prepacked: tuple[PrepackedLinear, PrepackedLinear] | None = None  # (qkv, o)
        self.stored = False  # ``prepacked`` holds quantized projections as stored (``use_stored``)

    def pack_weights(self) -> None:
        """q/k/v in one ``[hidden, (Hq + 2 Hkv) * D]`` tensor, o re-laid out (see the module docstring)."""
        self._qkv = pack_linears(self.q_proj, self.k_proj, self.v_proj)
        self._qkv_views = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        pack_linears(self.o_proj)

    def use_stored(self, qkv: QuantizedLinear, o: QuantizedLinear) -> None:
        """Compute with quantized projections as stored: ``qkv`` (q, k and v rows stacked) and ``o``."""
        self.prepacked, self.stored = (qkv, o), True

    def set_projections(self, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear) -> None:
        """Replace the projections (a tensor-parallel shard: fewer heads, whole heads only); the
        head counts follow their sizes, and packed / prepacked weights are rebuilt as they were."""
        if self.stored:
            raise ValueError(_STORED)
        packed, prepacked = self._qkv is not None, self.prepacked is not None
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q, k, v, o
        self.num_heads = q.out_features // self.head_dim
        self.num_kv_heads = k.out_features // self.head_dim
        self._qkv, self._qkv_views, self.prepacked = None, (), None
        if packed:
            self.pack_weights()
        if prepacked:
            self.prepack()

    def prepack(self) -> bool:
        """Prepacked q/k/v and o projections (``mstar.layers.prepack``); needs ``pack_weights``."""
        if self.stored:
            return False
        qkv = packed_weight(self._qkv, (self.q_proj, self.k_proj, self.v_proj), self._qkv_views)
        if not can_prepack(qkv, self.o_proj.weight):
            return False
        self.prepacked = (PrepackedLinear(qkv, in_out=True), PrepackedLinear(self.o_proj.weight))
        return True

    def _prepacked(self, qkv: torch.Tensor | None) -> tuple[PrepackedLinear, PrepackedLinear] | None:
        """The prepacked projections, if the weights they were packed from are unchanged."""
        pre = self.prepacked
        if self.stored:
            return pre
        if pre is None or qkv is None or not (pre[0].fresh(qkv) and pre[1].fresh(self.o_proj.weight)):
            return None
        return pre

    def fresh_prepacked(self) -> tuple[PrepackedLinear, PrepackedLinear] | None:
        """``(qkv, o)`` prepacked projections that ``forward`` would use now (None: it would not)."""
        return self._prepacked(packed_weight(self._qkv, (self.q_proj, self.k_proj, self.v_proj), self._qkv_views))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                engine_inputs: Any, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[T, hidden]`` (already normed); ``cos``/``sin`` ``[T, head_dim]`` at the tokens'
        positions; ``residual`` (optional) is added to the output (fused into the prepacked o)."""
        t = x.shape[0]
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = packed_weight(self._qkv, (self.q_proj, self.k_proj, self.v_proj), self._qkv_views)
        pre = self._prepacked(qkv)
        if pre is not None and y_rotatable(x, cos, sin):  # q and k rotated in place by the kernel
            y = pre[0](x)
            ops().rotary_(y, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim)
            q = y[:, :nq].view(t, self.num_heads, self.head_dim)
            k = y[:, nq:nq + nkv].view(t, self.num_kv_heads, self.head_dim)
            v = y[:, nq + nkv:]
        elif qkv is not None or pre is not None:  # one matmul; q and k heads side by side are rotated together
            y = pre[0](x) if pre is not None else torch.matmul(x, qkv)
            qk = apply_rotary(y[:, :nq + nkv].view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
            q, k, v = qk[:, :self.num_heads], qk[:, self.num_heads:], y[:, nq + nkv:]
        else:
            q = apply_rotary(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
            k = apply_rotary(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
            v = self.v_proj(x)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = engine_inputs.kv_caches[self.layer_idx]
        meta = engine_inputs.attention
        if self.backend is None:
            out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=self.scaling)
        else:
            out = self.backend.forward(q, k, v, k_cache, v_cache, meta, scale=self.scaling)
        out = out.reshape(t, self.num_heads * self.head_dim)
        if pre is not None:
            return pre[1](out, residual)
        return self.o_proj(out) if residual is None else residual + self.o_proj(out)


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, bias: bool = False) -> None:
        super().__init__()
        if bias:
            raise ValueError(_MLP_BIAS)
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        self._gate_up: torch.Tensor | None = None
        self._gate_up_views: tuple = ()
        self.takes_residual = True  # as LlamaAttention.takes_residual
        self.prepacked: tuple[PrepackedLinear, PrepackedLinear] | None = None  # (gate_up, down)
        self.stored = False  # as LlamaAttention.stored

    def pack_weights(self) -> None:
        """gate/up in one ``[hidden, 2 * intermediate]`` tensor, down re-laid out."""
        self._gate_up = pack_linears(self.gate_proj, self.up_proj)
        self._gate_up_views = (self.gate_proj.weight, self.up_proj.weight)
        pack_linears(self.down_proj)

    def use_stored(self, gate_up: QuantizedLinear, down: QuantizedLinear) -> None:
        """Compute with quantized projections as stored: ``gate_up`` (gate and up rows stacked, built
        with ``silu_mul=True``) and ``down``."""
        self.prepacked, self.stored = (gate_up, down), True

    def set_projections(self, gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> None:
        """Replace the projections (a tensor-parallel shard); packed / prepacked weights are rebuilt
        as they were."""
        if self.stored:
            raise ValueError(_STORED)
        packed, prepacked = self._gate_up is not None, self.prepacked is not None
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down
        self._gate_up, self._gate_up_views, self.prepacked = None, (), None
        if packed:
            self.pack_weights()
        if prepacked:
            self.prepack()

    def prepack(self) -> bool:
        """Prepacked gate/up (SiLU-mul fused) and down projections (``mstar.layers.prepack``)."""
        if self.stored:
            return False
        gate_up = packed_weight(self._gate_up, (self.gate_proj, self.up_proj), self._gate_up_views)
        if not can_prepack(gate_up, self.down_proj.weight):
            return False
        self.prepacked = (PrepackedLinear(gate_up, in_out=True, silu_mul=True),
                          PrepackedLinear(self.down_proj.weight))
        return True

    def fresh_prepacked(self) -> tuple[PrepackedLinear, PrepackedLinear] | None:
        """``(gate_up, down)`` prepacked projections that ``forward`` would use now (None: it would not)."""
        gate_up = packed_weight(self._gate_up, (self.gate_proj, self.up_proj), self._gate_up_views)
        pre = self.prepacked
        if self.stored:
            return pre
        if gate_up is not None and pre is not None and pre[0].fresh(gate_up) and pre[1].fresh(self.down_proj.weight):
            return pre
        return None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))``, plus ``residual`` when given (fused when prepacked)."""
        pre = self.fresh_prepacked()
        if pre is not None:
            return pre[1](pre[0](x), residual)  # SiLU-mul fused into the gate/up multiply
        gate_up = packed_weight(self._gate_up, (self.gate_proj, self.up_proj), self._gate_up_views)
        if gate_up is None:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        else:
            y = torch.matmul(x, gate_up)
            n = y.shape[-1] // 2
            out = self.down_proj(F.silu(y[..., :n]) * y[..., n:])
        return out if residual is None else residual + out


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks, each with a residual connection."""

    def __init__(self, cfg: LlamaArchitecture, layer_idx: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.self_attn = LlamaAttention(cfg, layer_idx, backend=backend, **kw)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, bias=getattr(cfg, "mlp_bias", False),
                            **kw)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                engine_inputs: Any) -> torch.Tensor:
        attn, mlp = self.self_attn, self.mlp
        if attn.takes_residual:  # the residual add fused into the o projection's store
            h = attn(self.input_layernorm(x), cos, sin, engine_inputs, residual=x)
        else:
            h = x + attn(self.input_layernorm(x), cos, sin, engine_inputs)
        if mlp.takes_residual:
            return mlp(self.post_attention_layernorm(h), residual=h)
        return h + mlp(self.post_attention_layernorm(h))


class _LeanLayer(NamedTuple):
    """A decoder layer's parts as ``LlamaDecoderLayer.forward`` uses them on the compiled route."""

    attn: LlamaAttention
    in_norm: RMSNorm
    post_norm: RMSNorm
    qkv: PrepackedLinear | QuantizedLinear
    o: PrepackedLinear | QuantizedLinear
    gate_up: PrepackedLinear | QuantizedLinear
    down: PrepackedLinear | QuantizedLinear


def _lean_layer(layer: nn.Module, dtype: torch.dtype) -> _LeanLayer | None:
    """``layer``'s parts if its forward would take the compiled route for a ``dtype`` input: a plain
    ``LlamaDecoderLayer`` (no subclass, no hooks) with fresh panel-prepacked (or quantized) projections, compiled
    norms of that dtype and fused residual adds; None otherwise."""
    if type(layer) is not LlamaDecoderLayer:
        return None
    attn, mlp, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
    if (type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP or type(n1) is not RMSNorm
            or type(n2) is not RMSNorm or not (attn.takes_residual and mlp.takes_residual)
            or hooked(layer, attn, mlp, n1, n2)):
        return None
    if not (n1.compiled and n2.compiled and n1.weight.dtype == dtype and n2.weight.dtype == dtype):
        return None
    a, m = attn.fresh_prepacked(), mlp.fresh_prepacked()
    if a is None or m is None or any(p.mode not in ("panel", "quant") for p in (*a, *m)):
        return None
    return _LeanLayer(attn, n1, n2, a[0], a[1], m[0], m[1])


def token_embedding(num: int, dim: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> nn.Embedding:
    """``nn.Embedding(num, dim)``; on the meta device without its random initialisation (its values
    are replaced anyway, and torch's meta ``normal_`` imports ``torch._dynamo``, a heavy import
    that would land on a process's first model build, a worker process's included)."""
    if device is not None and torch.device(device).type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim, dtype=dtype, device="meta"))
    return nn.Embedding(num, dim, dtype=dtype, device=device)


class LlamaBackbone(nn.Module):
    """Token embedding -> decoder layers -> final norm, over a flat batch of new tokens.

    ``forward(input_ids, engine_inputs)`` reads ``engine_inputs.positions`` (absolute position of
    each token, for the rotary embedding), ``engine_inputs.attention`` (the paged-attention
    metadata) and ``engine_inputs.kv_caches`` (one ``(k_cache, v_cache)`` per layer). Models that
    splice other embeddings in (audio, vision) pass ``inputs_embeds`` instead of ids.
    """

    def __init__(self, cfg: LlamaArchitecture, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        check_llama_architecture(cfg)
        kw = {"dtype": dtype, "device": device}
        backend = default_backend() if backend is None else backend
        self.embed_tokens = token_embedding(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, i, backend=backend, **kw)
                                     for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def pack_weights(self) -> None:
        """Re-lay out every layer's projections for fast CPU matrix multiplies (module docstring)."""
        for layer in self.layers:
            layer.self_attn.pack_weights()
            layer.mlp.pack_weights()

    def forward(self, input_ids: torch.Tensor | None, engine_inputs: Any,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the batch's new tokens."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            weight = getattr(self.embed_tokens, "weight", None)  # a QuantizedEmbedding has none: CPU
            inputs_embeds = self.embed_tokens(input_ids if weight is None else input_ids.to(weight.device))
        h = inputs_embeds
        positions = engine_inputs.positions
        if positions is None or positions.shape[0] != h.shape[0]:
            got = None if positions is None else tuple(positions.shape)
            raise ValueError(f"engine_inputs.positions must hold one position per token ({h.shape[0]}), "
                             f"got {got}")
        if engine_inputs.kv_caches is None or len(engine_inputs.kv_caches) < len(self.layers):
            raise ValueError(f"engine_inputs.kv_caches must hold one (k, v) cache per layer "
                             f"({len(self.layers)})")
        cos, sin = self.rotary_emb(positions, dtype=h.dtype, device=h.device)
        lean = self._lean_layers(h, cos, sin)
        if lean is not None:
            return self.norm(self._lean_forward(lean, h, cos, sin, engine_inputs))
        for layer in self.layers:
            h = layer(h, cos, sin, engine_inputs)
        return self.norm(h)

    def _lean_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[_LeanLayer] | None:
        """Every layer's parts (``_lean_layer``) when every layer would run on the compiled route for
        ``h``; None otherwise (the modules' own forwards then run)."""
        if (h.dim() != 2 or not h.is_contiguous() or h.dtype not in _COMPILED_DTYPES or not y_rotatable(h, cos, sin)
                or hooked(*self.layers) or torch.nn.modules.module._global_forward_hooks
                or torch.nn.modules.module._global_forward_pre_hooks):
            return None
        lean = []
        for layer in self.layers:
            part = _lean_layer(layer, h.dtype)
            if part is None:
                return None
            lean.append(part)
        return lean

    @staticmethod
    def _lean_forward(lean: list[_LeanLayer], h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      engine_inputs: Any) -> torch.Tensor:
        """The decoder layers as ``LlamaDecoderLayer.forward`` runs them on the compiled route: the same
        kernel calls with the same arguments, in the same order (so the same bits), without the
        modules' per-call dispatch and checks. A batch of one-token decode rows plans its fused
        attention step once (``CompiledPagedBackend.fused_decode``) for every layer whose caches
        match the first layer's."""
        t = h.shape[0]
        meta, caches = engine_inputs.attention, engine_inputs.kv_caches
        fused, fused_cache = None, None
        for i, part in enumerate(lean):
            attn = part.attn
            nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
            nq, nk = nh * d, nkv * d
            x = part.in_norm._kernel.rms_norm(h, part.in_norm.weight, part.in_norm.eps)
            qkv = part.qkv
            y = qkv._kernel.linear(x, qkv.packed, qkv.n_out, False, None) if qkv.mode == "panel" else qkv(x)
            ops().rotary_(y, cos, sin, nh + nkv, d)
            q = y[:, :nq].view(t, nh, d)
            k = y[:, nq:nq + nk].view(t, nkv, d)
            v = y[:, nq + nk:].view(t, nkv, d)
            k_cache, v_cache = caches[attn.layer_idx]
            backend = attn.backend
            if i == 0 and backend is not None and hasattr(backend, "fused_decode"):
                fused = backend.fused_decode(q, k, v, k_cache, v_cache, meta)
                fused_cache = (k_cache.dtype, k_cache.shape)
            if (fused is not None and backend is lean[0].attn.backend and k_cache.dtype == v_cache.dtype == fused_cache[0]
                    and k_cache.shape == v_cache.shape == fused_cache[1] and k_cache.is_contiguous()
                    and v_cache.is_contiguous()):
                out = fused(q, k, v, k_cache, v_cache, attn.scaling)
            elif backend is None:
                out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=attn.scaling)
            else:
                out = backend.forward(q, k, v, k_cache, v_cache, meta, scale=attn.scaling)
            h = part.o(out.reshape(t, nq), h)
            x = part.post_norm._kernel.rms_norm(h, part.post_norm.weight, part.post_norm.eps)
            gu = part.gate_up
            h = part.down(gu._kernel.linear(x, gu.packed, gu.n_out, True, None) if gu.mode == "panel" else gu(x), h)
        return h
