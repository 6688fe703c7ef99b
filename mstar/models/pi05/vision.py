"""pi0.5's image encoder: transformers' SigLIP vision model (no pooling head) and PaliGemma's linear
projector into the prefix width. One tower serves every camera; image embeddings are not scaled
(transformers 5.x and openpi's patched PaliGemma both leave out the old ``/ sqrt(hidden)``).

Module names equal the checkpoint's below ``paligemma.model.``: ``vision_tower.vision_model.*``
and ``multi_modal_projector.linear``.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.models.pi05.config import VisionConfig

__all__ = ["Pi05Vision"]


class _Tower(nn.Module):
    """Keeps the checkpoint prefix ``vision_tower.vision_model.`` whatever the transformers version."""

    def __init__(self, vision_model: nn.Module) -> None:
        super().__init__()
        self.vision_model = vision_model


class _Projector(nn.Module):
    def __init__(self, vision_width: int, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(vision_width, width)


class Pi05Vision(nn.Module):
    """``forward(images [N, 3, H, W] in [-1, 1])`` -> ``[N, tokens_per_image, prefix width]``."""

    def __init__(self, cfg: VisionConfig, width: int, attn_implementation: str = "sdpa") -> None:
        super().__init__()
        from transformers import SiglipVisionConfig, SiglipVisionModel

        self.cfg = cfg
        siglip = SiglipVisionModel(SiglipVisionConfig(
            hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_channels=3,
            image_size=cfg.image_size, patch_size=cfg.patch_size, hidden_act=cfg.hidden_act,
            layer_norm_eps=cfg.layer_norm_eps, attention_dropout=0.0, vision_use_head=False,
            attn_implementation=attn_implementation))
        # transformers 4.x nests the transformer under ``vision_model``; 5.x is the transformer itself
        self.vision_tower = _Tower(getattr(siglip, "vision_model", siglip))
        self.multi_modal_projector = _Projector(cfg.hidden_size, width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if images.dim() != 4 or tuple(images.shape[1:]) != (3, c.image_size, c.image_size):
            raise ValueError(f"images must be [N, 3, {c.image_size}, {c.image_size}], got {list(images.shape)}")
        w = self.multi_modal_projector.linear.weight
        feats = self.vision_tower.vision_model(pixel_values=images.to(device=w.device, dtype=w.dtype))
        return self.multi_modal_projector.linear(feats.last_hidden_state)
