"""``BagelWalk``: BAGEL's walks, by kind. The graph names its walks by their values; the LLM node
dispatches on the kind (``BagelLLMNode.prepare_inputs``), not on name strings."""

from __future__ import annotations

import enum

__all__ = ["BagelWalk"]


class BagelWalk(enum.Enum):
    PREFILL_TEXT = "prefill_text"  # a text item into the KV cache(s)
    PREFILL_VIT = "prefill_vit"  # an image item's ViT tokens into the main cache
    PREFILL_VAE = "prefill_vae"  # an image item's VAE tokens into the main cache (image targets)
    IMAGE_GEN = "image_gen"  # the flow loop without guidance, then the VAE decoder
    IMAGE_GEN_CFG = "image_gen_cfg"  # the flow loop with its guidance branches, then the VAE decoder
    DECODE = "decode"  # the text answer's AR loop
