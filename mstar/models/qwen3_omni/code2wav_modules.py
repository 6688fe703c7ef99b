"""Code2Wav's vocoder modules swapped for faster ones with the same parameters (``swap_fast_modules``):
kernel-1 convolutions as matrix multiplies, narrow convolutions through the compiled
``narrow_conv1d``, SnakeBeta through the compiled ``snake_beta`` (``mstar.models.qwen3_omni.kernels``);
each with a PyTorch path where the extension is missing."""

from __future__ import annotations

import torch
from torch import nn

from mstar.layers.prepack import Snapshot, unchanged, versions
from mstar.models.qwen3_omni import kernels

__all__ = ["swap_fast_modules"]


class _PointwiseConv1d(nn.Conv1d):
    """A kernel-1, stride-1 ``Conv1d`` computed as one matrix multiply over the channels. oneDNN's
    direct convolution reorders narrow tensors into its blocked layout and back at every call, which
    costs more than the multiply on few channels over many steps; the same parameters (names and
    shapes), so checkpoints load unchanged."""

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
    and back at every call, which dominates a convolution of so few channels (the real model's last
    ``96 -> 1`` convolution included). Without the extension a kernel-1 convolution is that multiply, a one-output convolution a matmul
    of its taps and a shifted sum, others ``nn.Conv1d``'s. Same parameters as the module it
    replaces."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = kernels.ops()
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
    (``mstar.models.qwen3_omni.kernels``: ``snake_beta``) instead of five operators; the same arithmetic in
    PyTorch without it. Same parameters as the module it replaces."""

    def __init__(self, channels: int, *, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels, device=device, dtype=dtype))
        self.beta = nn.Parameter(torch.zeros(channels, device=device, dtype=dtype))
        self.no_div_by_zero = 1e-9
        self._scales: tuple[Snapshot, float, torch.Tensor, torch.Tensor] | None = None

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(exp(alpha), 1 / (exp(beta) + 1e-9))``, computed once per version and storage of the parameters (a
        vocoder has dozens of these activations, each called once per chunk: three operators less
        per call); recomputed after a weight load or any in-place change, and under autograd."""
        if torch.is_grad_enabled():
            return torch.exp(self.alpha), 1.0 / (torch.exp(self.beta) + self.no_div_by_zero)
        kept = self._scales
        if kept is None or kept[1] != self.no_div_by_zero or not unchanged(kept[0], self.alpha, self.beta):
            kept = (versions(self.alpha, self.beta), self.no_div_by_zero, torch.exp(self.alpha),
                    1.0 / (torch.exp(self.beta) + self.no_div_by_zero))
            self._scales = kept
        return kept[2], kept[3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha, inv_beta = self.scales()
        kernel = kernels.ops()
        if kernel is not None and x.device.type == "cpu" and x.dtype == alpha.dtype == torch.float32:
            return kernel.snake_beta(x.contiguous(), alpha, inv_beta)
        return x + inv_beta[None, :, None] * torch.sin(x * alpha[None, :, None]).pow(2)


def swap_fast_modules(model: nn.Module) -> None:
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
