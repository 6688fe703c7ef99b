"""Code2Wav's batch-invariant streaming operators (``Code2Wav.decode_next_many``): the pre-transformer of
equal-length chunks in one forward (``PreTransformer``) and the vocoder over many requests' next
steps (``BatchVocoder``), every row computed the same way alone and in any batch."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mstar.layers import cpu_ops
from mstar.models.qwen3_omni import kernels
from mstar.models.qwen3_omni.code2wav_modules import _SnakeBeta

if TYPE_CHECKING:
    from mstar.layers.prepack import Snapshot

__all__ = ["BatchVocoder", "PreTransformer"]


def _kernel_width(channels: int) -> bool:
    """Output widths ``narrow_conv1d`` takes: 1, 8 or a multiple of 16."""
    return channels in (1, 8) or (channels > 0 and channels % 16 == 0)


# a transposed convolution over fewer input steps than this takes its taps as a panel multiply of
# the steps' rows (``BatchVocoder._transposed``): the convolution's 16-step blocks would mostly be padding
_SHORT_STEPS = 32


@functools.cache
def _hf() -> Any:
    """transformers' Qwen3-Omni modeling module, whose vocoder classes ``BatchVocoder`` dispatches on
    (imported at the first vocoder step: a Code2Wav is built from transformers' module anyway)."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe

    return modeling_qwen3_omni_moe


def _is_snake(m: nn.Module) -> bool:
    return isinstance(m, (_SnakeBeta, _hf().Qwen3OmniMoeSnakeBeta))


def _is_causal_conv(m: nn.Module | None) -> bool:
    return isinstance(m, _hf().Qwen3OmniMoeCausalConvNet)


def _is_causal_trans(m: nn.Module | None) -> bool:
    return isinstance(m, _hf().Qwen3OmniMoeCausalTransConvNet)


def _per_row(fn: Any, x: torch.Tensor) -> torch.Tensor:
    """``fn`` over each batch row of ``x`` alone (for operators whose rounding depends on the batch)."""
    if x.shape[0] == 1:
        return fn(x)
    return torch.cat([fn(x[b:b + 1]) for b in range(x.shape[0])])


class BatchVocoder:
    """The vocoder's modules over the next steps ``x`` ``[B, C, n]`` of B request streams at once, each
    causal convolution continuing from its inputs' tails (``old``: id of the module -> ``[B, C, keep]``;
    None for first chunks, whose tails are the zero padding; the new tails go to ``new``).

    Every operator computes a row the same way alone and in any batch, so a request's samples never
    depend on the requests decoded with it: convolutions through the compiled ``narrow_conv1d``
    (each output's terms in a fixed order; a transposed convolution as a kernel-1 convolution to its
    ``kernel * C_out`` taps, then an overlap-add), or one row at a time where it does not take the
    width or the kernels are missing; the depthwise convolution and the residual steps as
    elementwise multiplies and adds (one rounding each, wherever the element falls); a ConvNeXt
    block's LayerNorm and pointwise layers over its steps as rows (the rows kernel, then panel
    linears with the GELU in the first one's store), without the kernels one request at a time. The
    SnakeBeta kernel already works per row."""

    # residual units through the one-pass ``residual_unit`` kernel; False: the three-kernel form (the
    # same bits; tests compare the two)
    fuse_units = True

    def __init__(self, old: Mapping[int, torch.Tensor] | None, taps: dict[Any, tuple[object, Any]]) -> None:
        self.old = old
        self.new: dict[int, torch.Tensor] = {}
        # the vocoder kernels (``mstar.models.qwen3_omni.kernels``) go with the core panel linears (a
        # short input's taps, the ConvNeXt pointwise layers): both, or the PyTorch paths
        self.core = cpu_ops.ops()
        self.kernel = kernels.ops() if self.core is not None else None
        self._taps = taps

    def sequence(self, modules: Iterable[nn.Module], x: torch.Tensor) -> torch.Tensor:
        """``modules`` one after another; an activation followed by a convolution is applied as one
        step (``_causal`` / ``_trans``: the activation writes the convolution's padded input)."""
        modules = list(modules)
        i = 0
        while i < len(modules):
            m, nxt = modules[i], modules[i + 1] if i + 1 < len(modules) else None
            if _is_snake(m) and (_is_causal_conv(nxt) or _is_causal_trans(nxt)):
                x = self._causal(nxt, x, act=m) if _is_causal_conv(nxt) else self._trans(nxt, x, act=m)
                i += 2
            else:
                x = self(m, x)
                i += 1
        return x

    def __call__(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        hf = _hf()
        if _is_causal_conv(m):
            return self._causal(m, x)
        if _is_causal_trans(m):
            return self._trans(m, x)
        if isinstance(m, hf.Qwen3OmniMoeConvNeXtBlock):  # its depthwise convolution, then pointwise layers
            h = self._causal(m.dwconv, x)
            pointwise = self._packed_pointwise(m, h)
            if pointwise is not None:  # every step a row of [B * n, C]: LayerNorm, up with GELU, down
                up, down = pointwise
                b, c, n = h.shape
                rows = h.transpose(1, 2).reshape(b * n, c).contiguous()
                rows = self.core.layer_norm(rows, m.norm.weight, m.norm.bias, m.norm.eps)
                h = down(up.linear_gelu(rows, m.pwconv1.bias), bias=m.pwconv2.bias).view(b, n, c).transpose(1, 2)
            else:
                h = torch.stack([m.norm(row.t()).t() for row in h])  # LayerNorm over the channels
                h = self._pointwise(m.pwconv1, h)
                h = torch.stack([m.act(row) for row in h])
                h = self._pointwise(m.pwconv2, h)
            return x + m.gamma[:, None] * h
        if isinstance(m, hf.Qwen3OmniMoeCode2WavDecoderResidualUnit):  # x + conv2(act2(conv1(act1(x))))
            fused = self._unit(m, x)
            if fused is not None:
                return fused
            return self._causal(m.conv2, self._causal(m.conv1, x, act=m.act1), act=m.act2, residual=x)
        if isinstance(m, hf.Qwen3OmniMoeCode2WavDecoderBlock):
            return self.sequence(m.block, x)
        if _is_snake(m):
            return self._act(m, x)
        raise TypeError(f"Code2Wav streaming does not know the vocoder module {type(m).__name__}")

    def _packed_pointwise(self, m: nn.Module, h: torch.Tensor) -> tuple[Any, Any] | None:
        """A ConvNeXt block's pointwise layers as panel linears (``mstar.layers.prepack``), packed once
        per weight version and kept with the taps, when the kernels take the block (float32, an
        affine LayerNorm, the erf GELU); else None."""
        from mstar.layers.prepack import PrepackedLinear

        norm, act, up, down = m.norm, m.act, m.pwconv1, m.pwconv2
        if (self.core is None or self.kernel is None or h.device.type != "cpu" or h.dtype != torch.float32
                or not isinstance(norm, nn.LayerNorm) or norm.weight is None or norm.bias is None
                or not isinstance(act, nn.GELU) or act.approximate != "none"
                or any(p is None or p.dtype != torch.float32 for p in (up.weight, up.bias, down.weight, down.bias))):
            return None
        pack = lambda w: PrepackedLinear(w, mode="panel")  # noqa: E731
        return self._derived("panel", up.weight, pack), self._derived("panel", down.weight, pack)

    def _unit(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """A residual unit in one kernel pass (``residual_unit``: the activated input and the first
        convolution's output stay in per-task tiles; the same bits as the three-kernel form below),
        when the kernels take it: SnakeBeta activations, a causal stride-1 convolution and a kernel-1
        one, both ``C -> C`` with C 8 or a multiple of 16, float32; else None."""
        first, second = m.conv1, m.conv2
        a, b = first.conv, second.conv
        c = x.shape[1]
        if not (self.kernel is not None and self.fuse_units
                and isinstance(m.act1, _SnakeBeta) and isinstance(m.act2, _SnakeBeta)
                and _is_causal_conv(first) and _is_causal_conv(second)
                and x.device.type == "cpu" and x.dtype == torch.float32 and _kernel_width(c) and c != 1
                and all(conv.groups == 1 and conv.stride == (1,) and conv.padding == (0,)
                        and conv.in_channels == conv.out_channels == c and conv.weight.dtype == torch.float32
                        and (conv.bias is None or conv.bias.dtype == torch.float32) for conv in (a, b))
                and b.kernel_size == (1,) and second.padding == 0
                and first.padding == (a.kernel_size[0] - 1) * a.dilation[0]):
            return None
        left = self.old[id(first)] if self.old is not None else None
        alpha_a, inv_beta_a = m.act1.scales()
        alpha_b, inv_beta_b = m.act2.scales()
        out, tail = self.kernel.residual_unit(x.contiguous(), left, alpha_a, inv_beta_a, self._laid(a.weight), a.bias,
                                              a.dilation[0], alpha_b, inv_beta_b, self._laid(b.weight), b.bias)
        self.new[id(first)] = tail
        self.new[id(second)] = x[..., x.shape[-1]:]
        return out

    def _act(self, act: nn.Module, x: torch.Tensor, left: torch.Tensor | None = None) -> torch.Tensor:
        """``act(x)``, with ``left`` (already activated steps) in front when given."""
        if isinstance(act, _SnakeBeta) and self._usable(x, act.alpha, 1):
            alpha, inv_beta = act.scales()
            return self.kernel.snake_beta(x.contiguous(), alpha, inv_beta, left)
        y = _per_row(act, x)
        return y if left is None else torch.cat([left, y], dim=-1)

    def _causal(self, m: nn.Module, x: torch.Tensor, act: nn.Module | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """A causal convolution (its left zero padding of ``(k-1)*d`` = the previous inputs) over
        ``act(x)``, plus ``residual``."""
        keep = m.padding
        conv = m.conv
        if (keep == 0 and isinstance(act, _SnakeBeta) and act.alpha.dtype == torch.float32 and conv.groups == 1
                and conv.kernel_size[0] == 1 and conv.out_channels <= 16 and self._usable(x, conv.weight, conv.out_channels)):
            # a kernel-1 convolution of the activation: SnakeBeta applied as the kernel loads each input
            self.new[id(m)] = x[..., x.shape[-1]:]
            alpha, inv_beta = act.scales()
            return self.kernel.narrow_conv1d(x.contiguous(), self._laid(conv.weight), conv.bias, 1, residual, alpha,
                                             inv_beta)
        tail = None
        if keep > 0:
            tail = self.old[id(m)] if self.old is not None else x.new_zeros(x.shape[0], x.shape[1], keep)
        if act is not None:
            xin = self._act(act, x, tail)
        else:
            xin = x if tail is None else torch.cat([tail, x], dim=-1)
        self.new[id(m)] = xin[..., xin.shape[-1] - keep:]
        if conv.groups == 1:
            return self._conv(conv, xin, residual)
        if conv.groups == conv.in_channels == conv.out_channels:
            y = _depthwise(conv, xin)
        else:
            y = _per_row(conv, xin)
        return y if residual is None else y + residual

    def _trans(self, m: nn.Module, x: torch.Tensor, act: nn.Module | None = None) -> torch.Tensor:
        """A causal transposed convolution over ``act(x)``."""
        if m.left_pad == 0 and m.right_pad == 0:  # kernel == stride: an exact upsampling
            return self._transposed(m.conv, x if act is None else self._act(act, x), trimmed=False)
        # kernel 2r, stride r, r trimmed on both sides: output p needs inputs p // r and the next
        # one; emitted are the outputs whose inputs have both arrived
        prev = self.old[id(m)] if self.old is not None else None
        if act is not None:
            xin = self._act(act, x, prev)
        else:
            xin = x if prev is None else torch.cat([prev, x], dim=-1)
        self.new[id(m)] = xin[..., -1:]
        return self._transposed(m.conv, xin, trimmed=True)

    def _usable(self, x: torch.Tensor, weight: torch.Tensor, channels: int) -> bool:
        return (self.kernel is not None and _kernel_width(channels) and x.device.type == "cpu"
                and x.dtype == weight.dtype == torch.float32)

    def _conv(self, conv: nn.Conv1d, xin: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self._usable(xin, conv.weight, conv.out_channels):
            return self.kernel.narrow_conv1d(xin.contiguous(), self._laid(conv.weight), conv.bias, conv.dilation[0],
                                             residual)
        y = _per_row(conv, xin)
        return y if residual is None else y + residual

    def _derived(self, kind: str, weight: torch.Tensor, make: Any) -> Any:
        """``make(weight)``, kept with the taps until ``weight`` changes (``mstar.layers.prepack.unchanged``)."""
        from mstar.layers.prepack import unchanged, versions

        key = (kind, id(weight))
        cached = self._taps.get(key)
        if cached is None or not unchanged(cached[0], weight):
            with torch.inference_mode(False), torch.no_grad():  # a packed copy keeps a version counter
                cached = (versions(weight), make(weight.detach()))
            self._taps[key] = cached
        return cached[1]

    def _laid(self, weight: torch.Tensor) -> torch.Tensor:
        """A convolution weight ``[out, in, k]`` (a linear's ``[out, in]`` as kernel 1) as a view of a
        kept ``[in, k, out]`` copy: the layout the kernels read, so their ``permute(1, 2, 0).contiguous()``
        copies nothing at each call (the real model's 768-channel kernel-7 weights are 16.5 MB each)."""
        def make(w: torch.Tensor) -> torch.Tensor:
            w = w if w.dim() == 3 else w[:, :, None]
            return w.permute(1, 2, 0).contiguous().permute(2, 0, 1)

        return self._derived("laid", weight, make)

    def _taps_linear(self, conv: nn.ConvTranspose1d) -> Any:
        """The convolution's taps (``[k * out, in]``, as ``_transposed`` lays them out) as a panel
        linear, packed once per weight version."""
        from mstar.layers.prepack import PrepackedLinear

        k, out = conv.kernel_size[0], conv.out_channels
        return self._derived("linear", conv.weight, lambda w: PrepackedLinear(
            w.permute(2, 1, 0).reshape(k * out, conv.in_channels), mode="panel"))

    def _pointwise(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """An ``nn.Linear`` over the channels of ``x`` ``[B, C, n]`` (a kernel-1 convolution)."""
        if self._usable(x, linear.weight, linear.out_features):
            return self.kernel.narrow_conv1d(x.contiguous(), self._laid(linear.weight), linear.bias, 1)
        return torch.stack([linear(row.t()).t() for row in x])

    def _transposed(self, conv: nn.ConvTranspose1d, x: torch.Tensor, trimmed: bool) -> torch.Tensor:
        """``conv`` (stride r, kernel r, or 2r with r outputs trimmed on each side) over ``x`` ``[B, C, L]``:
        ``L * r`` outputs, or ``(L - 1) * r`` trimmed ones."""
        r, k = conv.stride[0], conv.kernel_size[0]
        if k != (2 * r if trimmed else r):
            raise TypeError(f"Code2Wav streaming expects a transposed convolution of kernel {'2r' if trimmed else 'r'}"
                            f" (stride {r}), got kernel {k}")
        out = conv.out_channels
        if not self._usable(x, conv.weight, k * out):
            return _per_row(lambda row: conv(row)[..., r:row.shape[-1] * r] if trimmed else conv(row), x)
        b, c, steps = x.shape
        if steps < _SHORT_STEPS:
            # few steps (a first stage's chunk): every step a row of one panel multiply, as the
            # convolution's 16-step blocks would mostly compute padding (each output the same sum in
            # input order; a row's bits do not depend on the batch)
            z = self._taps_linear(conv)(x.transpose(1, 2).reshape(b * steps, c).contiguous())
            z = z.view(b, steps, -1).transpose(1, 2).contiguous()
        else:
            # weight [in, out, k] -> taps [k * out, in, 1]: z[b, j*out + o, t] = tap j of x[b, :, t]
            taps = self._derived("taps", conv.weight, lambda w: w.permute(0, 2, 1).reshape(
                conv.in_channels, 1, k * out).contiguous().permute(2, 0, 1))
            z = self.kernel.narrow_conv1d(x.contiguous(), taps, None, 1)
        # output t * r + s = tap s of step t (trimmed: output (t - 1) * r + s = tap s of step t + tap
        # s + r of step t - 1), plus the bias: interleaved in one pass
        return self.kernel.upsample_taps(z, r, trimmed, conv.bias)


class PreTransformer:
    """transformers' Code2Wav pre-transformer (RMSNorm, sliding-window causal attention with the
    rotary embedding, SiLU MLP, layer scales) over a batch of equal-length chunks ``[B, T, H]``,
    every row computed as it would be alone: the projections through the panel kernel
    (``mstar.layers.prepack``, q/k/v and gate/up each one multiply, packed once per weight version),
    the norms through the per-row RMSNorm kernel, attention in one call (per request and head), the rest
    single-rounding elementwise steps. One forward of 16 five-frame chunks instead of 16 of
    transformers' (each with its own per-call overhead). ``usable()`` is False without
    the kernels or for a config it does not cover (attention bias, another activation); callers then
    run transformers' module per request."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model.pre_transformer
        self.config = model.config
        self._packed: tuple[Snapshot, list[tuple[Any, ...]]] | None = None
        self._masks: dict[tuple[int, int | None], torch.Tensor] = {}

    def usable(self, x: torch.Tensor) -> bool:
        c = self.config
        return (cpu_ops.ops() is not None and x.device.type == "cpu" and x.dtype == torch.float32
                and not getattr(c, "attention_bias", False) and c.hidden_act == "silu"
                and all(p.dtype == torch.float32 and p.device.type == "cpu" for p in self.model.parameters()))

    def _layers(self) -> list[tuple[Any, ...]]:
        from mstar.layers.prepack import PrepackedLinear, unchanged, versions

        params = list(self.model.parameters())
        if self._packed is not None and unchanged(self._packed[0], *params):
            return self._packed[1]
        packed = []
        with torch.inference_mode(False), torch.no_grad():  # the packed copies keep version counters
            for layer in self.model.layers:
                a, m = layer.self_attn, layer.mlp
                packed.append((
                    PrepackedLinear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), mode="panel"),
                    PrepackedLinear(a.o_proj.weight, mode="panel"),
                    PrepackedLinear(torch.cat([m.gate_proj.weight, m.up_proj.weight]), silu_mul=True, mode="panel"),
                    PrepackedLinear(m.down_proj.weight, mode="panel")))
        self._packed = (versions(*params), packed)
        return packed

    def _mask(self, t: int, window: int | None) -> torch.Tensor:
        """Query i sees keys j with i - window < j <= i (transformers' sliding-window causal mask)."""
        mask = self._masks.get((t, window))
        if mask is None:
            i = torch.arange(t)[:, None]
            j = torch.arange(t)[None, :]
            mask = (j <= i) & ((i - j < window) if window is not None else True)
            self._masks[(t, window)] = mask
        return mask

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernel, c = cpu_ops.ops(), self.config
        B, T, H = x.shape
        heads, kv_heads = int(c.num_attention_heads), int(c.num_key_value_heads)
        d = int(getattr(c, "head_dim", None) or H // heads)
        cos, sin = self.model.rotary_emb(x, torch.arange(T)[None])  # [1, T, d]
        h = x.reshape(B * T, H).contiguous()
        for i, (layer, (qkv, o_proj, gate_up, down)) in enumerate(zip(self.model.layers, self._layers())):
            a = layer.self_attn
            y = qkv(kernel.rms_norm(h, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon))
            q = y[:, :heads * d].reshape(B, T, heads, d).transpose(1, 2)
            k = y[:, heads * d:(heads + kv_heads) * d].reshape(B, T, kv_heads, d).transpose(1, 2)
            v = y[:, (heads + kv_heads) * d:].reshape(B, T, kv_heads, d).transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            window = a.sliding_window if c.layer_types[i] == "sliding_attention" else None
            mask = self._mask(T, window)
            # one call for the batch: PyTorch's CPU attention computes each (request, head) on its
            # own, blocked by the sequence lengths only (a row's bits alone and in any batch: tested)
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a.scaling,
                                                                   enable_gqa=heads != kv_heads)
            att = att.transpose(1, 2).reshape(B * T, heads * d).contiguous()
            h = h + layer.self_attn_layer_scale.scale * o_proj(att)
            mlp = down(gate_up(kernel.rms_norm(h, layer.post_attention_layernorm.weight,
                                               layer.post_attention_layernorm.variance_epsilon)))
            h = h + layer.mlp_layer_scale.scale * mlp
        norm = self.model.norm
        return kernel.rms_norm(h, norm.weight, norm.variance_epsilon).view(B, T, H)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding ``x * cos + rotate_half(x) * sin`` over ``[B, heads, T, d]``."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]


def _depthwise(conv: nn.Conv1d, xin: torch.Tensor) -> torch.Tensor:
    """A depthwise stride-1 convolution over a padded ``xin`` ``[B, C, L]`` as its taps, ``x[t + j*d] *
    w[c, j]`` added in tap order (then the bias), each step one rounding: the same bits for a row
    whatever the batch."""
    k, d = conv.kernel_size[0], conv.dilation[0]
    n = xin.shape[-1] - (k - 1) * d
    w = conv.weight[:, 0]  # [C, k]
    out = xin[..., :n] * w[:, 0:1]
    for j in range(1, k):
        out = out + xin[..., j * d:j * d + n] * w[:, j:j + 1]
    return out if conv.bias is None else out + conv.bias[:, None]
