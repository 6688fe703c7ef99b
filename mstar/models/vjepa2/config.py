"""Architecture configs of V-JEPA 2-AC: the ViT video encoder and the action-conditioned predictor.

Values follow Meta's ``vit_giant_xformers`` encoder (with 3D RoPE, as the AC checkpoint is built) and
``vit_ac_predictor`` (``VisionTransformerPredictorAC``) defaults. ``TINY_*`` are offline test sizes whose
head dims exercise both RoPE layouts: the encoder's 16-d heads leave 4 unrotated channels, the predictor's
12-d heads are rotated completely.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AC_PREDICTOR",
    "TINY_ENCODER",
    "TINY_PREDICTOR",
    "VITG_ENCODER",
    "EncoderConfig",
    "PredictorConfig",
    "rope_axis_dim",
    "swiglu_hidden",
]


def rope_axis_dim(head_dim: int) -> int:
    """Channels of a head rotated per axis (depth, height, width): the largest even number <= head_dim / 3.

    Channels past ``3 * rope_axis_dim`` are left unrotated (the reference's layout).
    """
    return 2 * ((head_dim // 3) // 2)


def swiglu_hidden(hidden: int, wide_silu: bool) -> int:
    """Hidden width of the reference's SwiGLU MLP: 2/3 of the GELU width, rounded up to a multiple of 8."""
    if not wide_silu:
        return hidden
    return (int(2 * hidden / 3) + 7) // 8 * 8


def _check_common(name: str, dim: int, heads: int, patch: int, img: tuple[int, int], use_rope: bool) -> None:
    if dim % heads:
        raise ValueError(f"{name}: dim {dim} is not divisible by num_heads {heads}")
    if img[0] % patch or img[1] % patch:
        raise ValueError(f"{name}: img_size {img} is not a multiple of patch_size {patch}")
    if use_rope and rope_axis_dim(dim // heads) < 4:
        # the reference's rotation squeezes a size-1 frequency axis away when an axis gets 2 channels,
        # which breaks its broadcasting: such head dims are not usable with RoPE
        raise ValueError(f"{name}: head_dim {dim // heads} is too small for 3D RoPE (need >= 12)")


class _Geometry:
    """Sizes both configs derive the same way from their width, heads, image and patch size."""

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.width * self.mlp_ratio)

    @property
    def grid(self) -> tuple[int, int]:
        return self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size

    @property
    def tokens_per_frame(self) -> int:
        """Patch tokens per frame (one tubelet for the encoder)."""
        return self.grid[0] * self.grid[1]


@dataclass(frozen=True)
class EncoderConfig(_Geometry):
    """ViT video encoder: Conv3d tubelet patch embedding, pre-norm blocks with 3D RoPE, final LayerNorm."""

    img_size: tuple[int, int] = (256, 256)
    patch_size: int = 16
    tubelet_size: int = 2
    in_chans: int = 3
    embed_dim: int = 1408
    depth: int = 40
    num_heads: int = 22
    mlp_ratio: float = 48 / 11
    qkv_bias: bool = True
    use_rope: bool = True
    use_silu: bool = False
    wide_silu: bool = True
    layernorm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if not self.use_rope:
            raise ValueError("EncoderConfig: only the RoPE encoder (no absolute pos_embed) is implemented")
        _check_common("EncoderConfig", self.embed_dim, self.num_heads, self.patch_size, self.img_size,
                      self.use_rope)

    @property
    def width(self) -> int:
        return self.embed_dim


@dataclass(frozen=True)
class PredictorConfig(_Geometry):
    """Action-conditioned predictor: per frame [action, state, (extrinsics), H*W patches], frame-causal."""

    img_size: tuple[int, int] = (256, 256)
    patch_size: int = 16
    tubelet_size: int = 2
    embed_dim: int = 1408  # encoder width (input and output of the predictor)
    predictor_embed_dim: int = 1024
    depth: int = 24
    num_heads: int = 16
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    use_rope: bool = True
    use_silu: bool = False
    wide_silu: bool = True
    use_extrinsics: bool = False
    action_dim: int = 7
    layernorm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if not self.use_rope:
            raise ValueError("PredictorConfig: only the RoPE predictor is implemented")
        _check_common("PredictorConfig", self.predictor_embed_dim, self.num_heads, self.patch_size,
                      self.img_size, self.use_rope)

    @property
    def width(self) -> int:
        return self.predictor_embed_dim

    @property
    def cond_tokens(self) -> int:
        """Conditioning tokens in front of each frame's patches: action, state (and extrinsics)."""
        return 3 if self.use_extrinsics else 2

    @property
    def block_tokens(self) -> int:
        """Tokens one frame adds to the predictor's sequence (and to its KV cache)."""
        return self.cond_tokens + self.tokens_per_frame


VITG_ENCODER = EncoderConfig()
AC_PREDICTOR = PredictorConfig()

TINY_ENCODER = EncoderConfig(img_size=(32, 32), embed_dim=64, depth=2, num_heads=4, mlp_ratio=4.0)
TINY_PREDICTOR = PredictorConfig(img_size=(32, 32), embed_dim=64, predictor_embed_dim=48, depth=2,
                                 num_heads=4)
