"""What shapes a BAGEL model: ``BagelSpec`` (LLM, ViT and VAE configs, latent grid, image transforms)
and ``BagelLLMConfig``, the architecture of its Mixture-of-Transformers language model.

BAGEL-7B-MoT's LLM is Qwen2.5-7B-shaped (GQA, RoPE, RMSNorm, q/k/v biases, no o_proj bias) with
per-head q/k RMSNorm before RoPE, and every layer duplicated into an understanding weight set and a
generation (``*_moe_gen``) set over one shared attention (see ``mstar.models.bagel.mot``).
Field names follow the Hugging Face ``config.json`` spelling, so the config also satisfies the
``LlamaArchitecture`` protocol of ``mstar.layers.llama`` (``rope_scaling`` is always None).
"""

from __future__ import annotations

from dataclasses import dataclass

from mstar.model.validation import check_int
from mstar.models.bagel.vae import BagelVAEConfig
from mstar.models.bagel.vit import TINY as TINY_VIT
from mstar.models.bagel.vit import BagelViTConfig

__all__ = ["BAGEL_7B_MOT", "TINY", "TINY_SPEC", "BagelLLMConfig", "BagelSpec", "ImageTransformSpec"]


@dataclass(frozen=True)
class BagelLLMConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    qk_norm: bool = True
    max_position_embeddings: int = 32768  # Qwen2.5-7B's context (RoPE has no table; a request beyond it is refused)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            check_int(getattr(self, name), f"BagelLLMConfig.{name}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) is not a multiple of "
                                 f"num_attention_heads ({self.num_attention_heads}); give head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even and >= 2, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")

    @property
    def rope_scaling(self) -> None:
        """Qwen2.5's default RoPE schedule (no scaling); here for the ``LlamaArchitecture`` protocol."""
        return None


# Qwen2.5-7B as used by ByteDance-Seed/BAGEL-7B-MoT.
BAGEL_7B_MOT = BagelLLMConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                              head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6, qk_norm=True)

# A tiny random-weight twin for tests.
TINY = BagelLLMConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


@dataclass(frozen=True)
class ImageTransformSpec:
    """Resize rule of an image input: longest side <= max_size, shortest >= min_size, both sides
    multiples of ``stride`` (the reference's MaxLongEdgeMinShortEdgeResize)."""

    max_size: int
    min_size: int
    stride: int
    max_pixels: int = 14 * 14 * 9 * 1024


@dataclass(frozen=True)
class BagelSpec:
    """Everything that shapes a BAGEL model (the reference's BagelConfig plus the image transforms)."""

    llm: BagelLLMConfig
    vit: BagelViTConfig
    vae: BagelVAEConfig
    latent_patch_size: int = 2
    max_latent_size: int = 64
    vae_transform: ImageTransformSpec = ImageTransformSpec(1024, 512, 16)
    vit_transform: ImageTransformSpec = ImageTransformSpec(980, 224, 14)
    default_size: tuple[int, int] = (1024, 1024)  # (height, width) of text-to-image

    def __post_init__(self) -> None:
        """The transforms must cut whole latent cells and ViT patches and stay within the position
        tables (a bigger image would index past them)."""
        vae, vit = self.vae_transform, self.vit_transform
        if vae.stride % self.latent_downsample or vae.max_size > self.max_image_side:
            raise ValueError(f"vae_transform {vae} needs a stride that is a multiple of the latent cell "
                             f"({self.latent_downsample} px) and a max_size of at most {self.max_image_side}")
        vit_side = self.vit.patch_size * self.vit.vit_max_num_patch_per_side
        if vit.stride % self.vit.patch_size or vit.max_size > vit_side:
            raise ValueError(f"vit_transform {vit} needs a stride that is a multiple of the ViT patch "
                             f"({self.vit.patch_size} px) and a max_size of at most {vit_side}")

    @classmethod
    def from_checkpoint_parts(cls, llm: BagelLLMConfig, vit: BagelViTConfig, vae: BagelVAEConfig,
                              latent_patch_size: int = 2, max_latent_size: int = 64) -> BagelSpec:
        """A checkpoint's spec, the image transforms sized from its files as the reference sizes them
        for the released one: the VAE's at most ``max_latent_size`` latent cells a side and at least
        half that (1024 / 512 px at FLUX's 8 px x latent patch 2), the ViT's at most its
        ``image_size`` and at least 16 patches a side (980 / 224 px at patch 14)."""
        cell = vae.downsample * latent_patch_size
        side = max_latent_size * cell
        return cls(llm=llm, vit=vit, vae=vae, latent_patch_size=latent_patch_size, max_latent_size=max_latent_size,
                   vae_transform=ImageTransformSpec(side, side // 2, cell),
                   vit_transform=ImageTransformSpec(vit.image_size, min(16 * vit.patch_size, vit.image_size),
                                                    vit.patch_size),
                   default_size=(side, side))

    @property
    def latent_downsample(self) -> int:
        return self.vae.downsample * self.latent_patch_size

    @property
    def latent_dim(self) -> int:
        return self.latent_patch_size ** 2 * self.vae.latent_channels

    @property
    def max_image_side(self) -> int:
        return self.max_latent_size * self.latent_downsample


# The tiny twin: byte tokenizer + BAGEL's four special tokens (vocab 264), 8-pixel latent cells.
TINY_SPEC = BagelSpec(
    llm=TINY, vit=TINY_VIT,
    vae=BagelVAEConfig(block_out_channels=(8, 16, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4),
    latent_patch_size=2, max_latent_size=32,
    vae_transform=ImageTransformSpec(64, 32, 8), vit_transform=ImageTransformSpec(56, 28, 14),
    default_size=(64, 64),
)
