"""BAGEL's image autoencoder: the FLUX VAE, run as ``diffusers.AutoencoderKL``.

BAGEL ships the autoencoder as Black Forest Labs' ``ae.safetensors`` (``encoder.down.{i}.block.{j}``
...); ``convert_bfl_state_dict`` renames it to diffusers' layout. Latents are scaled as BAGEL uses
them: ``encode`` returns ``scaling_factor * (mean - shift_factor)`` and ``decode`` inverts that.
``encode`` is deterministic (the posterior mean); BAGEL's own code draws a posterior sample when it
encodes an input image, a difference of the order of the posterior's (tiny) standard deviation.

Latent tokens: a latent ``[C, h*p, w*p]`` becomes ``h*w`` tokens of ``p*p*C`` values, patches
row-major and each flattened as (p_row, p_col, c) -- ``patchify_latents`` / ``unpatchify_latents``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from mstar.model.checkpoint import mismatch_report
from mstar.model.validation import check_int
from mstar.models.bagel.embeddings import patchify, unpatchify

__all__ = [
    "FLUX",
    "TINY",
    "BagelVAE",
    "BagelVAEConfig",
    "bfl_key_map",
    "convert_bfl_state_dict",
    "patchify_latents",
    "unpatchify_latents",
]


@dataclass(frozen=True)
class BagelVAEConfig:
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    latent_channels: int = 16
    norm_num_groups: int = 32
    scaling_factor: float = 0.3611
    shift_factor: float = 0.1159
    in_channels: int = 3
    out_channels: int = 3
    sample_size: int = 256

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_out_channels", tuple(int(c) for c in self.block_out_channels))
        if not self.block_out_channels:
            raise ValueError("block_out_channels must not be empty")
        for c in self.block_out_channels:
            if c < 1 or c % self.norm_num_groups:
                raise ValueError(f"every block_out_channels entry must be a positive multiple of "
                                 f"norm_num_groups ({self.norm_num_groups}), got {self.block_out_channels}")
        for name in ("layers_per_block", "latent_channels", "in_channels", "out_channels"):
            check_int(getattr(self, name), f"BagelVAEConfig.{name}")
        if self.scaling_factor == 0:
            raise ValueError("scaling_factor must be non-zero")

    @property
    def num_levels(self) -> int:
        return len(self.block_out_channels)

    @property
    def downsample(self) -> int:
        """Pixels per latent cell along each side."""
        return 2 ** (self.num_levels - 1)

    def diffusers_kwargs(self) -> dict:
        n = self.num_levels
        return dict(
            in_channels=self.in_channels, out_channels=self.out_channels,
            down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
            block_out_channels=self.block_out_channels, layers_per_block=self.layers_per_block,
            act_fn="silu", latent_channels=self.latent_channels, norm_num_groups=self.norm_num_groups,
            sample_size=self.sample_size, scaling_factor=self.scaling_factor, shift_factor=self.shift_factor,
            use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True,
        )


# The FLUX.1 autoencoder BAGEL-7B-MoT ships as ae.safetensors (8x downsampling, 16 latent channels).
FLUX = BagelVAEConfig()

# A tiny random-weight twin for tests (2x downsampling, 4 latent channels).
TINY = BagelVAEConfig(block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4)


# ----------------------------------------------------------------------------------------------
# BFL -> diffusers names
# ----------------------------------------------------------------------------------------------

_RESNET_PARTS = ("norm1", "conv1", "norm2", "conv2")
_ATTN_PARTS = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def _resnet(out: dict[str, str], bfl: str, dif: str, c_in: int, c_out: int) -> None:
    parts = [(p, p) for p in _RESNET_PARTS]
    if c_in != c_out:
        parts.append(("nin_shortcut", "conv_shortcut"))
    for b, d in parts:
        for t in ("weight", "bias"):
            out[f"{bfl}.{b}.{t}"] = f"{dif}.{d}.{t}"


def _module(out: dict[str, str], bfl: str, dif: str) -> None:
    for t in ("weight", "bias"):
        out[f"{bfl}.{t}"] = f"{dif}.{t}"


def _mid(out: dict[str, str], side: str, channels: int) -> None:
    _resnet(out, f"{side}.mid.block_1", f"{side}.mid_block.resnets.0", channels, channels)
    for b, d in _ATTN_PARTS.items():
        _module(out, f"{side}.mid.attn_1.{b}", f"{side}.mid_block.attentions.0.{d}")
    _resnet(out, f"{side}.mid.block_2", f"{side}.mid_block.resnets.1", channels, channels)


def bfl_key_map(config: BagelVAEConfig = FLUX) -> dict[str, str]:
    """Every parameter of the BFL autoencoder of ``config``: BFL name -> diffusers ``AutoencoderKL`` name.

    BFL numbers the decoder's ``up`` levels by resolution (level 0 is the full-resolution one, run
    last); diffusers numbers ``up_blocks`` in execution order, so BFL ``up.{i}`` is ``up_blocks.{n-1-i}``.
    """
    ch = config.block_out_channels
    n, layers = len(ch), config.layers_per_block
    out: dict[str, str] = {}
    # encoder
    _module(out, "encoder.conv_in", "encoder.conv_in")
    c_in = ch[0]
    for i in range(n):
        for j in range(layers):
            _resnet(out, f"encoder.down.{i}.block.{j}", f"encoder.down_blocks.{i}.resnets.{j}", c_in, ch[i])
            c_in = ch[i]
        if i != n - 1:
            _module(out, f"encoder.down.{i}.downsample.conv", f"encoder.down_blocks.{i}.downsamplers.0.conv")
    _mid(out, "encoder", ch[-1])
    _module(out, "encoder.norm_out", "encoder.conv_norm_out")
    _module(out, "encoder.conv_out", "encoder.conv_out")
    # decoder
    _module(out, "decoder.conv_in", "decoder.conv_in")
    _mid(out, "decoder", ch[-1])
    c_in = ch[-1]
    for u in range(n):
        level = n - 1 - u
        for j in range(layers + 1):
            _resnet(out, f"decoder.up.{level}.block.{j}", f"decoder.up_blocks.{u}.resnets.{j}", c_in, ch[level])
            c_in = ch[level]
        if level != 0:
            _module(out, f"decoder.up.{level}.upsample.conv", f"decoder.up_blocks.{u}.upsamplers.0.conv")
    _module(out, "decoder.norm_out", "decoder.conv_norm_out")
    _module(out, "decoder.conv_out", "decoder.conv_out")
    return out


def convert_bfl_state_dict(state_dict: Mapping[str, torch.Tensor],
                           config: BagelVAEConfig = FLUX) -> dict[str, torch.Tensor]:
    """A BFL/FLUX ``ae.safetensors`` state dict -> ``AutoencoderKL`` state dict for ``config``.

    The 1x1-conv attention projections (``[C, C, 1, 1]``) become ``Linear`` weights ``[C, C]``. Raises
    ``ValueError`` naming every missing and unexpected BFL key.
    """
    names = bfl_key_map(config)
    missing = sorted(k for k in names if k not in state_dict)
    unexpected = sorted(k for k in state_dict if k not in names)
    report = mismatch_report([(f"{len(missing)} missing key(s)", missing),
                              (f"{len(unexpected)} unexpected key(s)", unexpected)])
    if report:
        raise ValueError("the state dict does not match the BFL autoencoder of this config "
                         f"(block_out_channels={list(config.block_out_channels)}, "
                         f"layers_per_block={config.layers_per_block}): {report}")
    out: dict[str, torch.Tensor] = {}
    for bfl, dif in names.items():
        tensor = state_dict[bfl]
        if ".mid_block.attentions." in dif and dif.endswith(".weight") and tensor.dim() == 4:
            if tensor.shape[2:] != (1, 1):
                raise ValueError(f"{bfl}: expected a 1x1 conv weight, got shape {tuple(tensor.shape)}")
            tensor = tensor[:, :, 0, 0]
        out[dif] = tensor
    return out


# ----------------------------------------------------------------------------------------------
# the module
# ----------------------------------------------------------------------------------------------


class BagelVAE(nn.Module):
    """``model`` (a ``diffusers.AutoencoderKL`` without quant convs) with BAGEL's latent scaling."""

    def __init__(self, config: BagelVAEConfig = FLUX, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        with torch.device(device if device is not None else "cpu"):
            from diffusers import AutoencoderKL  # heavy: only where a VAE is built

            self.model = AutoencoderKL(**config.diffusers_kwargs())
        if dtype is not None:
            # plain Module.to: AutoencoderKL keeps no fp32-only modules, and its own .to() warns on a cast
            nn.Module.to(self.model, dtype)

    @property
    def downsample(self) -> int:
        return self.config.downsample

    @property
    def latent_channels(self) -> int:
        return self.config.latent_channels

    def load_bfl_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load BFL-named weights (strict; see ``convert_bfl_state_dict``)."""
        converted = convert_bfl_state_dict(state_dict, self.config)
        self.model.load_state_dict(converted, strict=True, assign=self._on_meta())

    def _on_meta(self) -> bool:
        return any(p.is_meta for p in self.model.parameters())

    @classmethod
    def from_bfl_file(cls, path: str | os.PathLike, config: BagelVAEConfig = FLUX, *,
                      dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> BagelVAE:
        """Build from an ``ae.safetensors`` file (weights cast to ``dtype``, placed on ``device``)."""
        from safetensors.torch import load_file

        state = load_file(os.fspath(path), device=str(device) if device is not None else "cpu")
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        vae = cls(config, dtype=dtype, device="meta")
        vae.load_bfl_state_dict(state)
        return vae.eval()

    def _check_images(self, images: torch.Tensor) -> None:
        if images.dim() != 4 or images.shape[1] != self.config.in_channels:
            raise ValueError(f"expected images [B, {self.config.in_channels}, H, W], got {tuple(images.shape)}")
        h, w = images.shape[2:]
        if h % self.downsample or w % self.downsample:
            raise ValueError(f"image size {h}x{w} is not a multiple of the VAE downsampling {self.downsample}")

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` in ``[-1, 1]`` -> scaled latents ``[B, C, H/d, W/d]`` (posterior mean)."""
        self._check_images(images)
        w = self.model.encoder.conv_in.weight
        moments = self.model.encoder(images.to(device=w.device, dtype=w.dtype))
        mean = moments[:, : self.config.latent_channels]
        return self.config.scaling_factor * (mean - self.config.shift_factor)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents ``[B, C, h, w]`` -> images ``[B, 3, h*d, w*d]`` (nominally in ``[-1, 1]``, not clamped)."""
        if latents.dim() != 4 or latents.shape[1] != self.config.latent_channels:
            raise ValueError(f"expected latents [B, {self.config.latent_channels}, h, w], "
                             f"got {tuple(latents.shape)}")
        w = self.model.decoder.conv_in.weight
        z = latents.to(device=w.device, dtype=w.dtype) / self.config.scaling_factor + self.config.shift_factor
        return self.model.decoder(z)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(images))


def patchify_latents(latent: torch.Tensor, patch_size: int = 2) -> torch.Tensor:
    """One latent ``[C, h*p, w*p]`` -> tokens ``[h*w, p*p*C]`` (BAGEL's (h, w, p, q, c) layout)."""
    return patchify(latent, patch_size)


def unpatchify_latents(tokens: torch.Tensor, h: int, w: int, patch_size: int = 2,
                       channels: int = 16) -> torch.Tensor:
    """Tokens ``[h*w, p*p*C]`` -> latent ``[C, h*p, w*p]`` (``h``, ``w`` counted in patches)."""
    return unpatchify(tokens, h, w, patch_size, channels)
