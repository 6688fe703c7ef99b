"""Qwen3-Omni's Code2Wav: codec frames (16 codes each, 12.5 Hz) -> 24 kHz mono waveform.

:class:`Code2Wav` wraps transformers' ``Qwen3OmniMoeCode2Wav`` (built from its config; weights
under ``code2wav.*`` in the checkpoint) as a batched, stateless module:

* ``decode(codes [B, Q, T]) -> [B, wave_length(T)]``: the whole sequence at once (the module's
  forward, clamped to [-1, 1]);
* ``decode_chunk(codes [B, Q, T], left_context) -> list of B 1-D waveforms``: one streamed chunk,
  whose first ``left_context`` frames were already decoded by earlier chunks;
* ``decode_chunks(list of ChunkRequest) -> list of waveforms``: many requests' chunks, one forward
  per group of equal shape.

Lengths. Every decoder block upsamples with a transposed convolution of kernel ``2r`` and stride
``r`` trimmed by ``r`` on both sides, so ``L`` steps become ``(L - 1) * r``: each output sample
needs the *next* input step (one step of look-ahead). For the real config (upsampling 2, 2 then
8, 5, 4, 3) ``n`` frames give ``1920 * n - 555`` samples (:meth:`Code2Wav.wave_length`). The
samples a decode of frames ``[0, n)`` produces depend on those frames only (everything is causal
apart from that look-ahead, which the trimming already excludes).

Stitching rule. A chunk holds frames ``[s - c, e)``: ``c`` frames of left context then the new
frames ``[s, e)``. The stream so far has ``wave_length(s)`` samples, so the chunk emits its
decode's samples ``[wave_length(c), wave_length(e - s + c))``: global samples
``[wave_length(s), wave_length(e))``. The concatenation of a stream's chunks therefore has exactly
the length of a full decode, ``wave_length(n)`` (transformers' ``chunked_decode`` instead drops
``ctx * 1920`` samples, losing 555 at every boundary). A first chunk (``c = 0``) emits everything.

Values. The causal convolutions reach fewer than :data:`CONV_CONTEXT` frames back, so a chunk
convolves only its new frames and that many before them. The pre-transformer attends over a
72-frame sliding window per layer, so with 25 frames of left context a stateless chunk differs from
a full decode after each chunk start (tiny random config: relative L2 ~2e-3; the real config with
random weights: ~0.3). With ``left_context >= exact_left_context`` (``layers * (window - 1) +
CONV_CONTEXT``: 578 frames for the real model, 81 for the tiny one) the transformer sees its whole
reach and a chunk equals the full decode to rounding; the transformer is cheap next to the
convolutions, which still run over ``CONV_CONTEXT`` + new frames only.

Exact streaming with a state (:meth:`Code2Wav.decode_next`, what the served node uses; and
``new_stream`` / ``decode_streams`` over it): per request a :class:`VocoderState` holding, for each
causal convolution of the vocoder, the tail of its input it still needs, and for each transposed
convolution its last input step. Each chunk's frames go through the pre-transformer with their left
context, then only the NEW frames through the vocoder, continuing from those tails: equal to a full
decode to rounding at any chunk sizes (relative L2 ~4e-7 on random weights with audible output),
with no convolution recomputed over context. The state must be dropped when the request ends
(``Code2WavNode.release``).

Batching (:meth:`Code2Wav.decode_next_many`, the node's path): the chunks of one step decode together,
per group of equal new-frame count and alike state, with operators that compute each row as they
would alone (``_PreTransformer``, ``_BatchVocoder``): a request's samples are the same bits whatever
it shares the step with. On the benchmark model (2-core AVX2 machine, 16 requests): 16 five-frame
first chunks 543 -> 203 ms, 16 25-frame chunks 1,545 -> 746 ms against decoding them one by one
with the previous per-request path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mstar.layers import cpu_ops
from mstar.model.checkpoint import load_into

if TYPE_CHECKING:  # transformers is imported when a Code2Wav is built, not with this module
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

__all__ = ["CONV_CONTEXT", "SAMPLE_RATE", "WEIGHT_PREFIX", "ChunkRequest", "Code2Wav", "Code2WavStream",
           "NextChunk", "to_pcm16"]

SAMPLE_RATE = 24_000
WEIGHT_PREFIX = "code2wav."
# frames of transformer output the convolutions need on the left: their causal kernels reach
# 3 + 1.5 + 1.5 + 2.4 + 0.5 + 0.1 < 10 frames back (ConvNeXt at 2 and 4 steps per frame, the input
# convolution, then the residual units of each decoder block); 5 already agree to rounding
CONV_CONTEXT = 10


@dataclass(frozen=True)
class ChunkRequest:
    """One request's chunk: ``codes`` ``[Q, T]`` (row 0 = layer-0 codes), of which the first
    ``left_context`` frames are context already decoded by an earlier chunk."""

    codes: torch.Tensor
    left_context: int

    def __post_init__(self) -> None:
        if self.codes.dim() != 2:
            raise ValueError(f"chunk codes must be [num_quantizers, frames], got {tuple(self.codes.shape)}")
        if not 0 <= self.left_context < self.codes.shape[1]:
            raise ValueError(f"left_context must be in [0, {self.codes.shape[1]}), got {self.left_context}")


@dataclass(frozen=True)
class VocoderState:
    """What a streamed decode keeps of one request between chunks: the ``frames`` decoded so far and,
    per causal convolution of the vocoder, the tail of its input it still needs (``(kernel - 1) *
    dilation`` steps; the last input step for a transposed convolution, whose outputs need the next
    step too). Immutable: a chunk's decode returns a new state, so a failed decode leaves the old one."""

    frames: int
    tails: Mapping[int, torch.Tensor]  # id of the convolution module -> its kept input [1, C, steps]


@dataclass
class Code2WavStream:
    """One request's exact streaming decode (``new_stream`` / ``decode_streams``): the codes of its
    last ``transformer_context`` frames (the pre-transformer's reach) and the vocoder's state."""

    codes: torch.Tensor  # [Q, <= transformer_context]
    vocoder: VocoderState | None = None
    frames: int = 0


def _config(config: Qwen3OmniMoeCode2WavConfig | Mapping[str, Any]) -> Qwen3OmniMoeCode2WavConfig:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

    if isinstance(config, Qwen3OmniMoeCode2WavConfig):
        return config
    if isinstance(config, Mapping):
        return Qwen3OmniMoeCode2WavConfig(**config)
    raise TypeError(f"code2wav config must be a Qwen3OmniMoeCode2WavConfig or a dict, got {type(config).__name__}")


class _PointwiseConv1d(nn.Conv1d):
    """A kernel-1, stride-1 ``Conv1d`` computed as one matrix multiply over the channels. oneDNN's
    direct convolution reorders narrow tensors into its blocked layout and back: at 8 channels x
    66,663 steps (the last decoder block of the benchmark model) 4.1 ms against 0.15 ms here; the
    same parameters (names and shapes), so checkpoints load unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _pointwise(self, x)


def _pointwise(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """A kernel-1 convolution as a batched matrix multiply over the channels."""
    w = conv.weight[:, :, 0].expand(x.shape[0], -1, -1)  # [B, out, in] over x [B, in, T]
    if conv.bias is None:
        return torch.bmm(w, x)
    return torch.baddbmm(conv.bias[None, :, None], w, x)


class _NarrowConv1d(nn.Conv1d):
    """A stride-1, unpadded ``Conv1d`` with few channels (the vocoder's last stages: 1, 8 or 16
    outputs) through the compiled ``narrow_conv1d`` (every output channel's accumulator in a
    register; terms in a fixed order). oneDNN reorders such narrow tensors into its blocked layout
    and back at every call: on the benchmark model's ``8 -> 8`` kernel-7 convolution over 48,000
    steps 0.93 ms against 0.21 ms, ``8 -> 1`` over 66,651 steps 1.24 ms against 0.10 ms; the
    kernel-1 ``8 -> 8`` over 48,000 steps 56 us against 113 us as a batched matrix multiply.
    Without the extension a kernel-1 convolution is that multiply, a one-output convolution a matmul
    of its taps and a shifted sum, others ``nn.Conv1d``'s. Same parameters as the module it
    replaces."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = cpu_ops.ops()
        if kernel is not None and x.device.type == "cpu" and x.dtype == self.weight.dtype == torch.float32:
            return kernel.narrow_conv1d(x.contiguous(), self.weight, self.bias, self.dilation[0])
        if self.kernel_size == (1,):
            return _pointwise(self, x)
        if self.out_channels != 1:
            return super().forward(x)
        k, d = self.kernel_size[0], self.dilation[0]
        steps = x.shape[-1] - (k - 1) * d
        taps = torch.matmul(self.weight[0].t(), x)  # [B, k, L]: tap j of every input step
        out = taps[:, 0, :steps].clone()
        for j in range(1, k):
            out += taps[:, j, j * d:j * d + steps]
        if self.bias is not None:
            out += self.bias
        return out[:, None]


class _SnakeBeta(nn.Module):
    """transformers' ``Qwen3OmniMoeSnakeBeta`` (``x + sin(alpha * x)^2 / (beta + 1e-9)``, alpha and beta
    stored as logs, per channel of ``[B, C, T]``) in one pass of the compiled kernel
    (``mstar.layers.cpu_ops``: ``snake_beta``) instead of five operators; the same arithmetic in
    PyTorch without it. Same parameters as the module it replaces."""

    def __init__(self, channels: int, *, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels, device=device, dtype=dtype))
        self.beta = nn.Parameter(torch.zeros(channels, device=device, dtype=dtype))
        self.no_div_by_zero = 1e-9
        self._scales: tuple[tuple[object, ...], torch.Tensor, torch.Tensor] | None = None

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(exp(alpha), 1 / (exp(beta) + 1e-9))``, computed once per version of the parameters (a
        vocoder has dozens of these activations, each called once per chunk: three operators less
        per call); recomputed after a weight load or any in-place change, and under autograd."""
        if torch.is_grad_enabled():
            return torch.exp(self.alpha), 1.0 / (torch.exp(self.beta) + self.no_div_by_zero)
        key = (self.alpha._version, self.beta._version, id(self.alpha), id(self.beta), self.no_div_by_zero)
        if self._scales is None or self._scales[0] != key:
            self._scales = (key, torch.exp(self.alpha), 1.0 / (torch.exp(self.beta) + self.no_div_by_zero))
        return self._scales[1], self._scales[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha, inv_beta = self.scales()
        kernel = cpu_ops.ops()
        if kernel is not None and x.device.type == "cpu" and x.dtype == alpha.dtype == torch.float32:
            return kernel.snake_beta(x.contiguous(), alpha, inv_beta)
        return x + inv_beta[None, :, None] * torch.sin(x * alpha[None, :, None]).pow(2)


def _swap_fast_modules(model: nn.Module) -> None:
    """Swap every narrow stride-1 ``Conv1d`` of ``model`` (1 output channel, or 8 / 16 from at most
    16; kernel-1 ones included) for a ``_NarrowConv1d``, every other kernel-1 ``Conv1d`` (the
    residual units' second convolutions) for a ``_PointwiseConv1d`` and every SnakeBeta for a
    ``_SnakeBeta``, with the same parameters."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeSnakeBeta

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            plain = (type(child) is nn.Conv1d and child.stride == (1,) and child.padding == (0,)
                     and child.groups == 1)
            narrow = plain and (child.out_channels == 1
                                or (child.out_channels in (8, 16) and child.in_channels <= 16))
            if plain and not narrow and child.kernel_size == (1,):
                swap: nn.Module = _PointwiseConv1d(child.in_channels, child.out_channels, 1,
                                                   bias=child.bias is not None, device=child.weight.device,
                                                   dtype=child.weight.dtype)
            elif narrow:
                swap = _NarrowConv1d(child.in_channels, child.out_channels, child.kernel_size,
                                     dilation=child.dilation, bias=child.bias is not None,
                                     device=child.weight.device, dtype=child.weight.dtype)
            elif type(child) is Qwen3OmniMoeSnakeBeta:
                swap = _SnakeBeta(child.in_features, device=child.alpha.device, dtype=child.alpha.dtype)
                swap.no_div_by_zero = child.no_div_by_zero
            else:
                continue
            swap.load_state_dict(child.state_dict())
            setattr(module, name, swap)


@dataclass(frozen=True)
class NextChunk:
    """One request's next chunk for :meth:`Code2Wav.decode_next_many`: ``codes`` ``[Q, T]`` whose first
    ``left_context`` frames were decoded before, and the request's state (None for its first chunk)."""

    codes: torch.Tensor
    left_context: int
    state: VocoderState | None


def _kernel_width(channels: int) -> bool:
    """Output widths ``narrow_conv1d`` takes: 1, 8 or a multiple of 16."""
    return channels in (1, 8) or (channels > 0 and channels % 16 == 0)


_CAUSAL = ("Qwen3OmniMoeCausalConvNet", "Qwen3OmniMoeCausalTransConvNet")


def _is_snake(m: nn.Module) -> bool:
    return isinstance(m, _SnakeBeta) or type(m).__name__ == "Qwen3OmniMoeSnakeBeta"


def _per_row(fn: Any, x: torch.Tensor) -> torch.Tensor:
    """``fn`` over each batch row of ``x`` alone (for operators whose rounding depends on the batch)."""
    if x.shape[0] == 1:
        return fn(x)
    return torch.cat([fn(x[b:b + 1]) for b in range(x.shape[0])])


class _BatchVocoder:
    """The vocoder's modules over the next steps ``x`` ``[B, C, n]`` of B request streams at once, each
    causal convolution continuing from its inputs' tails (``old``: id of the module -> ``[B, C, keep]``;
    None for first chunks, whose tails are the zero padding; the new tails go to ``new``).

    Every operator computes a row the same way alone and in any batch, so a request's samples never
    depend on the requests decoded with it: convolutions through the compiled ``narrow_conv1d``
    (each output's terms in a fixed order; a transposed convolution as a kernel-1 convolution to its
    ``kernel * C_out`` taps, then an overlap-add), or one row at a time where it does not take the
    width or the kernels are missing; the depthwise convolution and the residual steps as
    elementwise multiplies and adds (one rounding each, wherever the element falls); LayerNorm and
    GELU one row at a time. The SnakeBeta kernel already works per row."""

    def __init__(self, old: Mapping[int, torch.Tensor] | None, taps: dict[int, tuple[object, torch.Tensor]]) -> None:
        self.old = old
        self.new: dict[int, torch.Tensor] = {}
        self.kernel = cpu_ops.ops()
        self._taps = taps

    def sequence(self, modules: Iterable[nn.Module], x: torch.Tensor) -> torch.Tensor:
        """``modules`` one after another; an activation followed by a convolution is applied as one
        step (``_causal`` / ``_trans``: the activation writes the convolution's padded input)."""
        modules = list(modules)
        i = 0
        while i < len(modules):
            m, nxt = modules[i], modules[i + 1] if i + 1 < len(modules) else None
            if _is_snake(m) and nxt is not None and type(nxt).__name__ in _CAUSAL:
                x = self._causal(nxt, x, act=m) if type(nxt).__name__ == _CAUSAL[0] else self._trans(nxt, x, act=m)
                i += 2
            else:
                x = self(m, x)
                i += 1
        return x

    def __call__(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        kind = type(m).__name__
        if kind == _CAUSAL[0]:
            return self._causal(m, x)
        if kind == _CAUSAL[1]:
            return self._trans(m, x)
        if kind == "Qwen3OmniMoeConvNeXtBlock":  # its depthwise convolution, then pointwise layers
            h = self._causal(m.dwconv, x)
            h = torch.stack([m.norm(row.t()).t() for row in h])  # LayerNorm over the channels
            h = self._pointwise(m.pwconv1, h)
            h = torch.stack([m.act(row) for row in h])
            h = self._pointwise(m.pwconv2, h)
            return x + m.gamma[:, None] * h
        if kind == "Qwen3OmniMoeCode2WavDecoderResidualUnit":  # x + conv2(act2(conv1(act1(x))))
            return self._causal(m.conv2, self._causal(m.conv1, x, act=m.act1), act=m.act2, residual=x)
        if kind == "Qwen3OmniMoeCode2WavDecoderBlock":
            return self.sequence(m.block, x)
        if _is_snake(m):
            return self._act(m, x)
        raise TypeError(f"Code2Wav streaming does not know the vocoder module {kind}")

    def _act(self, act: nn.Module, x: torch.Tensor, left: torch.Tensor | None = None) -> torch.Tensor:
        """``act(x)``, with ``left`` (already activated steps) in front when given."""
        if isinstance(act, _SnakeBeta) and self._usable(x, act.alpha, 1):
            alpha, inv_beta = act.scales()
            return self.kernel.snake_beta(x.contiguous(), alpha, inv_beta, left)
        y = act(x) if isinstance(act, _SnakeBeta) and self.kernel is not None else _per_row(act, x)
        return y if left is None else torch.cat([left, y], dim=-1)

    def _causal(self, m: nn.Module, x: torch.Tensor, act: nn.Module | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """A causal convolution (its left zero padding of ``(k-1)*d`` = the previous inputs) over
        ``act(x)``, plus ``residual``."""
        keep = m.padding
        tail = None
        if keep > 0:
            tail = self.old[id(m)] if self.old is not None else x.new_zeros(x.shape[0], x.shape[1], keep)
        if act is not None:
            xin = self._act(act, x, tail)
        else:
            xin = x if tail is None else torch.cat([tail, x], dim=-1)
        self.new[id(m)] = xin[..., xin.shape[-1] - keep:]
        conv = m.conv
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
            return self.kernel.narrow_conv1d(xin.contiguous(), conv.weight, conv.bias, conv.dilation[0], residual)
        y = _per_row(conv, xin)
        return y if residual is None else y + residual

    def _pointwise(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """An ``nn.Linear`` over the channels of ``x`` ``[B, C, n]`` (a kernel-1 convolution)."""
        if self._usable(x, linear.weight, linear.out_features):
            return self.kernel.narrow_conv1d(x.contiguous(), linear.weight[:, :, None], linear.bias, 1)
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
        key = (id(conv.weight), conv.weight._version)
        cached = self._taps.get(id(conv))
        if cached is None or cached[0] != key:  # weight [in, out, k] -> taps [k * out, in, 1]
            cached = (key, conv.weight.permute(2, 1, 0).reshape(k * out, conv.in_channels, 1).contiguous())
            self._taps[id(conv)] = cached
        z = self.kernel.narrow_conv1d(x.contiguous(), cached[1], None, 1)  # z[b, j*out + o, t] = tap j of x[b, :, t]
        B, L = x.shape[0], x.shape[-1]
        z = z.view(B, k, out, L)
        if trimmed:  # output (t - 1) * r + s = tap s of step t + tap s + r of step t - 1
            z = z[:, :r, :, 1:] + z[:, r:, :, :-1]
            L -= 1
        y = z.permute(0, 2, 3, 1).reshape(B, out, L * r)
        return y if conv.bias is None else y + conv.bias[:, None]


class _PreTransformer:
    """transformers' Code2Wav pre-transformer (RMSNorm, sliding-window causal attention with the
    rotary embedding, SiLU MLP, layer scales) over a batch of equal-length chunks ``[B, T, H]``,
    every row computed as it would be alone: the projections through the panel kernel
    (``mstar.layers.prepack``, q/k/v and gate/up each one multiply, packed once per weight version),
    the norms through the per-row RMSNorm kernel, attention one request at a time, the rest
    single-rounding elementwise steps. One forward of 16 five-frame chunks instead of 16 of
    transformers' (each ~5 ms of per-call work on the benchmark model). ``usable()`` is False without
    the kernels or for a config it does not cover (attention bias, another activation); callers then
    run transformers' module per request."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model.pre_transformer
        self.config = model.config
        self._packed: tuple[tuple[tuple[torch.Tensor, int], ...], list[tuple[Any, ...]]] | None = None
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
            att = torch.cat([torch.nn.functional.scaled_dot_product_attention(
                q[b:b + 1], k[b:b + 1], v[b:b + 1], attn_mask=mask, scale=a.scaling,
                enable_gqa=heads != kv_heads) for b in range(B)])  # one request at a time
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


class Code2Wav(nn.Module):
    """Batched stateless codec decoder around transformers' ``Qwen3OmniMoeCode2Wav`` (its kernel-1
    and narrow convolutions and its activations through faster paths:
    ``_swap_fast_modules``)."""

    def __init__(self, config: Qwen3OmniMoeCode2WavConfig | Mapping[str, Any]) -> None:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

        super().__init__()
        self.config = _config(config)
        self.model = Qwen3OmniMoeCode2Wav(self.config).eval()
        _swap_fast_modules(self.model)
        self.num_quantizers = int(self.config.num_quantizers)
        self.codebook_size = int(self.config.codebook_size)
        self.upsampling_ratios = tuple(int(r) for r in self.config.upsampling_ratios)
        self.upsample_rates = tuple(int(r) for r in self.config.upsample_rates)
        self.samples_per_frame = int(self.model.total_upsample)
        self._taps: dict[int, tuple[object, torch.Tensor]] = {}  # transposed convolutions' weights as taps
        self._pre = _PreTransformer(self.model)

    @property
    def sample_rate(self) -> int:
        return SAMPLE_RATE

    def wave_length(self, frames: int) -> int:
        """Samples a decode of ``frames`` frames produces (0 for 0 frames)."""
        if frames <= 0:
            return 0
        steps = frames
        for ratio in self.upsampling_ratios:  # kernel == stride: exact multiple
            steps *= ratio
        for rate in self.upsample_rates:  # kernel 2r, stride r, trimmed by r on both sides
            steps = (steps - 1) * rate
        return max(steps, 0)

    def emit_range(self, frames: int, left_context: int) -> tuple[int, int]:
        """The samples of a ``frames``-frame decode that a chunk with ``left_context`` context
        frames emits: ``[wave_length(left_context), wave_length(frames))``."""
        return self.wave_length(left_context), self.wave_length(frames)

    def load_weights(self, state: Mapping[str, torch.Tensor], prefix: str = WEIGHT_PREFIX) -> None:
        """Copy the ``prefix``-named tensors of a checkpoint state dict (strict: every mismatch is a
        ``CheckpointError``); tensors with other prefixes are ignored."""
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        load_into(self.model, own, what=f"checkpoint '{prefix}*' tensors")

    def _check_codes(self, codes: torch.Tensor) -> None:
        if codes.dim() != 3 or codes.shape[1] != self.num_quantizers:
            raise ValueError(f"codes must be [batch, {self.num_quantizers}, frames], got {tuple(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ValueError(f"codes must lie in [0, {self.codebook_size})")

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes`` ``[B, Q, T]`` -> waveform ``[B, wave_length(T)]`` (float32, in [-1, 1])."""
        self._check_codes(codes)
        if codes.shape[-1] == 0:
            return torch.zeros(codes.shape[0], 0)
        wav = self.model(codes.long().to(self._device()))
        return wav[:, 0].float()

    def _embed(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, Q, T]`` codes -> the mean of their 16 code embeddings ``[B, T, H]``."""
        return self.model.code_embedding(codes.long().to(self._device()) + self.model.code_offset).mean(1)

    def _vocode(self, hidden: torch.Tensor) -> torch.Tensor:
        """Transformer outputs ``[B, T, H]`` -> waveform ``[B, wave_length(T)]`` (the convolutions)."""
        x = hidden.transpose(1, 2)
        for stage in self.model.upsample:
            for block in stage:
                x = block(x)
        for block in self.model.decoder:
            x = block(x)
        return x.clamp(min=-1, max=1)[:, 0].float()

    def new_stream(self) -> Code2WavStream:
        return Code2WavStream(torch.zeros(self.num_quantizers, 0, dtype=torch.long))

    @torch.inference_mode()
    def decode_streams(self, streams: Sequence[Code2WavStream], codes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each stream's next frames (``codes[i]`` ``[Q, n_i]``, ``n_i >= 1``) -> the samples they add
        (``wave_length(total) - wave_length(before)``), decoded together (``decode_next_many``: each
        stream's samples are the same bits as decoded alone)."""
        chunks = [torch.cat([stream.codes, new.to(stream.codes)], dim=1) for stream, new in zip(streams, codes)]
        decoded = self.decode_next_many([NextChunk(chunk, stream.codes.shape[1], stream.vocoder)
                                         for stream, chunk in zip(streams, chunks)])
        out = []
        for stream, chunk, new, (wave, state) in zip(streams, chunks, codes, decoded):
            stream.vocoder = state
            stream.codes = chunk[:, max(0, chunk.shape[1] - self.transformer_context):]
            stream.frames += new.shape[1]
            out.append(wave)
        return out

    @torch.inference_mode()
    def decode_next(self, codes: torch.Tensor, left_context: int, state: VocoderState | None
                    ) -> tuple[torch.Tensor, VocoderState]:
        """A request's next chunk with the state of its earlier ones: ``codes`` ``[Q, T]`` whose first
        ``left_context`` frames were decoded before (at least ``transformer_context`` of them, or
        all frames so far) -> (the new frames' samples, the state after them). ``state`` is None
        for the first chunk. The pre-transformer runs over the whole chunk; the vocoder only over
        the new frames, from the kept tails (``VocoderState``): no recomputed context. Equals a
        full decode to float rounding at any chunk sizes; :meth:`decode_next_many` of one chunk."""
        return self.decode_next_many([NextChunk(codes, left_context, state)])[0]

    @torch.inference_mode()
    def decode_next_many(self, chunks: Sequence[NextChunk]) -> list[tuple[torch.Tensor, VocoderState]]:
        """:meth:`decode_next` for many requests' chunks: (samples, new state) per chunk, in order.
        The pre-transformer runs per request; the vocoder over each group of chunks with as many new
        frames and alike states (all first chunks, or all continuing), as one batch when the compiled
        kernels are there (``_BatchVocoder``: every row's samples are the same bits as decoded alone),
        else one request at a time."""
        for c in chunks:
            self._check_codes(c.codes[None])
            if not 0 <= c.left_context < c.codes.shape[1]:
                raise ValueError(f"left_context must be in [0, {c.codes.shape[1]}), got {c.left_context}")
            if (c.state.frames if c.state is not None else 0) < c.left_context:
                raise ValueError("the state has fewer frames than the chunk's left context")
        hidden: list[torch.Tensor] = [None] * len(chunks)  # type: ignore[list-item]  # [H, new] per chunk
        for rows in _groups(c.codes.shape[1] for c in chunks).values():
            embeds = self._embed(torch.stack([chunks[i].codes for i in rows]))
            if self._pre.usable(embeds):
                out = self._pre(embeds)
            else:  # transformers' module, one request at a time (its batched rows round differently)
                out = torch.cat([self.model.pre_transformer(inputs_embeds=e[None]).last_hidden_state for e in embeds])
            for b, i in enumerate(rows):
                hidden[i] = out[b, chunks[i].left_context:].t()
        batched = cpu_ops.ops() is not None and all(h.device.type == "cpu" and h.dtype == torch.float32
                                                    for h in hidden)
        keys = [(h.shape[1], c.state is None) for h, c in zip(hidden, chunks)]
        groups = _groups(keys) if batched else {i: [i] for i in range(len(chunks))}
        out: list[tuple[torch.Tensor, VocoderState] | None] = [None] * len(chunks)
        for rows in groups.values():
            states = [chunks[i].state for i in rows]
            old = None if states[0] is None else {k: torch.cat([s.tails[k] for s in states])  # type: ignore[union-attr]
                                                  for k in states[0].tails}
            vocoder = _BatchVocoder(old, self._taps)
            x = torch.stack([hidden[i] for i in rows])  # [B, H, new]
            for stage in self.model.upsample:
                x = vocoder.sequence(stage, x)
            x = vocoder.sequence(self.model.decoder, x)
            wave = x.clamp(min=-1, max=1)[:, 0].float()
            for b, i in enumerate(rows):
                c = chunks[i]
                frames = (c.state.frames if c.state is not None else 0) + c.codes.shape[1] - c.left_context
                tails = {k: v[b:b + 1].clone() for k, v in vocoder.new.items()}  # not views of the batch
                out[i] = (wave[b].clone(), VocoderState(frames, tails))
        return out  # type: ignore[return-value]

    @property
    def transformer_context(self) -> int:
        """Frames of left context the pre-transformer reaches (``layers * (window - 1)``)."""
        return int(self.config.num_hidden_layers) * (int(self.config.sliding_window) - 1)

    def decode_chunk(self, codes: torch.Tensor, left_context: int) -> list[torch.Tensor]:
        """One chunk of each of ``B`` rows with the same ``left_context``: the new samples of each
        row (``wave_length(T) - wave_length(left_context)`` of them)."""
        return self.decode_chunks([ChunkRequest(row, left_context) for row in codes])

    @torch.inference_mode()
    def decode_chunks(self, chunks: Sequence[ChunkRequest]) -> list[torch.Tensor]:
        """Chunks of many requests, in the order given. The transformer runs over every frame of a
        chunk (one forward per group of equal frame count); the convolutions only over the new
        frames and the :data:`CONV_CONTEXT` before them (their reach), which gives the same samples
        as convolving the whole chunk."""
        hidden: list[torch.Tensor | None] = [None] * len(chunks)
        for rows in _groups(chunk.codes.shape[1] for chunk in chunks).values():
            codes = torch.stack([chunks[i].codes for i in rows])
            self._check_codes(codes)
            out = self.model.pre_transformer(inputs_embeds=self._embed(codes)).last_hidden_state
            for row, i in enumerate(rows):
                hidden[i] = out[row]
        pieces = []
        for chunk, h in zip(chunks, hidden):
            keep = min(CONV_CONTEXT, chunk.left_context)
            pieces.append((keep, h[chunk.left_context - keep:]))
        return self._vocode_pieces(pieces)

    def _vocode_pieces(self, pieces: Sequence[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        """``(context frames, transformer outputs [T, H])`` pairs -> the samples of the frames after
        the context; one convolution pass per group of equal length."""
        out: list[torch.Tensor | None] = [None] * len(pieces)
        for frames, rows in _groups(h.shape[0] for _, h in pieces).items():
            wav = self._vocode(torch.stack([pieces[i][1] for i in rows]))
            for row, i in enumerate(rows):
                start, end = self.emit_range(frames, pieces[i][0])
                out[i] = wav[row, start:end]
        return out  # type: ignore[return-value]

    @property
    def exact_left_context(self) -> int:
        """The left context that makes a stateless chunk exact: the transformer's reach
        (``layers * (window - 1)`` frames) plus the convolutions' (:data:`CONV_CONTEXT`)."""
        return int(self.config.num_hidden_layers) * (int(self.config.sliding_window) - 1) + CONV_CONTEXT

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device


def _groups(sizes: Iterable[int]) -> dict[int, list[int]]:
    """Indices by size, in order: the rows that can share one forward."""
    out: dict[int, list[int]] = {}
    for i, size in enumerate(sizes):
        out.setdefault(size, []).append(i)
    return out


def to_pcm16(wave: torch.Tensor) -> torch.Tensor:
    """A float waveform in [-1, 1] as int16 PCM (scaled by 32767, rounded, clamped)."""
    return (wave.float().clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
