"""BAGEL's understanding image encoder: SigLIP (``transformers.SiglipVisionModel``) over native-size
images, then the ``connector`` MLP into the LLM width plus the fixed ``vit_pos_embed``.

Differences from stock SigLIP, as BAGEL trained it:

- the patch embedding is an ``nn.Linear`` over patchified pixels (the conv kernel permuted to
  (out, kh, kw, in) and flattened), so any image whose sides are multiples of the patch size works;
- patch ``(r, c)`` reads SigLIP's learned position table and ``vit_pos_embed`` at the flat id
  ``r * vit_max_num_patch_per_side + c``: a smaller image takes the top-left sub-grid;
- the last encoder layer of the released SigLIP is dropped and there is no pooling head.

Module names equal the checkpoint prefixes (``vit_model.vision_model.*``, ``connector.fc{1,2}``,
``vit_pos_embed.pos_embed``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.layers.prepack import PrepackableLinear
from mstar.model.validation import check_int
from mstar.models.bagel.embeddings import PositionEmbedding, flattened_position_ids, patchify

# activations SigLIP configs use (transformers, the heavy import, loads only when a ViT is built)
_ACTIVATIONS = frozenset({"gelu_pytorch_tanh", "gelu", "gelu_new", "gelu_fast", "quick_gelu", "relu", "silu",
                          "swish", "tanh"})

__all__ = ["BAGEL_7B_MOT_VIT", "TINY", "BagelViT", "BagelViTConfig", "conv_patch_weight_to_linear"]


@dataclass(frozen=True)
class BagelViTConfig:
    """The SigLIP encoder as BAGEL builds it. ``num_hidden_layers`` is the number of layers BUILT
    (``from_json`` subtracts the dropped last layer)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    patch_size: int
    image_size: int
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    num_channels: int = 3
    vit_max_num_patch_per_side: int = 70
    llm_hidden: int = 3584
    connector_act: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "patch_size", "image_size", "num_channels", "vit_max_num_patch_per_side", "llm_hidden"):
            check_int(getattr(self, name), f"BagelViTConfig.{name}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.image_size // self.patch_size != self.vit_max_num_patch_per_side:
            # Both position tables are read with the same flat ids (stride vit_max_num_patch_per_side).
            raise ValueError(f"image_size // patch_size ({self.image_size // self.patch_size}) must equal "
                             f"vit_max_num_patch_per_side ({self.vit_max_num_patch_per_side})")
        if self.llm_hidden % 4:
            raise ValueError(f"llm_hidden must be a multiple of 4 (2D sin-cos table), got {self.llm_hidden}")
        for name in ("hidden_act", "connector_act"):
            if getattr(self, name) not in _ACTIVATIONS:
                raise ValueError(f"unknown activation {getattr(self, name)!r} for {name}")

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * self.num_channels

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, llm_hidden: int = 3584, vit_max_num_patch_per_side: int = 70,
                  connector_act: str = "gelu_pytorch_tanh", drop_last_layer: bool = True) -> BagelViTConfig:
        """From a SigLIP ``vit_config.json`` dict; BAGEL runs all but the last layer (``drop_last_layer``)."""
        layers = int(data["num_hidden_layers"]) - (1 if drop_last_layer else 0)
        return cls(
            hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=int(data["num_attention_heads"]),
            patch_size=int(data["patch_size"]),
            image_size=int(data["image_size"]),
            layer_norm_eps=float(data.get("layer_norm_eps", 1e-6)),
            hidden_act=str(data.get("hidden_act", "gelu_pytorch_tanh")),
            num_channels=int(data.get("num_channels", 3)),
            vit_max_num_patch_per_side=vit_max_num_patch_per_side,
            llm_hidden=llm_hidden,
            connector_act=connector_act,
        )

    def siglip_config(self, attn_implementation: str = "sdpa") -> Any:
        """The ``transformers`` config of the wrapped ``SiglipVisionModel`` (no head)."""
        from transformers import SiglipVisionConfig

        return SiglipVisionConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_channels=self.num_channels, image_size=self.image_size, patch_size=self.patch_size,
            hidden_act=self.hidden_act, layer_norm_eps=self.layer_norm_eps, attention_dropout=0.0,
            vision_use_head=False, attn_implementation=attn_implementation,
        )


# SigLIP so400m/14 at 980 px as in ByteDance-Seed/BAGEL-7B-MoT's vit_config.json (27 layers, 26 run).
BAGEL_7B_MOT_VIT = BagelViTConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26,
                                  num_attention_heads=16, patch_size=14, image_size=980,
                                  vit_max_num_patch_per_side=70, llm_hidden=3584)

# A tiny random-weight twin for tests (llm_hidden matches the tiny LLM config).
TINY = BagelViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      patch_size=14, image_size=14 * 8, vit_max_num_patch_per_side=8, llm_hidden=64)


def conv_patch_weight_to_linear(weight: torch.Tensor) -> torch.Tensor:
    """A conv patch kernel ``[out, C, p, p]`` as the equivalent ``Linear`` weight ``[out, p * p * C]``
    over ``patchify``'s (p_row, p_col, c) layout."""
    return weight.permute(0, 2, 3, 1).reshape(weight.shape[0], -1)


class _Connector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, act: str, **kw: Any) -> None:
        super().__init__()
        self.fc1 = PrepackableLinear(in_dim, out_dim, **kw)
        from transformers.activations import ACT2FN

        self.act = ACT2FN[act]
        self.fc2 = PrepackableLinear(out_dim, out_dim, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _SiglipHolder(nn.Module):
    """Keeps the checkpoint prefix ``vit_model.vision_model.`` whatever the transformers version."""

    def __init__(self, vision_model: nn.Module) -> None:
        super().__init__()
        self.vision_model = vision_model


class BagelViT(nn.Module):
    """``vit_model.vision_model`` (SigLIP's embeddings, encoder and ``post_layernorm``, built by
    ``transformers.SiglipVisionModel``, linear patch embedding), ``connector`` and ``vit_pos_embed``.

    ``forward(images)`` maps a list of ``[C, H, W]`` images (sides multiples of ``patch_size``, at most
    ``vit_max_num_patch_per_side`` patches each) to one ``[n_i, llm_hidden]`` tensor per image, ``n_i``
    its patches in row-major order. Each image attends only within itself; images of the same size
    run as one batch.
    """

    def __init__(self, cfg: BagelViTConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, attn_implementation: str = "sdpa") -> None:
        super().__init__()
        self.cfg = cfg
        kw = {"dtype": dtype, "device": device}
        with torch.device(device if device is not None else "cpu"):
            from transformers import SiglipVisionModel

            siglip = SiglipVisionModel(cfg.siglip_config(attn_implementation))
            # transformers 4.x nests the transformer under ``vision_model``; 5.x flattens it into the model.
            siglip = getattr(siglip, "vision_model", siglip)
            siglip.embeddings.patch_embedding = nn.Linear(cfg.patch_dim, cfg.hidden_size)
        if dtype is not None:
            siglip.to(dtype)
        self.vit_model = _SiglipHolder(siglip)
        self.connector = _Connector(cfg.hidden_size, cfg.llm_hidden, cfg.connector_act, **kw)
        self.vit_pos_embed = PositionEmbedding(cfg.vit_max_num_patch_per_side, cfg.llm_hidden, **kw)

    @property
    def siglip(self) -> nn.Module:
        """The SigLIP vision transformer (``vit_model.vision_model``)."""
        return self.vit_model.vision_model

    def position_ids(self, height: int, width: int, device: torch.device | str | None = None) -> torch.Tensor:
        cfg = self.cfg
        if height % cfg.patch_size or width % cfg.patch_size:
            raise ValueError(f"image size {height}x{width} is not a multiple of the patch size {cfg.patch_size}")
        return flattened_position_ids(height, width, cfg.patch_size, cfg.vit_max_num_patch_per_side, device=device)

    def _groups(self, images: Sequence[torch.Tensor]) -> dict[tuple[int, int], list[int]]:
        groups: dict[tuple[int, int], list[int]] = {}
        for i, image in enumerate(images):
            if image.dim() != 3 or image.shape[0] != self.cfg.num_channels:
                raise ValueError(f"image {i}: expected [{self.cfg.num_channels}, H, W], got {tuple(image.shape)}")
            groups.setdefault((int(image.shape[1]), int(image.shape[2])), []).append(i)
        return groups

    def encode(self, images: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """SigLIP features after ``post_layernorm``: one ``[n_i, hidden_size]`` per image (no connector)."""
        vm = self.siglip
        weight = vm.embeddings.patch_embedding.weight
        out: list[torch.Tensor | None] = [None] * len(images)
        for (h, w), idx in self._groups(images).items():
            ids = self.position_ids(h, w, device=weight.device)
            pixels = torch.stack([patchify(images[i].to(device=weight.device, dtype=weight.dtype),
                                           self.cfg.patch_size) for i in idx])
            x = vm.embeddings.patch_embedding(pixels) + vm.embeddings.position_embedding(ids)[None]
            x = vm.encoder(inputs_embeds=x).last_hidden_state
            x = vm.post_layernorm(x)
            for j, i in enumerate(idx):
                out[i] = x[j]
        return out  # type: ignore[return-value]

    def forward(self, images: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        feats = self.encode(images)
        device = self.vit_pos_embed.pos_embed.device
        return [self.connector(f) + self.vit_pos_embed(self.position_ids(im.shape[1], im.shape[2], device))
                for f, im in zip(feats, images)]
