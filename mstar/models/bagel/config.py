"""``BagelLLMConfig``: the architecture of BAGEL's Mixture-of-Transformers language model.

BAGEL-7B-MoT's LLM is Qwen2.5-7B-shaped (GQA, RoPE, RMSNorm, q/k/v biases, no o_proj bias) with
per-head q/k RMSNorm before RoPE, and every layer duplicated into an understanding weight set and a
generation (``*_moe_gen``) set over one shared attention (see ``mstar.models.bagel.modules``).
Field names follow the Hugging Face ``config.json`` spelling, so the config also satisfies the
``LlamaArchitecture`` protocol of ``mstar.layers.llama`` (``rope_scaling`` is always None).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BAGEL_7B_MOT", "TINY", "BagelLLMConfig"]


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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BagelLLMConfig.{name} must be an int >= 1, got {value!r}")
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
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@dataclass(frozen=True)
class ImageTransformSpec:
    """Resize rule of an image input: longest side <= max_size, shortest >= min_size, both sides
    multiples of ``stride`` (the reference's MaxLongEdgeMinShortEdgeResize)."""

    max_size: int
    min_size: int
    stride: int
    max_pixels: int = 14 * 14 * 9 * 1024
