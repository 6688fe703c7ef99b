"""V-JEPA 2's ViT video encoder (tubelet patches, 3D RoPE) and the per-frame encoding of the AC world model.

Parameter names equal Meta's state dicts once ``module.`` / ``backbone.`` are stripped (see ``loader``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.vjepa2.blocks import Block
from mstar.models.vjepa2.config import EncoderConfig
from mstar.models.vjepa2.rope import rope_tables

__all__ = ["PatchEmbed3D", "VJepaEncoder", "encode_frames"]


class PatchEmbed3D(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        k = (cfg.tubelet_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_chans, cfg.embed_dim, kernel_size=k, stride=k)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        return self.proj(video).flatten(2).transpose(1, 2)  # [B, T'*H'*W', D], order (t, h, w)


class VJepaEncoder(nn.Module):
    """ViT video encoder: ``video [B, C, T, H, W] -> tokens [B, (T/tubelet) * (H/p) * (W/p), D]``.

    Output = the reference ``VisionTransformer.forward`` (final LayerNorm applied, no extra normalisation).
    """

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed3D(cfg)
        self.blocks = nn.ModuleList(
            Block(cfg.embed_dim, cfg.num_heads, cfg.mlp_hidden, cfg.qkv_bias, cfg.use_silu, cfg.wide_silu,
                  cfg.layernorm_eps)
            for _ in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(cfg.embed_dim, eps=cfg.layernorm_eps)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        if video.ndim != 5:
            raise ValueError(f"expected video [B, C, T, H, W], got shape {tuple(video.shape)}")
        _, _, t, h, w = video.shape
        c = self.cfg
        if t % c.tubelet_size or h % c.patch_size or w % c.patch_size:
            raise ValueError(f"video {t}x{h}x{w} is not a multiple of tubelet {c.tubelet_size} / "
                             f"patch {c.patch_size}")
        gt, gh, gw = t // c.tubelet_size, h // c.patch_size, w // c.patch_size
        dev = video.device
        d, hh, ww = torch.meshgrid(torch.arange(gt, device=dev), torch.arange(gh, device=dev),
                                   torch.arange(gw, device=dev), indexing="ij")
        cos, sin = rope_tables(c.head_dim, d.flatten(), hh.flatten(), ww.flatten())
        x = self.patch_embed(video)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.norm(x)


def encode_frames(encoder: VJepaEncoder, frames: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Encode each frame on its own, as the AC world model does: ``frames [B, T, C, H, W] -> [B, T*N, D]``.

    Every frame is repeated ``tubelet_size`` times along time (one tubelet), encoded, and, with
    ``normalize``, layer-normed without affine parameters (eps 1e-5) -- the reference world-model wrapper's
    ``normalize_reps``; predictor outputs fed back during a rollout are normalised the same way.
    """
    b, t = frames.shape[:2]
    clips = frames.flatten(0, 1).unsqueeze(2).repeat(1, 1, encoder.cfg.tubelet_size, 1, 1)
    h = encoder(clips)  # [B*T, N, D]
    h = h.view(b, t * h.shape[1], h.shape[2])
    return F.layer_norm(h, (h.shape[-1],)) if normalize else h
